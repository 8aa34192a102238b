import json

import pytest

from kvtier.cli import main


def test_bench_runs_the_cpu_twin_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bw.json"
    assert main(["bench", "--quick", "--no-progress", "--sizes", "4,64", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["meta"]["mode"].startswith("cpu twin")
    sections = {(row["section"], row["page_bytes"]) for row in report["rows"]}
    for section in ("offload", "reload", "offload+quantize", "reload+upcast"):
        assert (section, 4096) in sections and (section, 65536) in sections
    assert all(row["gbps"] > 0 for row in report["rows"])
    assert "offload" in capsys.readouterr().out


def test_unknown_command_is_refused(capsys):
    assert main(["benchmark"]) == 2
    assert "unknown command 'benchmark'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--sizes", "x"])
