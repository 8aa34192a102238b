"""Plots of the benchmark reports: offload / reload bandwidth per copy path, and the remote tier.

Owns turning a report (the JSON a benchmark writes) into a matplotlib figure: one colour per
copy path in every panel, the legend in a panel of its own so it never covers a curve, page
sizes as 4K ... 4M, error bars spanning the repeats where the report has them, and the limit
each panel is measured against. It must never measure anything, and it imports matplotlib
only when a figure is drawn: a missing matplotlib raises PlotUnavailable, never passes quietly.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Fixed colours so that a path looks the same in every panel and in every report.
PATH_COLOURS = {
    "kernel": "tab:blue",
    "copy_engine": "tab:orange",
    "staged": "tab:green",
    "torch": "tab:red",
    "per-piece memcpy": "tab:purple",
    "cpu twin": "tab:gray",
}
SPARE_COLOURS = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan")

# (section, title, x label, converting): the pass-through row on top, the converting row below.
OFFLOAD_PANELS = (
    ("offload", "offload: device → host", "page record size", False),
    ("reload", "reload: host → device", "page record size", False),
    ("offload+reload at once", "offload and reload at once (sum)", "page record size", False),
    ("offload+quantize", "offload + quantize bf16 → fp8", "page size in bf16 bytes", True),
    ("reload+upcast", "reload + upcast fp8 → bf16", "page size in bf16 bytes", True),
)
REMOTE_PANELS = (
    ("write", "write, fsync per batch"),
    ("read_cold", "cold read (after fadvise DONTNEED)"),
    ("read_warm", "warm read (page cache)"),
)
REMOTE_SERIES = (
    ("raw", "raw disk: os.write / os.preadv per page", "black", "s"),
    ("store", "kvtier RemoteStore (NIXL POSIX, CRC32C)", "tab:blue", "o"),
)


class PlotUnavailable(RuntimeError):
    """A figure cannot be drawn or written here: matplotlib is missing or the target is unusable."""


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend, or PlotUnavailable saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("drawing a PNG needs matplotlib: pip install 'kvtier[bench]' (or matplotlib)") from None
    return plt


def check_target(target: str | os.PathLike) -> Path:
    """The PNG path, once it is known to be writable; raises PlotUnavailable before any work is done."""
    target = Path(target)
    if target.suffix.lower() != ".png":
        raise PlotUnavailable(f"PNG target {str(target)!r} must end in .png")
    if not target.parent.is_dir():
        raise PlotUnavailable(f"PNG target {str(target)!r}: folder {str(target.parent)!r} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise PlotUnavailable(f"PNG target {str(target)!r}: folder {str(target.parent)!r} is not writable")
    pyplot()
    return target


def size_label(nbytes: int) -> str:
    """4096 -> "4K", 1048576 -> "1M", 1536 -> "1.5K" (binary units, as page sizes are)."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes}B"


def path_colours(paths: Iterable[str]) -> dict[str, str]:
    """Colour of each path: the fixed ones first, in PATH_COLOURS order, then any other."""
    paths = set(paths)
    spare = iter(SPARE_COLOURS)
    known = [p for p in PATH_COLOURS if p in paths]
    return {p: PATH_COLOURS.get(p) or next(spare, "black") for p in known + sorted(set(paths) - set(known))}


def _size_axis(ax, sizes: list[int], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [size_label(s) for s in sizes])
    ax.minorticks_off()
    ax.margins(x=0.08)
    ax.set_xlabel(label)


def _spread(value: float, runs: list[float]):
    """(below, above) the plotted value reaching the slowest and fastest repeat."""
    if not runs:
        return (0.0, 0.0)
    return (max(value - min(runs), 0.0), max(max(runs) - value, 0.0))


def _curve(ax, xs, values, runs, colour: str, marker: str, label: str):
    below, above = zip(*(_spread(v, r) for v, r in zip(values, runs)))
    return ax.errorbar(
        xs, values, yerr=[below, above], color=colour, marker=marker, markersize=4, capsize=3, linewidth=1.4, label=label
    )


def _legend_panel(ax, handles, labels, notes: list[str]) -> None:
    ax.axis("off")
    ax.legend(handles, labels, loc="upper left", fontsize=8, frameon=False)
    ax.text(0.0, 0.0, "\n".join(notes), transform=ax.transAxes, fontsize=7.5, va="bottom", wrap=True)


