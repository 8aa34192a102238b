"""One decode-attention call per named config between cudaProfilerStart and Stop, for
`ncu --profile-from-start off` (scripts/decode_h200_probe.sh): each config is called three times
first (compiles, warm caches), then once under the profiler with an NVTX range of its name.
Names: see CONFIGS ("_hnd" appended: the same pages head-major). Needs CUDA.

    ncu --profile-from-start off ... python3 scripts/decode_ncu_calls.py fp8_default,bf16_default 16 8192
"""

from __future__ import annotations

import sys
from pathlib import Path
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch  # noqa: E402

import decode_attention as bench  # noqa: E402  benchmarks/decode_attention.py
from kvtier.decode.attention import paged_decode_attention  # noqa: E402

CONFIGS = {
    "fp8_default": ("fp8", {}),
    "fp8_4w3s": ("fp8", dict(block_n=128, num_warps=4, num_stages=3, fp8_dot="pairs", page_ahead=True, programs_per_sm=3)),
    "fp8_1w64_3s": ("fp8", dict(block_n=64, num_warps=1, num_stages=3, fp8_dot="pairs", page_ahead=True, programs_per_sm=8)),
    "bf16_default": ("bf16", {}),
    "fp8_two": ("fp8", dict(block_n=64, num_warps=4, num_stages=2, fp8_dot="pairs_two_heads", page_ahead=True, programs_per_sm=3)),
    "fp8_stacked": ("fp8", dict(block_n=128, num_warps=4, num_stages=2, fp8_dot="pairs_stacked", page_ahead=True, programs_per_sm=3)),
    "fp8_fused": ("fp8", dict(merge="fused")),
    "fp8_pdl": ("fp8", dict(merge="pdl")),
    "bf16_fused": ("bf16", dict(merge="fused")),
    "fp8_3s": ("fp8", dict(block_n=128, num_warps=4, num_stages=3, fp8_dot="pairs", page_ahead=True, programs_per_sm=3)),
    "fp8_3s_fused": ("fp8", dict(block_n=128, num_warps=4, num_stages=3, fp8_dot="pairs", page_ahead=True, programs_per_sm=3,
                                 merge="fused")),
    "fp8_2kv": ("fp8", dict(block_n=64, num_warps=4, num_stages=3, fp8_dot="pairs", page_ahead=True, kv_per_program=2, programs_per_sm=2)),
}
for n in list(CONFIGS):
    CONFIGS[n + "_hnd"] = (CONFIGS[n][0], dict(CONFIGS[n][1], layout="hnd"))
names = sys.argv[1].split(",")
batch, ctx = int(sys.argv[2]), int(sys.argv[3])
gen = torch.Generator().manual_seed(7)
inputs = {}
for n in names:
    d, cfg = CONFIGS[n]
    lay = cfg.get("layout", "nhd")
    if (d, lay) not in inputs:
        inputs[(d, lay)] = bench.make_inputs(batch, ctx, d, "cuda", gen, layout=lay)


def call(n: str):
    """Call config `n` once."""
    d, cfg = CONFIGS[n]
    lay = cfg.get("layout", "nhd")
    cfg = {k: v for k, v in cfg.items() if k != "layout"}
    return paged_decode_attention(**inputs[(d, lay)], **cfg)


for n in names:
    for _ in range(3):
        call(n)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for n in names:
    torch.cuda.nvtx.range_push(n)
    call(n)
    torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("done", names)
