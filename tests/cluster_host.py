"""One "host" of the cluster tier's tests: a process with its own pool, local store and Mooncake client.

Reads commands from stdin, one a line, and answers each with one line on stdout:
``commit NAME FIRST COUNT SEED`` writes COUNT random pages under keys NAME/FIRST.., flushes them
to the local store and the cluster, answers the SHA-256 of each page (data and scales);
``load NAME FIRST COUNT`` matches and loads those keys, answers ``remote=N`` and each page's
SHA-256, poisoning the device slots first; ``stats`` answers the cluster's counters; ``exit``.
Argv: the JSON of the cluster settings, the local store's directory ('' for none).
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from tests.conftest import fill_random, poison, small_format, snapshot
from kvtier import TieredPool


def digest(pool, slot) -> str:
    data, scales = snapshot(pool, slot)
    return hashlib.sha256(data + scales).hexdigest()


def main() -> None:
    settings, local = json.loads(sys.argv[1]), sys.argv[2] or None
    pool = TieredPool(small_format(), device_pages=64, host_pages=64, remote=local, cluster=settings, registry=None)
    cluster = pool.remote.cluster if local else pool.remote
    assert cluster.client.wait_connected(30), cluster.client.last_error
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "commit":
            name, first, count, seed = args[0], int(args[1]), int(args[2]), int(args[3])
            keys = [f"{name}/{i}" for i in range(first, first + count)]
            slots = pool.allocate(count)
            fill_random(pool, slots, torch.Generator().manual_seed(seed))
            pool.commit(keys, slots)
            answer = [digest(pool, s) for s in slots]
            pool.release(slots)
            assert pool.flush() == 0
            print(" ".join(answer), flush=True)
        elif cmd == "load":
            name, first, count = args[0], int(args[1]), int(args[2])
            keys = [f"{name}/{i}" for i in range(first, first + count)]
            found = pool.match(keys)
            slots = pool.allocate(found.total)
            poison(pool, slots)
            handle = pool.load(keys[: found.total], slots)
            handle.wait()
            print(f"remote={found.remote}", *[digest(pool, s) for s in slots], flush=True)
            pool.release(slots)
        elif cmd == "stats":
            print(json.dumps(cluster.stats()["cluster"], separators=(",", ":")), flush=True)
        elif cmd == "exit":
            break
    pool.close()


if __name__ == "__main__":
    main()
