#!/usr/bin/env bash
# Issue 24 goal 3 (a prefetched decode step at batch 8 x 8k within 1.2x of max(resident step,
# PCIe bound)) before and after splitting large loads by layer, in one GPU call of about 3 minutes.
# Each part is fail-soft under its own `timeout` and writes JSON into ${OUT:-/tmp}:
#   base      (only with BASE=<a checkout of the old code>) its decode_ttft.py --quick
#   split     this tree's decode_ttft.py --quick (TTFT rows too), with a per-layer timeline of one step
#   ce        its decode rows on the copy engines (--copy-path copy_engine --decode-only): copies use no SM
#
#     OUT=/some/dir BASE=/path/to/old/checkout scripts/issue24_decode_overlap.sh
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python}"
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
failed=()
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    local start=$SECONDS
    timeout --kill-after=5 "$limit" "$@"
    local rc=$?
    echo "-- $name: exit $rc after $((SECONDS - start)) s"
    [[ $rc -ne 0 ]] && failed+=("$name (exit $rc)")
}

if [[ -n "${BASE:-}" ]]; then
    part base 75 env PYTHONPATH="$BASE" "$PYTHON" "$BASE/benchmarks/decode_ttft.py" --quick --json "$OUT/decode_base.json"
fi
part split 75 env PYTHONPATH=. "$PYTHON" benchmarks/decode_ttft.py --quick --layer-ordered-loads --json "$OUT/decode_split.json"
part ce 45 env PYTHONPATH=. "$PYTHON" benchmarks/decode_ttft.py --quick --decode-only --layer-ordered-loads --copy-path copy_engine \
    --json "$OUT/decode_copy_engine.json"
if ((${#failed[@]})); then
    echo "failed parts: ${failed[*]}"
    exit 1
fi
