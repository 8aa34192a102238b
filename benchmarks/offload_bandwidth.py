"""Entry point from a source checkout; the benchmark is kvtier.bench.offload_bandwidth (`kvtier bench`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.bench.offload_bandwidth import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