def offload_figure(report: dict) -> Figure:
    """Bandwidth per copy path and page size: pass-through panels on top, converting below."""
    plt = pyplot()
    rows = report["rows"]
    limits = report.get("limits", {})
    meta = report.get("meta", {})
    colours = path_colours({r["path"] for r in rows})
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    panels = dict(zip((p[0] for p in OFFLOAD_PANELS), (axes[0, 0], axes[0, 1], axes[0, 2], axes[1, 0], axes[1, 1])))
    handles: dict[str, object] = {}
    limit_handles: dict[str, object] = {}
    repeats = {len(r.get("runs_gbps", [])) for r in rows}
    for section, title, xlabel, converting in OFFLOAD_PANELS:
        ax = panels[section]
        mine = [r for r in rows if r["section"] == section]
        ax.set_title(title, fontsize=10)
        if not mine:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        for path in sorted({r["path"] for r in mine}):
            line = sorted((r for r in mine if r["path"] == path), key=lambda r: r["page_bytes"])
            handles[path] = _curve(
                ax, [r["page_bytes"] for r in line], [r["gbps"] for r in line],
                [r.get("runs_gbps", []) for r in line], colours[path], "o", path,
            )
        for value, label, (style, colour) in _limit_lines(section, converting, limits):
            limit_handles[label] = ax.axhline(value, color=colour, linestyle=style, linewidth=1.1, label=label)
        _size_axis(ax, sorted({r["page_bytes"] for r in mine}), xlabel)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("GB/s")
        ax.grid(True, alpha=0.3)
    if "memcpy_gbps" in limits:
        notes = ["CPU twin: copies between CPU tensors, no PCIe; converting panels count bf16 bytes."]
    else:
        notes = [
            "Converting panels count bf16 bytes: the fp8 record on the wire is about half,",
            "so their limit is twice the PCIe line of the same direction.",
        ]
    notes.append(_repeats_note(repeats))
    order = [p for p in colours if p in handles]  # paths in colour order, then the limits
    legend = {**{p: handles[p] for p in order}, **limit_handles}
    _legend_panel(axes[1, 2], list(legend.values()), list(legend), notes)
    where = meta.get("gpu") or meta.get("mode", "")
    versions = ", ".join(f"{k} {meta[k]}" for k in ("torch", "cuda", "driver") if meta.get(k))
    fig.suptitle(f"kvtier transfer bandwidth — {where} ({str(meta.get('date', ''))[:10]}; {versions})", fontsize=11)
    fig.tight_layout()
    return fig


# Line style and colour of each limit, so a limit looks the same in every panel it is drawn in.
CONTIGUOUS = (":", "black")
HALF_OF_BOTH = ("-.", "dimgray")
BOTH = ("--", "black")
DOUBLE = ((0, (6, 2)), "dimgray")


def _limit_lines(section: str, converting: bool, limits: dict) -> list[tuple[float, str, tuple]]:
    """(value, label, (style, colour)) of the limits a section is measured against."""
    if "memcpy_gbps" in limits:
        return [] if converting else [(limits["memcpy_gbps"], "CPU memcpy, one contiguous copy", CONTIGUOUS)]
    d2h, h2d, both = limits.get("d2h_gbps"), limits.get("h2d_gbps"), limits.get("both_gbps")
    half = both / 2 if both else None
    contiguous, half_of_both = "PCIe limit: contiguous pinned copy", "half of both directions at once"
    lines = {
        "offload": [(d2h, contiguous, CONTIGUOUS), (half, half_of_both, HALF_OF_BOTH)],
        "reload": [(h2d, contiguous, CONTIGUOUS), (half, half_of_both, HALF_OF_BOTH)],
        "offload+reload at once": [(both, "PCIe limit: both directions at once", BOTH)],
        "offload+quantize": [(d2h and 2 * d2h, "2 × PCIe limit of the direction (bf16 bytes)", DOUBLE)],
        "reload+upcast": [(h2d and 2 * h2d, "2 × PCIe limit of the direction (bf16 bytes)", DOUBLE)],
    }[section]
    return [(value, label, look) for value, label, look in lines if value]


def _repeats_note(repeats: set[int]) -> str:
    counted = sorted(n for n in repeats if n)
    if not counted:
        return "Error bars: this report has no per-repeat times (written before they were recorded)."
    span = f"{counted[0]}" if len(counted) == 1 else f"{counted[0]}–{counted[-1]}"
    return f"Points: median of {span} repeats; error bars: slowest to fastest repeat."


def remote_figure(report: dict) -> Figure:
    """Remote tier bandwidth per page size: raw NIXL transfers against the store, per direction."""
    plt = pyplot()
    results = sorted(report["results"], key=lambda r: r["page_bytes"])
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1, 1, 1, 0.8]})
    handles = {}
    sizes = [r["page_bytes"] for r in results]
    repeats = set()
    for ax, (kind, title) in zip(axes, REMOTE_PANELS):
        for series, label, colour, marker in REMOTE_SERIES:
            values = [r[f"{series}_{kind}_gbps"] for r in results]
            runs = [r.get(f"{series}_{kind}_runs_gbps", []) for r in results]
            repeats |= {len(x) for x in runs}
            handles[label] = _curve(ax, sizes, values, runs, colour, marker, label)
        # Along the foot of the panel, where no curve or error bar runs.
        foot = ax.get_xaxis_transform()
        for r in results:
            ratio = r[f"store_{kind}_gbps"] / r[f"raw_{kind}_gbps"]
            ax.text(r["page_bytes"], 0.03, f"{ratio:.2f}×", transform=foot, ha="center", fontsize=7.5, color="tab:blue")
        _size_axis(ax, sizes, "page size")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("GB/s")
        ax.grid(True, alpha=0.3)
    args = report.get("args", {})
    notes = [
        "Blue figures at the foot of each panel: store / raw (medians).",
        f"{args.get('total_mib', '?')} MiB per pass in batches of {args.get('batch_mib', '?')} MiB,",
        f"{report.get('cpus', '?')} CPUs, {report.get('nixl', 'nixl ?')}, "
        f"checksum threads {args.get('checksum_threads') or 'default'}.",
        _repeats_note(repeats),
    ]
    _legend_panel(axes[3], list(handles.values()), list(handles), notes)
    fig.suptitle(f"kvtier remote tier bandwidth — {report.get('host', '?')} ({str(report.get('date', ''))[:10]}; "
                 f"torch {report.get('torch', '?')}, Python {report.get('python', '?')})", fontsize=11)
    fig.tight_layout()
    return fig


def save(fig: Figure, target: str | os.PathLike) -> Path:
    target = Path(target)
    fig.savefig(target, dpi=120)
    pyplot().close(fig)
    return target
