#!/usr/bin/env bash
# The CUDA engine's check on a GPU machine: versions, an offline compile of native/ (when
# nvcc is there), the GPU tests, compute-sanitizer memcheck and racecheck over every kernel,
# the host-cost benchmark and the quick bandwidth benchmark, then a compact table.
# Needs only torch (CUDA build), CuPy and cuda-bindings; kvtier need not be installed.
# Writes pytest.xml, engine_host_cost.json, offload_bandwidth.json / .png into ${OUT:-/tmp}.
# About 5 minutes on one H200. Exits non-zero on the first failure.
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

if command -v nvcc >/dev/null; then
    echo "== nvcc -arch=sm_90 (register use and spills per kernel)"
    for source in native/page_copy.cu native/page_convert.cu; do
        nvcc -arch=sm_90 -c -I native -Xptxas -v "$source" -o /dev/null 2>&1 \
            | grep -E "error|warning|spill|Used" | sort | uniq -c
    done
fi

echo "== tests/gpu"
"$PYTHON" -m pytest tests/gpu -q -x -p no:cacheprovider --junitxml="$OUT/pytest.xml"

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
        # cuda-bindings asks the driver for entry points it may lack; memcheck reports those
        # answers (cuGetProcAddress, CUDA_ERROR_INVALID_VALUE) as API errors: they are not ours.
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" --report-api-errors no --error-exitcode 1 \
            "$PYTHON" tests/gpu/sanitize_case.py
    done
fi

echo "== host cost per call"
"$PYTHON" benchmarks/engine_host_cost.py --json "$OUT/engine_host_cost.json"

echo "== benchmark (quick)"
"$PYTHON" benchmarks/offload_bandwidth.py --quick --no-progress \
    --json "$OUT/offload_bandwidth.json" --png "$OUT/offload_bandwidth.png"

echo "== summary: host us per call, submit / submit-to-done / PCIe time of the bytes"
"$PYTHON" - "$OUT/engine_host_cost.json" <<'EOF'
import json
import sys

rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["path"] in ("auto", "kernel")]
print(f"{'format':16} {'op':8} {'path':7} {'taken':12}" + "".join(f"{n:>22}" for n in (1, 4, 16, 256)))
for key in sorted({(r["format"], r["op"], r["path"]) for r in rows}):
    cells = {r["pages"]: r for r in rows if (r["format"], r["op"], r["path"]) == key}
    taken = "/".join(sorted({r["taken"] for r in cells.values()}))
    text = "".join(
        f" {cells[n]['submit_us']:7.1f}/{cells[n]['done_us']:7.1f}/{cells[n]['pcie_us']:5.0f}" if n in cells else f"{'-':>22}"
        for n in (1, 4, 16, 256)
    )
    print(f"{key[0]:16} {key[1]:8} {key[2]:7} {taken:12}{text}")
EOF

echo "== gpu_check passed"
