"""native/ through the on-disk kernel cache on a real GPU: with the prebuilt cubins off, a first
process compiles both modules and stores them, a second loads them without compiling, and a
corrupt entry is compiled again; with them on (a GPU of native.PREBUILT_ARCHS), a process with
an empty cache loads both without NVRTC and writes nothing. Each process reloads pages through
the kernels it loaded, bit-exact against the CPU twin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.transfer import native

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys, torch
from kvtier.format import PageFormat
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine, native
from kvtier.transfer.cuda_engine import CudaEngine
gen = torch.Generator().manual_seed(5)
for fmt in (PageFormat(2, 2, 64, 16), PageFormat(2, 2, 64, 16, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16")):
    host, cpu_host = HostTier(fmt, 8, pin=True), HostTier(fmt, 8, pin=False)
    cpu_host.buffer.copy_(torch.randint(1, 120, cpu_host.buffer.shape, dtype=torch.uint8, generator=gen))
    if fmt.has_scales:
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                view = cpu_host.scale_view(layer, plane)
                view.copy_(torch.rand(view.shape, generator=gen) + 0.5)
    host.buffer.copy_(cpu_host.buffer)
    dev, cpu_dev = DeviceTier(fmt, 8, "cuda"), DeviceTier(fmt, 8, "cpu")
    dev.kv.view(torch.uint8).fill_(0xFF)
    cpu_dev.kv.view(torch.uint8).fill_(0xFF)
    CudaEngine(dev, host, path="kernel").reload([1, 2], [3, 4]).synchronize()
    TorchEngine(cpu_dev, cpu_host).reload([1, 2], [3, 4]).synchronize()
    assert torch.equal(dev.kv.cpu().view(torch.uint8), cpu_dev.kv.view(torch.uint8)), f"{fmt.describe()}: reload differs"
cache = native.cache()
print("RESULT " + json.dumps({"hits": cache.hits, "compiles": cache.compiles,
                             "from": sorted(set(native.loaded_from.values())), "nvrtc": "cuda.bindings.nvrtc" in sys.modules}))
"""


def _run(cache_dir: Path, prebuilt: bool = False) -> dict:
    env = {**os.environ, "KVTIER_KERNEL_CACHE": str(cache_dir), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           native.PREBUILT_ENV: "on" if prebuilt else "off"}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    if not prebuilt:
        assert "prebuilt" not in result["from"]
    return {"hits": result["hits"], "compiles": result["compiles"]} if not prebuilt else result


@pytest.mark.skipif(not native.kernels_available(), reason="needs cuda-bindings with NVRTC")
def test_second_process_loads_cached_kernels(tmp_path):
    assert _run(tmp_path) == {"hits": 0, "compiles": 2}
    assert len(list(tmp_path.glob("*.cubin"))) == 2
    assert _run(tmp_path) == {"hits": 2, "compiles": 0}
    entry = sorted(tmp_path.glob("*.cubin"))[0]
    entry.write_bytes(entry.read_bytes()[:-100])
    assert _run(tmp_path) == {"hits": 1, "compiles": 1}


_ARCH = "sm_%d%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else None


@pytest.mark.skipif(_ARCH not in native.PREBUILT_ARCHS, reason="no prebuilt cubins for this GPU")
def test_prebuilt_cubins_load_without_nvrtc_or_cache(tmp_path):
    assert _run(tmp_path, prebuilt=True) == {"hits": 0, "compiles": 0, "from": ["prebuilt"], "nvrtc": False}
    assert list(tmp_path.iterdir()) == []
