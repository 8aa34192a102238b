"""Check a remote store, and rebuild its index from the segment files: ``kvtier store``.

Owns ``check_store`` (is the index readable and consistent, does every published page's record
header say what the index says, do segment files the index does not name hold records) and
``rebuild_index`` (build a new index from the records themselves beside the old one, then swap
it in), and their command line. It reads segment files with ``pread``: it is an offline tool,
the store's data path is NIXL only. It must never change a record (a rebuild writes only a
damaged superblock back, with the shape its records verified under), never delete an index (the
old one is kept beside the new one), never leave the store without a complete index (a rebuild
that fails or is killed leaves the old one in place), and never rebuild while any process has
the store open (the store directory's ``flock``: every open store holds it shared, a rebuild
takes it exclusively).

What a rebuild brings back: every record whose header CRC, payload CRC32C (and MAC, given the
key) verify; per (namespace, key) the record the old index published if it still verifies
(publication order, which writers' clocks cannot skew), else the newest write token. That includes records the index had
already let go of, as long as their slot was not reused: pages deleted, evicted or superseded
by a write that was never published (a writer killed after its record was durable). Each is a
complete, verified record of its key, never wrong bytes. Torn or corrupt records are skipped and
counted. A segment whose superblock is damaged is read with the shape the old index gives it, or
one of the other segments' shapes, whichever verifies the most records. Records carrying a MAC hold the MAC where the namespace fingerprint would be, so their
namespace is found by trying the namespaces given (``namespaces=``, the hex strings the stores
were opened with); without the key the rebuild fails and names the key option (or, with
``leave_out_unverified``, leaves them out).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sqlite3
import stat
import sys
import time
import urllib.request
from typing import Callable, Optional, Sequence

from kvtier.tiers.remote import labels, records
from kvtier.tiers.remote.errors import StoreBusy, StoreCorrupt, StoreUnsafe, StoreVersionMismatch
from kvtier.tiers.remote.index import RemoteIndex
from kvtier.tiers.remote.index_schema import SCHEMA_VERSION, stored_labels
from kvtier.tiers.remote.owners import make_owner
from kvtier.tiers.remote.paths import (
    INDEX_FILENAME,
    INDEX_SIDE_FILES,
    SEGMENTS_DIRNAME,
    Modes,
    create_file,
    lock_exclusive,
    lock_shared,
    open_no_follow,
    refuse_symlink,
)
from kvtier.tiers.remote.records import FLAG_MAC, FORMAT_VERSION, HEADER_BYTES, parse_header
from kvtier.tiers.remote.segments import (
    SUPERBLOCK_BYTES,
    header_table_bytes,
    holds_no_record,
    pack_superblock,
    parse_superblock,
    payload_offset,
    segment_file_bytes,
)

_SEGMENT_FILE = re.compile(r"(\d{8})\.seg")
_EMPTY_HEADER = bytes(HEADER_BYTES)

Progress = Callable[[str], None]


def _no_progress(message: str) -> None:
    pass


class _Store:
    """An existing store directory opened for the tool: descriptors of it and ``segments/``."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{path} is not a directory (no store there)")
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.segments_path = os.path.join(path, SEGMENTS_DIRNAME)
        self.index_path = os.path.join(path, INDEX_FILENAME)
        refuse_symlink(self.segments_path)
        for suffix in ("", *INDEX_SIDE_FILES):
            refuse_symlink(self.index_path + suffix)
        try:
            self.segments_fd = os.open(
                SEGMENTS_DIRNAME, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                dir_fd=self.fd,
            )
        except FileNotFoundError:
            self.segments_fd = None

    def segment_files(self) -> dict[int, str]:
        """Segment id -> file name, for every ``NNNNNNNN.seg`` in ``segments/``."""
        if self.segments_fd is None:
            return {}
        found = {}
        for name in os.listdir(self.segments_fd):
            match = _SEGMENT_FILE.fullmatch(name)
            if match:
                found[int(match.group(1))] = name
        return dict(sorted(found.items()))

    def open_segment(self, name: str) -> int:
        return open_no_follow(
            self.segments_fd, name, os.O_RDONLY, os.path.join(self.segments_path, name)
        )

    def close(self) -> None:
        if self.segments_fd is not None:
            os.close(self.segments_fd)
        os.close(self.fd)


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = os.pread(fd, min(size, 64 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


class _Mac:
    """Finds the namespace of a MAC-carrying record among the candidates (see the module
    docstring)."""

    def __init__(self, mac_key: Optional[bytes], namespaces: Sequence[str]):
        self.codecs = [
            records.RecordCodec(records.namespace_fingerprint(ns), mac_key) for ns in namespaces
        ] if mac_key is not None else []

    def namespace_of(self, header: records.Header, payload: bytes) -> Optional[bytes]:
        for codec in self.codecs:
            if codec.mac(header.key_id, header.length, header.token, [payload]) == header.namespace_or_mac:
                return codec.namespace_fp
        return None


def check_store(
    path: str,
    *,
    payloads: bool = False,
    mac_key: Optional[bytes] = None,
    namespaces: Sequence[str] = (),
    progress: Progress = _no_progress,
) -> dict:
    """Check a store directory without changing it; ``report["ok"]`` says whether it is sound.

    Checks: the index opens, passes SQLite's ``integrity_check`` and has this kvtier's schema;
    its kept counters equal a recount and every slot is in exactly one state; every segment the
    index names exists as a regular file with a matching superblock and full size; every
    published page's record header carries the index's key id, length, token and CRC32C (with
    ``payloads``, its payload's CRC32C and, given ``mac_key`` and ``namespaces``, its MAC too).
    Also reported, not failures: segment files the index does not name, and verified records in
    free slots (pages the index let go of, which a rebuild would bring back)."""
    report: dict = {"path": path, "ok": False, "problems": []}
    problems = report["problems"]
    store = _Store(path)
    try:
        lock_shared(store.fd, path)
        db = _open_index_readonly(store.index_path, problems)
        if db is None:
            return report
        try:
            db.execute("BEGIN")  # one snapshot: a live store's writes do not skew the counts
            try:
                _check_index(db, report)
            finally:
                db.execute("COMMIT")
            _check_segments(store, db, report, payloads, _Mac(mac_key, namespaces), progress)
        except sqlite3.DatabaseError as exc:
            problems.append(f"store index {store.index_path} could not be read: {exc}")
        finally:
            db.close()
    finally:
        store.close()
    report["ok"] = not problems
    return report


def _open_index_readonly(index_path: str, problems: list[str]) -> Optional[sqlite3.Connection]:
    if not os.path.exists(index_path):
        problems.append(f"store index {index_path} does not exist")
        return None
    try:
        db = sqlite3.connect(
            f"file:{urllib.request.pathname2url(index_path)}?mode=ro", uri=True, isolation_level=None
        )
        result = db.execute("PRAGMA integrity_check").fetchall()
    except sqlite3.DatabaseError as exc:
        problems.append(f"store index {index_path} is damaged or not a kvtier index: {exc}")
        return None
    if result != [("ok",)]:
        problems.append(f"store index {index_path} fails integrity_check: {result[:5]}")
        db.close()
        return None
    try:
        version = db.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
    except sqlite3.DatabaseError as exc:
        problems.append(f"store index {index_path} is not a kvtier index: {exc}")
        db.close()
        return None
    if version is None or version[0] != SCHEMA_VERSION:
        problems.append(
            f"store index {index_path} has schema {version[0] if version else None}, expected "
            f"{SCHEMA_VERSION}"
        )
        db.close()
        return None
    return db


def _check_index(db: sqlite3.Connection, report: dict) -> None:
    problems = report["problems"]
    meta = dict(db.execute("SELECT name, value FROM meta"))
    pages, used = db.execute("SELECT COUNT(*), COALESCE(SUM(length), 0) FROM pages").fetchone()
    reserved = db.execute("SELECT COUNT(*) FROM reservations").fetchone()[0]
    free = db.execute("SELECT COUNT(*) FROM free_slots").fetchone()[0]
    allocated = db.execute("SELECT COALESCE(SUM(next_unused), 0) FROM segments").fetchone()[0]
    report["index"] = {
        "pages": pages, "used_bytes": used, "reserved_slots": reserved, "free_slots": free,
        "allocated_slots": allocated,
    }
    if (meta.get("pages"), meta.get("used_bytes")) != (pages, used):
        problems.append(
            f"kept counters say {meta.get('pages')} pages / {meta.get('used_bytes')} bytes; "
            f"the pages table holds {pages} / {used}"
        )
    kept = {ns: (n, b) for ns, n, b in db.execute("SELECT ns, pages, used_bytes FROM namespaces")}
    counted = {
        ns: (n, b)
        for ns, n, b in db.execute("SELECT ns, COUNT(*), SUM(length) FROM pages GROUP BY ns")
    }
    for ns in set(kept) | set(counted):
        if kept.get(ns, (0, 0)) != counted.get(ns, (0, 0)):
            problems.append(
                f"namespace {ns.hex()}: kept counters {kept.get(ns, (0, 0))}, pages table "
                f"{counted.get(ns, (0, 0))}"
            )
    stored = stored_labels(db)
    report["namespaces"] = {
        ns.hex(): {"pages": n, "used_bytes": b, "describe": labels.describe(labels.decode(stored.get(ns)), ns),
                   "label": labels.decode(stored.get(ns))}
        for ns, (n, b) in sorted(counted.items(), key=lambda item: -item[1][0])
    }
    if allocated != pages + reserved + free:
        problems.append(
            f"slot states do not add up: {allocated} slots handed out, {pages} published + "
            f"{reserved} reserved + {free} free"
        )
    twice = db.execute(
        "SELECT COUNT(*) FROM free_slots f JOIN pages p ON p.seg = f.seg AND p.slot = f.slot"
    ).fetchone()[0] + db.execute(
        "SELECT COUNT(*) FROM reservations r JOIN pages p ON p.seg = r.seg AND p.slot = r.slot"
    ).fetchone()[0]
    if twice:
        problems.append(f"{twice} slots are both published and free or reserved")


def _check_segments(
    store: _Store, db: sqlite3.Connection, report: dict, payloads: bool, mac: _Mac,
    progress: Progress,
) -> None:
    problems = report["problems"]
    segments = db.execute("SELECT id, slot_stride, nslots, next_unused FROM segments ORDER BY id").fetchall()
    # The files after the rows: a live store creates a segment's file inside the transaction that
    # adds its row, so a row read first has its file listed after (listed first, a segment created
    # in between was reported missing).
    files = store.segment_files()
    report["segments"] = len(segments)
    checked = bad = in_free = 0
    for n, (seg, stride, nslots, next_unused) in enumerate(segments):
        progress(f"checking segment {n + 1}/{len(segments)} ({checked} pages checked)")
        name = files.get(seg)
        if name is None:
            problems.append(f"segment {seg} is in the index but {store.segments_path}/{seg:08d}.seg is missing")
            continue
        fd = store.open_segment(name)
        try:
            info = os.fstat(fd)
            where = os.path.join(store.segments_path, name)
            if not stat.S_ISREG(info.st_mode):
                problems.append(f"{where} is not a regular file")
                continue
            if info.st_size < segment_file_bytes(stride, nslots):
                problems.append(f"{where} is {info.st_size} bytes; expected {segment_file_bytes(stride, nslots)}")
            head = _pread_all(fd, SUPERBLOCK_BYTES + header_table_bytes(nslots), 0)
            superblock = parse_superblock(head)
            if superblock is None or (superblock.seg, superblock.slot_stride, superblock.nslots) != (seg, stride, nslots):
                problems.append(f"{where}: superblock {superblock} does not match the index ({seg}, {stride}, {nslots})")
                continue
            published = {
                slot: (ns, key, length, crc, token)
                for ns, key, slot, length, crc, token in db.execute(
                    "SELECT ns, key, slot, length, crc, token FROM pages WHERE seg = ?", (seg,)
                )
            }
            free = {row[0] for row in db.execute("SELECT slot FROM free_slots WHERE seg = ?", (seg,))}
            suspects = {}
            for slot in range(nslots):
                raw = head[SUPERBLOCK_BYTES + slot * HEADER_BYTES : SUPERBLOCK_BYTES + (slot + 1) * HEADER_BYTES]
                header = parse_header(raw) if len(raw) == HEADER_BYTES else None
                if slot in published:
                    checked += 1
                    if _published_mismatch(fd, stride, nslots, slot, header, published[slot], payloads, mac):
                        suspects[slot] = published[slot]
                elif slot in free and header is not None and header.version == FORMAT_VERSION:
                    in_free += 1
            for slot, reason in _confirm(db, fd, seg, stride, nslots, suspects, payloads, mac):
                bad += 1
                if bad <= 20:
                    problems.append(f"{where} slot {slot}: {reason}")
        finally:
            os.close(fd)
    if bad > 20:
        problems.append(f"... {bad - 20} more published pages do not match their records")
    report.update(pages_checked=checked, pages_bad=bad, records_in_free_slots=in_free)
    _check_stray_files(store, db, files, report)


def _confirm(
    db: sqlite3.Connection, fd: int, seg: int, stride: int, nslots: int, suspects: dict,
    payloads: bool, mac: _Mac,
) -> list[tuple[int, str]]:
    """The suspects (slot -> what the index published there) that still do not match once the
    index and the header are read again: on a live store, a page published or a slot reused
    between the two reads of the first pass is not damage."""
    confirmed = []
    for slot, expected in suspects.items():
        row = db.execute(
            "SELECT ns, key, length, crc, token FROM pages WHERE seg = ? AND slot = ?", (seg, slot)
        ).fetchone()
        if row is None or tuple(row) != expected:
            continue  # the index moved on: no longer this page
        raw = _pread_all(fd, HEADER_BYTES, SUPERBLOCK_BYTES + slot * HEADER_BYTES)
        header = parse_header(raw) if len(raw) == HEADER_BYTES else None
        reason = _published_mismatch(fd, stride, nslots, slot, header, expected, payloads, mac)
        if reason:
            confirmed.append((slot, reason))
    return confirmed


def _check_stray_files(store: _Store, db: sqlite3.Connection, files: dict[int, str], report: dict) -> None:
    """Segment files the index does not name: a failure when one holds records (the only copy
    of pages the index lost: an index deleted, cut back by a power loss, or a rebuild killed);
    an empty one (left by a creation that rolled back) is only listed."""
    known = {row[0] for row in db.execute("SELECT id FROM segments")}
    stray = sorted(name for seg, name in files.items() if seg not in known)
    holding = []
    for name in stray:
        try:
            fd = store.open_segment(name)
        except OSError as exc:
            report["problems"].append(f"{os.path.join(store.segments_path, name)}: {exc}")
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode) and not holds_no_record(fd, 0):
                holding.append(name)
        finally:
            os.close(fd)
    # Read again after the files: a live store writes records only into a segment whose creation
    # has committed, so a file that held records when read and is still unknown now is stray.
    known = {row[0] for row in db.execute("SELECT id FROM segments")}
    report["stray_segment_files"] = [name for name in stray if int(name[:8]) not in known]
    holding = [name for name in holding if int(name[:8]) not in known]
    if holding:
        report["problems"].append(
            f"{len(holding)} segment files the index does not name hold records ({', '.join(holding[:10])}"
            f"{', ...' if len(holding) > 10 else ''} in {store.segments_path}): the index lost them; "
            f"recover them with `kvtier store rebuild {store.path}` once no process has the store "
            "open (running stores never write into these files)"
        )


def _published_mismatch(
    fd: int, stride: int, nslots: int, slot: int, header: Optional[records.Header],
    expected: tuple, payloads: bool, mac: _Mac,
) -> Optional[str]:
    ns, key, length, crc, token = expected
    if header is None:
        return "no valid record header (empty, torn or overwritten)"
    got = (header.version, header.key_id, header.length, header.token, header.crc)
    if got != (FORMAT_VERSION, key, length, token, crc):
        return f"record header says version/key/length/token/crc {got}, the index {(FORMAT_VERSION, key, length, token, crc)}"
    if not header.flags & FLAG_MAC and header.namespace_or_mac != ns:
        return "record header names another namespace"
    if not payloads:
        return None
    payload = _pread_all(fd, length, payload_offset(stride, nslots, slot))
    if len(payload) != length or records.payload_crc([payload]) != crc:
        return "payload CRC32C does not match"
    if header.flags & FLAG_MAC and mac.codecs and mac.namespace_of(header, payload) != ns:
        return "MAC does not verify under the given key and namespaces"
    return None


def rebuild_index(
    path: str,
    *,
    mac_key: Optional[bytes] = None,
    namespaces: Sequence[str] = (),
    leave_out_unverified: bool = False,
    progress: Progress = _no_progress,
) -> dict:
    """Build a new index from the verified records of every segment file, then swap it in
    (the old one is kept as ``index.sqlite3.damaged-<time>``); see the module docstring for what
    comes back. ``report["ok"]`` is False, and the old index is left in place untouched, when
    records carry a MAC that no given key and namespace verifies (unless
    ``leave_out_unverified``). Raises StoreBusy if any process has the store open; any other
    failure also leaves the old index in place."""
    store = _Store(path)
    try:
        lock_exclusive(store.fd, path)
        old = _OldIndex.read(store.index_path)
        building = _start_building(store)
        report: dict = {"path": path, "ok": False, "problems": [], "moved_aside": []}
        try:
            index = RemoteIndex(
                building, owner=make_owner("rebuild"), reuse_delay_s=0.0,
                reservation_lease_s=0.0, busy_timeout_s=60.0,
            )
            try:
                _rebuild(store, index, report, _Mac(mac_key, namespaces), old, progress)
            finally:
                index.close()
            if report["mac_unverified"] and not leave_out_unverified:
                report["problems"].append(
                    f"{report['mac_unverified']} records carry a MAC that no given key and "
                    "namespace verifies: give the store's key with --mac-key-file and every "
                    "namespace written with --namespace (or --leave-out-unverified to rebuild "
                    "without them); the index was left as it was"
                )
            else:
                report["moved_aside"] = _swap_in(store, os.path.basename(building))
                report["ok"] = True
        finally:
            if not report["ok"]:
                _remove_building(store)
    finally:
        store.close()
    return report


_BUILDING = INDEX_FILENAME + ".rebuilding"


def _remove_building(store: _Store) -> None:
    for suffix in ("", *INDEX_SIDE_FILES):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_BUILDING + suffix, dir_fd=store.fd)


