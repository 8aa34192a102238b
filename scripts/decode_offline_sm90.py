"""Compile the decode kernels for sm_90 without a GPU and count what their SASS does.

For each candidate configuration of scripts/decode_sweep_h200.py (the shape of
benchmarks/decode_attention.py: 32 query / 8 kv heads, head_dim 128, page 16, "nhd", fp8 e4m3
with per-token-head scales, or bf16), Triton compiles the split kernel for GPUTarget("cuda", 90, 64)
with the argument specializations a call on the GPU gets (pointers and strides divisible by 16,
unit strides as constants), and cuobjdump's SASS is counted: registers, spills, shared memory
(against the H200's 232,448 bytes a block), and instruction counts that say how the loop runs
(LDGSTS: loads pipelined through shared memory; LDG: loads into registers; HMMA / HGMMA / QGMMA:
fp16 mma.sync, fp16 and fp8 wgmma; F2FP: conversions; SHFL: cross-lane reductions). The
Triton here may differ from the GPU machine's; the counts say where to look, the sweep decides.

    TRITON_INTERPRET=0 PYTHONPATH=. python3 scripts/decode_offline_sm90.py [--sass-dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (kvtier.decode honours an explicit 0)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvtier.decode import attention  # noqa: E402

import decode_sweep_h200 as sweep  # noqa: E402  scripts/decode_sweep_h200.py

SHARED_LIMIT = 232_448
KV_HEADS, GROUP, HEAD_DIM, PAGE, SPLITS = 8, 4, 128, 16, 4
OPS = ("LDGSTS", "LDG", "STS", "LDS", "LDSM", "HMMA", "HGMMA", "QGMMA", "F2FP", "SHFL", "BAR", "MUFU")


def kernel_and_args(dtype: str, config: dict) -> tuple[object, dict, dict]:
    """(kernel, signature, constexprs) of the call benchmarks/decode_attention.py makes with `config`."""
    fp8_dot = config.get("fp8_dot", "pairs")
    elem = 1 if dtype == "fp8" else 2
    if dtype == "bf16":
        kernel, page_ty, width = attention._decode_split, "*bf16", 1
        flags = dict(FP8=0, SCALED=False, F16=False, DOT_F32=False)
    elif fp8_dot == "mma":
        kernel, page_ty, width = attention._decode_split_mma, "*u8", 1
        flags = dict(FP8=1, Q_TERMS=2, DOT_F32=False)
    elif fp8_dot == "pairs_two_heads":
        kernel, page_ty, width = attention._decode_split_pairs_two_heads, "*i16", 2
        flags = dict(FP8=1, ASM=True)
    elif fp8_dot == "pairs_stacked":
        kernel, page_ty, width = attention._decode_split_pairs_stacked, "*i16", 2
        flags = dict(FP8=1, ASM=True)
    elif config.get("kv_per_program", 1) > 1:
        kernel, page_ty, width = attention._decode_split_pairs_kv, "*i16", 2
        flags = dict(FP8=1, ASM=True, KVP=config["kv_per_program"])
    else:
        kernel, page_ty, width = attention._decode_split_pairs, "*i16", 2
        flags = dict(FP8=1, ASM=True, SPLIT_VMAX=fp8_dot != "pairs", ROW_SUMS=fp8_dot == "pairs_lean")
    plane = PAGE * KV_HEADS * HEAD_DIM * elem // width
    strides = dict(
        stride_qb=KV_HEADS * GROUP * HEAD_DIM, stride_qh=HEAD_DIM,
        stride_kp=plane, stride_kt=KV_HEADS * HEAD_DIM * elem // width, stride_kh=HEAD_DIM * elem // width,
        stride_vp=plane, stride_vt=KV_HEADS * HEAD_DIM * elem // width, stride_vh=HEAD_DIM * elem // width,
        stride_ksp=PAGE * KV_HEADS, stride_kst=KV_HEADS, stride_ksh=1,
        stride_vsp=PAGE * KV_HEADS, stride_vst=KV_HEADS, stride_vsh=1,
        stride_ptb=512,
        stride_ob=KV_HEADS * GROUP * SPLITS * HEAD_DIM, stride_oh=SPLITS * HEAD_DIM, stride_os=HEAD_DIM,
        stride_lb=KV_HEADS * GROUP * SPLITS, stride_lh=SPLITS,
        stride_outb=KV_HEADS * GROUP * HEAD_DIM, stride_outh=HEAD_DIM,
        tokens_per_split=2048,
    )
    pointers = dict(Q="*bf16", K=page_ty, V=page_ty, KS="*fp32", VS="*fp32", PT="*i32", LENS="*i32",
                    MID_O="*fp32", MID_LSE="*fp32", OUT="*bf16", CNT="*i32")
    constexprs = dict(GROUP=GROUP, BLOCK_H=max(16, GROUP * config.get("kv_per_program", 1)), HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE,
                      BLOCK_N=config["block_n"] // (16 // GROUP if fp8_dot == "pairs_stacked" else 1),
                      SINGLE=False, PAGE_AHEAD=config.get("page_ahead", False),
                      FUSED=config.get("merge") == "fused" and fp8_dot not in ("mma", "pairs_stacked", "pairs_two_heads"), **flags)
    if "MERGE_H" in kernel.arg_names:  # the fused merge's tile: heads a program, splits (powers of two)
        fused = constexprs["FUSED"]
        constexprs.update(MERGE_H=GROUP * config.get("kv_per_program", 1) if fused else 1, MERGE_S=SPLITS if fused else 1)
    if "LAUNCH_MERGE" in kernel.arg_names:  # merge="pdl": the split kernel lets the merge's programs be placed
        constexprs["LAUNCH_MERGE"] = config.get("merge") == "pdl"
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name == "qk_scale":
            signature[name] = "fp32"
        elif strides[name] == 1:  # Triton specializes a 1 into a constant
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if strides[name] % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    return kernel, signature, constexprs, attrs


def sass_counts(cubin: bytes, where: Path) -> dict:
    """Registers, spilled bytes (local memory) and instruction counts of a cubin (kept, with its SASS, at `where`)."""
    where.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    tool = str(tool) if tool.exists() else "cuobjdump"
    sass = subprocess.run([tool, "-sass", str(where)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", str(where)], capture_output=True, text=True, check=True).stdout
    where.with_suffix(".sass").write_text(sass)
    ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
    found = {key: int(value) for key, value in re.findall(r"(REG|LOCAL):(\d+)", usage)}
    return {"regs": found.get("REG"), "spills": found.get("LOCAL")} | {op: ops.get(op, 0) for op in OPS} | {
        "instructions": sum(ops.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass-dir", type=Path, default=Path("/tmp/decode_sm90"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--only", default=None, help="comma-separated parts of candidate names (default: all)")
    args = parser.parse_args()
    only = [part.strip() for part in (args.only or "").split(",") if part.strip()]
    args.sass_dir.mkdir(parents=True, exist_ok=True)
    target = GPUTarget("cuda", 90, 64)
    rows = {}
    for dtype, candidates in sweep.CANDIDATES.items():
        for name, config in candidates.items():
            if only and not any(part in name for part in only):
                continue
            try:
                kernel, signature, constexprs, attrs = kernel_and_args(dtype, config)
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                          options=dict(num_warps=config["num_warps"], num_stages=config["num_stages"],
                                                       maxnreg=config.get("maxnreg")))
                slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
                row = dict(shared=compiled.metadata.shared)
                row.update(sass_counts(compiled.asm["cubin"], args.sass_dir / f"{slug}.cubin"))
            except Exception as error:  # noqa: BLE001 - one candidate failing leaves the others
                row = {"error": repr(error)[:300]}
            rows[name] = row
            if "error" in row:
                print(f"{name:<46} FAILED {row['error']}", flush=True)
                continue
            fits = "" if row["shared"] <= SHARED_LIMIT else "  OVER the shared-memory limit"
            print(f"{name:<46} regs {row['regs']:>3} spills {row['spills']:>3} shared {row['shared']:>7}  "
                  + " ".join(f"{op} {row[op]}" for op in OPS if row[op]) + fits, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
