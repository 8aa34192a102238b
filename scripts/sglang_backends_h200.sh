#!/usr/bin/env bash
# benchmarks/sglang_backends.py on the GPU machine's own disk: SGLang 0.5.17's controller (the
# newest SGLang that runs on that machine's torch) over kvtier, SGLang's `file` and `nixl`
# backends and a raw O_DIRECT file, with the sglang and nixl the gpu-sglang kit carries
# (`make gpu-sglang-kit`, then a device call with `carry: [".gpu-sglang"]`).
#   bash scripts/sglang_backends_h200.sh [benchmark arguments, default --quick]
# Writes $OUT/sglang_backends_h200.json (OUT defaults to /tmp/out). The store directory is
# $DIR (default .sgb-store under the checkout: the machine's disk, not /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-.gpu-sglang}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}
DIR=${DIR:-$PWD/.sgb-store}
mkdir -p "$OUT"
SITE=$SITE UNPACK_ONLY=1 bash "$KIT/run_server.sh" "$KIT" || exit 1
export PYTHONPATH=.:$SITE/sglang-site:$SITE/nixl-site PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-ERROR}
[ $# -gt 0 ] || set -- --quick
df -hT "$(dirname "$DIR")" | tail -1
rm -rf "$DIR"
python3 benchmarks/sglang_backends.py "$@" --dir "$DIR" --json "$OUT/sglang_backends_h200.json"
rc=$?
rm -rf "$DIR"
exit $rc
