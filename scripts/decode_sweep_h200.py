"""One H200 call: fp8 and bf16 decode attention per kernel configuration, to choose DEFAULT_CONFIGS.

Each candidate (block_n, warps, stages, page_ahead, fp8_dot) is first checked against the
float64 reference on a small random case on the GPU (bound as in tests/test_decode_attention.py),
then timed at batch 16 / 64 x 1k / 8k / 32k tokens as benchmarks/decode_attention.py times
(kernels replayed from a CUDA graph, L2 flushed before each replay), as x of a device-to-device
copy's HBM traffic measured in the same run. The fp8 step time over the bf16 default's is
printed per shape (the goal: <= 0.6 from 8k tokens). Last, where time is left, the first pool
in a fresh process (cold then warm kernel cache) through scripts/h200_kernels_at_the_limit.py.

Fails soft per candidate and shape; stops starting new work past --budget seconds. Prints
tables and writes $OUT/decode_sweep.json (OUT defaults to /tmp) after every shape.

    PYTHONPATH=. python3 scripts/decode_sweep_h200.py --budget 230
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

import decode_attention as bench  # noqa: E402  benchmarks/decode_attention.py

from kvtier.decode import attention  # noqa: E402
from kvtier.decode.attention import paged_decode_attention, reference_decode_attention  # noqa: E402
from kvtier.format import quantize  # noqa: E402


def _config(block_n, warps, stages, page_ahead=False, fp8_dot=None):
    """Keyword arguments of paged_decode_attention (a "programs_per_sm" key, where added, sets the
    call's split plan's programs an SM)."""
    config = dict(block_n=block_n, num_warps=warps, num_stages=stages, page_ahead=page_ahead)
    if fp8_dot is not None:
        config["fp8_dot"] = fp8_dot
    return config


# Offline compiles for sm_90 (scripts/decode_offline_sm90.py) give each one's registers and shared
# memory: all fit the H200's 232,448 bytes a block; "mma" at 128 tokens / 4 warps takes ~190
# registers a thread, so two programs an SM (programs_per_sm sets the split plan's target).
CANDIDATES = {
    "fp8": {
        "pairs 128/4w/2s": _config(128, 4, 2, False, "pairs"),
        "pairs 128/4w/2s ahead": _config(128, 4, 2, True, "pairs"),
        "pairs 128/4w/3s ahead": _config(128, 4, 3, True, "pairs"),
        "pairs 64/4w/3s ahead": _config(64, 4, 3, True, "pairs"),
        "pairs 64/4w/4s ahead": _config(64, 4, 4, True, "pairs"),
        "pairs 128/8w/2s ahead": _config(128, 8, 2, True, "pairs"),
        "pairs_lean 128/4w/2s ahead": _config(128, 4, 2, True, "pairs_lean"),
        "mma 128/4w/2s": _config(128, 4, 2, False, "mma"),
        "mma 128/4w/2s ahead": _config(128, 4, 2, True, "mma"),
        "mma 128/4w/3s ahead": _config(128, 4, 3, True, "mma"),
        "mma 64/4w/3s ahead": _config(64, 4, 3, True, "mma"),
        "mma 256/4w/2s ahead": _config(256, 4, 2, True, "mma"),
        "mma 128/8w/3s ahead": _config(128, 8, 3, True, "mma"),
        "mma 128/4w/2s ahead, 2 per SM": dict(_config(128, 4, 2, True, "mma"), programs_per_sm=2),
        # The split plan against the default kernel (2026-12-05): 2 per SM takes fewer splits (64 x 1k:
        # one, no merge), 6 and 12 more (two and four waves at 16 x 8k); 8 warps hold ~108 registers
        # a thread (two programs an SM).
        "pairs 128/4w/3s ahead, 2 per SM": dict(_config(128, 4, 3, True, "pairs"), programs_per_sm=2),
        "pairs 128/4w/3s ahead, 6 per SM": dict(_config(128, 4, 3, True, "pairs"), programs_per_sm=6),
        "pairs 128/4w/3s ahead, 12 per SM": dict(_config(128, 4, 3, True, "pairs"), programs_per_sm=12),
        "pairs 128/8w/3s ahead, 2 per SM": dict(_config(128, 8, 3, True, "pairs"), programs_per_sm=2),
        "pairs 64/4w/3s ahead, 2 per SM": dict(_config(64, 4, 3, True, "pairs"), programs_per_sm=2),
        # The merge fused into the split kernel (merge="fused": no second launch), alone and with
        # plans of more splits, whose merge it makes cheaper.
        "pairs 128/4w/3s ahead, fused merge": dict(_config(128, 4, 3, True, "pairs"), merge="fused"),
        "pairs 128/4w/3s ahead, fused merge, 6 per SM": dict(_config(128, 4, 3, True, "pairs"), merge="fused",
                                                             programs_per_sm=6),
        # Two warps: fewer warps to reduce across, more programs an SM (offline sm_90: 180 / 181 / 255
        # registers, 40 / 57 / 42 KB shared: five, four, four an SM).
        "pairs 64/2w/3s ahead, 5 per SM": dict(_config(64, 2, 3, True, "pairs"), programs_per_sm=5),
        "pairs 64/2w/4s ahead, 4 per SM": dict(_config(64, 2, 4, True, "pairs"), programs_per_sm=4),
        "pairs 128/2w/2s ahead, 4 per SM": dict(_config(128, 2, 2, True, "pairs"), programs_per_sm=4),
        "pairs 128/4w/2s ahead, cap 128, 4 per SM": dict(_config(128, 4, 2, True, "pairs"), programs_per_sm=4, maxnreg=128),
        # Several kv heads a program (kv_per_program): 2 -> 8 of 16 rows live and 256-byte pieces per
        # token under "nhd", 4 -> 16 of 16 and 512 bytes (H100 flush panel, 2026-12-05: "hnd" pages,
        # 2 KB pieces, read 0.92-0.97x at 8k-32k tokens against 0.81-0.87x for "nhd"'s 128 bytes).
        # Offline sm_90 (Triton 3.9) registers / shared: 174 / 92 KB (64/4w/3s, 2 kv), 128 / 92 KB
        # (64/8w/3s), 156 / 94 KB (128/8w/2s), 185 / 91 KB (32/4w/3s, 4 kv), 148 / 91 KB (32/8w/3s),
        # 164 / 92 KB (64/8w/2s), 134 / 71 KB (32/4w/4s, 2 kv); programs an SM set to match.
        "pairs 64/4w/3s ahead, 2 kv": dict(_config(64, 4, 3, True, "pairs"), kv_per_program=2),
        "pairs 64/4w/3s ahead, 2 kv, 2 per SM": dict(_config(64, 4, 3, True, "pairs"), kv_per_program=2,
                                                     programs_per_sm=2),
        "pairs 64/8w/3s ahead, 2 kv, 2 per SM": dict(_config(64, 8, 3, True, "pairs"), kv_per_program=2,
                                                     programs_per_sm=2),
        "pairs 128/8w/2s ahead, 2 kv, 1 per SM": dict(_config(128, 8, 2, True, "pairs"), kv_per_program=2,
                                                      programs_per_sm=1),
        "pairs 32/4w/3s ahead, 4 kv, 2 per SM": dict(_config(32, 4, 3, True, "pairs"), kv_per_program=4,
                                                     programs_per_sm=2),
        "pairs 32/8w/3s ahead, 4 kv, 1 per SM": dict(_config(32, 8, 3, True, "pairs"), kv_per_program=4,
                                                     programs_per_sm=1),
        "pairs 64/8w/2s ahead, 4 kv, 1 per SM": dict(_config(64, 8, 2, True, "pairs"), kv_per_program=4,
                                                     programs_per_sm=1),
        "pairs 32/4w/4s ahead, 2 kv, 3 per SM": dict(_config(32, 4, 4, True, "pairs"), kv_per_program=2,
                                                     programs_per_sm=3),
        # One warp a program (2026-12-07): no cross-warp reductions in the loop (each block's row
        # maxima and sums stay within the warp), more programs an SM to keep the SM's issue slots fed.
        "pairs 64/1w/2s ahead, 8 per SM": dict(_config(64, 1, 2, True, "pairs"), programs_per_sm=8),
        "pairs 64/1w/3s ahead, 8 per SM": dict(_config(64, 1, 3, True, "pairs"), programs_per_sm=8),
        "pairs 32/1w/4s ahead, 8 per SM": dict(_config(32, 1, 4, True, "pairs"), programs_per_sm=8),
        "pairs 128/1w/2s ahead, 6 per SM": dict(_config(128, 1, 2, True, "pairs"), programs_per_sm=6),
        "pairs 64/1w/3s ahead, 12 per SM": dict(_config(64, 1, 3, True, "pairs"), programs_per_sm=12),
        # The query heads stacked over interleaved slices of a step (fp8_dot="pairs_stacked": all 16
        # rows of the dots live at 4 query heads a kv head; block_n tokens a step, block_n / 4 tile rows).
        "stacked 128/4w/2s ahead, 3 per SM": dict(_config(128, 4, 2, True, "pairs_stacked"), programs_per_sm=3),
        "stacked 128/4w/3s ahead, 3 per SM": dict(_config(128, 4, 3, True, "pairs_stacked"), programs_per_sm=3),
        "stacked 128/2w/2s ahead, 4 per SM": dict(_config(128, 2, 2, True, "pairs_stacked"), programs_per_sm=4),
        "stacked 256/4w/2s ahead, 2 per SM": dict(_config(256, 4, 2, True, "pairs_stacked"), programs_per_sm=2),
        "stacked 128/8w/2s ahead, 2 per SM": dict(_config(128, 8, 2, True, "pairs_stacked"), programs_per_sm=2),
        "stacked 64/2w/3s ahead, 4 per SM": dict(_config(64, 2, 3, True, "pairs_stacked"), programs_per_sm=4),
        # Two kv heads a program, each its own softmax (fp8_dot="pairs_two_heads"): a token's two heads'
        # 256 contiguous bytes of "nhd" pages read at once; twice the registers of one head (offline
        # sm_90: 144 / 255 / 201 / 86 registers, 44-80 KB shared; programs an SM set to match).
        "two heads 64/4w/2s ahead, 3 per SM": dict(_config(64, 4, 2, True, "pairs_two_heads"), programs_per_sm=3),
        "two heads 64/2w/2s ahead, 4 per SM": dict(_config(64, 2, 2, True, "pairs_two_heads"), programs_per_sm=4),
        "two heads 128/4w/2s ahead, 2 per SM": dict(_config(128, 4, 2, True, "pairs_two_heads"), programs_per_sm=2),
        "two heads 64/8w/2s ahead, 2 per SM": dict(_config(64, 8, 2, True, "pairs_two_heads"), programs_per_sm=2),
    },
    "bf16": {
        "bf16 64/4w/2s": _config(64, 4, 2),
        "bf16 64/4w/2s ahead": _config(64, 4, 2, True),
        "bf16 64/4w/3s ahead": _config(64, 4, 3, True),
        "bf16 128/8w/2s ahead": _config(128, 8, 2, True),
        "bf16 64/4w/3s ahead, fused merge": dict(_config(64, 4, 3, True), merge="fused"),
    },
}


def default_name(dtype: str) -> str | None:
    """The candidate that is today's DEFAULT_CONFIGS entry for `dtype` (its label gets "(default)")."""
    wanted = attention.DEFAULT_CONFIGS["fp8" if dtype == "fp8" else "16-bit"]
    for name, config in CANDIDATES[dtype].items():
        if "programs_per_sm" not in config and all(config.get(k, v) == v for k, v in wanted.items()) and \
                all(wanted.get(k, config[k]) == config[k] for k in config):
            return name
    return None


