"""Issue 25: do more fp8 decode programs an SM, bought with a register cap, read HBM faster?

The fp8 default until 2026-12-07 (128 tokens, 2 warps, 2 stages) compiles to 255 registers a
thread, so an SM holds 4 of its programs (12.5% occupancy) and ncu on an H100 found it waiting on
memory (BENCHMARKS.md, "The probe, run"). This times, as scripts/decode_layout_probe.py does (CUDA
graph replay, L2 flushed clean, x of a same-run device-to-device copy's HBM traffic), that config
and the library's default (since 2026-12-07 the capped 128 / 4 warps / 2 stages) beside configurations that cap registers with `maxnreg` (ptxas spills the rest) and
raise `programs_per_sm` to what the cap and their shared memory allow (offline sm_90 counts in
the table below), each first checked against the float64 reference on the GPU, on "nhd" pages
at batch 16 x 8k, 16 x 32k, 64 x 8k and 64 x 1k, beside the bf16 default. Needs CUDA.

    PYTHONPATH=. python3 scripts/decode_regs_probe.py      # writes $OUT/regs_probe.json
    PYTHONPATH=. python3 scripts/decode_regs_probe.py --more   # around 128/4w/2s cap 128: regs_probe_more.json
    PYTHONPATH=. python3 scripts/decode_regs_probe.py --defaults   # the library's defaults: regs_probe_defaults.json
    PYTHONPATH=. python3 scripts/decode_regs_probe.py --merge   # the defaults, each merge: regs_probe_merge.json
    PYTHONPATH=. python3 scripts/decode_regs_probe.py --fused   # the fused merge, two and three stages: regs_probe_fused.json

Offline (Triton 3.9, sm_90): registers / local loads and stores / shared memory a program:
128/2w/2s 255 / 34 / 42 KB (cap 168: 240 local, cap 128: 411); 64/2w/3s 180 / 0 / 40 KB;
64/2w/2s 181 / 0 / 23 KB (cap 168: 20 local, cap 128: 105); 128/4w/2s 157 / 0 / 42 KB (cap 128: 59).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from kvtier.decode.attention import paged_decode_attention  # noqa: E402

import decode_attention as bench  # noqa: E402  benchmarks/decode_attention.py
import decode_sweep_h200 as sweep  # noqa: E402  scripts/decode_sweep_h200.py


def pairs(block_n: int, warps: int, stages: int, per_sm: int, maxnreg: int | None = None) -> dict:
    config = dict(block_n=block_n, num_warps=warps, num_stages=stages, fp8_dot="pairs", page_ahead=True,
                  programs_per_sm=per_sm)
    if maxnreg is not None:
        config["maxnreg"] = maxnreg
    return config


CONFIGS = {
    "fp8 128/2w/2s/4 (default until 2026-12-07)": ("fp8", pairs(128, 2, 2, 4)),
    "fp8 default": ("fp8", {}),
    "fp8 128/2w/2s/5 cap 168": ("fp8", pairs(128, 2, 2, 5, 168)),
    "fp8 64/2w/3s/5": ("fp8", pairs(64, 2, 3, 5)),
    "fp8 64/2w/2s/5": ("fp8", pairs(64, 2, 2, 5)),
    "fp8 64/2w/2s/6 cap 168": ("fp8", pairs(64, 2, 2, 6, 168)),
    "fp8 64/2w/2s/8 cap 128": ("fp8", pairs(64, 2, 2, 8, 128)),
    "fp8 128/4w/2s/4 cap 128": ("fp8", pairs(128, 4, 2, 4, 128)),
    "bf16 default": ("bf16", {}),
}
# --more: around the best capped configuration of the first run (128 / 4 warps / 2 stages, cap 128)
MORE = {
    "fp8 128/2w/2s/4 (default until 2026-12-07)": ("fp8", pairs(128, 2, 2, 4)),
    "fp8 default": ("fp8", {}),
    "fp8 128/4w/2s/4 cap 128": ("fp8", pairs(128, 4, 2, 4, 128)),
    "fp8 128/4w/2s/5 cap 96": ("fp8", pairs(128, 4, 2, 5, 96)),
    "fp8 128/4w/2s/3": ("fp8", pairs(128, 4, 2, 3)),
    "fp8 128/4w/3s/3 cap 168": ("fp8", pairs(128, 4, 3, 3, 168)),
    "fp8 64/4w/2s/4 cap 128": ("fp8", pairs(64, 4, 2, 4, 128)),
    "fp8 64/4w/2s/5 cap 96": ("fp8", pairs(64, 4, 2, 5, 96)),
    "fp8 128/4w/2s/8 cap 128": ("fp8", pairs(128, 4, 2, 8, 128)),
    "bf16 default": ("bf16", {}),
}
# --merge: the library's defaults with each way of merging the splits (merge="kernel", "pdl", "fused"),
# and twice the splits the plan gives at batch 16 x 8k (two waves of shorter programs)
MERGE = {
    "fp8 default": ("fp8", {}),
    "fp8 default merge pdl": ("fp8", {"merge": "pdl"}),
    "fp8 default merge fused": ("fp8", {"merge": "fused"}),
    "fp8 default splits 8": ("fp8", {"num_splits": 8}),
    "fp8 default merge pdl splits 8": ("fp8", {"merge": "pdl", "num_splits": 8}),
    "bf16 default": ("bf16", {}),
    "bf16 default merge pdl": ("bf16", {"merge": "pdl"}),
}
# --fused: the merge fused into the split kernel (one tile read after the counter, 2026-12-07) beside
# the merge kernel, for the default and for three stages at 3 programs an SM (0.75x at 16 x 8k on
# the H200, the best there, but 0.48x at 64 x 1k: one split over 512 programs is 1.3 waves of 396)
FUSED = {
    "fp8 default": ("fp8", {}),
    "fp8 default fused": ("fp8", {"merge": "fused"}),
    "fp8 128/4w/3s/3": ("fp8", pairs(128, 4, 3, 3)),
    "fp8 128/4w/3s/3 fused": ("fp8", dict(pairs(128, 4, 3, 3), merge="fused")),
    "fp8 128/4w/3s/3 cap 168 fused": ("fp8", dict(pairs(128, 4, 3, 3, 168), merge="fused")),
    "bf16 default": ("bf16", {}),
    "bf16 default fused": ("bf16", {"merge": "fused"}),
}
SHAPES = [(16, 8192), (16, 32768), (64, 8192), (64, 1024)]
FUSED_SHAPES = [(16, 8192), (16, 32768), (64, 8192), (64, 1024), (16, 1024), (32, 8192)]


def main() -> int:
    global CONFIGS
    if "--more" in sys.argv[1:]:
        CONFIGS = MORE
    if "--defaults" in sys.argv[1:]:  # what a call naming no configuration gets
        CONFIGS = {"fp8 default": ("fp8", {}), "bf16 default": ("bf16", {})}
    if "--merge" in sys.argv[1:]:
        CONFIGS = MERGE
    shapes = SHAPES
    if "--fused" in sys.argv[1:]:
        CONFIGS, shapes = FUSED, FUSED_SHAPES
    torch.backends.cuda.matmul.allow_tf32 = False
    checked = {}
    for name, (dtype, config) in CONFIGS.items():
        if config:
            try:
                checked[name] = sweep.numerics(dtype, config, torch.Generator().manual_seed(5), "cuda")
                print(f"numerics {name}: worst / bound {checked[name]:.3f}", flush=True)
            except Exception as error:  # noqa: BLE001 - reported; the config is left out of the timing
                checked[name] = repr(error)[:300]
                print(f"numerics {name}: FAILED {checked[name]}", flush=True)
    copy = bench.copy_rate(True, "cuda")["hbm_gbps"]
    print(f"device-to-device copy {copy:.0f} GB/s of HBM traffic", flush=True)
    gen = torch.Generator().manual_seed(11)
    rows = []
    rounds = int(os.environ.get("ROUNDS", "1"))  # the shapes' loop again, each config timed once a round
    for batch, context in [shape for _ in range(rounds) for shape in shapes]:
        for dtype in ("fp8", "bf16"):
            inputs = bench.make_inputs(batch, context, dtype, "cuda", gen, layout="nhd")
            nbytes = bench.bytes_read(inputs, context)
            for name, (kind, config) in CONFIGS.items():
                if kind != dtype or isinstance(checked.get(name, 0.0), str) or checked.get(name, 0.0) > 1.0:
                    continue
                seconds = bench.time_replay(lambda: paged_decode_attention(**inputs, **config))
                of_copy = nbytes / seconds / 1e9 / copy
                rows.append(dict(config=name, batch=batch, context=context, us=seconds * 1e6, of_copy=of_copy))
                print(f"{name:<26} {batch:>3} x {context // 1024:>2}k {seconds * 1e6:8.1f} us {of_copy:5.2f}x", flush=True)
            inputs = None
            torch.cuda.empty_cache()
    name = ("regs_probe_more" if CONFIGS is MORE else "regs_probe_merge" if CONFIGS is MERGE
            else "regs_probe_fused" if CONFIGS is FUSED
            else "regs_probe_defaults" if "--defaults" in sys.argv[1:] else "regs_probe")
    out = Path(os.environ.get("OUT", "/tmp")) / f"{name}.json"
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), copy=copy, numerics=checked, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
