#!/usr/bin/env bash
# Issue 25's next GPU call (about 5 minutes): scripts/decode_layout_probe.py over this checkout and
# over a copy launched kv head first, then ncu (--set full) of six kernels at batch 16 x 8k (one
# call each after warm-up; stall reasons, DRAM throughput, pipe use in $OUT/ncu_*.txt / .csv).
#     OUT=out bash scripts/decode_h200_probe.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode_probe}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
timeout -k 5 140 python3 scripts/decode_layout_probe.py > "$OUT/layout_main.log" 2>&1; echo "layout probe rc=$?"
HF="$OUT/kvhead_first"; rm -rf "$HF"; mkdir -p "$HF"; cp -r kvtier "$HF/"
python3 - "$HF/kvtier/decode/attention.py" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
for old, new in (("    b = tl.program_id(0)\n    kvh = tl.program_id(1)\n", "    b = tl.program_id(1)\n    kvh = tl.program_id(0)\n"),
                 ("kernel[(batch, groups, splits)](", "kernel[(groups, batch, splits)](")):
    assert s.count(old) == 1, old
    s = s.replace(old, new)
open(p, "w").write(s)
PY
timeout -k 5 50 python3 scripts/decode_layout_probe.py "$HF" > "$OUT/layout_kvhead_first.log" 2>&1; echo "kv-head-first rc=$?"
grep -h " us \|numerics" "$OUT/layout_main.log" "$OUT/layout_kvhead_first.log"
if command -v ncu > /dev/null; then
  timeout -k 5 90 ncu --profile-from-start off --clock-control none --set full --import-source no -k regex:_decode_split \
    -o "$OUT/ncu16x8k" -f env PYTHONPATH=. python3 scripts/decode_ncu_calls.py \
    fp8_default,fp8_default_hnd,fp8_two,fp8_stacked,fp8_1w64_3s,bf16_default 16 8192 > "$OUT/ncu_run.log" 2>&1
  echo "ncu rc=$?"
  if [ -f "$OUT/ncu16x8k.ncu-rep" ]; then
    ncu -i "$OUT/ncu16x8k.ncu-rep" --page details --print-details all > "$OUT/ncu_details.txt" 2>&1
    ncu -i "$OUT/ncu16x8k.ncu-rep" --page raw --csv > "$OUT/ncu_raw.csv" 2>&1
    grep -E "^  _decode|Duration  |DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Warp Cycles Per Issued" "$OUT/ncu_details.txt" | head -40
  fi
fi
