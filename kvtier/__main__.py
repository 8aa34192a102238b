"""``python -m kvtier``: the ``kvtier`` command (kvtier.cli), for installs without the console script."""

from kvtier.cli import main

raise SystemExit(main())
