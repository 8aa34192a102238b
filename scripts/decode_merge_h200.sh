#!/usr/bin/env bash
# Issue 25 (and 24's goal 3) in two GPU calls (PARTS=decode, about 8 minutes; PARTS=reload, about
# 4), each part fail-soft under its own timeout, results into $OUT:
#   merge    scripts/decode_regs_probe.py --merge: the defaults with merge="kernel" / "pdl" / "fused"
#            (regs_probe_merge.json); if "pdl" beats "kernel" at every fp8 shape of the probe, this
#            copy's fp8 default takes merge="pdl" (patched here, said in the log) before the next part
#   bench    benchmarks/decode_attention.py --quick (decode_attention.json): the official table
#   (PARTS=bench runs the official table alone, without the merge probe and the tests)
#   fused    scripts/decode_regs_probe.py --fused, ncu of those kernels at 16 x 8k, the merges' GPU tests
#   tests    the decode tests of the merges on the GPU (pytest)
#   reload   benchmarks/decode_ttft.py --quick --decode-only --graphs --layer-ordered-loads, the pool's
#            copy kernel at one block an SM against 33 blocks a launch, alternating (reload.tgz)
#   bulk     benchmarks/pool_bulk.py for build/oldtree (carried; made with
#            `git archive REV kvtier benchmarks native | tar -x -C build/oldtree`) and this tree,
#            alternating, then the pool's GPU tests (bulk.tgz)
#   latency  benchmarks/pool_latency.py --pages 16 (32 layers, fp8) for build/oldtree and this tree,
#            alternating (latency.tgz): the host time of 16-page loads and commits
#   REQUIRE=H200: run nothing (rc 3) unless the card's name has it; FUSED_EXTRAS=0: the fused part's
#   probe alone (no ncu, no tests)
#   ROUNDS (default 2): rounds of the alternating parts; RELOAD_BLOCKS (default "default 33"): the
#   reload part's block caps; RELOAD_TREES="old new": the reload part for build/oldtree (OLD) too
#     OUT=out PARTS=decode bash scripts/decode_merge_h200.sh; OUT=out PARTS="reload bulk" bash scripts/decode_merge_h200.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/decode_merge}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
# REQUIRE=H200: stop at once (rc 3) on any other card, so a call that lands on an H100 costs only its start
if [ -n "${REQUIRE:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$REQUIRE"; then
  echo "not a $REQUIRE: nothing run"; exit 3
fi
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)"
git rev-parse --short HEAD 2>/dev/null
PARTS=${PARTS:-decode}
has() { [[ " $PARTS " == *" $1 "* ]]; }
bench_table() {  # the official table: benchmarks/decode_attention.py --quick
  timeout -k 5 260 env PYTHONPATH=. python3 benchmarks/decode_attention.py --quick --json "$OUT/decode_attention.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"; tail -22 "$OUT/bench.log"
}
alternate() {  # alternate NAME SECONDS SCRIPT ARGS...: benchmarks/SCRIPT of build/oldtree (OLD) and of this
  # tree, ROUNDS rounds of old then new, each under its own timeout: $OUT/NAME_{old,new}_ROUND.{json,log}
  local name=$1 limit=$2 script=$3 round tree dir run
  shift 3
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for tree in old new; do
      dir=.; [ $tree = old ] && dir=${OLD:-build/oldtree}
      [ -d "$dir/kvtier" ] || { echo "no tree at $dir"; continue; }
      run="$OUT/${name}_${tree}_${round}"
      timeout -k 5 "$limit" env PYTHONPATH="$dir" python3 "$dir/benchmarks/$script" "$@" --json "$run.json" > "$run.log" 2>&1
      echo "$name $tree round $round rc=$?"
    done
  done
}
if has decode; then
timeout -k 5 170 env OUT="$OUT" PYTHONPATH=. python3 scripts/decode_regs_probe.py --merge > "$OUT/merge.log" 2>&1
echo "merge probe rc=$?"; grep -h " us \|numerics\|copy" "$OUT/merge.log"
python3 - "$OUT/regs_probe_merge.json" <<'PY'
import json, sys, re
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as e:
    print("no merge probe result:", e); sys.exit(0)
t = {(r["config"], r["batch"], r["context"]): r["us"] for r in rows}
shapes = sorted({(b, c) for (_, b, c) in t})
wins = [t.get(("fp8 default merge pdl", b, c), 1e9) < t.get(("fp8 default", b, c), 0) for b, c in shapes]
print("pdl faster than the merge kernel at", [s for s, w in zip(shapes, wins) if w], "of", shapes)
if shapes and all(wins):
    p = "kvtier/decode/attention.py"
    s = open(p).read()
    old = '"fp8": dict(block_n=128, num_warps=4, num_stages=2, fp8_dot="pairs", page_ahead=True, programs_per_sm=4,'
    assert s.count(old) == 1
    open(p, "w").write(s.replace(old, old + ' merge="pdl",'))
    print("PATCHED this copy: the fp8 default takes merge='pdl' for the benchmark below")
