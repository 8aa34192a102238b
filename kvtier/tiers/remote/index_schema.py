"""The remote index's tables: their schema and version, how an index is created or checked
at open, the advice given when one is damaged, and the reads of namespace labels that the
index and the store tool share. It must never hold a connection of its own nor decide
anything about slots or pages.
"""

from __future__ import annotations

import sqlite3

from kvtier.tiers.remote.errors import StoreVersionMismatch

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE segments (
    id INTEGER PRIMARY KEY,
    slot_stride INTEGER NOT NULL,
    nslots INTEGER NOT NULL,
    next_unused INTEGER NOT NULL
);
CREATE INDEX segments_open ON segments (slot_stride, id);
CREATE TABLE pages (
    ns BLOB NOT NULL,
    key BLOB NOT NULL,
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    length INTEGER NOT NULL,
    crc INTEGER NOT NULL,
    token INTEGER NOT NULL,
    last_access INTEGER NOT NULL,
    PRIMARY KEY (ns, key)
) WITHOUT ROWID;
CREATE INDEX pages_lru ON pages (last_access);
CREATE UNIQUE INDEX pages_slot ON pages (seg, slot);
CREATE TABLE namespaces (
    ns BLOB PRIMARY KEY,
    pages INTEGER NOT NULL,
    used_bytes INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE reservations (
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    length INTEGER NOT NULL,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (seg, slot)
) WITHOUT ROWID;
CREATE TABLE free_slots (
    seg INTEGER NOT NULL,
    slot INTEGER NOT NULL,
    slot_stride INTEGER NOT NULL,
    free_after REAL NOT NULL,
    PRIMARY KEY (seg, slot)
) WITHOUT ROWID;
CREATE INDEX free_by_stride ON free_slots (slot_stride, free_after);
"""
# Readable labels of namespaces (kvtier.tiers.remote.labels), for people only; added without a
# schema change, so an index written before it gains the table when it is next opened.
_LABELS_TABLE = "CREATE TABLE IF NOT EXISTS namespace_labels (ns BLOB PRIMARY KEY, label TEXT NOT NULL) WITHOUT ROWID"


def create_or_check_schema(db: sqlite3.Connection, path: str, directory: str) -> None:
    """Create the tables in an empty index, or check an existing index's schema version (inside
    the caller's write transaction). Raises StoreVersionMismatch for another schema, and
    sqlite3.DatabaseError for a database that is not a kvtier index."""
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                db.execute(statement)
        db.execute(
            "INSERT INTO meta VALUES ('schema_version', ?), ('clock', 0), "
            "('used_bytes', 0), ('pages', 0), ('removals', 0)",
            (SCHEMA_VERSION,),
        )
        db.execute(_LABELS_TABLE)
        return
    row = None
    if "meta" in tables:
        row = db.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
    if row is None:
        raise sqlite3.DatabaseError(f"tables {sorted(tables)} but no kvtier schema version")
    if row[0] != SCHEMA_VERSION:
        raise StoreVersionMismatch(
            f"store index {path} has schema {row[0]}; this kvtier reads schema "
            f"{SCHEMA_VERSION} (pages keyed by 16-byte key ids, record format 3), so the "
            f"store's pages cannot be served. Move or delete {directory} (or give "
            "the pool another directory) to start an empty store there."
        )
    # An index written before the removal counter or the labels existed (same schema otherwise).
    db.execute("INSERT OR IGNORE INTO meta VALUES ('removals', 0)")
    db.execute(_LABELS_TABLE)


def recovery_hint(directory: str) -> str:
    return (
        f"check it with `kvtier store check {directory}`; rebuild the index from the segment "
        f"files with `kvtier store rebuild {directory}` once no process has the store open "
        "(the damaged index is kept beside the new one)"
    )


def stored_labels(db: sqlite3.Connection) -> dict[bytes, str]:
    """ns -> label JSON of every labelled namespace; {} for an index without the labels table
    (one no kvtier with labels has opened)."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'namespace_labels'").fetchone():
        return {}
    return dict(db.execute("SELECT ns, label FROM namespace_labels"))


def namespace_rows(db: sqlite3.Connection) -> list[tuple[bytes, int, int, str | None]]:
    """(ns, pages, used bytes, label or None) of every namespace with pages, most pages first,
    from the kept counters."""
    labels = stored_labels(db)
    rows = db.execute("SELECT ns, pages, used_bytes FROM namespaces WHERE pages > 0 ORDER BY pages DESC")
    return [(ns, pages, used, labels.get(ns)) for ns, pages, used in rows]
