"""README.md as a user meets it: every ```python block runs as written (each in its own process,
on the CPU), every ```toml block is a configuration kvtier accepts, every extra it names exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvtier.config import pool_kwargs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", README, flags=re.M | re.S)


def clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


def test_readme_has_the_snippets_it_promises():
    python = blocks("python")
    assert len(python) >= 3
    assert any("pool.device_kv(layer)" in code and "pool.device_scales(layer)" in code for code in python)
    assert not any("raw_plane" in code or "device_tier.kv" in code for code in python), "snippets use internals"
    assert len(blocks("toml")) >= 1


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs_as_written(index, tmp_path):
    code = blocks("python")[index]
    if "remote=" in code and not any(_importable(m) for m in ("nixl_cu13", "nixl_cu12")):
        pytest.skip("the remote tier needs a NIXL wheel")
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         env=clean_environment(), timeout=240)
    assert out.returncode == 0, f"README python block {index} failed:\n{code}\n--- stderr ---\n{out.stderr[-3000:]}"


@pytest.mark.parametrize("index", range(len(blocks("toml"))))
def test_toml_block_is_an_accepted_configuration(index, tmp_path, monkeypatch):
    for var in [v for v in os.environ if v.startswith("KVTIER_")]:
        monkeypatch.delenv(var)
    path = tmp_path / "kvtier.toml"
    path.write_text(blocks("toml")[index])
    kwargs = pool_kwargs(path)
    assert kwargs["fmt"].num_layers == tomllib.loads(blocks("toml")[index])["format"]["num_layers"]


def test_every_extra_the_readme_names_exists_and_every_extra_is_described():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    in_commands = {e for group in re.findall(r"kvtier\[([a-z0-9,-]+)\]", README) for e in group.split(",")}
    table = README[README.index("| extra |") :].split("\n\n")[0]
    in_table = {name for row in table.splitlines()[2:] for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert in_commands and in_commands <= extras, in_commands - extras
    assert in_table == extras, (in_table ^ extras)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
