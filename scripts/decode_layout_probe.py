"""Issue 25's next H200 probe: fp8 decode attention per kernel variant on "nhd" and "hnd" pages.

Times (graph replay, L2 flushed clean, x of a same-run device-to-device copy's HBM traffic, as
benchmarks/decode_attention.py) the library's fp8 default, the H200 search's 128/4w/3s pick, two
kv heads stacked block-diagonally (kv_per_program=2), one warp a program, and the two variants of
kvtier/decode/fp8_variants.py ("pairs_two_heads", "pairs_stacked"), each new one first checked
against the float64 reference on the GPU (scripts/decode_sweep_h200.py's numerics), at batch 16 x 8k,
64 x 8k and 64 x 1k, on the same pages in "nhd" (a kv head's token a 128-byte piece) and "hnd"
(a kv head's 16 tokens one 2 KB piece) layout, beside the bf16 default. If "hnd" reads much faster
than "nhd" with one kernel, the pieces' length, not the kernel's instructions, holds fp8 back.

TREE is a checkout to import kvtier from (default: this one): scripts/decode_h200_probe.sh runs it
again over a copy whose split kernels are launched kv head first (grid (kv heads, batch, splits)),
so that the programs of one token range's kv heads run side by side. Needs CUDA.

    PYTHONPATH=. python3 scripts/decode_layout_probe.py [TREE]     # writes $OUT/layout_<tree>.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
tree = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT
sys.path.insert(0, str(tree))

import torch  # noqa: E402

from kvtier.decode import attention  # noqa: E402  the tree's, before the benchmark puts this checkout first
from kvtier.decode.attention import paged_decode_attention  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import decode_attention as bench  # noqa: E402  benchmarks/decode_attention.py

assert Path(attention.__file__).resolve().parents[2] == tree, attention.__file__
print("kvtier from", attention.__file__, flush=True)
DEV = "cuda"
CONFIGS = {
    "fp8 default": ("fp8", {}),
    "fp8 4w3s/3": ("fp8", dict(block_n=128, num_warps=4, num_stages=3, fp8_dot="pairs", page_ahead=True, programs_per_sm=3)),
    "fp8 2kv 64/4w/3s/2": ("fp8", dict(block_n=64, num_warps=4, num_stages=3, fp8_dot="pairs", page_ahead=True, kv_per_program=2, programs_per_sm=2)),
    "fp8 1w 64/3s/8": ("fp8", dict(block_n=64, num_warps=1, num_stages=3, fp8_dot="pairs", page_ahead=True, programs_per_sm=8)),
    "fp8 two 64/4w/2s/3": ("fp8", dict(block_n=64, num_warps=4, num_stages=2, fp8_dot="pairs_two_heads", page_ahead=True, programs_per_sm=3)),
    "fp8 stacked 128/4w/2s/3": ("fp8", dict(block_n=128, num_warps=4, num_stages=2, fp8_dot="pairs_stacked", page_ahead=True, programs_per_sm=3)),
    "bf16 default": ("bf16", {}),
}
CONFIGS = {n: c for n, c in CONFIGS.items() if c[1].get("fp8_dot", "pairs") in attention.FP8_DOTS}
shapes = [(16, 8192), (64, 8192), (64, 1024)]
if tree == ROOT:  # the new variants checked against the float64 reference on the GPU first
    sys.path.insert(0, str(ROOT / "scripts"))
    import decode_sweep_h200 as sweep  # scripts/decode_sweep_h200.py
    for name, (d, cfg) in CONFIGS.items():
        if d == "fp8" and cfg.get("fp8_dot", "pairs") != "pairs" or cfg.get("num_warps") == 1:
            try:
                print(f"numerics {name}: worst / bound {sweep.numerics(d, cfg, torch.Generator().manual_seed(3), DEV):.3f}", flush=True)
            except Exception as error:  # noqa: BLE001 - reported, the timing goes on
                print(f"numerics {name}: FAILED {error!r}"[:300], flush=True)
else:
    CONFIGS = {n: c for n, c in CONFIGS.items() if n in ("fp8 default", "fp8 4w3s/3", "bf16 default")}
copy = bench.copy_rate(True, "cuda")["hbm_gbps"]
gen = torch.Generator().manual_seed(11)
rows = []
for b, c in shapes:
    for dtype in ("fp8", "bf16"):
        for lay in ("nhd", "hnd"):
            inputs = bench.make_inputs(b, c, dtype, "cuda", gen, layout=lay)
            nbytes = bench.bytes_read(inputs, c)
            for name, (d, cfg) in CONFIGS.items():
                if d != dtype:
                    continue
                s = bench.time_replay(lambda: paged_decode_attention(**inputs, **cfg))
                rows.append(dict(tree=str(tree), config=name, layout=lay, batch=b, context=c, us=s * 1e6, of_copy=nbytes / s / 1e9 / copy))
                print(f"{tree.name:>8} {name:<24} {lay} {b:>3} x {c // 1024:>2}k {s*1e6:8.1f} us {nbytes / s / 1e9 / copy:5.2f}x", flush=True)
            inputs = None
            torch.cuda.empty_cache()
out = Path(os.environ.get("OUT", "/tmp")) / f"layout_{tree.name}.json"
out.write_text(json.dumps(dict(copy=copy, rows=rows), indent=1))