def select(only: str | None) -> None:
    """Keep the defaults and the candidates whose names contain one of the comma-separated `only` parts."""
    if not only:
        return
    # ";" separates parts where names hold commas ("pairs 64/1w/3s ahead, 8 per SM;stacked").
    parts = [part.strip() for part in only.split(";" if ";" in only else ",") if part.strip()]
    for dtype, candidates in CANDIDATES.items():
        keep = default_name(dtype)
        for name in list(candidates):
            if name != keep and not any(part in name for part in parts):
                del candidates[name]


SHAPES = [(b, c) for b in (16, 64) for c in (1024, 8192, 32768)]
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def kernel_args(config: dict) -> dict:
    """paged_decode_attention's keyword arguments of a candidate (programs_per_sm included: the
    split plan's wave for that configuration)."""
    return dict(config)


def numerics(dtype: str, config: dict, gen: torch.Generator, device: str = "cuda") -> float:
    """Worst error / bound of `config` on a random case of 3 sequences (bound: the dot dtype's ulp
    times the attention over |V|, plus fp32 noise; fp16 dots under "pairs", bf16's otherwise)."""
    batch, kv_heads, group, head_dim, page = 3, 8, 4, 128, 16
    lens = torch.tensor([1000, 1, 777], dtype=torch.int32)
    pages = -(-int(lens.max()) // page)
    shape = (batch * pages, page, kv_heads, head_dim)
    table = torch.randperm(batch * pages, generator=gen).view(batch, pages).int()
    q = torch.randn((batch, kv_heads * group, head_dim), generator=gen).bfloat16()
    args = dict(q=q, page_table=table, seq_lens=lens)
    if dtype == "bf16":
        args.update(k_pages=torch.randn(shape, generator=gen).bfloat16(), v_pages=torch.randn(shape, generator=gen).bfloat16())
    else:
        k, ks = quantize(torch.randn(shape, generator=gen), "fp8_e4m3", "per_token_head", "nhd")
        v, vs = quantize(torch.randn(shape, generator=gen), "fp8_e4m3", "per_token_head", "nhd")
        args.update(k_pages=k, v_pages=v, k_scales=ks, v_scales=vs, scale="per_token_head")
    ref = reference_decode_attention(**args)
    abs_v = args["v_pages"].view(torch.uint8) & 0x7F if dtype != "bf16" else args["v_pages"].view(torch.int16) & 0x7FFF
    mean_abs_v = reference_decode_attention(**dict(args, v_pages=abs_v.view(args["v_pages"].dtype)))
    gpu = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in args.items()}
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=device)
    paged_decode_attention(**gpu, out=out, **({"num_splits": 2} | kernel_args(config)))  # a config may name its own
    dot = torch.float16 if config.get("fp8_dot", "").startswith("pairs") else torch.bfloat16
    bound = (ULP[dot] + 1e-5) * mean_abs_v + 2.0**-23 * ref.abs()
    return float(((out.cpu().double() - ref).abs() / bound).max())


