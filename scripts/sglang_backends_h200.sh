#!/usr/bin/env bash
# benchmarks/sglang_backends.py on the GPU machine's own disk: SGLang 0.5.17's controller (the
# newest SGLang that runs on that machine's torch) over kvtier, SGLang's `file` and `nixl`
# backends and a raw O_DIRECT file, with the sglang and nixl the gpu-sglang kit carries
# (`make gpu-sglang-kit`, then a device call with `carry: [".gpu-sglang"]`).
#   bash scripts/sglang_backends_h200.sh [benchmark arguments, default --runs 1: the whole table,
#   one run interleaved]
# Writes $OUT/sglang_backends_h200.json and the printed table to $OUT/sglang_backends_h200.txt (OUT
# defaults to /tmp/out). The store directory is $DIR (default .sgb-store under the checkout: the
# machine's disk, not /tmp). KVTIER=<dir> imports kvtier from <dir> instead of this checkout (an
# A/B on one machine: `git archive <commit> kvtier | tar -x -C .ab-old` beside the checkout, then
# KVTIER=.ab-old). Fail-soft: a run that fails or passes $LIMIT seconds (default 420, so a 600 s
# device call has room) is followed by a --quick run, written as *_quick.json / .txt.
set -uo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-.gpu-sglang}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}
DIR=${DIR:-$PWD/.sgb-store}
mkdir -p "$OUT"
SITE=$SITE UNPACK_ONLY=1 bash "$KIT/run_server.sh" "$KIT" || exit 1
KVTIER=${KVTIER:-.}
export PYTHONPATH=$KVTIER:$SITE/sglang-site:$SITE/nixl-site PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-ERROR}
LIMIT=${LIMIT:-420}
[ $# -gt 0 ] || set -- --runs 1
df -hT "$(dirname "$DIR")" | tail -1
nproc; free -g | head -2
rm -rf "$DIR"
timeout "$LIMIT" python3 benchmarks/sglang_backends.py "$@" --dir "$DIR" --json "$OUT/sglang_backends_h200.json" \
    2>&1 | tee "$OUT/sglang_backends_h200.txt"
rc=${PIPESTATUS[0]}
rm -rf "$DIR"
if [ "$rc" -ne 0 ]; then
    echo "full table ended with rc=$rc (124: past ${LIMIT}s); a --quick run follows"
    timeout 150 python3 benchmarks/sglang_backends.py --quick --dir "$DIR" --json "$OUT/sglang_backends_h200_quick.json" \
        2>&1 | tee "$OUT/sglang_backends_h200_quick.txt"
    rc=${PIPESTATUS[0]}
    rm -rf "$DIR"
fi
exit $rc
