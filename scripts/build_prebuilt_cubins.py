"""Build the prebuilt cubins that kvtier ships (kvtier/native/prebuilt/), so that a fresh machine
with one of the common GPUs never runs NVRTC (kvtier.transfer.native).

Compiles every native/ module for every architecture of native.PREBUILT_ARCHS with NVRTC
itself, through native.compile_module: the same source text (native.source, includes inlined),
the same options (native.COMPILE_OPTIONS) and the same call as a compile at run time, so a
prebuilt cubin is what the machine would have built. Needs no GPU. NVRTC's version must be
native.PREBUILT_NVRTC (it is part of every file's name; a driver of that CUDA version or later
loads the cubins). Writes each as native.encode_prebuilt (header + sha256 + zlib), named by
native.prebuilt_name, and removes files of older sources. `--check` only reports whether the
shipped set matches the sources (what tests/test_prebuilt_cubins.py asserts in CI).

    make prebuilt-cubins          # installs NVRTC 13.0 under build/nvrtc, then runs this
    python scripts/build_prebuilt_cubins.py [--check]

Run it after every edit of a native/*.cu file or of the compile options, and commit the result.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NVRTC_TARGET = ROOT / "build" / "nvrtc"  # pip install --target of nvidia-cuda-nvrtc and cuda-bindings


def _use_local_nvrtc() -> None:
    """Put build/nvrtc (make prebuilt-cubins installs there) on sys.path and its libnvrtc on the
    loader's path; the loader reads LD_LIBRARY_PATH at start, so the process re-executes once."""
    lib = NVRTC_TARGET / "nvidia" / "cu13" / "lib"
    if not lib.is_dir():
        return
    if str(lib) not in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(p for p in (str(lib), os.environ.get("LD_LIBRARY_PATH")) if p)}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    sys.path.insert(0, str(NVRTC_TARGET))


def expected_files() -> dict[str, tuple[str, str]]:
    from kvtier.transfer import native

    return {native.prebuilt_name(m, a): (m, a) for m in native.MODULES for a in native.PREBUILT_ARCHS}


def check(directory: Path) -> list[str]:
    """What is wrong with the shipped set (empty: it matches the sources)."""
    from kvtier.transfer import native

    problems = []
    wanted = expected_files()
    for name, (module, arch) in sorted(wanted.items()):
        path = directory / name
        if not path.is_file():
            problems.append(f"missing {name} ({module}.cu for {arch})")
        elif native.decode_prebuilt(path.read_bytes(), arch) is None:
            problems.append(f"damaged {name}")
    for path in sorted(directory.glob(f"*{native.PREBUILT_SUFFIX}")):
        if path.name not in wanted:
            problems.append(f"stale {path.name}")
    return problems


def build(directory: Path) -> None:
    from cuda.bindings import nvrtc

    from kvtier.transfer import native

    error, major, minor = nvrtc.nvrtcVersion()
    if (major, minor) != native.PREBUILT_NVRTC:
        raise SystemExit(f"NVRTC {major}.{minor} found; the prebuilt set is built by NVRTC "
                         f"{'.'.join(map(str, native.PREBUILT_NVRTC))} (native.PREBUILT_NVRTC): make prebuilt-cubins")
    directory.mkdir(parents=True, exist_ok=True)
    wanted = expected_files()
    total = 0
    for name, (module, arch) in sorted(wanted.items()):
        began = time.perf_counter()
        cubin = native.compile_module(module, arch, True)
        if native.cubin_arch(cubin) != arch:
            raise SystemExit(f"{module}.cu for {arch}: NVRTC returned an image for {native.cubin_arch(cubin)}")
        data = native.encode_prebuilt(cubin)
        (directory / name).write_bytes(data)
        total += len(data)
        print(f"{module:<13} {arch:<7} cubin {len(cubin):>8} B, shipped {len(data):>7} B, {time.perf_counter() - began:.1f} s")
    for path in directory.glob(f"*{native.PREBUILT_SUFFIX}"):
        if path.name not in wanted:
            path.unlink()
            print(f"removed stale {path.name}")
    print(f"{len(wanted)} files, {total} B in {directory}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the shipped set matches the sources")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    directory = ROOT / "native" / "prebuilt"  # kvtier/native is a link to native/
    if args.check:
        problems = check(directory)
        print("\n".join(problems) or f"prebuilt set matches the sources ({len(expected_files())} files)")
        return 1 if problems else 0
    _use_local_nvrtc()
    build(directory)
    problems = check(directory)
    if problems:
        print("\n".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
