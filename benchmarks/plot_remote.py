"""Draw the remote tier's bandwidth reports (benchmarks/remote_bandwidth.py --json) as PNGs.

    python benchmarks/plot_remote.py                      # every benchmarks/results/remote_bandwidth_*.json
    python benchmarks/plot_remote.py run.json --png run.png

Each report becomes one figure (kvtier.bench.plots.remote_figure): write, cold read and warm
read per page size, the raw disk against the store, error bars over the repeats. Without
--png the PNG goes next to its JSON under the same name. Needs matplotlib; exits 2 without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a source checkout too

from kvtier.bench import plots  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", nargs="*", type=Path,
                        help="report JSON files (default: benchmarks/results/remote_bandwidth_*.json)")
    parser.add_argument("--png", type=Path, default=None, help="the PNG to write (only with a single report)")
    args = parser.parse_args(argv)
    reports = args.reports or sorted(RESULTS.glob("remote_bandwidth_*.json"))
    if not reports:
        parser.error(f"no reports given and none in {RESULTS}")
    if args.png is not None and len(reports) != 1:
        parser.error(f"--png names one file, but {len(reports)} reports were given")
    targets = [args.png or report.with_suffix(".png") for report in reports]
    try:
        for target in targets:
            plots.check_target(target)
    except plots.PlotUnavailable as err:
        print(f"plot_remote: {err}", file=sys.stderr)
        return 2
    for report, target in zip(reports, targets):
        plots.save(plots.remote_figure(json.loads(report.read_text())), target)
        print(f"# wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
