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


def walk_slots(dev_table, host_table, ids: list[bytes]) -> tuple[int, int, list[int], list[int]]:
    """A walk without a remote tier that keeps what it found: (device, host, the leading device
    slots, the leading host slots), the last two what `leading_slots` of each table gives. Each
    tier is looked up once per id of the prefix (`walk` then `leading_slots` look the host tier
    up twice for pages only it holds), in chunks of PIECE ids, then MANY, then CHUNK_GROWTH times
    more each time; a chunk's tally in numpy from MANY ids."""
    dev_slots: list[int] = []
    host_slots: list[int] = []
    pos, chunk, d = 0, PIECE, 0
    while pos < len(ids):
        end = pos + chunk if len(ids) - pos - chunk >= chunk else len(ids)  # a short tail joins the chunk
        part = ids[pos:end]
        chunk = MANY if chunk < MANY else chunk * CHUNK_GROWTH
        found_dev = dev_table.get_many(part)
        found_host = host_table.get_many(part)
        if len(part) >= MANY:
            on_dev = np.asarray(found_dev, dtype=np.int64)
            held = np.maximum(on_dev, np.asarray(found_host, dtype=np.int64))
            missed = np.flatnonzero(held < 0)
            end = int(missed[0]) if missed.size else len(part)
            d += int((on_dev[:end] >= 0).sum())
        else:
            held = list(map(max, found_dev, found_host))
            end = held.index(-1) if -1 in held else len(part)
            d += end - found_dev[:end].count(-1)
        dev_slots += found_dev[:end]
        host_slots += found_host[:end]
        pos += end
        if end < len(part):
            break
    if -1 in dev_slots:
        del dev_slots[dev_slots.index(-1) :]
    if -1 in host_slots:
        del host_slots[host_slots.index(-1) :]
    return d, pos - d, dev_slots, host_slots
