#!/usr/bin/env bash
# The CUDA engine's check on a GPU machine: versions, the GPU tests, compute-sanitizer
# memcheck and racecheck over every kernel, and the quick bandwidth benchmark.
# Needs only torch (CUDA build), CuPy and cuda-bindings; kvtier need not be installed.
# Writes offload_bandwidth.json / .png into ${OUT:-/tmp}. About 5 minutes on one H200.
# Exits non-zero on the first failure.
set -euo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python}"
OUT="${OUT:-/tmp}"
mkdir -p "$OUT"

echo "== versions"
"$PYTHON" - <<'EOF'
import importlib
import platform

import torch

print(f"python {platform.python_version()}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), cuda available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible to torch")
props = torch.cuda.get_device_properties(0)
print(f"gpu {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
for name in ("cupy", "cuda.bindings", "triton", "numpy"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except ImportError:
        print(f"{name} not installed")
EOF
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader || true
else
    echo "nvidia-smi not found"
fi

echo "== tests/gpu"
"$PYTHON" -m pytest tests/gpu -q -x -p no:cacheprovider

echo "== compute-sanitizer"
SANITIZER="$(command -v compute-sanitizer || true)"
for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [ -z "$SANITIZER" ] && [ -x "$candidate" ]; then
        SANITIZER="$candidate"
    fi
done
if [ -z "$SANITIZER" ]; then
    echo "SKIPPED: compute-sanitizer not found (install the CUDA toolkit's compute-sanitizer to run it)"
else
    for tool in memcheck racecheck; do
        echo "-- $tool"
        # Without the caching allocator every tensor is its own allocation: memcheck then sees
        # an access even one byte past a tensor.
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" --error-exitcode 1 \
            "$PYTHON" tests/gpu/sanitize_case.py
    done
fi

echo "== benchmark (quick)"
"$PYTHON" benchmarks/offload_bandwidth.py --quick --no-progress \
    --json "$OUT/offload_bandwidth.json" --png "$OUT/offload_bandwidth.png"

echo "== gpu_check passed"