def _start_building(store: _Store) -> str:
    """A fresh, empty file for the new index beside the old one (what a rebuild killed earlier
    left there is removed first)."""
    _remove_building(store)
    mode = stat.S_IMODE(os.fstat(store.fd).st_mode)
    modes = Modes.for_store(shared_group=bool(mode & 0o070))
    building = os.path.join(store.path, _BUILDING)
    os.close(create_file(store.fd, _BUILDING, building, modes))
    return building


def _swap_in(store: _Store, building: str) -> list[str]:
    """Keep the old index under ``index.sqlite3.damaged-<time>`` and put the complete new one in
    its place. The old index's WAL and shared memory are moved aside first, so they are never
    applied to the new file; the new file then replaces the old name in one rename, so the
    index is at every moment the old one (perhaps without its last commits) or the new one."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    taken = set(os.listdir(store.fd))
    base, n = stamp, 1
    while any(f"{INDEX_FILENAME}.damaged-{stamp}{s}" in taken for s in ("", *INDEX_SIDE_FILES)):
        n += 1
        stamp = f"{base}-{n}"
    aside = f"{INDEX_FILENAME}.damaged-{stamp}"
    moved = []
    if os.path.lexists(store.index_path):
        os.link(INDEX_FILENAME, aside, src_dir_fd=store.fd, dst_dir_fd=store.fd, follow_symlinks=False)
        moved.append(os.path.join(store.path, aside))
    for suffix in INDEX_SIDE_FILES:
        if os.path.lexists(store.index_path + suffix):
            os.rename(INDEX_FILENAME + suffix, aside + suffix, src_dir_fd=store.fd, dst_dir_fd=store.fd)
            moved.append(os.path.join(store.path, aside + suffix))
    os.fsync(store.fd)
    os.rename(building, INDEX_FILENAME, src_dir_fd=store.fd, dst_dir_fd=store.fd)
    os.fsync(store.fd)
    return moved


class _OldIndex:
    """What the index being replaced still tells, read best-effort (it may be damaged or
    absent): each segment's shape (for a segment whose superblock is damaged) and each page's
    published record (the index orders writes by publication, which a writer's clock cannot
    skew; tokens order them only by the writers' clocks)."""

    def __init__(self, shapes: dict[int, tuple[int, int]], published: dict[tuple[bytes, bytes], tuple]):
        self.shapes = shapes
        self.published = published

    @classmethod
    def read(cls, index_path: str) -> "_OldIndex":
        shapes: dict[int, tuple[int, int]] = {}
        published: dict[tuple[bytes, bytes], tuple] = {}
        if not os.path.exists(index_path):
            return cls(shapes, published)
        try:
            db = sqlite3.connect(
                f"file:{urllib.request.pathname2url(index_path)}?mode=ro", uri=True,
                isolation_level=None,
            )
        except sqlite3.Error:
            return cls(shapes, published)
        try:
            with contextlib.suppress(sqlite3.Error):
                shapes.update((seg, (stride, nslots)) for seg, stride, nslots in db.execute(
                    "SELECT id, slot_stride, nslots FROM segments"
                ))
            with contextlib.suppress(sqlite3.Error):
                published.update(((ns, key), (seg, slot, token)) for ns, key, seg, slot, token in db.execute(
                    "SELECT ns, key, seg, slot, token FROM pages"
                ))
        finally:
            db.close()
        return cls(shapes, published)


def _scan_segment(
    fd: int, seg: int, stride: int, nslots: int, mac: _Mac, counts: dict
) -> list[tuple]:
    """Every verified record of a segment of this shape, as (ns, key, token, slot, length,
    crc); ``counts`` gets the slots that hold none."""
    found = []
    table = _pread_all(fd, header_table_bytes(nslots), SUPERBLOCK_BYTES)
    for slot in range(nslots):
        raw = table[slot * HEADER_BYTES : (slot + 1) * HEADER_BYTES]
        if raw == _EMPTY_HEADER or len(raw) < HEADER_BYTES:
            counts["empty_slots"] += 1
            continue
        header = parse_header(raw)
        if header is None:
            counts["torn_headers"] += 1
            continue
        if header.version != FORMAT_VERSION:
            counts["old_format"] += 1
            continue
        payload = _pread_all(fd, header.length, payload_offset(stride, nslots, slot)) if header.length <= stride else b""
        if header.length > stride or len(payload) != header.length or records.payload_crc([payload]) != header.crc:
            counts["bad_payloads"] += 1
            continue
        if header.flags & FLAG_MAC:
            ns = mac.namespace_of(header, payload)
            if ns is None:
                counts["mac_unverified"] += 1
                continue
        else:
            ns = header.namespace_or_mac
        found.append((ns, header.key_id, header.token, slot, header.length, header.crc))
    return found


def _shape_candidates(seg: int, size: int, old: _OldIndex, known: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
    """Shapes a segment whose superblock is damaged may have: the old index's, then those of
    the other segments, each only if the file is large enough for its header table."""
    candidates = [old.shapes[seg]] if seg in old.shapes else []
    candidates += [shape for shape in (*old.shapes.values(), *known.values()) if shape not in candidates]
    return [
        (stride, nslots) for stride, nslots in dict.fromkeys(candidates)
        if stride > 0 and nslots > 0 and size >= SUPERBLOCK_BYTES + header_table_bytes(nslots)
    ]


def _rebuild(
    store: _Store, index: RemoteIndex, report: dict, mac: _Mac, old: _OldIndex, progress: Progress
) -> None:
    counts = dict.fromkeys(
        ("records", "empty_slots", "torn_headers", "bad_payloads", "old_format",
         "mac_unverified", "superseded", "superblocks_repaired"), 0,
    )
    unreadable: list[str] = []
    shapes: dict[int, tuple[int, int]] = {}
    scanned: dict[int, list[tuple]] = {}
    damaged: list[tuple[int, str]] = []
    files = store.segment_files()
    started = time.monotonic()
    for n, (seg, name) in enumerate(files.items()):
        progress(f"scanning segment {n + 1}/{len(files)} ({counts['records']} records, "
                 f"{time.monotonic() - started:.0f} s)")
        fd = store.open_segment(name)
        try:
            superblock = parse_superblock(_pread_all(fd, SUPERBLOCK_BYTES, 0))
            if superblock is None or superblock.seg != seg or superblock.version != FORMAT_VERSION:
                damaged.append((seg, name))
                continue
            shapes[seg] = (superblock.slot_stride, superblock.nslots)
            scanned[seg] = _scan_segment(fd, seg, *shapes[seg], mac, counts)
        finally:
            os.close(fd)
    for seg, name in damaged:  # after the others: their shapes are candidates
        where = os.path.join(store.segments_path, name)
        fd = store.open_segment(name)
        try:
            best: Optional[tuple] = None
            for shape in _shape_candidates(seg, os.fstat(fd).st_size, old, shapes):
                trial = dict.fromkeys(counts, 0)
                found = _scan_segment(fd, seg, *shape, mac, trial)
                if found and (best is None or len(found) > len(best[1])):
                    best = (shape, found, trial)
            if best is None:
                unreadable.append(f"{where}: no valid format-{FORMAT_VERSION} superblock for segment "
                                  f"{seg}, and no known shape finds a verified record in it")
                continue
            shapes[seg], scanned[seg], trial = best
            for name_ in trial:
                counts[name_] += trial[name_]
        finally:
            os.close(fd)
        _write_superblock(store, name, seg, *shapes[seg])
        counts["superblocks_repaired"] += 1
    newest: dict[tuple[bytes, bytes], tuple] = {}
    for seg, found in scanned.items():
        for ns, key, token, slot, length, crc in found:
            counts["records"] += 1
            entry = (token, seg, slot, length, crc)
            previous = newest.get((ns, key))
            counts["superseded"] += previous is not None
            if previous is None or _newer(entry, previous, old.published.get((ns, key))):
                newest[(ns, key)] = entry
    by_segment: dict[int, list[tuple]] = {seg: [] for seg in shapes}
    for rank, ((ns, key), (token, seg, slot, length, crc)) in enumerate(
        sorted(newest.items(), key=lambda item: item[1][0]), start=1
    ):
        by_segment[seg].append((ns, key, slot, length, crc, token, rank))
    for seg, (stride, nslots) in sorted(shapes.items()):
        index.restore_segment(seg, stride, nslots, by_segment[seg])
    report.update(counts, segments=len(shapes), pages_published=len(newest),
                  unreadable_segments=unreadable,
                  namespaces={ns.hex(): sum(1 for n, _ in newest if n == ns) for ns in {n for n, _ in newest}})


def _newer(entry: tuple, previous: tuple, published: Optional[tuple]) -> bool:
    """Whether record ``entry`` (token, seg, slot, ...) of a key beats ``previous``: the one the
    old index published wins; between others, the larger token."""
    if published is not None:
        if (entry[1], entry[2], entry[0]) == published:
            return True
        if (previous[1], previous[2], previous[0]) == published:
            return False
    return previous[0] < entry[0]


def _write_superblock(store: _Store, name: str, seg: int, stride: int, nslots: int) -> None:
    """Give a segment whose superblock was damaged its superblock again, so the store and
    ``check`` read it (its records were verified under this shape)."""
    fd = open_no_follow(store.segments_fd, name, os.O_WRONLY, os.path.join(store.segments_path, name))
    try:
        os.pwrite(fd, pack_superblock(seg, stride, nslots), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_key(path: Optional[str]) -> Optional[bytes]:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def _stderr_progress(every_s: float = 1.0) -> Progress:
    last = [0.0]

    def show(message: str) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            print(message, file=sys.stderr, flush=True)

    return show


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kvtier store check|rebuild PATH``: 0 when the store is sound (check) or rebuilt
    (rebuild), 1 when it is not, 2 for an error before any result (bad arguments, no store, a
    link in the store, the store in use)."""
    parser = argparse.ArgumentParser(prog="kvtier store", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="check the index and the records it names; changes nothing")
    check.add_argument("path", help="the store's directory or file:// URL")
    check.add_argument("--payloads", action="store_true",
                       help="also read every published payload and verify its CRC32C (and MAC)")
    rebuild = commands.add_parser(
        "rebuild", help="move the index aside and rebuild it from the segment files (store closed)"
    )
    rebuild.add_argument("path", help="the store's directory or file:// URL")
    rebuild.add_argument("--leave-out-unverified", action="store_true",
                         help="rebuild even when records carry a MAC that no given key verifies "
                              "(they are left out)")
    for sub in (check, rebuild):
        sub.add_argument("--json", action="store_true", help="print the report as JSON")
        sub.add_argument("--mac-key-file", help="file holding the store's mac_key (raw bytes)")
        sub.add_argument("--namespace", action="append", default=[],
                         help="namespace hex of records carrying a MAC (repeat for each)")
        sub.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    progress = _no_progress if args.no_progress else _stderr_progress()
    try:
        key = _read_key(args.mac_key_file)
        if args.command == "check":
            report = check_store(args.path, payloads=args.payloads, mac_key=key,
                                 namespaces=args.namespace, progress=progress)
            ok = report["ok"]
        else:
            report = rebuild_index(args.path, mac_key=key, namespaces=args.namespace,
                                   leave_out_unverified=args.leave_out_unverified, progress=progress)
            ok = report["ok"]
    except (OSError, StoreBusy, StoreUnsafe, StoreCorrupt, StoreVersionMismatch) as exc:
        print(f"kvtier store {args.command}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2, default=lambda v: v.hex() if isinstance(v, bytes) else str(v)))
    else:
        _print_report(args.command, report)
    return 0 if ok else 1


def _print_report(command: str, report: dict) -> None:
    if command == "check":
        print(f"{report['path']}: {'ok' if report['ok'] else 'PROBLEMS'}")
        for problem in report["problems"]:
            print(f"  problem: {problem}")
        for name in ("segments", "pages_checked", "pages_bad", "records_in_free_slots", "stray_segment_files"):
            if name in report:
                print(f"  {name}: {report[name]}")
        if "index" in report:
            print(f"  index: {report['index']}")
        for ns, entry in report.get("namespaces", {}).items():
            print(f"  namespace {ns}: {entry['describe']}: {entry['pages']} pages, {labels.size(entry['used_bytes'])}")
        return
    if report["ok"]:
        print(f"{report['path']}: index rebuilt; old index kept as {report['moved_aside'] or 'nothing (there was none)'}")
    else:
        print(f"{report['path']}: NOT rebuilt; the index was left as it was")
    for problem in report["problems"]:
        print(f"  problem: {problem}")
    for name in ("segments", "pages_published", "records", "superseded", "empty_slots", "torn_headers",
                 "bad_payloads", "old_format", "mac_unverified", "superblocks_repaired",
                 "unreadable_segments"):
        print(f"  {name}: {report[name]}")
