"""kvtier.bench.plots on the stored reports in benchmarks/results and on reports with known repeats."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from kvtier.bench import plots  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
H200 = json.loads((RESULTS / "offload_bandwidth_h200_2026-12-02.json").read_text())
REMOTE = json.loads((RESULTS / "remote_bandwidth_cpu-vm_2026-12-02.json").read_text())
SIZES = ["4K", "16K", "64K", "256K", "1M", "4M"]


def curves(ax) -> dict[str, object]:
    return {c.get_label(): c for c in ax.containers}


def bar_ends(container) -> list[float]:
    """low, high, low, high, ... of the error bars of an errorbar container, in x order."""
    (bars,) = container.lines[2]
    return [float(y) for seg in sorted(bars.get_segments(), key=lambda s: s[0][0]) for y in (seg[0][1], seg[1][1])]


def spans(runs: list[list[float]]) -> list[float]:
    return [y for x in runs for y in (min(x), max(x))]


def test_offload_panels_colours_ticks_limits_and_legend():
    fig = plots.offload_figure(H200)
    data, legend = fig.axes[:5], fig.axes[5]
    colours: dict[str, set] = {}
    for ax in data:
        assert ax.get_legend() is None, "a legend inside a data panel covers curves"
        assert [t.get_text() for t in ax.get_xticklabels()] == SIZES
        for label, container in curves(ax).items():
            colours.setdefault(label, set()).add(container.lines[0].get_color())
    assert all(len(c) == 1 for c in colours.values()), colours
    assert len({next(iter(c)) for c in colours.values()}) == len(colours), "two paths share a colour"
    assert set(colours) == {"kernel", "copy_engine", "staged", "torch", "per-piece memcpy"}
    titles = [ax.get_title() for ax in data]
    assert "offload and reload at once (sum)" in titles
    limits = H200["limits"]
    for ax, section in zip(data, [p[0] for p in plots.OFFLOAD_PANELS]):
        levels = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if "limit" in line.get_label()}
        expected = {
            "offload": limits["d2h_gbps"],
            "reload": limits["h2d_gbps"],
            "offload+reload at once": limits["both_gbps"],
            "offload+quantize": 2 * limits["d2h_gbps"],
            "reload+upcast": 2 * limits["h2d_gbps"],
        }[section]
        assert expected in levels.values(), (section, levels)
    converting = {ax.get_title(): set(curves(ax)) for ax in data[3:]}
    assert all("copy_engine" not in paths for paths in converting.values())
    labels = [t.get_text() for t in legend.get_legend().get_texts()]
    assert labels[:5] == ["kernel", "copy_engine", "staged", "torch", "per-piece memcpy"]
    plots.pyplot().close(fig)


def test_error_bars_span_the_slowest_and_fastest_repeat():
    rng = np.random.default_rng(7)
    rows = []
    for section in ("offload", "reload", "offload+quantize"):
        for page in (4096, 65536, 1 << 20):
            runs = sorted(rng.uniform(5, 50, size=4).round(3).tolist())
            rows.append(
                {"section": section, "path": "kernel", "page_bytes": page, "gbps": float(np.median(runs)), "runs_gbps": runs}
            )
    limits = {"d2h_gbps": 55.0, "h2d_gbps": 54.0, "both_gbps": 100.0}
    report = {"meta": {"mode": "gpu", "gpu": "test"}, "limits": limits, "rows": rows}
    fig = plots.offload_figure(report)
    for ax, section in zip(fig.axes, ("offload", "reload", "offload+reload at once", "offload+quantize")):
        mine = [r for r in rows if r["section"] == section]
        if not mine:
            assert not ax.containers and "not measured" in ax.texts[0].get_text()
            continue
        ends = bar_ends(curves(ax)["kernel"])
        assert ends == pytest.approx(spans([r["runs_gbps"] for r in mine]))
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4K", "64K", "1M"]
    assert "median of 4 repeats" in fig.axes[5].texts[0].get_text()
    plots.pyplot().close(fig)


def test_remote_figure_bars_ratios_and_ticks():
    fig = plots.remote_figure(REMOTE)
    results = sorted(REMOTE["results"], key=lambda r: r["page_bytes"])
    for ax, (kind, _) in zip(fig.axes, plots.REMOTE_PANELS):
        assert ax.get_legend() is None
        assert [t.get_text() for t in ax.get_xticklabels()] == ["64K", "256K", "1M", "4M"]
        found = curves(ax)
        for series, label, colour, _marker in plots.REMOTE_SERIES:
            assert found[label].lines[0].get_color() == colour
            runs = [r[f"{series}_{kind}_runs_gbps"] for r in results]
            assert bar_ends(found[label]) == pytest.approx(spans(runs))
        ratios = [t.get_text() for t in ax.texts]
        assert ratios == [f"{r[f'store_{kind}_gbps'] / r[f'raw_{kind}_gbps']:.2f}×" for r in results]
    plots.pyplot().close(fig)


def test_plot_remote_script_writes_a_png_per_report(tmp_path):
    target = tmp_path / "remote.png"
    script = RESULTS.parent / "plot_remote.py"
    subprocess.run([sys.executable, str(script), str(RESULTS / "remote_bandwidth_cpu-vm_2026-12-02.json"), "--png", str(target)],
                   check=True, capture_output=True)
    assert target.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    missing = subprocess.run([sys.executable, str(script), "--png", str(tmp_path / "no" / "x.png"),
                              str(RESULTS / "remote_bandwidth_cpu-vm_2026-12-02.json")], capture_output=True, text=True)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


@pytest.mark.parametrize("nbytes, label", [(4096, "4K"), (1 << 20, "1M"), (4 << 20, "4M"), (1536, "1.5K"), (512, "512B")])
def test_size_labels(nbytes, label):
    assert plots.size_label(nbytes) == label
