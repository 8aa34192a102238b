#!/usr/bin/env bash
# Issue 24's measurements in one call (under 4 minutes on one H200), each part fail-soft under
# its own `timeout`: host time of load/commit of 1, 16 and 256 pages and when a load is done,
# at 32 layers (1 MiB pages) and 92 layers (11.5 MiB pages); bulk commit + flush then load of
# whole tiers for 8 KiB to 11.5 MiB records against contiguous pinned copies of the same run;
# the copy paths alone (offload_bandwidth --quick); the prefetched decode step (batch 8 x 8k)
# of decode_ttft.py --quick; the pool's bookkeeping per page up to 8,192 pages (pool_bookkeeping).
# Prints the tables and writes JSON into ${OUT:-/tmp}; a part that fails or runs out of time
# is named at the end and the others still run. The limits add up to 235 s.
#
#     OUT=/some/dir scripts/issue24_h200.sh            # from the repository root, on the GPU machine
#     scripts/issue24_h200.sh --cpu-check              # the same scripts, small, on the CPU twin
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python}"
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"

if [[ "${1:-}" == "--cpu-check" ]]; then
    latency=(--device cpu --repeats 3 --formats "32L fp8 (1 MiB)" --pages 1,16)
    bulk=(--device cpu --repeats 1 --scale 0.02)
    copies=(--quick --sizes 4,64 --pages 64 --repeats 2 --no-progress)
    bookkeeping=(--pages 16,256 --rounds 5)
else
    latency=(--repeats 20 --formats "32L fp8 (1 MiB),92L fp8 (11.5 MiB)" --pages 1,16,256)
    bulk=(--repeats 3)
    copies=(--quick --sizes 64,1024,4096 --no-progress)
    bookkeeping=(--pages 16,256,4096,8192)
fi

failed=()
part() {  # part NAME SECONDS COMMAND...: run one measurement, note it if it fails or times out
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@"
    local rc=$?
    echo "-- $name: exit $rc after $((SECONDS - start)) s"
    if [[ $rc -ne 0 ]]; then
        failed+=("$name (exit $rc)")
    fi
}

"$PYTHON" - <<'PY' | tee "$OUT/versions.txt"
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"gpu {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
PY
part pool_latency 70 "$PYTHON" benchmarks/pool_latency.py "${latency[@]}" --json "$OUT/pool_latency.json"
part pool_bulk 70 "$PYTHON" benchmarks/pool_bulk.py "${bulk[@]}" --json "$OUT/pool_bulk.json"
part pool_bookkeeping 20 "$PYTHON" benchmarks/pool_bookkeeping.py "${bookkeeping[@]}" --json "$OUT/pool_bookkeeping.json"
if [[ "${1:-}" != "--cpu-check" ]]; then
    part decode_ttft 45 "$PYTHON" benchmarks/decode_ttft.py --quick --json "$OUT/decode_ttft.json"
fi
part offload_bandwidth 30 "$PYTHON" benchmarks/offload_bandwidth.py "${copies[@]}" --json "$OUT/offload_bandwidth.json"

if [[ ${#failed[@]} -gt 0 ]]; then
    echo "== parts that did not finish: ${failed[*]}"
    exit 1
fi
echo "== every part finished; JSON in $OUT"
