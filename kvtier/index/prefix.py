"""Prefix walks over the key tables: how far a batch of key ids is held, and by which tier.

Owns the walks a `match` makes (device, then host, then what the remote tier said) and the
leading slots a tier holds. The first MANY ids are looked up one at a time, so a short prefix
pays for what it reads and nothing more; the rest in chunks of MANY and more, each chunk's
lookups at once (numpy over the compact key table) and its tally in numpy. It must never
change a table, a state or an order: callers hold what they found.
"""

from __future__ import annotations

import numpy as np

from kvtier.index.key_table import MANY

CHUNK_GROWTH = 4  # each chunk after the first MANY ids is this many times the one before
PIECE = 32  # of the first MANY ids, the device tier's are looked up this many at a time


def walk(dev_table, host_table, ids: list[bytes], start: int, in_remote=None) -> tuple[int, int, int, int]:
    """(device, host, remote, end) over the leading ids from `start` held by the device, the
    host or (where `in_remote`, one flag per id from `start`, says so) the remote tier."""
    hget = host_table.get
    d = h = r = 0
    pos, plain = start, min(len(ids), start + MANY)
    while pos < plain:  # the device lookups of a piece at once (a miss costs a call in Python else)
        piece = ids[pos : min(pos + PIECE, plain)]
        for i, (kid, slot) in enumerate(zip(piece, dev_table.get_many(piece)), pos):
            if slot >= 0:
                d += 1
            elif hget(kid) >= 0:
                h += 1
            elif in_remote is not None and in_remote[i - start]:
                r += 1
            else:
                return d, h, r, i
        pos += len(piece)
    chunk = MANY
    while pos < len(ids):
        part = ids[pos : pos + chunk]
        chunk *= CHUNK_GROWTH
        n = len(part)
        on_dev = np.fromiter(dev_table.get_each(part), dtype=np.int64, count=n) >= 0
        on_host = np.zeros(n, dtype=bool)
        off = np.flatnonzero(~on_dev)
        if off.size:
            on_host[off] = np.asarray(host_table.get_many(list(map(part.__getitem__, off.tolist())))) >= 0
        held = on_dev | on_host
        if in_remote is not None:
            remote = np.asarray(in_remote[pos - start : pos - start + n], dtype=bool) & ~held
            held |= remote
        missed = np.flatnonzero(~held)
        end = int(missed[0]) if missed.size else n
        d += int(on_dev[:end].sum())
        h += int(on_host[:end].sum())
        if in_remote is not None:
            r += int(remote[:end].sum())
        if end < n:
            return d, h, r, pos + end
        pos += n
    return d, h, r, pos


def leading_slots(table, ids: list[bytes]) -> list[int]:
    """The slots of the leading ids `table` holds."""
    out = table.leading(ids[:MANY])
    if len(out) < MANY:
        return out
    pos, chunk = MANY, MANY
    while pos < len(ids):
        slots = table.get_many(ids[pos : pos + chunk])
        chunk *= CHUNK_GROWTH
        if -1 in slots:
            return out + slots[: slots.index(-1)]
        out += slots
        pos += len(slots)
    return out
