"""Decode attention's achieved HBM bandwidth against a device-to-device copy measured in the same run.

The Triton paged decode kernel (kvtier.decode.attention) over fp8 pages with per-token-head
scales and over bf16 pages, a Llama-3-8B-like layer (32 query heads, 8 kv heads, head dim 128,
16-token pages handed out in a random order), batch 1-64, context 1k-32k. Bandwidth is the KV
and scale bytes the kernel must read over its median time (L2 flushed clean before every call:
256 MB written then read, see _flush; the write-only flush is reported as a second table), with the kernels replayed from a CUDA graph so that the wrapper's host
time does not count (each row keeps the time of a call from Python too). The copy rate is
`dst.copy_(src)` of 1 GiB, counted as bytes read plus bytes written (the HBM traffic a copy
makes), so the ratio compares like with like; the JSON keeps the copy's one-way rate too. Before the sweep a short search picks the kernel's block
size, warp count, pipeline stages (and for fp8 pages how the dots read them) per dtype at batch 16,
16k tokens, then the split plan's programs per SM for that config at batch 16, 64 and 1 (a table
of what else the kernel can do). The sweep runs what a call that names no configuration gets
(attention.DEFAULT_CONFIGS and its split plan); with --tuned, the search's best kernel config and
programs per SM instead.

Without CUDA it runs the CPU twin: the same code at tiny sizes in Triton's interpreter, whose
times say nothing about a GPU.

    PYTHONPATH=. python3 benchmarks/decode_attention.py [--quick] [--json out.json] [--layout hnd]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.decode import attention  # noqa: E402
from kvtier.decode.attention import paged_decode_attention, split_plan  # noqa: E402
from kvtier.format import quantize  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
KERNEL_SHAPES = ((32, 2, 2), (32, 4, 2), (64, 2, 2), (64, 2, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 2, 2),
                 (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3))
TUNE_CONFIGS = {
    "fp8": [dict(block_n=bn, num_warps=warps, num_stages=stages, fp8_dot=dot)
            for dot in ("pairs", "query") for bn, warps, stages in KERNEL_SHAPES],
    "bf16": [dict(block_n=bn, num_warps=warps, num_stages=stages) for bn, warps, stages in KERNEL_SHAPES],
}
# Programs per SM the split plan fills waves of, tried with each dtype's best kernel config.
PROGRAMS_PER_SM = (2, 3, 4, 6)


def make_inputs(batch: int, context: int, dtype: str, device: str, gen: torch.Generator, layout: str = "nhd") -> dict:
    """Pages of `batch` sequences of `context` tokens each, scattered over the cache in a random
    order, in `layout` ("hnd": the same values with each page head-major)."""
    args = _make_nhd_inputs(batch, context, dtype, device, gen)
    if layout == "hnd":
        args["layout"] = "hnd"
        for key in ("k_pages", "v_pages", "k_scales", "v_scales"):
            if key in args:
                args[key] = args[key].transpose(1, 2).contiguous()
    return args


def _make_nhd_inputs(batch: int, context: int, dtype: str, device: str, gen: torch.Generator) -> dict:
    pages_per_seq = -(-context // PAGE)
    num_pages = batch * pages_per_seq
    shape = (num_pages, PAGE, KV_HEADS, HEAD_DIM)
    table = torch.randperm(num_pages, generator=gen).view(batch, pages_per_seq).int()
    q = torch.randn((batch, Q_HEADS, HEAD_DIM), generator=gen).bfloat16()
    args = dict(q=q.to(device), page_table=table.to(device), seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device))
    if dtype == "bf16":
        k = torch.randn(shape, device=device, dtype=torch.bfloat16)
        v = torch.randn(shape, device=device, dtype=torch.bfloat16)
        args.update(k_pages=k, v_pages=v)
    else:
        # Quantize in chunks: a float32 copy of 32k x 64 tokens of KV would not fit beside the pages.
        k = torch.empty(shape, device=device, dtype=torch.float8_e4m3fn)
        v = torch.empty_like(k)
        ks = torch.empty((num_pages, PAGE, KV_HEADS), device=device)
        vs = torch.empty_like(ks)
        for lo in range(0, num_pages, 4096):
            hi = min(lo + 4096, num_pages)
            for pages, scales in ((k, ks), (v, vs)):
                qv, sv = quantize(torch.randn((hi - lo, *shape[1:]), device=device), "fp8_e4m3", "per_token_head", "nhd")
                pages[lo:hi], scales[lo:hi] = qv, sv
        args.update(k_pages=k, v_pages=v, k_scales=ks, v_scales=vs, scale="per_token_head")
    return args


def bytes_read(args: dict, context: int) -> int:
    batch = args["q"].shape[0]
    per_token = 2 * KV_HEADS * HEAD_DIM * args["k_pages"].element_size()
    if "k_scales" in args:
        per_token += 2 * KV_HEADS * 4
    return batch * context * per_token


def time_call(fn, cuda: bool) -> float:
    """Median seconds of one call."""
    if cuda:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3
    fn()
    samples = []
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


FLUSH_BYTES = 256 * 1024 * 1024
_flush_buffer: list = []


def _flush(kind: str) -> None:
    """Evict L2 before a timed call. "clean" writes 256 MB and then reads them, so the write-back
    of the written lines happens here and L2 is left holding clean lines; "dirty" only writes them
    (triton.testing.do_bench's flush), which leaves L2 full of dirty lines that the timed kernel's
    reads then write back to HBM: on an H100 that cost each decode step 0.01-0.07x of the copy
    rate, most where it reads least (scripts/decode_sweep_h200.py's flush panel, 2026-12-05). A decode step
    follows kernels that write little, so "clean" is the state it meets."""
    if not _flush_buffer:
        _flush_buffer.append(torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda"))
    buffer = _flush_buffer[0]
    buffer.zero_()
    if kind == "clean":
        buffer.max()


def _replay_median(graph, kind: str, warmup_ms: float = 10.0, rep_ms: float = 40.0) -> float:
    """Median seconds of graph.replay() after a flush of `kind`, over about rep_ms of replays."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _flush(kind)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate_ms))):
        graph.replay()
    reps = max(5, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for begin, finish in zip(starts, ends):
        _flush(kind)
        begin.record()
        graph.replay()
        finish.record()
    torch.cuda.synchronize()
    times = sorted(begin.elapsed_time(finish) for begin, finish in zip(starts, ends))
    return times[len(times) // 2] / 1e3


def time_replay(fn, flushes: dict | None = None) -> float:
    """Median seconds of one call replayed from a CUDA graph, L2 flushed clean before each replay
    (see _flush): the device's time for the kernels alone, as an engine that captures its decode
    step sees it. Where `flushes` is a dict, it gets the median under each flush ("clean",
    "dirty": the flush these tables used before 2026-12-05). A call from Python costs the
    wrapper's host time too (checks, plan, two launches: about 0.1 ms on the H200's host), which
    small shapes cannot hide."""
    fn()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    seconds = _replay_median(graph, "clean")
    if flushes is not None:
        flushes["clean"] = seconds
        flushes["dirty"] = _replay_median(graph, "dirty")
    del graph
    return seconds


def copy_rate(cuda: bool, device: str) -> dict:
    nbytes = (1 << 30) if cuda else (16 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    seconds = time_call(lambda: dst.copy_(src), cuda)
    return {"bytes": nbytes, "seconds": seconds, "copy_gbps": nbytes / seconds / 1e9, "hbm_gbps": 2 * nbytes / seconds / 1e9}


def _registers() -> dict:
    """Registers and spills of the split kernel compiled last (empty where Triton does not say)."""
    try:
        cache = next(iter(attention._decode_split.device_caches.values()))[0]
        kernel = list(cache.values())[-1]
        return {"regs": kernel.n_regs, "spills": kernel.n_spills}
    except Exception:  # interpreter, or another Triton's layout of its caches
        return {}


def tune(dtype: str, batch: int, context: int, device: str, cuda: bool, gen: torch.Generator,
         layout: str = "nhd") -> tuple[dict, list]:
    """The best kernel config at (batch, context), then the best split target for it at that point
    and at batch 1 (where splits matter most)."""
    args = make_inputs(batch, context, dtype, device, gen, layout)
    tried = []
    for config in TUNE_CONFIGS[dtype]:
        seconds = time_call(lambda: paged_decode_attention(**args, **config), cuda)
        tried.append({**config, "seconds": seconds, "gbps": bytes_read(args, context) / seconds / 1e9, **_registers()})
        print(f"  {dtype} {config}: {tried[-1]['gbps']:.0f} GB/s {_registers()}", flush=True)
    best = max(tried, key=lambda row: row["gbps"])
    config = {k: best[k] for k in TUNE_CONFIGS[dtype][0]}
    one = make_inputs(1, context, dtype, device, gen, layout)
    wide = make_inputs(64, min(context, 8192), dtype, device, gen, layout)
    default_per_sm = attention.PROGRAMS_PER_SM
    for per_sm in PROGRAMS_PER_SM:
        attention.PROGRAMS_PER_SM = per_sm
        for inputs in (args, wide, one):
            b, n = inputs["q"].shape[0], inputs["page_table"].shape[1] * PAGE
            seconds = time_call(lambda: paged_decode_attention(**inputs, **config), cuda)
            tried.append({**config, "programs_per_sm": per_sm, "batch": b, "context": n, "seconds": seconds,
                          "gbps": bytes_read(inputs, n) / seconds / 1e9})
            print(f"  {dtype} {per_sm} programs per SM, batch {b} x {n}: {tried[-1]['gbps']:.0f} GB/s", flush=True)
    attention.PROGRAMS_PER_SM = default_per_sm
    del wide
    del args, one
    return config, tried


def _swept_config(dtype: str, tuned: dict, tuning: list, use_tuned: bool) -> dict:
    """The sweep's keyword arguments: the library's defaults for the dtype's pages (what a call naming
    no configuration runs), or the search's best config with its best programs per SM at the
    search's point."""
    if not use_tuned:
        config = dict(attention.DEFAULT_CONFIGS["fp8" if dtype == "fp8" else "16-bit"])
        config.setdefault("programs_per_sm", attention.PROGRAMS_PER_SM)
        return config
    per_sm = [row for row in tuning if "programs_per_sm" in row and row["batch"] >= 16]
    best = max(per_sm, key=lambda row: row["gbps"])["programs_per_sm"] if per_sm else attention.PROGRAMS_PER_SM
    return {**tuned, "programs_per_sm": best}


def main(argv: list[str] | None = None) -> int:
    global PROGRAMS_PER_SM
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer points (batch 1/16/64, context 1k/8k/32k)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tuned", action="store_true",
                    help="sweep with the search's best config and programs per SM instead of the library's defaults")
    ap.add_argument("--layout", choices=("nhd", "hnd"), default="nhd",
                    help="page layout: nhd (token-major, SGLang's) or hnd (head-major inside a page)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(0)
    if cuda:
        from kvtier.bench.offload_bandwidth import gpu_meta

        meta = gpu_meta()
        batches = (1, 16, 64) if args.quick else (1, 4, 16, 32, 64)
        contexts = (1024, 8192, 32768) if args.quick else (1024, 4096, 8192, 16384, 32768)
        tune_at = (16, 16384)
    else:
        meta = {"mode": "cpu twin (Triton interpreter): times say nothing about a GPU"}
        batches, contexts, tune_at = (1, 2), (64, 256), (2, 256)
        for configs in TUNE_CONFIGS.values():
            configs[:] = configs[:2]
        PROGRAMS_PER_SM = (3,)
    print(f"decode attention bandwidth: {meta}", flush=True)
    copy = copy_rate(cuda, device)
    print(f"device-to-device copy of {copy['bytes'] >> 20} MiB: {copy['copy_gbps']:.0f} GB/s copied, "
          f"{copy['hbm_gbps']:.0f} GB/s of HBM traffic", flush=True)
    configs, tuning = {}, {}
    for dtype in ("fp8", "bf16"):
        configs[dtype], tuning[dtype] = tune(dtype, *tune_at, device, cuda, gen, args.layout)
        print(f"{dtype}: best kernel config at batch {tune_at[0]}, {tune_at[1]} tokens: {configs[dtype]}", flush=True)
    swept = {dtype: _swept_config(dtype, configs[dtype], tuning[dtype], args.tuned) for dtype in configs}
    for dtype, config in swept.items():
        print(f"{dtype}: the sweep runs {config}", flush=True)
    rows = []
    for dtype, batch, context in itertools.product(("fp8", "bf16"), batches, contexts):
        inputs = make_inputs(batch, context, dtype, device, gen, args.layout)
        eager = time_call(lambda: paged_decode_attention(**inputs, **swept[dtype]), cuda)
        flushes: dict = {}
        seconds = time_replay(lambda: paged_decode_attention(**inputs, **swept[dtype]), flushes) if cuda else eager
        nbytes = bytes_read(inputs, context)
        splits, _ = split_plan(batch, KV_HEADS, inputs["page_table"].shape[1] * PAGE, swept[dtype]["block_n"],
                               slots=attention.wave_slots(inputs["q"].device, swept[dtype]["programs_per_sm"]))
        gbps = nbytes / seconds / 1e9
        rows.append(dict(dtype=dtype, batch=batch, context=context, splits=splits, bytes=nbytes, us=seconds * 1e6,
                         gbps=gbps, of_copy=gbps / copy["hbm_gbps"], eager_us=eager * 1e6,
                         dirty_flush_us=flushes.get("dirty", 0.0) * 1e6,
                         dirty_flush_of_copy=nbytes / flushes["dirty"] / 1e9 / copy["hbm_gbps"] if "dirty" in flushes else None,
                         eager_of_copy=nbytes / eager / 1e9 / copy["hbm_gbps"]))
        print(f"  {dtype} batch {batch:>3} context {context:>6}: {seconds * 1e6:9.1f} us {gbps:8.0f} GB/s "
              f"(called from Python: {eager * 1e6:.1f} us)", flush=True)
        del inputs
    report = {"meta": meta, "layout": args.layout, "copy": copy, "kernel_configs": configs, "swept_configs": swept,
              "tuned": args.tuned, "tuning": tuning, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(f"\nGB/s of KV + scale bytes read (kernels replayed from a CUDA graph, L2 flushed clean); x = of the D2D "
          f"copy's HBM traffic ({copy['hbm_gbps']:.0f} GB/s); in brackets: x when called from Python")
    print(f"{'dtype':<5} {'batch':>5} " + " ".join(f"{str(c) + ' tokens':>13}" for c in contexts))
    for dtype, batch in itertools.product(("fp8", "bf16"), batches):
        cells = [r for r in rows if r["dtype"] == dtype and r["batch"] == batch]
        print(f"{dtype:<5} {batch:>5} " + " ".join(f"{r['gbps']:6.0f} {r['of_copy']:4.2f}x ({r['eager_of_copy']:4.2f})" for r in cells))
    if cuda:
        print("\nx of the copy with L2 flushed dirty (writes only: the flush these tables used before 2026-12-05)")
        for dtype, batch in itertools.product(("fp8", "bf16"), batches):
            cells = [r for r in rows if r["dtype"] == dtype and r["batch"] == batch]
            print(f"{dtype:<5} {batch:>5} " + " ".join(f"{r['dirty_flush_of_copy']:>13.2f}x" for r in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
