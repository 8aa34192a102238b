#!/usr/bin/env bash
# Issue 24 on a GPU host in one call: the index's C paths (kvtier.index.native, built here first)
# against its Python twins (KVTIER_HOST_CACHE=off), alternating, same tree, same machine; or, with
# MODES="old new", an older tree (OLD, default build/oldtree, made with `git archive REV kvtier
# benchmarks native | tar -x -C build/oldtree`; its own benchmarks, its C library built first too)
# against this one:
#   latency   benchmarks/pool_latency.py --pages 16 (32 and 92 layers, fp8): host time of 16-page
#             loads and commits (lat_{c,python}_ROUND.{json,log})
#   books     benchmarks/pool_bookkeeping.py --pages 16,256,4096 (books_{c,python}_ROUND.{json,log})
#   ttft      benchmarks/decode_ttft.py --quick --decode-only --graphs --layer-ordered-loads: the
#             prefetched 8 x 8k decode step (ttft_{c,python}_ROUND.{json,log})
#   tests     the pool's GPU tests on the C paths (gpu_tests.log)
# PARTS (default "latency books tests"), ROUNDS (default 3), MODES (default "c python"); TTFT_ROUNDS
# (default ROUNDS): rounds that run the ttft part. Everything lands in $OUT as native_ab.tgz.
#   OUT=out bash scripts/issue24_native_ab.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/issue24_native}; mkdir -p "$OUT/ab"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version.split()[0])"
command -v cc gcc || echo "no cc on PATH"
export KVTIER_HOST_CACHE="$OUT/hostlib"  # a fresh directory: this call builds the library itself
MODES=${MODES:-c python}
OLD=${OLD:-build/oldtree}
for tree in . $([[ " $MODES " == *" old "* ]] && echo "$OLD"); do
(cd "$tree" && PYTHONPATH=. python3 -c "
import time; t = time.perf_counter()
from kvtier.index import native
m = native.start(wait=True); print('C paths of $tree:', m, 'built and loaded in %.2f s' % (time.perf_counter() - t))")
done
PARTS=${PARTS:-latency books tests}
has() { [[ " $PARTS " == *" $1 "* ]]; }
for round in $(seq 1 "${ROUNDS:-3}"); do
  for mode in $MODES; do
    cache="$OUT/hostlib"; [ $mode = python ] && cache=off
    dir=.; [ $mode = old ] && dir=$OLD
    if has ttft && [ "$round" -le "${TTFT_ROUNDS:-${ROUNDS:-3}}" ]; then
    KVTIER_HOST_CACHE=$cache timeout -k 5 90 env PYTHONPATH=$dir python3 $dir/benchmarks/decode_ttft.py --quick --decode-only --graphs \
      --layer-ordered-loads --json "$OUT/ab/ttft_${mode}_${round}.json" > "$OUT/ab/ttft_${mode}_${round}.log" 2>&1
    echo "ttft $mode round $round rc=$?"; grep -h "decode batch\|bound\|timeline" "$OUT/ab/ttft_${mode}_${round}.log" | head -6
    fi
    has latency || continue
    KVTIER_HOST_CACHE=$cache timeout -k 5 120 env PYTHONPATH=$dir python3 $dir/benchmarks/pool_latency.py --pages 16 --repeats 20 \
      --formats "32L fp8 (1 MiB),92L fp8 (11.5 MiB)" --json "$OUT/ab/lat_${mode}_${round}.json" > "$OUT/ab/lat_${mode}_${round}.log" 2>&1
    echo "latency $mode round $round rc=$?"; grep -h "^ *[0-9]*L" "$OUT/ab/lat_${mode}_${round}.log" | head -4
    has books || continue
    KVTIER_HOST_CACHE=$cache timeout -k 5 120 env PYTHONPATH=$dir python3 $dir/benchmarks/pool_bookkeeping.py --pages 16,256,4096 \
      --json "$OUT/ab/books_${mode}_${round}.json" > "$OUT/ab/books_${mode}_${round}.log" 2>&1
    echo "bookkeeping $mode round $round rc=$?"; tail -3 "$OUT/ab/books_${mode}_${round}.log"
  done
done
if has tests; then
  timeout -k 5 180 env PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pool_gpu.py tests/test_index_native.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "pool GPU tests + native tests rc=$?"; tail -3 "$OUT/gpu_tests.log"; cp "$OUT/gpu_tests.log" "$OUT/ab/"
fi
tar -C "$OUT" -czf "$OUT/native_ab.tgz" ab && rm -rf "$OUT/ab" "$OUT/hostlib"
