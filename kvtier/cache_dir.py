"""Where kvtier keeps what it builds at run time: compiled kernels (kvtier.transfer.kernel_cache)
and the index's C library (kvtier.index.native).

Owns the one rule for such a folder: its KVTIER_* variable names it ("off" or empty: nothing is
kept), else $XDG_CACHE_HOME/kvtier/<name>, else ~/.cache/kvtier/<name>. It must never create,
read or write the folder.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_directory(env: str, name: str) -> Path | None:
    """The folder `env` names, else kvtier's cache folder `name` (None: `env` turns it off)."""
    chosen = os.environ.get(env)
    if chosen is not None:
        return None if chosen.strip() in ("", "off") else Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvtier" / name