PY
bench_table
timeout -k 5 90 env PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py -k "pdl or fused_merge or split_kv" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -3 "$OUT/tests.log"
fi
if has bench; then
bench_table
fi
# fused: the fused merge (one tile read after the counter) against the merge kernel, two and three
# stages, six shapes, ROUNDS rounds (regs_probe_fused.json); ncu (launch, occupancy, speed of light)
# of those kernels at 16 x 8k (ncu_fused_details.txt); the merges' tests on the GPU. About 8 minutes.
if has fused; then
timeout -k 5 280 env OUT="$OUT" ROUNDS="${ROUNDS:-2}" PYTHONPATH=. python3 scripts/decode_regs_probe.py --fused > "$OUT/fused.log" 2>&1
echo "fused probe rc=$?"; grep -h " us \|numerics\|copy" "$OUT/fused.log"
if [ "${FUSED_EXTRAS:-1}" = 1 ] && command -v ncu > /dev/null; then
  timeout -k 5 100 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \
    --section Occupancy -o "$OUT/ncu_fused" -f env PYTHONPATH=. python3 scripts/decode_ncu_calls.py \
    fp8_default,fp8_fused,fp8_3s,fp8_3s_fused,bf16_default 16 8192 > "$OUT/ncu_fused_run.log" 2>&1
  echo "ncu rc=$?"
  ncu -i "$OUT/ncu_fused.ncu-rep" --page details > "$OUT/ncu_fused_details.txt" 2>&1
  grep -E "^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Registers Per|Achieved Occ" "$OUT/ncu_fused_details.txt" | head -60
fi
if [ "${FUSED_EXTRAS:-1}" = 1 ]; then
timeout -k 5 150 env PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py \
  -k "fused or pdl or split_kv or stacked_per_program" > "$OUT/fused_tests.log" 2>&1
echo "fused tests rc=$?"; tail -3 "$OUT/fused_tests.log"
fi
fi
if has reload; then
R="$OUT/reload"; mkdir -p "$R"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in ${RELOAD_TREES:-new}; do
  dir=.; [ "$tree" = old ] && dir=${OLD:-build/oldtree}
  for blocks in ${RELOAD_BLOCKS:-default 33}; do
    extra=(); [ "$blocks" != default ] && extra=(--reload-blocks "$blocks")
    name="${tree}_${blocks}_${round}"
    timeout -k 5 60 env PYTHONPATH="$dir" python3 "$dir/benchmarks/decode_ttft.py" --quick --decode-only --graphs \
      --layer-ordered-loads "${extra[@]}" --json "$R/reload_$name.json" > "$R/reload_$name.log" 2>&1
    echo "reload tree=$tree blocks=$blocks round $round rc=$?"; grep -h "decode batch\|timeline" "$R/reload_$name.log"
  done
  done
done
tar -C "$OUT" -czf "$OUT/reload.tgz" reload && rm -rf "$R"
fi
if has latency; then
alternate latency 90 pool_latency.py --pages 16 --repeats 20 --formats "${LATENCY_FORMATS:-32L fp8 (1 MiB)}"
grep -H "^ *[0-9]*L" "$OUT"/latency_*.log
tar -C "$OUT" -czf "$OUT/latency.tgz" $(cd "$OUT" && ls latency_*) && rm -f "$OUT"/latency_*.json "$OUT"/latency_*.log
fi
# bulk: benchmarks/pool_bulk.py (commit + flush, then load, of whole tiers) for the tree in
# build/oldtree (carried; OLD=<dir>) and this one, alternating: long commits start their copies in chunks
if has bulk; then
alternate bulk 100 pool_bulk.py --records 1m,2m,64k --repeats 3
grep -H -A3 "x PCIe" "$OUT"/bulk_*.log
timeout -k 5 120 env PYTHONPATH=. python3 -m pytest -q -p no:cacheprovider tests/gpu/test_pool_gpu.py tests/test_pool_chunked_commit.py \
  > "$OUT/bulk_tests.log" 2>&1
echo "pool GPU tests rc=$?"; tail -3 "$OUT/bulk_tests.log"
tar -C "$OUT" -czf "$OUT/bulk.tgz" $(cd "$OUT" && ls bulk_*) && rm -f "$OUT"/bulk_*.json "$OUT"/bulk_*.log
fi
