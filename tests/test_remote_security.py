"""RemoteStore on real files: private modes whatever the umask, refused symbolic links, a
foreign owner refused, and the keyed MAC that names forgery where CRC32C cannot."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import stat
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl_cu13")

from kvtier.index.keys import key_id  # noqa: E402
from kvtier.tiers.remote import RemoteStore, StoreUnsafe, namespace_fingerprint  # noqa: E402
from kvtier.tiers.remote.records import HEADER_BYTES, RecordCodec, crc32c, parse_header, payload_crc  # noqa: E402
from tests.test_remote_store import (  # noqa: E402
    NS,
    PAGE,
    open_store,  # noqa: F401 (fixture)
    poisoned,
    random_pages,
    record_offsets,
    same,
)

KEY = bytes(range(32))


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def modes_of(directory: Path) -> dict[str, int]:
    found = {".": stat.S_IMODE(os.lstat(directory).st_mode)}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root) / name
            found[str(path.relative_to(directory))] = stat.S_IMODE(os.lstat(path).st_mode)
    return found


@pytest.mark.parametrize("mask, shared_group, file_mode, dir_mode", [
    (0o000, False, 0o600, 0o700),  # a permissive umask does not widen the private modes
    (0o022, False, 0o600, 0o700),
    (0o077, True, 0o660, 0o770),   # a strict umask does not narrow the shared ones
    (0o000, True, 0o660, 0o770),
])
def test_files_and_directories_get_exact_modes_whatever_the_umask(open_store, tmp_path, mask, shared_group, file_mode, dir_mode):
    directory = tmp_path / "store"
    with umask(mask):
        store = open_store(location=directory, shared_group=shared_group)
        assert all(store.put(["a", "b"], random_pages(2, seed=41)))
    modes = modes_of(directory)
    assert {"index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm", "segments/00000001.seg"} <= set(modes)
    for name, mode in modes.items():
        expected = dir_mode if name in (".", "segments") else file_mode
        assert mode == expected, f"{name}: {oct(mode)}, expected {oct(expected)}"


def _written_store(tmp_path) -> tuple[Path, list[torch.Tensor]]:
    directory = tmp_path / "store"
    data = random_pages(3, seed=42)
    with RemoteStore(directory, namespace=NS, page_bytes=PAGE, segment_bytes=1 << 20) as store:
        assert all(store.put(["a", "b", "c"], data))
    return directory, data


def test_a_planted_segment_symlink_is_refused_never_followed(tmp_path):
    directory, data = _written_store(tmp_path)
    segment = directory / "segments" / "00000001.seg"
    elsewhere = tmp_path / "elsewhere.seg"
    shutil.copyfile(segment, elsewhere)
    before = elsewhere.read_bytes()
    segment.unlink()
    segment.symlink_to(elsewhere)
    with RemoteStore(directory, namespace=NS, page_bytes=PAGE, segment_bytes=1 << 20) as store:
        with pytest.raises(StoreUnsafe, match=f"{segment} is a symbolic link"):
            store.get(["a"], poisoned(1))
        with pytest.raises(StoreUnsafe, match="symbolic link"):
            store.put(["a"], data[:1])  # a reader's write into the freed slot would follow it
        s = store.stats()
        assert (s["reserved_slots"], s["pages"]) == (0, 3)  # nothing half-done
    assert elsewhere.read_bytes() == before


def test_a_planted_symlink_for_a_new_segment_is_refused(tmp_path):
    directory = tmp_path / "store"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    with RemoteStore(directory, namespace=NS, page_bytes=PAGE, segment_bytes=1 << 20) as store:
        (directory / "segments" / "00000001.seg").symlink_to(victim)
        with pytest.raises(StoreUnsafe, match="00000001.seg is a symbolic link"):
            store.put(["a"], random_pages(1, seed=43))
        s = store.stats()
        assert (s["reserved_slots"], s["segments"], s["pages"]) == (0, 0, 0)
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("name", ["index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm", "segments"])
def test_a_symlink_at_the_index_or_segments_directory_is_refused_at_open(tmp_path, name):
    directory, _ = _written_store(tmp_path)
    path = directory / name
    target = tmp_path / f"target-{name}"
    if path.is_dir():
        shutil.move(path, target)
    elif path.exists():
        shutil.move(path, target)
    else:
        target.write_bytes(b"")
    path.symlink_to(target)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(StoreUnsafe, match=f"{path} is a symbolic link"):
        RemoteStore(directory, namespace=NS, page_bytes=PAGE, segment_bytes=1 << 20)
    assert sorted(os.listdir(tmp_path)) == before


def test_a_store_directory_owned_by_another_user_is_refused_unless_allowed(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root; this test runs as uid %d" % os.geteuid())
    directory, data = _written_store(tmp_path)
    os.chown(directory, 65534, 65534)
    with pytest.raises(StoreUnsafe, match=f"{directory} belongs to uid 65534.*allow_foreign_owner=True"):
        RemoteStore(directory, namespace=NS, page_bytes=PAGE, segment_bytes=1 << 20)
    with RemoteStore(directory, namespace=NS, page_bytes=PAGE, segment_bytes=1 << 20,
                     allow_foreign_owner=True) as store:
        out = poisoned(3)
        assert store.get(["a", "b", "c"], out) == [True] * 3 and same(out, data)


def forge(store: RemoteStore, key: str, payload_offset: int, header_offset: int, path: Path) -> None:
    """What someone who can write the store's files but has no MAC key can do: change a page's
    bytes and make every checksum (record header, header CRC, index) agree with the change."""
    with open(path, "r+b") as f:
        f.seek(payload_offset)
        payload = bytearray(f.read(PAGE))
        payload[100] ^= 0xFF
        f.seek(payload_offset)
        f.write(payload)
        f.seek(header_offset)
        header = parse_header(f.read(HEADER_BYTES))
        crc = payload_crc([bytes(payload)])
        forged = RecordCodec(header.namespace_or_mac, None).header(header.key_id, header.length, header.token, crc, None)
        if header.flags:  # keep the MAC field and flag as they were: the forger cannot compute it
            forged = bytearray(forged)
            forged[6:8] = header.flags.to_bytes(2, "little")
            forged[8:24] = header.namespace_or_mac
            body = bytes(forged[:60])
            forged[60:] = crc32c.crc32c(body).to_bytes(4, "little")
        f.seek(header_offset)
        f.write(bytes(forged))
    db = sqlite3.connect(Path(store.directory) / "index.sqlite3")
    db.execute("UPDATE pages SET crc = ? WHERE ns = ? AND key = ?",
               (crc, namespace_fingerprint(store.namespace), key_id(key)))
    db.commit()
    db.close()


@pytest.mark.parametrize("mac_key", [None, KEY])
def test_crc32c_serves_a_forgery_the_mac_names_it(open_store, mac_key):
    store = open_store(mac_key=mac_key)
    data = random_pages(2, seed=44)
    assert all(store.put(["victim", "bystander"], data))
    path, header, payload = record_offsets(store, "victim")
    forge(store, "victim", payload, header, path)
    out = poisoned(2)
    found = store.get(["victim", "bystander"], out)
    if mac_key is None:  # CRC32C detects corruption, not forgery
        assert found == [True, True] and not torch.equal(out[0], data[0])
        assert store.stats()["corrupt_reads"] == 0
    else:
        assert found == [False, True] and torch.equal(out[1], data[1])
        assert store.stats()["corrupt_reads"] == 1
        assert store.contains(["victim"]) == [False]


def test_records_written_without_the_key_or_with_another_are_misses(open_store, tmp_path):
    data = random_pages(3, seed=45)
    keyed = open_store(mac_key=KEY)
    assert all(keyed.put(["k0"], data[:1]))
    out = poisoned(1)
    assert keyed.get(["k0"], out) == [True] and torch.equal(out[0], data[0])
    plain = open_store(location=tmp_path / "plain")
    assert all(plain.put(["p0"], data[1:2]))
    plain.close()
    assert open_store(location=tmp_path / "plain", mac_key=KEY).get(["p0"], poisoned(1)) == [False]
    other_key = open_store(location=tmp_path / "other", mac_key=KEY)
    assert all(other_key.put(["o0"], data[2:3]))
    other_key.close()
    wrong = open_store(location=tmp_path / "other", mac_key=bytes(reversed(KEY)))
    assert wrong.get(["o0"], poisoned(1)) == [False]
    assert wrong.stats()["corrupt_reads"] == 1


def test_a_mac_covers_the_namespace(open_store):
    a = open_store(namespace="aa", mac_key=KEY)
    b = open_store(namespace="bb", mac_key=KEY)
    assert all(a.put(["k"], random_pages(1, seed=46)))
    # Move a's page into b's namespace in the index, as someone editing the index could.
    db = sqlite3.connect(Path(a.directory) / "index.sqlite3")
    db.execute("UPDATE pages SET ns = ? WHERE ns = ? AND key = ?",
               (namespace_fingerprint("bb"), namespace_fingerprint("aa"), key_id("k")))
    db.commit()
    db.close()
    assert b.contains(["k"]) == [True]
    assert b.get(["k"], poisoned(1)) == [False]
    assert b.stats()["corrupt_reads"] == 1 and b.contains(["k"]) == [False]


def test_a_mac_key_of_the_wrong_size_is_refused(open_store):
    with pytest.raises(ValueError, match="mac_key of 8 bytes; expected bytes of 16 to 64 bytes"):
        open_store(mac_key=b"short!!!")
    with pytest.raises(ValueError, match="mac_key of str"):
        open_store(mac_key="a" * 32)
