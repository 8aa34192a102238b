"""The built wheel: CUDA sources, py.typed and LICENSE inside, sources found after a --target
install, every module shipped, and no extra that names torch or a serving engine."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvtier.transfer import native

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: setuptools never cleans build/, so an in-tree build could ship stale modules.
    tree = tmp_path_factory.mktemp("tree") / "kvtier"
    junk = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "out")
    shutil.copytree(ROOT, tree, symlinks=True, ignore=junk)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(tree)],
        check=True,
        cwd=out,
    )
    (built,) = out.glob("kvtier-*.whl")
    return built


def _inlined(module: str) -> str:
    """native/<module>.cu with its #include "x.cu" lines replaced by the files, as compiled."""
    lines = []
    for line in (ROOT / "native" / f"{module}.cu").read_text(encoding="utf-8").splitlines():
        match = native.INCLUDE.match(line)
        lines.append((ROOT / "native" / match.group(1)).read_text(encoding="utf-8") if match else line)
    return "\n".join(lines) + "\n"


def test_checkout_reads_the_sources_at_the_repository_root():
    for module in native.MODULES:
        assert native.source(module) == _inlined(module)
    with pytest.raises(ValueError, match="page_copy"):
        native.source("page_kopy")


def test_wheel_carries_sources_types_license_and_every_module(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        for cu in sorted((ROOT / "native").glob("*.cu")) + sorted((ROOT / "native").glob("*.c")):
            assert whl.read(f"kvtier/native/{cu.name}") == cu.read_bytes()
        prebuilt = sorted((ROOT / "native" / "prebuilt").glob("*.cubin.z"))
        assert prebuilt, "no prebuilt cubins in native/prebuilt"
        for cubin in prebuilt:
            assert whl.read(f"kvtier/native/prebuilt/{cubin.name}") == cubin.read_bytes()
        assert "kvtier/py.typed" in names
        (license_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert whl.read(license_name) == (ROOT / "LICENSE").read_bytes()
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kvtier").rglob("*.py")}
    assert {n for n in names if n.endswith(".py")} == sources


def test_no_extra_names_torch_or_an_engine(wheel):
    with zipfile.ZipFile(wheel) as whl:
        (meta_name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(whl.read(meta_name))
    extras = set(meta.get_all("Provides-Extra"))
    assert {"nixl", "nixl-cu12", "nixl-cu13", "cuda", "cuda12", "cuda13", "sglang", "decode", "triton"} <= extras
    for requirement in meta.get_all("Requires-Dist"):
        name = requirement.split(";")[0].strip().lower()
        if "extra ==" in requirement:
            assert not name.startswith(("torch", "sglang", "vllm")), requirement
        elif name.startswith("torch"):
            assert "+" not in name and "<" not in name, f"core torch requirement caps or pins a build: {requirement}"


def _extras(meta) -> dict[str, set[str]]:
    """extra -> the distributions it brings, through other extras of kvtier too."""
    direct: dict[str, set[str]] = {extra: set() for extra in meta.get_all("Provides-Extra")}
    for requirement in meta.get_all("Requires-Dist"):
        if "extra ==" in requirement:
            name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()
            extra = re.search(r"extra == [\"']([^\"']+)", requirement).group(1)
            inner = re.search(r"kvtier\[([^\]]+)\]", requirement)
            direct[extra] |= {f"[{e}]" for e in inner.group(1).split(",")} if inner else {name}
    def expand(extra: str) -> set[str]:
        out = set()
        for item in direct[extra]:
            out |= expand(item[1:-1]) if item.startswith("[") else {item}
        return out
    return {extra: expand(extra) for extra in direct}


def test_extras_match_machines_only_cuda_extras_bring_cuda_packages(wheel):
    with zipfile.ZipFile(wheel) as whl:
        (meta_name,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(whl.read(meta_name))
    extras = _extras(meta)
    cuda = ("cupy", "cuda-", "nvidia-")
    for extra, brings in extras.items():
        on_cuda = [name for name in brings if name.startswith(cuda)]
        assert bool(on_cuda) == (extra in ("cuda", "cuda12", "cuda13")), (extra, brings)
    assert extras["nixl"] == {"nixl-cu13", "crc32c"} and "triton" in extras["decode"] == extras["triton"]


def test_the_decoder_without_triton_names_its_extra():
    probe = (  # a finder that answers for triton as pip would where it is not installed
        "import sys\n"
        "class NoTriton:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'triton':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoTriton())\n"
        "try:\n    import kvtier.decode\nexcept ImportError as e:\n    print(e)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "kvtier.decode (the reference decoder) needs Triton" in out.stdout and "kvtier[decode]" in out.stdout


def test_target_install_finds_the_sources(wheel, tmp_path):
    target = tmp_path / "target"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
    )
    probe = (
        "import kvtier, kvtier.transfer.native as n; "
        "print(kvtier.__file__); print(len(n.source('page_copy')), len(n.source('page_convert')))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=env, cwd=tmp_path)
    where, sizes = out.stdout.splitlines()
    assert Path(where).is_relative_to(target)
    expected = [len(_inlined(m)) for m in ("page_copy", "page_convert")]
    assert [int(s) for s in sizes.split()] == expected
