"""One GPU call for issue 25's goal 3: the first pool in a fresh process, with the prebuilt
cubins, with NVRTC (prebuilt off, empty kernel cache) and from a warm disk cache.

Each case runs in a fresh Python process with its own KVTIER_KERNEL_CACHE directory (empty at
the start unless the case says warm) and times, apart: importing torch, creating the CUDA
context, importing cuda.bindings' driver and kvtier, loading each native/ module (the time
inside kvtier.transfer.native._load, where NVRTC runs when it does), the first TieredPool (a
format of fp8 pages upcast to bf16 on the device, then one of bf16 pages: constructor, commit +
flush to host, evict, load back) and a first round trip through the kernel path
(CudaEngine(path="kernel")) of each format. Every round trip is checked: pool pages bit-exact
(bf16), or equal to the float64 dequantized reference (fp8 -> bf16); kernel-path reloads
byte-equal to the CPU twin (TorchEngine). The parent also times each child's whole wall time
(interpreter start included).

Cases, in order:
  prebuilt        empty cache, prebuilt cubins on (the default for a user)
  nvrtc_cold      empty cache, KVTIER_PREBUILT_KERNELS=off (the old first run on a fresh machine)
  warm_cache      nvrtc_cold's cache directory again, prebuilt off
  prebuilt_again  the prebuilt case once more (the OS file cache now holds the files)
  prebuilt_pyc    the prebuilt case after `python -m compileall kvtier` (bytecode present, as a
                  pip install leaves it; each case reports whether kvtier's .pyc existed)
  profiled        the same with the first pool's constructor under cProfile: its 40 costliest
                  calls by cumulative time (that case's timings are inflated by the profiler)

Fail-soft: a case that fails is reported with its error and the others still run. Prints a
table; writes $OUT/first_pool.json (OUT defaults to /tmp). About 20-40 s.

    python scripts/first_pool_h200.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, os, sys, time, importlib.util
t0 = time.perf_counter()
sys.path.insert(0, ROOT)
PYC = {"dont_write_bytecode": bool(sys.flags.dont_write_bytecode),
       "kvtier_pyc_present": os.path.exists(importlib.util.cache_from_source(os.path.join(ROOT, "kvtier", "pool", "pool.py")))}
import torch
t1 = time.perf_counter()
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t2 = time.perf_counter()
from cuda.bindings import driver
t3 = time.perf_counter()
from kvtier import TieredPool, prefix_keys, quantize, dequantize
from kvtier.format import PageFormat
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine, native
from kvtier.transfer.cuda_engine import CudaEngine
t4 = time.perf_counter()
out = {"import_torch_s": t1 - t0, "cuda_context_s": t2 - t1, "import_cuda_bindings_s": t3 - t2, "import_kvtier_s": t4 - t3,
       "capability": "sm_%d%d" % torch.cuda.get_device_capability(), "driver": driver.cuDriverGetVersion()[1],
       "module_load_s": {}, "checks": {}, "bytecode": PYC}

original_load = native._load
def timed_load(device_index, module):
    began = time.perf_counter()
    try:
        return original_load(device_index, module)
    finally:
        out["module_load_s"][module] = time.perf_counter() - began
native._load = timed_load

def device_pages(pool, slots, gen):
    dev, fmt = pool.device_tier, pool.fmt
    idx = torch.as_tensor(slots, dtype=torch.int64, device=dev.device)
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            values = (torch.randn((len(slots), *fmt.plane_shape), generator=gen) * 4).to(fmt.device_torch_dtype)
            dev.raw_plane(layer, plane).index_copy_(0, idx, values.view(len(slots), -1).view(torch.uint8).to(dev.device))

def poison(pool, slots):
    dev, fmt = pool.device_tier, pool.fmt
    idx = torch.as_tensor(slots, dtype=torch.int64, device=dev.device)
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            dev.raw_plane(layer, plane)[idx] = 0xFF

gen = torch.Generator().manual_seed(25)
formats = (("fp8->bf16", PageFormat(32, 8, 128, 16, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16")),
           ("bf16", PageFormat(32, 8, 128, 16)))
out["first_pools_s"] = 0.0  # constructors + commit/flush/evict/load, without filling or checking pages
PROFILE = os.environ.get("FIRST_POOL_PROFILE") == "1"
def first_pool(label, fmt):
    if PROFILE and label == formats[0][0]:  # where the first constructor's time goes (timings then inflated)
        import cProfile, io, pstats
        profiler = cProfile.Profile()
        profiler.enable()
    a = time.perf_counter()
    pool = TieredPool(fmt, device="cuda", device_pages=16, host_pages=16)
    b = time.perf_counter()
    if PROFILE and label == formats[0][0]:
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative")
        top = []
        for (path, line, name), (_, calls, own, cumulative, _) in sorted(
                stats.stats.items(), key=lambda item: -item[1][3])[:40]:
            top.append(f"{cumulative * 1e3:8.2f} ms cum {own * 1e3:8.2f} ms own {calls:>6}x {path.split('site-packages/')[-1]}:{line}({name})")
        out["constructor_profile"] = top
    keys = prefix_keys(list(range(4 * fmt.page_size)), fmt.page_size, pool.namespace)
    slots = pool.allocate(len(keys))
    device_pages(pool, slots, gen)
    originals = pool.device_tier.kv[:, :, slots].clone()
    c = time.perf_counter()
    pool.commit(keys, slots)
    pool.flush()
    pool.release(slots)
    pool.evict(tier="device")
    back = pool.allocate(len(keys))
    poison(pool, back)
    pool.load(keys, back).wait()
    torch.cuda.synchronize()
    d = time.perf_counter()
    got = pool.device_tier.kv[:, :, back]
    if fmt.dtype == "bf16" or fmt.device_dtype == fmt.dtype:
        exact = bool(torch.equal(got.view(torch.uint8), originals.view(torch.uint8)))
    else:
        exact = True
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                q, s = quantize(originals[layer, plane].cpu(), fmt.dtype, fmt.scale, fmt.layout)
                ref = dequantize(q, s, fmt.scale, fmt.layout, torch.float64).to(fmt.device_torch_dtype)
                exact &= bool(torch.equal(got[layer, plane].cpu(), ref))
    out["checks"][f"pool {label}"] = exact
    out[f"pool {label}"] = {"constructor_s": b - a, "commit_flush_evict_load_s": d - c, "pool_s": (b - a) + (d - c),
                            "path": str(getattr(pool.engine, "last_path", type(pool.engine).__name__))}
    out["first_pools_s"] += (b - a) + (d - c)
    pool.close()
for label, fmt in formats:
    try:
        first_pool(label, fmt)
    except Exception as error:
        out["checks"][f"pool {label}"] = False
        out[f"pool {label}"] = {"error": repr(error)[-800:]}

# The kernel path on its own (the pool's engine may have taken the copy engines): a reload
# through each module, byte-equal to the CPU twin.
kernel_began = time.perf_counter()
def kernel_reload(label, fmt):
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
    out["checks"][f"kernel reload {label}"] = bool(torch.equal(dev.kv.cpu().view(torch.uint8), cpu_dev.kv.view(torch.uint8)))
for label, fmt in (("bf16", PageFormat(2, 2, 64, 16)),
                   ("fp8->bf16", PageFormat(2, 2, 64, 16, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16"))):
    try:
        kernel_reload(label, fmt)
    except Exception as error:
        out["checks"][f"kernel reload {label}"] = False
        out[f"kernel reload {label} error"] = repr(error)[-800:]
out["kernel_round_trips_s"] = time.perf_counter() - kernel_began
cache = native.cache()
out["loaded_from"] = {module: where for (_, module), where in native.loaded_from.items()}
out["cache"] = {"directory": str(cache.directory), "hits": cache.hits, "compiles": cache.compiles}
out["nvrtc_loaded"] = "cuda.bindings.nvrtc" in sys.modules
out["total_s"] = time.perf_counter() - t0
out["kvtier_first_pool_s"] = out["import_cuda_bindings_s"] + out["import_kvtier_s"] + out["first_pools_s"]
print("RESULT " + json.dumps(out))
"""


