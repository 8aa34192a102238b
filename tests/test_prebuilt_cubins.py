"""The prebuilt cubins shipped in kvtier/native/prebuilt: one per module and architecture of
native.PREBUILT_ARCHS under the name the current sources give (so a .cu edited without
`make prebuilt-cubins` fails here), each a whole CUDA ELF image of its architecture, no stale
files; and a torn, corrupt or foreign file is never handed to the driver."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kvtier.transfer import kernel_cache, native

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "native" / "prebuilt"


def test_every_module_and_architecture_has_a_cubin_of_the_current_source():
    names = {p.name for p in SHIPPED.glob(f"*{native.PREBUILT_SUFFIX}")}
    for module in native.MODULES:
        for arch in native.PREBUILT_ARCHS:
            name = native.prebuilt_name(module, arch)
            assert name in names, f"{name} missing: native/{module}.cu changed without `make prebuilt-cubins`"
            cubin = native.read_prebuilt(module, arch)
            assert cubin is not None and native.cubin_arch(cubin) == arch
            # Every kernel the engine launches is in the image (extern "C" names are ELF symbols).
            for kernel in _kernels(module):
                assert kernel.encode() + b"\0" in cubin, f"{module} {arch} lacks {kernel}"
    assert len(names) == len(native.MODULES) * len(native.PREBUILT_ARCHS), "stale prebuilt files: rebuild the set"


def test_the_build_script_check_agrees():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_prebuilt_cubins.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_names_follow_source_options_architecture_and_nvrtc(monkeypatch):
    name = native.prebuilt_name("page_copy", "sm_90")
    assert name.startswith("page_copy.sm_90.") and name.endswith(native.PREBUILT_SUFFIX)
    source = native.source("page_copy")
    key = kernel_cache.entry_key(source, native.COMPILE_OPTIONS, "sm_90", native.prebuilt_toolchain())
    assert key in name
    others = {
        kernel_cache.entry_key(source + "\n", native.COMPILE_OPTIONS, "sm_90", native.prebuilt_toolchain()),
        kernel_cache.entry_key(source, (*native.COMPILE_OPTIONS, "-lineinfo"), "sm_90", native.prebuilt_toolchain()),
        kernel_cache.entry_key(source, native.COMPILE_OPTIONS, "sm_89", native.prebuilt_toolchain()),
    }
    monkeypatch.setattr(native, "PREBUILT_NVRTC", (13, 1))
    others.add(kernel_cache.entry_key(source, native.COMPILE_OPTIONS, "sm_90", native.prebuilt_toolchain()))
    assert key not in others and len(others) == 4
    # An edited source has no shipped file: it is compiled until the set is rebuilt.
    monkeypatch.setattr(native, "PREBUILT_NVRTC", (13, 0))
    monkeypatch.setattr(native, "source", lambda module: source + "// edited\n")
    assert native.read_prebuilt("page_copy", "sm_90") is None


def test_no_file_for_an_architecture_not_shipped():
    assert native.read_prebuilt("page_copy", "sm_75") is None
    assert native.read_prebuilt("page_kopy", "sm_90") is None


def test_the_environment_turns_them_off(monkeypatch):
    assert native.read_prebuilt("page_convert", "sm_90") is not None
    for value in ("off", "0", "false"):
        monkeypatch.setenv(native.PREBUILT_ENV, value)
        assert native.read_prebuilt("page_convert", "sm_90") is None
    monkeypatch.setenv(native.PREBUILT_ENV, "1")
    assert native.read_prebuilt("page_convert", "sm_90") is not None


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "bare_cubin", "bad_zlib", "other_arch", "not_elf"])
def test_a_damaged_or_foreign_file_is_ignored(tmp_path, damage):
    directory = tmp_path / "prebuilt"
    shutil.copytree(SHIPPED, directory)
    module, arch = "page_copy", "sm_90"
    path = directory / native.prebuilt_name(module, arch)
    good = native.read_prebuilt(module, arch, directory)
    assert good is not None
    data = bytearray(path.read_bytes())
    if damage == "flip":
        at = random.Random(11).randrange(len(kernel_cache.MAGIC), len(data))
        data[at] ^= 0x04
    elif damage == "truncate":
        data = data[: len(data) - 1000]
    elif damage == "empty":
        data = bytearray()
    elif damage == "bare_cubin":
        data = bytearray(good)  # the image without header or compression
    elif damage == "bad_zlib":
        data = bytearray(kernel_cache.encode(b"not zlib at all"))
    elif damage == "other_arch":
        data = bytearray((directory / native.prebuilt_name(module, "sm_89")).read_bytes())
    else:
        data = bytearray(kernel_cache.encode(zlib.compress(b"\x7fELF" + bytes(200))))
    path.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="damaged"):
        native._warned.discard(f"corrupt {path}")
        assert native.read_prebuilt(module, arch, directory) is None
    # The other module of the set still reads.
    assert native.read_prebuilt("page_convert", arch, directory) is not None


def test_cubin_arch_reads_the_elf_header():
    cubin = native.read_prebuilt("page_copy", "sm_100")
    assert native.cubin_arch(cubin) == "sm_100"
    assert native.cubin_arch(b"\x7fELF") is None
    assert native.cubin_arch(b"PK" + bytes(100)) is None
    other_machine = bytearray(cubin[:64])
    other_machine[18:20] = (62).to_bytes(2, "little")  # x86-64
    assert native.cubin_arch(bytes(other_machine)) is None


def _kernels(module: str) -> list[str]:
    """The kernels native/<module>.cu defines: the first argument of each KVTIER_*_KERNEL(...) line."""
    found = re.findall(r"^KVTIER_\w+_KERNEL\((\w+),", native.source(module), flags=re.M)
    assert len(found) >= 8
    return found