def run(args: argparse.Namespace, report: dict, out_file: Path) -> None:
    began = time.perf_counter()

    def left() -> float:
        return args.budget - (time.perf_counter() - began)

    copy = bench.copy_rate(True, "cuda")
    report["copy"] = copy
    gen = torch.Generator().manual_seed(25)
    checks = report.setdefault("numerics", {})
    for dtype, candidates in CANDIDATES.items():
        for name, config in candidates.items():
            try:
                checks[name] = {"worst_over_bound": numerics(dtype, config, gen)}
            except Exception as error:  # noqa: BLE001 - a candidate that fails to compile is reported
                checks[name] = {"error": repr(error)[:400]}
            print(f"numerics {name:<30} {checks[name]}", flush=True)
    rows = report.setdefault("rows", [])
    default_per_sm = attention.PROGRAMS_PER_SM
    for batch, context in SHAPES:
        for dtype, candidates in CANDIDATES.items():
            if left() < 0:
                report["stopped"] = f"budget spent before {dtype} batch {batch} x {context}"
                return
            try:
                inputs = bench.make_inputs(batch, context, dtype, "cuda", gen)
            except Exception as error:  # noqa: BLE001
                rows.append(dict(dtype=dtype, batch=batch, context=context, variant="inputs", error=repr(error)))
                continue
            nbytes = bench.bytes_read(inputs, context)
            for name, config in candidates.items():
                if "error" in checks.get(name, {}) or checks.get(name, {}).get("worst_over_bound", 0) > 1:
                    continue
                attention.PROGRAMS_PER_SM = config.get("programs_per_sm", default_per_sm)
                try:
                    seconds = bench.time_replay(lambda: paged_decode_attention(**inputs, **kernel_args(config)))
                    gbps = nbytes / seconds / 1e9
                    rows.append(dict(dtype=dtype, batch=batch, context=context, variant=name, us=seconds * 1e6,
                                     gbps=gbps, of_copy=gbps / copy["hbm_gbps"]))
                except Exception as error:  # noqa: BLE001
                    rows.append(dict(dtype=dtype, batch=batch, context=context, variant=name, error=repr(error)[:300]))
                finally:
                    attention.PROGRAMS_PER_SM = default_per_sm
            del inputs
            torch.cuda.empty_cache()
            out_file.write_text(json.dumps(report, indent=1, default=str))


