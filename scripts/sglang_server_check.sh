#!/usr/bin/env bash
# ON THE GPU MACHINE, from the root of a kvtier checkout that carries the kit folder
# (`make gpu-sglang-kit` builds it here; the device call names it in `carry`):
#   bash scripts/sglang_server_check.sh [check|ttft|all] [extra arguments of benchmarks/sglang_server.py]
# Builds nothing there: unpacks the kit's sglang and nixl sites into /tmp/site, installs this
# checkout with --target (for kvtier's sglang.srt.plugins entry point), puts a `nixl` shim over
# nixl_cu13 on the path of SGLang's own nixl server only, and runs benchmarks/sglang_server.py,
# whose results land in $OUT (default /tmp/out). Exit status 0 only if every check passed.
# Env: KIT (default .gpu-sglang), BUDGET_S (whole script, default 570).
set -u
T0=$SECONDS
MODE=${1:-all}; shift || true
KIT=${KIT:-.gpu-sglang} SITE=/tmp/site KVT=/tmp/kvt SHIM=/tmp/nixl-shim BUDGET_S=${BUDGET_S:-570}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d "$KIT" ] || { echo "no kit folder $KIT: run 'make gpu-sglang-kit' and carry it" >&2; exit 2; }
for t in sglang-site nixl-site; do
  f=$KIT/$t.tar.xz D=$SITE/$t
  [ -f "$D/.ok" ] && continue
  [ -f "$f" ] || { echo "$f is missing" >&2; exit 2; }
  rm -rf "$D"; mkdir -p "$D"
  python3 -c "import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({'filter': 'tar'} if hasattr(tarfile, 'tar_filter') else {}))" "$f" "$D" \
    || { echo "unpacking $f failed" >&2; exit 1; }
  touch "$D/.ok"
done
rm -rf "$KVT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target "$KVT" . 2>&1 | grep -v "^WARNING: Target directory" | tail -3
mkdir -p "$SHIM/nixl"
printf 'from nixl_cu13._api import *  # noqa\nfrom nixl_cu13._api import nixl_agent, nixl_agent_config, nixlBind  # noqa\n' > "$SHIM/nixl/_api.py"
: > "$SHIM/nixl/__init__.py"
export PYTHONPATH=$KVT:$SITE/sglang-site:$SITE/nixl-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-ERROR}
export TVM_FFI_CACHE_DIR=/tmp/jit/tvm-ffi TRITON_CACHE_DIR=/tmp/jit/triton
if [ -z "${CUDA_HOME:-}" ]; then  # SGLang's JIT kernels need nvcc and ninja at run time
  if [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda
  else CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"); export CUDA_HOME; fi
  export PATH=$CUDA_HOME/bin:$PATH
fi
echo "setup took $((SECONDS - T0)) s"
exec python3 benchmarks/sglang_server.py "$MODE" --kit "$KIT" --out "$OUT" --budget-s $((BUDGET_S - (SECONDS - T0))) --nixl-shim "$SHIM" "$@"
