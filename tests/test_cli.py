"""The `kvtier` command: real argparse, the real CPU-twin benchmark, real files and processes."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.cli import STORE_TOOL, build_parser, main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvtier {kvtier.__version__}"
    assert kvtier.__version__ == importlib.metadata.version("kvtier")


def test_console_script_and_module_run_as_processes():
    script = shutil.which("kvtier", path=str(Path(sys.executable).parent))
    assert script is not None, "the kvtier console script is not installed beside this Python"
    for command in ([script, "--version"], [sys.executable, "-m", "kvtier.cli", "--version"],
                    [sys.executable, "-m", "kvtier", "--version"]):
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == f"kvtier {kvtier.__version__}"


def test_bench_help_is_its_own_and_every_option_has_help(capsys):
    assert main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: kvtier bench")
    bench = subcommands(build_parser())["bench"]
    options = [a for a in bench._actions if a.option_strings and a.dest != "help"]
    assert {"repeats", "json", "png", "no_progress", "from_json", "sizes", "quick"} <= {a.dest for a in options}
    for action in options:
        assert action.help and len(action.help) > 10, action.option_strings
        assert action.option_strings[0] in text


def test_every_command_and_action_has_help():
    parser = build_parser()
    for name, sub in subcommands(parser).items():
        assert sub.description, name
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                for inner in action.choices.values():
                    assert all(a.help for a in inner._actions), inner.prog
            else:
                assert action.help, (name, action.dest)


def test_bench_runs_the_cpu_twin_writes_json_with_every_repeat_and_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "bw.json", tmp_path / "bw.png"
    argv = ["bench", "--quick", "--no-progress", "--sizes", "4,64", "--repeats", "3", "--json", str(out), "--png", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["mode"].startswith("cpu twin")
    sections = {(row["section"], row["page_bytes"]) for row in report["rows"]}
    for section in ("offload", "reload", "offload+quantize", "reload+upcast"):
        assert (section, 4096) in sections and (section, 65536) in sections
    for row in report["rows"]:
        if row["section"] != "decode loop, reload per layer":
            assert len(row["runs_gbps"]) == 3
            assert min(row["runs_gbps"]) <= row["gbps"] <= max(row["runs_gbps"])
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "offload" in capsys.readouterr().out


def test_bench_replots_an_earlier_report_without_measuring(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    stored = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "offload_bandwidth_h200_2026-12-02.json"
    png = tmp_path / "h200.png"
    assert main(["bench", "--from-json", str(stored), "--png", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    assert "NVIDIA H200" in capsys.readouterr().out


def test_png_without_matplotlib_fails_before_measuring(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    out, png = tmp_path / "bw.json", tmp_path / "bw.png"
    assert main(["bench", "--quick", "--no-progress", "--sizes", "4", "--json", str(out), "--png", str(png)]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "kvtier[bench]" in err and "nothing was measured" in err
    assert not png.exists() and not out.exists()


def test_unusable_targets_fail_before_measuring(tmp_path, capsys):
    assert main(["bench", "--png", str(tmp_path / "missing" / "bw.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "--png", str(tmp_path / "bw.jpg")]) == 2
    assert "must end in .png" in capsys.readouterr().err
    assert main(["bench", "--json", str(tmp_path / "missing" / "bw.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["bench", "--from-json", str(tmp_path / "gone.json")]) == 2
    assert "gone.json' does not exist" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    assert main(["benchmark"]) == 2
    assert "invalid choice: 'benchmark'" in capsys.readouterr().err
    assert main(["bench", "--sizes", "x"]) == 2
    assert "comma-separated KiB" in capsys.readouterr().err
    assert main([]) == 2
    assert "usage: kvtier" in capsys.readouterr().err
    assert main(["store"]) == 2
    assert "usage: kvtier store" in capsys.readouterr().err


def test_config_prints_what_a_file_makes_or_names_the_bad_key(tmp_path, capsys, monkeypatch):
    for var in [v for v in os.environ if v.startswith("KVTIER_")]:
        monkeypatch.delenv(var)
    good = tmp_path / "kv.toml"
    good.write_text('host_bytes = "1MiB"\n[format]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 16\npage_size = 4\n'
                    'dtype = "bfloat16"\n')
    assert main(["config", str(good)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["host_bytes"] == 2**20 and shown["format"]["dtype"] == "bf16"
    bad = tmp_path / "bad.toml"
    bad.write_text('host_byte = "1MiB"\n')
    assert main(["config", str(bad)]) == 2
    assert "did you mean 'host_bytes'" in capsys.readouterr().err


def test_store_commands_reach_the_store_tool(tmp_path, capsys):
    try:
        tool = importlib.import_module(STORE_TOOL)
    except ModuleNotFoundError as err:
        assert err.name == STORE_TOOL
        assert main(["store", "check", str(tmp_path)]) == 2
        assert f"{STORE_TOOL} is missing" in capsys.readouterr().err
        assert main(["store", "rebuild", str(tmp_path)]) == 2
    else:
        for action in ("check", "rebuild"):
            expected = tool.main([action, str(tmp_path)])
            capsys.readouterr()
            assert main(["store", action, str(tmp_path)]) == expected


def test_store_help_lists_every_flag_at_every_level(capsys):
    pytest.importorskip("crc32c")
    assert main(["store", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: kvtier store") and "check" in text and "rebuild" in text
    for action, flags in (("check", ["--payloads", "--json", "--mac-key-file", "--namespace", "--no-progress"]),
                          ("rebuild", ["--json", "--mac-key-file", "--namespace", "--no-progress"])):
        assert main(["store", action, "--help"]) == 0  # no PATH needed to see the flags
        text = capsys.readouterr().out
        assert text.startswith(f"usage: kvtier store {action}") and "the store's directory" in text
        for flag in flags:
            assert flag in text, (action, flag)


def test_config_without_a_file_says_what_to_pass_on_the_command_line(tmp_path, capsys, monkeypatch):
    for var in [v for v in os.environ if v.startswith("KVTIER_")]:
        monkeypatch.delenv(var)
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "kvtier config kvtier.toml" in err and "KVTIER_CONFIG=" in err and "KVTIER_FORMAT_NUM_LAYERS" in err
    assert "PageFormat" not in err
    no_format = tmp_path / "kv.toml"
    no_format.write_text('device = "cpu"\n')
    assert main(["config", str(no_format)]) == 2
    err = capsys.readouterr().err
    assert f"{no_format} has no [format] table" in err and "PageFormat" not in err
