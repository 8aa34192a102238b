"""Time to first token from the host tier against recomputing the prefix and against all-resident,
and a decode step whose KV is prefetched layer by layer against one whose KV is resident.

The model is kvtier.decode's transformer with a Llama-3-8B layer shape (hidden 4096, 32 query
heads, 8 kv heads, head dim 128, SwiGLU 14336) and 4 layers, random weights; KV pages are fp8
e4m3 with per-token-head scales, 16 tokens a page, in a TieredPool over the model's own KV
tensors (write_through, the CUDA copy engine).

TTFT: a request of a P-token prefix plus a 16-token user turn, timed from `match` to the first
token on the host (DecodeRunner's ttft_s), median of the repeats, each with a fresh user turn:
  recompute   the prefix is in no tier: prefill of every token
  host hit    the prefix pages are in the host tier only (evicted from the device after a first
              request committed them): loaded while the user turn's layers run, wait_layer(i)
              before layer i's attention
  resident    the prefix pages are on the device
Decode step: B sequences of C tokens each, one new token each:
  resident    every page on the device
  prefetched  every page in the host tier; `load` then the step, waiting on layer i's pages just
              before layer i's attention; the time includes the host's load call
  pcie bound  the pages' bytes over the pinned host-to-device rate measured in the same run;
              prefetched can only approach max(resident, pcie bound)

Without CUDA it runs the CPU twin (tiny model, torch copy engine, Triton interpreter), whose
times say nothing about a GPU.

    PYTHONPATH=. python3 benchmarks/decode_ttft.py [--quick] [--decode-only] [--copy-path PATH] [--json out.json]

With CUDA each decode row also prints one more prefetched step's timeline (CUDA events): when
the host's load call returned, when each layer's pages had landed, when each layer's attention
could start, and the step's end, all in ms from the step's start.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier import TieredPool, prefix_keys  # noqa: E402
from kvtier.decode.model import DecoderConfig, PagedKV, TinyDecoder  # noqa: E402
from kvtier.decode.runner import DecodeRunner, Request  # noqa: E402
from pool_latency import pcie_h2d_gbps  # noqa: E402  benchmarks/pool_latency.py

PAGE = 16
USER_TOKENS = 16
GPU_MODEL = DecoderConfig(vocab=32000, hidden=4096, layers=4, q_heads=32, kv_heads=8, head_dim=128, ffn=14336)
CPU_MODEL = DecoderConfig(vocab=256, hidden=128, layers=2, q_heads=4, kv_heads=2, head_dim=64, ffn=256)


# --reload-blocks: the most blocks one launch of the pool's copy kernel may take (None: one an SM)
RELOAD_BLOCKS: int | None = None


def make_pool(model: TinyDecoder, device_pages: int, host_pages: int, copy_path: str = "auto",
              layer_ordered_loads: bool = False):
    fmt = model.config.page_format(PAGE, dtype="fp8_e4m3", scale="per_token_head")
    kv = PagedKV(fmt, device_pages, model.device)
    extra = {}
    if RELOAD_BLOCKS is not None and model.device.type == "cuda":
        from kvtier.transfer.cuda_engine import CudaEngine

        extra["engine"] = lambda device_tier, host_tier: CudaEngine(
            device_tier, host_tier, path=copy_path, max_blocks=RELOAD_BLOCKS)
    pool = TieredPool(fmt, host_pages=host_pages, write_policy="write_through", registry=CollectorRegistry(),
                      copy_path=copy_path, layer_ordered_loads=layer_ordered_loads, **kv.pool_args(), **extra)
    return kv, pool


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def ttft(model: TinyDecoder, prefix_tokens: int, repeats: int, gen: torch.Generator, cuda: bool) -> dict:
    vocab = model.config.vocab
    pages = -(-(prefix_tokens + USER_TOKENS) // PAGE) + 1
    kv, pool = make_pool(model, pages * 2, pages * 2)

    def request(prefix: list[int]) -> Request:
        return Request(tuple(prefix + torch.randint(vocab, (USER_TOKENS,), generator=gen).tolist()), 1)

    def fresh_prefix() -> list[int]:
        return torch.randint(vocab, (prefix_tokens,), generator=gen).tolist()

    times = {"recompute": [], "host": [], "resident": []}
    with pool:
        runner = DecodeRunner(model, kv, pool)
        runner.run([request(fresh_prefix())], 1)  # compiles kernels and warms the allocator
        for _ in range(repeats):
            prefix = fresh_prefix()
            sync(cuda)
            [done] = runner.run([request(prefix)], 1)
            assert done.hit.total == 0
            times["recompute"].append(done.ttft_s)
            pool.flush()
            pool.evict(tier="device")
            sync(cuda)
            [done] = runner.run([request(prefix)], 1)
            assert done.hit.host == prefix_tokens // PAGE and done.hit.device == 0, done.hit
            times["host"].append(done.ttft_s)
            sync(cuda)
            [done] = runner.run([request(prefix)], 1)
            assert done.hit.device == prefix_tokens // PAGE, done.hit
            times["resident"].append(done.ttft_s)
            pool.evict(tier="device")
    row = {name: statistics.median(v) for name, v in times.items()}
    row.update(prefix_tokens=prefix_tokens, recompute_over_host=row["recompute"] / row["host"],
               host_over_resident=row["host"] / row["resident"])
    return row


def decode_step(model: TinyDecoder, batch: int, context: int, repeats: int, gen: torch.Generator, cuda: bool,
                h2d: float | None, copy_path: str = "auto", layer_ordered_loads: bool = False,
                profile_dir: Path | None = None, graphs: bool = False) -> dict:
    c, vocab = model.config, model.config.vocab
    per_seq = context // PAGE
    kv, pool = make_pool(model, batch * (per_seq + 1) + 1, batch * (per_seq + 1) + 1, copy_path, layer_ordered_loads)
    prompts = [torch.randint(vocab, (context,), generator=gen).tolist() for _ in range(batch)]
    step = {"resident": [], "prefetched": []}
    with pool:
        DecodeRunner(model, kv, pool).run([Request(tuple(p), 1) for p in prompts], batch)
        pool.flush()
        keys = [prefix_keys(torch.tensor(p).numpy(), PAGE, pool.namespace) for p in prompts]
        flat = [k for ks in keys for k in ks]
        tails = torch.zeros((c.layers, 2, batch, PAGE, c.kv_heads, c.head_dim), dtype=torch.bfloat16, device=kv.device)
        tokens = torch.randint(vocab, (batch,), generator=gen).to(kv.device)
        positions = torch.full((batch,), context, dtype=torch.int64, device=kv.device)
        new_pages = pool.allocate(batch)

        def table_of(slots: list[int]) -> torch.Tensor:
            # As an engine writes its page table: from pinned memory, without waiting for the
            # device (a copy from pageable memory would wait for every kernel queued before it).
            rows = [slots[i * per_seq : (i + 1) * per_seq] + [new_pages[i]] for i in range(batch)]
            host = torch.tensor(rows, dtype=torch.int32)
            return (host.pin_memory() if cuda else host).to(kv.device, non_blocking=True)

        def timed(fn) -> float:
            sync(cuda)
            t0 = time.perf_counter()
            fn()
            sync(cuda)
            return time.perf_counter() - t0

        if graphs:  # the step as a serving engine runs it: replayed from CUDA graphs
            from kvtier.decode.graphs import DecodeGraphs

            graphed = DecodeGraphs(model, kv, tails, batch, per_seq + 1)

            def run_step(table, wait_layer=None):
                return graphed.step(tokens, positions, table, wait_layer)
        else:
            def run_step(table, wait_layer=None):
                return model.decode(kv, tokens, positions, table, tails, wait_layer=wait_layer)

        held = pool.acquire(flat)
        assert len(held) == len(flat)
        table = table_of(held)
        run_step(table)  # warm (and, with graphs, captured)
        for _ in range(repeats):
            step["resident"].append(timed(lambda: run_step(table)))
        resident_enqueue = resident_timeline(run_step, table) if cuda else None
        pool.release(held)
        landed: list[list[int]] = []

        def prefetched():
            handle = pool.load(flat)
            landed.append(handle.slots)
            run_step(table_of(handle.slots), handle.wait_layer)

        for _ in range(repeats + 1):
            pool.evict(tier="device", keys=flat)
            step["prefetched"].append(timed(prefetched))
            pool.release(landed.pop())
        step["prefetched"].pop(0)
        timeline = prefetch_timeline(pool, model.config.layers, flat, table_of, run_step) if cuda else None
        if timeline:
            timeline["resident"] = resident_enqueue
        if profile_dir is not None:
            profile_steps(profile_dir, f"b{batch}x{context}{'-graphs' if graphs else ''}", pool, flat, landed, prefetched,
                          lambda: run_step(table), cuda)
        pool.release(new_pages)
    row = {name: statistics.median(v) for name, v in step.items()}
    nbytes = len(flat) * pool.fmt.page_bytes
    bound = nbytes / h2d if h2d else None
    row.update(batch=batch, context=context, bytes=nbytes, pcie_bound=bound, copy_path=copy_path,
               layer_ordered_loads=layer_ordered_loads, graphs=graphs,
               reload_path=getattr(pool.engine, "last_path", pool.engine.name), timeline=timeline,
               prefetched_over_resident=row["prefetched"] / row["resident"],
               prefetched_over_floor=row["prefetched"] / max(row["resident"], bound) if bound else None)
    return row


def profile_steps(out: Path, name: str, pool, flat, landed: list, prefetched, resident, cuda: bool) -> None:
    """One resident and one prefetched step under torch.profiler (host ops and CUDA calls):
    the top host ops by self time printed, the traces written to `out`."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for label in ("resident", "prefetched"):
        held = None
        if label == "resident":
            held = pool.acquire(flat)
        else:
            pool.evict(tier="device", keys=flat)
        sync(cuda)
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            prefetched() if label == "prefetched" else resident()
            host_s = time.perf_counter() - t0
            sync(cuda)
        print(f"    profile {name} {label}: host {host_s * 1e3:.2f} ms", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        prof.export_chrome_trace(str(out / f"decode_{name}_{label}.json"))
        if held is not None:
            pool.release(held)
        if label == "prefetched":
            pool.release(landed.pop())


def resident_timeline(run_step, table) -> dict:
    """One more resident step (untimed above): ms from its start to when the host had queued it
    (decode returned) and to its end on the device. Queued close to the end: the host bounds the step."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    run_step(table)
    end.record()
    enqueued_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    return {"step_enqueued_ms": enqueued_s * 1e3, "step_end_ms": start.elapsed_time(end)}


def prefetch_timeline(pool, layers: int, flat, table_of, run_step) -> dict:
    """One more prefetched step (untimed above), with events: ms from the step's start on the
    compute stream to when the host's `load` call returned (host clock), to when each layer's
    pages had landed (a side stream waiting on that layer alone), to when each layer's attention
    could start (the compute stream past wait_layer(i)), and to the step's end."""
    pool.evict(tier="device", keys=flat)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    new_event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    start, end = new_event(), new_event()
    landed = [new_event() for _ in range(layers)]
    attention = [new_event() for _ in range(layers)]
    t0 = time.perf_counter()
    start.record()
    handle = pool.load(flat)
    load_s = time.perf_counter() - t0
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer, event in enumerate(landed):
            handle.wait_layer(layer)
            event.record(side)

    def wait_layer(layer: int) -> None:
        handle.wait_layer(layer)
        attention[layer].record()

    run_step(table_of(handle.slots), wait_layer)
    end.record()
    enqueued_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    pool.release(handle.slots)
    return {
        "load_call_ms": load_s * 1e3,
        "step_enqueued_ms": enqueued_s * 1e3,
        "layer_landed_ms": [start.elapsed_time(e) for e in landed],
        "attention_start_ms": [start.elapsed_time(e) for e in attention],
        "step_end_ms": start.elapsed_time(end),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8k and 32k prefixes; two decode shapes")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--copy-path", default="auto", help="the pool's copy path: auto, kernel, copy_engine, torch")
    ap.add_argument("--decode-only", action="store_true", help="skip the TTFT rows")
    ap.add_argument("--graphs", action="store_true",
                    help="decode steps replayed from CUDA graphs (kvtier.decode.graphs), as serving engines run them")
    ap.add_argument("--profile", type=Path, default=None, metavar="DIR",
                    help="profile one resident and one prefetched step of the last decode shape; traces into DIR")
    ap.add_argument("--layer-ordered-loads", action="store_true",
                    help="the pool's layer_ordered_loads: every chunk's first layer first, then the others")
    ap.add_argument("--reload-blocks", type=int, default=None, metavar="N",
                    help="cap the pool's copy kernel at N blocks a launch (default: one an SM), so that "
                         "attention finds SMs free while a reload runs")
    args = ap.parse_args(argv)
    global RELOAD_BLOCKS
    RELOAD_BLOCKS = args.reload_blocks
    cuda = torch.cuda.is_available()
    gen = torch.Generator().manual_seed(0)
    if cuda:
        from kvtier.bench.offload_bandwidth import gpu_meta

        meta = gpu_meta()
        model = TinyDecoder(GPU_MODEL, "cuda")
        prefixes = (8192, 32768) if args.quick else (8192, 16384, 32768)
        shapes = [(1, 2048), (8, 8192)] if args.quick else [(1, 1024), (1, 4096), (4, 4096), (8, 8192), (16, 16384)]
        repeats = 3 if args.quick else 5
    else:
        meta = {"mode": "cpu twin (torch copy engine, Triton interpreter): times say nothing about a GPU"}
        model = TinyDecoder(CPU_MODEL, "cpu")
        prefixes, shapes, repeats = (64, 128), [(1, 64), (2, 64)], 2
    print(f"TTFT and prefetched decode: {meta}\nmodel: {model.config}", flush=True)
    h2d = pcie_h2d_gbps(torch.device("cuda"), 256 << 20) * 1e9 if cuda else None  # bytes/s
    if cuda:
        print(f"pinned host-to-device copy: {h2d / 1e9:.1f} GB/s", flush=True)
    ttft_rows = []
    for prefix in () if args.decode_only else prefixes:
        ttft_rows.append(ttft(model, prefix, repeats, gen, cuda))
        r = ttft_rows[-1]
        print(f"  TTFT {prefix} tokens: recompute {r['recompute'] * 1e3:.1f} ms, host hit {r['host'] * 1e3:.1f} ms, "
              f"resident {r['resident'] * 1e3:.1f} ms", flush=True)
    decode_rows = []
    for batch, context in shapes:
        last = (batch, context) == shapes[-1]
        decode_rows.append(decode_step(model, batch, context, repeats, gen, cuda, h2d, args.copy_path,
                                       args.layer_ordered_loads, args.profile if last else None, args.graphs))
        r = decode_rows[-1]
        print(f"  decode batch {batch} context {context}{' (CUDA graphs)' if args.graphs else ''}: resident {r['resident'] * 1e3:.2f} ms, "
              f"prefetched {r['prefetched'] * 1e3:.2f} ms (reload path {r['reload_path']})", flush=True)
        if r["timeline"]:
            t = r["timeline"]
            print(f"    timeline (ms from step start): load call returned {t['load_call_ms']:.2f}, step enqueued "
                  f"{t['step_enqueued_ms']:.2f}, layers landed {[round(x, 2) for x in t['layer_landed_ms']]}, "
                  f"attention started {[round(x, 2) for x in t['attention_start_ms']]}, end {t['step_end_ms']:.2f}; "
                  f"resident step: enqueued {t['resident']['step_enqueued_ms']:.2f}, end {t['resident']['step_end_ms']:.2f}",
                  flush=True)
    report = {"meta": meta, "model": repr(model.config), "h2d_gbps": h2d / 1e9 if h2d else None, "ttft": ttft_rows, "decode": decode_rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print("\nTTFT (ms)            recompute   host hit   resident   recompute/host   host/resident")
    for r in ttft_rows:
        print(f"  prefix {r['prefix_tokens']:>6} tokens {r['recompute'] * 1e3:10.1f} {r['host'] * 1e3:10.1f} "
              f"{r['resident'] * 1e3:10.1f} {r['recompute_over_host']:14.1f}x {r['host_over_resident']:14.2f}x")
    print("decode step (ms)     resident   prefetched   pcie bound   prefetched/resident   prefetched/max(resident, bound)")
    for r in decode_rows:
        bound = "-" if r["pcie_bound"] is None else f"{r['pcie_bound'] * 1e3:.2f}"
        floor = "-" if r["prefetched_over_floor"] is None else f"{r['prefetched_over_floor']:.2f}x"
        print(f"  batch {r['batch']:>3} x {r['context']:>6} {r['resident'] * 1e3:9.2f} {r['prefetched'] * 1e3:12.2f} "
              f"{bound:>12} {r['prefetched_over_resident']:20.2f}x {floor:>20}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
