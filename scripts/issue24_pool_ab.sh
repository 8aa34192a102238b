#!/usr/bin/env bash
# The pool's host time per call, an old revision against this checkout, alternating on one GPU
# machine (hosts of one GPU kind differ by up to 2-3x, so only numbers of one machine compare):
# pool_latency (load/commit of 1, 16, 256 pages at 32 and 92 layers) and pool_bookkeeping (µs a
# page at 16 to 8,192 pages), ROUNDS rounds of old then new. Each part is fail-soft under its own
# `timeout`; JSON per run and a summary (medians over rounds) go to ${OUT:-/tmp}.
#
#     git archive 8332363 kvtier benchmarks | (mkdir -p ab_old && tar -x -C ab_old)   # here, before the run
#     OLD=ab_old OUT=/some/dir scripts/issue24_pool_ab.sh [ROUNDS]                    # on the GPU machine
#     OLD=ab_old scripts/issue24_pool_ab.sh --cpu-check                               # small, on the CPU twin
#
# Each revision runs its own copy of the scripts with its own kvtier first on the path. About
# 90 s a round and revision on an H100 or H200 (ROUNDS 2 by default: about 6 minutes).
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-/tmp}"
OLD="${OLD:?OLD must name a copy of the old revision (git archive REV kvtier benchmarks | tar -x -C DIR)}"
mkdir -p "$OUT"

if [[ "${1:-}" == "--cpu-check" ]]; then
    rounds=1
    latency=(--device cpu --repeats 3 --formats "32L fp8 (1 MiB)" --pages 1,16)
    bookkeeping=(--pages 16,256 --rounds 5)
else
    rounds="${1:-2}"
    latency=(--repeats 20 --formats "32L fp8 (1 MiB),92L fp8 (11.5 MiB)" --pages 1,16,256)
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
for round in $(seq 1 "$rounds"); do
    for side in old new; do
        dir=.
        [[ $side == old ]] && dir="$OLD"
        part "pool_latency $side $round" 120 env PYTHONPATH="$dir" "$PYTHON" "$dir/benchmarks/pool_latency.py" \
            "${latency[@]}" --json "$OUT/pool_latency_${side}_${round}.json"
        part "pool_bookkeeping $side $round" 40 "$PYTHON" "$dir/benchmarks/pool_bookkeeping.py" \
            "${bookkeeping[@]}" --json "$OUT/pool_bookkeeping_${side}_${round}.json"
    done
done

OUT="$OUT" "$PYTHON" - <<'PY' | tee "$OUT/summary.txt"
import glob, json, os, statistics
from collections import defaultdict

out = os.environ["OUT"]
lat, book = defaultdict(list), defaultdict(list)
for path in glob.glob(f"{out}/pool_latency_*_*.json"):
    side = path.rsplit("_", 2)[-2]
    for row in json.load(open(path))["rows"]:
        for col in ("load_returns_us", "load_returns_back_to_back_us", "load_done_us", "pcie_us", "commit_us",
                    "commit_back_to_back_us"):
            lat[(row["format"], row["pages"], col, side)].append(row[col])
for path in glob.glob(f"{out}/pool_bookkeeping_*_*.json"):
    side = path.rsplit("_", 2)[-2]
    for row in json.load(open(path))["rows"]:
        for op, us in row["us_per_page"].items():
            book[(row["pages"], op, side)].append(us)


def med(values):
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


print("pool_latency, µs, median over rounds: old -> new")
cols = ("load_returns_us", "load_returns_back_to_back_us", "load_done_us", "pcie_us", "commit_us", "commit_back_to_back_us")
for fmt, pages in sorted({(k[0], k[1]) for k in lat}):
    cells = [f"{c.replace('_us', '')} {med(lat[(fmt, pages, c, 'old')]):.0f} -> {med(lat[(fmt, pages, c, 'new')]):.0f}"
             for c in cols]
    print(f"{fmt:<20} {pages:>5}  " + "  ".join(cells))
print("pool_bookkeeping, µs a page, median over rounds: old -> new")
for pages in sorted({k[0] for k in book}):
    ops = sorted({k[1] for k in book if k[0] == pages})
    print(f"{pages:>6}  " + "  ".join(f"{op} {med(book[(pages, op, 'old')]):.3f} -> {med(book[(pages, op, 'new')]):.3f}"
                                   for op in ops))
PY

if (( ${#failed[@]} )); then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