def merge_only(report: dict) -> None:
    """The merge kernel alone, as the default fp8 plan launches it at each shape: what fusing it
    into the split kernel (or a plan of one split) could save at most."""
    import triton

    rows = report.setdefault("merge_only", [])
    config = attention.DEFAULT_CONFIGS["fp8"]
    for batch, context in SHAPES:
        row = dict(batch=batch, context=context)
        try:
            heads, q_heads, head_dim = bench.KV_HEADS, bench.Q_HEADS, bench.HEAD_DIM
            splits, per_split = attention.split_plan(batch, heads, context, config["block_n"], None,
                                                     attention.wave_slots(torch.device("cuda")))
            row["splits"] = splits
            if splits > 1:
                mid_o = torch.randn((batch, q_heads, splits, head_dim), device="cuda")
                mid_lse = torch.randn((batch, q_heads, splits), device="cuda")
                lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                out = torch.empty((batch, q_heads, head_dim), dtype=torch.bfloat16, device="cuda")

                def merge():
                    attention._merge_splits[(batch, q_heads)](
                        mid_o, mid_lse, lens, out, per_split,
                        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
                        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                        num_warps=4)

                row["us"] = bench.time_replay(merge) * 1e6
        except Exception as error:  # noqa: BLE001
            row["error"] = repr(error)[:300]
        rows.append(row)