def _child(env: dict) -> dict:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", f"ROOT = {str(ROOT)!r}\n" + CHILD], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    wall = time.perf_counter() - began
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result["process_wall_s"] = wall
            if done.stderr.strip():
                result["stderr_tail"] = done.stderr[-600:]
            return result
    raise RuntimeError(f"exit {done.returncode}: {done.stderr[-2000:]}")


def main() -> int:
    out = Path(os.environ.get("OUT") or "/tmp")
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": sys.version.split()[0]}
    try:
        import torch

        from kvtier.transfer import native

        arch = "sm_%d%d" % torch.cuda.get_device_capability()
        report["meta"] = {"gpu": torch.cuda.get_device_name(), "arch": arch, "torch": torch.__version__,
                          "torch_cuda": torch.version.cuda, "prebuilt_archs": list(native.PREBUILT_ARCHS),
                          "prebuilt_files": {m: native.prebuilt_name(m, arch) for m in native.MODULES},
                          "prebuilt_readable": {m: native.read_prebuilt(m, arch) is not None for m in native.MODULES}}
        try:
            import cuda.bindings

            report["meta"]["cuda_bindings"] = cuda.bindings.__version__
        except Exception as error:  # noqa: BLE001
            report["meta"]["cuda_bindings"] = repr(error)
    except Exception as error:  # noqa: BLE001 - the cases still run
        report["meta"] = {"error": repr(error)}
    print(report["meta"])
    base = {k: v for k, v in os.environ.items() if k not in ("KVTIER_KERNEL_CACHE", "KVTIER_PREBUILT_KERNELS")}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    runs: dict = {}
    with tempfile.TemporaryDirectory() as prebuilt_dir, tempfile.TemporaryDirectory() as nvrtc_dir:
        cases = (("prebuilt", prebuilt_dir, "on"), ("nvrtc_cold", nvrtc_dir, "off"),
                 ("warm_cache", nvrtc_dir, "off"), ("prebuilt_again", prebuilt_dir, "on"),
                 ("prebuilt_pyc", prebuilt_dir, "on"), ("profiled", prebuilt_dir, "on"))
        for label, directory, prebuilt in cases:
            env = {**base, "KVTIER_KERNEL_CACHE": directory, "KVTIER_PREBUILT_KERNELS": prebuilt}
            if label == "profiled":
                env["FIRST_POOL_PROFILE"] = "1"
            if label == "prebuilt_pyc":
                # As a pip install leaves kvtier: its modules compiled to bytecode (pip compiles them at
                # install; a checkout run with PYTHONDONTWRITEBYTECODE=1 compiles them in every process).
                try:
                    done = subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "kvtier")],
                                          capture_output=True, text=True, cwd=ROOT, timeout=120)
                    report["compileall"] = {"rc": done.returncode, "stderr": done.stderr[-300:]}
                except Exception as error:  # noqa: BLE001
                    report["compileall"] = {"error": repr(error)}
            try:
                runs[label] = _child(env)
                runs[label]["cache_files_after"] = sorted(os.listdir(directory))
            except Exception as error:  # noqa: BLE001 - reported, the other cases still run
                runs[label] = {"error": str(error)}
                traceback.print_exc()
            report["runs"] = runs
            (out / "first_pool.json").write_text(json.dumps(report, indent=1, default=str))
    print("\n== first pool in a fresh process (s); goal: cuda.bindings + kvtier imports + first pools <= 0.25")
    print(f"{'case':<15}{'torch':>7}{'context':>8}{'cu.bind':>8}{'kvtier':>8}{'copy ld':>8}{'conv ld':>8}"
          f"{'pools':>8}{'kern rt':>8}{'goal sum':>9}{'proc':>7}  from / checks")
    for label, run in runs.items():
        if "error" in run:
            print(f"{label:<15}FAILED {run['error'][-800:]}")
            continue
        loads = run["module_load_s"]
        checks = "ok" if all(run["checks"].values()) else f"MISMATCH {run['checks']}"
        print(f"{label:<15}{run['import_torch_s']:>7.3f}{run['cuda_context_s']:>8.3f}{run['import_cuda_bindings_s']:>8.3f}"
              f"{run['import_kvtier_s']:>8.3f}{loads.get('page_copy', float('nan')):>8.3f}{loads.get('page_convert', float('nan')):>8.3f}"
              f"{run['first_pools_s']:>8.3f}{run['kernel_round_trips_s']:>8.3f}{run['kvtier_first_pool_s']:>9.3f}"
              f"{run['process_wall_s']:>7.2f}  {run['loaded_from']} nvrtc={run['nvrtc_loaded']} cache={run['cache']['hits']}h/"
              f"{run['cache']['compiles']}c; pyc {run['bytecode']['kvtier_pyc_present']}; {checks}")
        for name in ("pool fp8->bf16", "pool bf16"):
            print(f"{'':<15}{name}: {run.get(name)}")
        if run.get("constructor_profile"):
            print("  the first constructor under cProfile (cumulative; its timings above are inflated):")
            print("\n".join("    " + line for line in run["constructor_profile"][:30]))
    print(f"\nJSON: {out / 'first_pool.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
