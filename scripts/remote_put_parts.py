"""Where a 1-page remote put's CPU goes: ``process_time`` (every thread) around the whole
``RemoteStore.put_ids`` call and around its parts (slot reservation, locating the segment, the
durable write, its ``fdatasync``, the index publication), medians over many puts of 16 KiB
pages into a fresh store on this machine's temporary directory.

    python scripts/remote_put_parts.py [CHECKOUT] [--puts 1200]

CHECKOUT (default: this one) is put first on the path, so two revisions can be compared by
running this script against each in turn.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--puts", type=int, default=1200)
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temporary directory under /var/tmp)")
    args = ap.parse_args()
    sys.path.insert(0, args.checkout)
    import torch

    import kvtier
    from kvtier.index.keys import key_ids
    from kvtier.tiers.remote import RemoteStore

    parts: dict[str, list[float]] = {}

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*a, **k):
            start = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                parts.setdefault(label, []).append(time.process_time() - start)

        setattr(obj, name, timed)

    directory = tempfile.mkdtemp(dir=args.dir or ("/var/tmp" if os.path.isdir("/var/tmp") else None))
    store = RemoteStore(directory, namespace="5a11ca11", page_bytes=16 << 10, segment_bytes=64 << 20,
                        capacity_bytes=8 << 30, create=True)
    try:
        warm = 200
        src = torch.randint(0, 256, (warm + args.puts, 16 << 10), dtype=torch.uint8)
        store.register_host_memory(src)
        ids = key_ids(f"part-{i}" for i in range(warm + args.puts))
        for i in range(warm):
            store.put_ids([ids[i]], [src[i]])
        wrap(store._index, "publish", "publish")
        wrap(store, "_reserve", "reserve")
        wrap(store._medium, "locate", "locate")
        wrap(store._path, "write_durable", "write (with fdatasync)")
        wrap(os, "fdatasync", "fdatasync")
        total = []
        for i in range(warm, warm + args.puts):
            start = time.process_time()
            if store.put_ids([ids[i]], [src[i]]) != [True]:
                raise RuntimeError("put failed")
            total.append(time.process_time() - start)
    finally:
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    print(f"kvtier from {Path(kvtier.__file__).parent}; {args.puts} puts of 16 KiB, CPU µs (median, mean)")
    print(f"  {'put':24s} {statistics.median(total) * 1e6:7.1f} {statistics.mean(total) * 1e6:7.1f}")
    for label, values in parts.items():
        print(f"  {label:24s} {statistics.median(values) * 1e6:7.1f} {statistics.mean(values) * 1e6:7.1f}")


if __name__ == "__main__":
    main()
