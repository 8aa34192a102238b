#!/usr/bin/env bash
# Issue 24's measurements in one call (about 3 minutes on one H200): host time of load/commit
# of 1, 16 and 256 pages and when a load is done, at 32 layers (1 MiB pages) and 92 layers
# (11.5 MiB pages); bulk commit + flush then load of whole tiers for 8 KiB to 11.5 MiB records
# against contiguous pinned copies of the same run; the prefetched decode step (batch 8 x 8k)
# of decode_ttft.py --quick. Prints the three tables and writes JSON into ${OUT:-/tmp}.
# `scripts/issue24_h200.sh --cpu-check` runs the same scripts small on the CPU twin.
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"

if [[ "${1:-}" == "--cpu-check" ]]; then
    latency=(--device cpu --repeats 3 --formats "32L fp8 (1 MiB)" --pages 1,16)
    bulk=(--device cpu --repeats 1 --scale 0.02)
    decode=()
else
    latency=(--repeats 20 --formats "32L fp8 (1 MiB),92L fp8 (11.5 MiB)" --pages 1,16,256)
    bulk=(--repeats 3)
    decode=(--quick)
fi

"$PYTHON" - <<'PY'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"gpu {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PY
echo "== pool_latency (load / commit host time, load done)"
"$PYTHON" benchmarks/pool_latency.py "${latency[@]}" --json "$OUT/pool_latency.json"
echo "== pool_bulk (whole tiers through the public API against PCIe)"
"$PYTHON" benchmarks/pool_bulk.py "${bulk[@]}" --json "$OUT/pool_bulk.json"
if [[ "${1:-}" != "--cpu-check" ]]; then
    echo "== decode_ttft --quick (prefetched decode step, batch 8 x 8k)"
    "$PYTHON" benchmarks/decode_ttft.py "${decode[@]}" --json "$OUT/decode_ttft.json"
fi