FLUSHES = ("zero", "zero+read", "read")


def time_flushed(fn, flush: str, buffer: torch.Tensor, reps: int = 40) -> float:
    """Median seconds of `fn` replayed from a CUDA graph after an L2 flush of kind `flush`:
    "zero" writes 256 MB (triton.testing.do_bench's flush, used by every table above: it leaves
    L2 full of dirty lines, which the timed kernel's reads then write back to HBM), "zero+read"
    writes it then reads it (the write-back happens before the timed call, L2 is left clean),
    "read" only reads it (clean L2 without the zeroing)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def clear() -> None:
        if "zero" in flush:
            buffer.zero_()
        if "read" in flush:
            buffer.max()

    for _ in range(5):
        clear()
        graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        clear()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    times = sorted(start.elapsed_time(end) for start, end in zip(starts, ends))
    return times[len(times) // 2] / 1e3


def flush_panel(report: dict, left) -> None:
    """The defaults (and the fused merge, and pages in "hnd" layout) at every shape under each L2
    flush of time_flushed: how much of each step the flush's dirty lines cost (a decode step
    follows kernels that write little, so its L2 holds few dirty lines), and whether longer
    contiguous pieces per program read faster."""
    configs = {"fp8": {"fp8 default": {}, "fp8 default, fused merge": dict(merge="fused")},
               "bf16": {"bf16 default": {}}}
    rows = report.setdefault("flush_rows", [])
    copy = report.get("copy", {}).get("hbm_gbps") or bench.copy_rate(True, "cuda")["hbm_gbps"]
    buffer = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(26)
    for batch, context in SHAPES:
        for dtype, variants in configs.items():
            if left() < 0:
                report["flush_stopped"] = f"budget spent before {dtype} batch {batch} x {context}"
                return
            inputs = bench.make_inputs(batch, context, dtype, "cuda", gen)
            nbytes = bench.bytes_read(inputs, context)
            # The same pages head-major ("hnd": a kv head's tokens of a page contiguous, 2 KB of fp8
            # at head_dim 128, where "nhd" gives each program 128-byte pieces 1 KB apart).
            variants = dict(variants)
            variants[f"{dtype} default, hnd pages"] = dict(layout="hnd", _hnd=True)
            hnd = None
            for name, extra in variants.items():
                call = inputs
                if extra.get("_hnd"):
                    try:
                        if hnd is None:
                            hnd = dict(inputs, layout="hnd")
                            for key in ("k_pages", "v_pages", "k_scales", "v_scales"):
                                if key in inputs:
                                    hnd[key] = inputs[key].transpose(1, 2).contiguous()
                        call = hnd
                    except Exception as error:  # noqa: BLE001 - too large for the device beside the nhd pages
                        rows.append(dict(dtype=dtype, variant=name, flush="-", batch=batch, context=context,
                                         error=repr(error)[:300]))
                        continue
                extra = {key: value for key, value in extra.items() if key not in ("_hnd", "layout")}
                for flush in FLUSHES:
                    row = dict(dtype=dtype, variant=name, flush=flush, batch=batch, context=context)
                    try:
                        seconds = time_flushed(lambda: paged_decode_attention(**call, **extra), flush, buffer)
                        row.update(us=seconds * 1e6, of_copy=nbytes / seconds / 1e9 / copy)
                    except Exception as error:  # noqa: BLE001
                        row["error"] = repr(error)[:300]
                    rows.append(row)
            del inputs, hnd
            torch.cuda.empty_cache()


def print_flush_table(report: dict) -> None:
    rows = report.get("flush_rows", [])
    if not rows:
        return
    print("\n== the defaults under each L2 flush: x of the D2D copy's HBM traffic (us); 'zero' is the tables' flush")
    print(f"{'variant / flush':<42}" + "".join(f"{f'{b} x {c // 1024}k':>16}" for b, c in SHAPES))
    for key in dict.fromkeys((r["variant"], r["flush"]) for r in rows):
        cells = []
        for b, c in SHAPES:
            row = next((r for r in rows if (r["variant"], r["flush"], r["batch"], r["context"]) == (*key, b, c)), None)
            cells.append(f"{'-':>16}" if row is None else f"{'FAIL':>16}" if "error" in row else
                         f"{row['of_copy']:>6.2f}x ({row['us']:6.1f})")
        print(f"{key[0] + ' / ' + key[1]:<42}" + "".join(cells))
    print("fp8 step / bf16 step, same flush (goal <= 0.6 from 8k tokens):")
    for name in dict.fromkeys(r["variant"] for r in rows if r["dtype"] == "fp8"):
        for flush in FLUSHES:
            cells = []
            for b, c in SHAPES:
                fp8 = next((r for r in rows if (r["variant"], r["flush"], r["batch"], r["context"]) == (name, flush, b, c)
                            and "us" in r), None)
                reference = "bf16 default" + (", hnd pages" if "hnd" in name else "")
                bf16 = next((r for r in rows if (r["variant"], r["flush"], r["batch"], r["context"]) == (reference, flush, b, c)
                             and "us" in r), None)
                cells.append(f"{fp8['us'] / bf16['us']:>16.2f}" if fp8 and bf16 else f"{'-':>16}")
            print(f"{name + ' / ' + flush:<42}" + "".join(cells))


def print_tables(report: dict) -> None:
    rows = report.get("rows", [])
    copy = report.get("copy", {}).get("hbm_gbps", 0)
    print(f"\n== decode attention, graph replay: x of the D2D copy's HBM traffic ({copy:.0f} GB/s); us in brackets")
    print(f"{'candidate':<42}" + "".join(f"{f'{b} x {c // 1024}k':>16}" for b, c in SHAPES))
    bf16_default = default_name("bf16")
    bf16 = {(r["batch"], r["context"]): r["us"] for r in rows if r.get("variant") == bf16_default and "us" in r}
    for dtype, candidates in CANDIDATES.items():
        for name in candidates:
            cells = []
            for b, c in SHAPES:
                row = next((r for r in rows if (r["variant"], r["batch"], r["context"]) == (name, b, c)), None)
                cells.append(f"{'-':>16}" if row is None else f"{'FAIL':>16}" if "error" in row else
                             f"{row['of_copy']:>6.2f}x ({row['us']:6.1f})")
            label = name + (" (default)" if name == default_name(dtype) else "")
            print(f"{label:<42}" + "".join(cells))
    print(f"fp8 step time / bf16 default ({bf16_default}) step time (goal <= 0.6 from 8k tokens):")
    for name in CANDIDATES["fp8"]:
        ratios = [next((f"{r['us'] / bf16[(b, c)]:.2f}" for r in rows if (r["variant"], r["batch"], r["context"]) ==
                        (name, b, c) and "us" in r and (b, c) in bf16), "-") for b, c in SHAPES]
        print(f"{name:<42}" + "".join(f"{x:>16}" for x in ratios))
    merges = report.get("merge_only", [])
    if merges:
        print("the merge kernel alone at the default fp8 plan (us; graph replay, L2 flushed):")
        for row in merges:
            print(f"  batch {row['batch']} x {row['context'] // 1024}k: {row.get('splits')} splits, "
                  + (f"{row['us']:.1f} us" if "us" in row else row.get("error", "single split: no merge")))
    for name, check in report.get("numerics", {}).items():
        if "error" in check or check["worst_over_bound"] > 1:
            print(f"NUMERICS FAILED {name}: {check}")
    for row in rows:
        if "error" in row:
            print(f"FAILED {row['variant']} batch {row['batch']} x {row['context']}: {row['error']}")


def first_pool(report: dict) -> None:
    """The first pool in a fresh process, cold then warm kernel cache (one empty cache directory)."""
    import tempfile

    import h200_kernels_at_the_limit as kernels  # scripts/h200_kernels_at_the_limit.py

    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    runs = report.setdefault("first_pool", {})
    with tempfile.TemporaryDirectory() as cache_dir:
        env["KVTIER_KERNEL_CACHE"] = cache_dir
        for label in ("cold", "warm"):
            try:
                runs[label] = kernels._child(kernels.FIRST_POOL, env)
            except Exception as error:  # noqa: BLE001 - reported, what was measured stays
                runs[label] = {"error": str(error)[-400:]}
            pools = {k: v["pool_s"] for k, v in runs[label].items() if isinstance(v, dict) and "pool_s" in v}
            print(f"first pool, {label} cache: {pools or runs[label]} (s; goal <= 0.25)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=230.0, help="seconds after which no new shape starts")
    parser.add_argument("--no-first-pool", action="store_true", help="skip the first-pool timing at the end")
    parser.add_argument("--no-flush-panel", action="store_true", help="skip the defaults under each L2 flush")
    parser.add_argument("--flush-only", action="store_true", help="time only the defaults under each L2 flush")
    parser.add_argument("--only", default=None,
                        help="comma-separated parts of candidate names to time besides the defaults, e.g. 'per SM'")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated BATCHxTOKENS shapes in the order to time them (default: all six)")
    args = parser.parse_args()
    select(args.only)
    if args.shapes:
        SHAPES[:] = [tuple(int(x) for x in part.lower().split("x")) for part in args.shapes.split(",") if part.strip()]
    out = Path(os.environ.get("OUT") or "/tmp")
    out.mkdir(parents=True, exist_ok=True)
    out_file = out / "decode_sweep.json"
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "default_configs": attention.DEFAULT_CONFIGS, "candidates": CANDIDATES}
    began = time.perf_counter()
    try:
        from kvtier.bench.offload_bandwidth import gpu_meta

        report["meta"] = gpu_meta()
        report["meta"]["triton"] = __import__("triton").__version__
    except Exception as error:  # noqa: BLE001
        report["meta"] = {"error": repr(error)}
    if not args.flush_only:
        try:
            run(args, report, out_file)
        except Exception as error:  # noqa: BLE001 - what was measured stays in the JSON
            report.setdefault("errors", []).append(repr(error))
            traceback.print_exc()
        try:
            merge_only(report)
        except Exception as error:  # noqa: BLE001
            report.setdefault("errors", []).append(f"merge_only: {error!r}")
        print_tables(report)
    if not args.no_flush_panel:
        try:
            flush_panel(report, lambda: args.budget + 150 - (time.perf_counter() - began))
        except Exception as error:  # noqa: BLE001
            report.setdefault("errors", []).append(f"flush_panel: {error!r}")
            traceback.print_exc()
        print_flush_table(report)
        out_file.write_text(json.dumps(report, indent=1, default=str))
    if not args.no_first_pool and time.perf_counter() - began < args.budget + 30:
        first_pool(report)
    report["seconds"] = time.perf_counter() - began
    out_file.write_text(json.dumps(report, indent=1, default=str))
    print(f"\ntook {report['seconds']:.0f} s; JSON: {out_file}; errors: {report.get('errors', [])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
