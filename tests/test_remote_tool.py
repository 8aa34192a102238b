"""kvtier store check / rebuild on real stores: a damaged index is named with its path and
rebuilt from the segment files, bit-exact; torn records are skipped; a store in use is not
rebuilt."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13")

from kvtier.index.keys import key_id  # noqa: E402
from kvtier.tiers.remote import RemoteStore, StoreBusy, StoreCorrupt, namespace_fingerprint  # noqa: E402
from kvtier.tiers.remote.tool import check_store, main, rebuild_index  # noqa: E402
from tests.test_remote_store import PAGE, flip_byte, poisoned, random_pages, record_offsets, same  # noqa: E402

MAC_KEY = bytes(range(100, 132))


def open_at(directory: Path, namespace: str, **kw) -> RemoteStore:
    return RemoteStore(directory, namespace=namespace, page_bytes=PAGE, segment_bytes=1 << 20,
                       reuse_delay_s=0.0, **kw)


def write_store(directory: Path, **kw) -> dict:
    """Two namespaces over three segments, a key rewritten, one torn record; returns what each
    (namespace, key) must read back as, None for the torn one."""
    truth = {}
    a = open_at(directory, "aa", **kw)
    b = open_at(directory, "bb", **kw)
    for store, ns, seed in ((a, "aa", 1), (b, "bb", 2)):
        keys = [f"{ns}-{i}" for i in range(70)] + [b"raw-bytes-key"]
        data = random_pages(len(keys), seed=seed)
        assert all(store.put(keys, data))
        truth.update({(ns, k): d for k, d in zip(keys, data)})
    newer = random_pages(1, seed=3)[0]
    assert a.put(["aa-5"], [newer]) == [True]  # two records of aa-5: the newer wins
    truth[("aa", "aa-5")] = newer
    path, _, payload = record_offsets(a, "aa-9")
    flip_byte(path, payload + 77)  # torn: its CRC32C no longer matches
    truth[("aa", "aa-9")] = None
    a.close()
    b.close()
    return truth


def read_back(directory: Path, truth: dict, **kw) -> None:
    for ns in ("aa", "bb"):
        with open_at(directory, ns, **kw) as store:
            keys = [k for n, k in truth if n == ns]
            out = poisoned(len(keys))
            found = store.get(keys, out)
            for key, ok, page in zip(keys, found, out):
                expected = truth[(ns, key)]
                assert ok == (expected is not None), (ns, key)
                if ok:
                    assert same([page], [expected]), (ns, key)
            assert store.stats()["pages"] == sum(truth[(ns, k)] is not None for k in keys)


def damage_index(directory: Path) -> None:
    index = directory / "index.sqlite3"
    wal = directory / "index.sqlite3-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # closed stores checkpointed
    with open(index, "r+b") as f:
        f.seek(0)
        f.write(os.urandom(100))  # the SQLite header and the start of the first page


def test_a_damaged_index_is_named_checked_and_rebuilt_bit_exact(tmp_path, capsys):
    directory = tmp_path / "store"
    truth = write_store(directory)
    assert check_store(str(directory))["ok"]
    report = check_store(str(directory), payloads=True)
    assert not report["ok"] and len(report["problems"]) == 1  # the torn record is found
    assert "payload CRC32C does not match" in report["problems"][0]
    damage_index(directory)
    index = directory / "index.sqlite3"
    with pytest.raises(StoreCorrupt) as raised:
        open_at(directory, "aa")
    assert str(index) in str(raised.value) and f"kvtier store rebuild {directory}" in str(raised.value)
    report = check_store(str(directory))
    assert not report["ok"] and str(index) in report["problems"][0]
    assert main(["check", str(directory), "--no-progress"]) == 1
    assert str(index) in capsys.readouterr().out
    assert main(["rebuild", str(directory), "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pages_published"] == 71 + 71 - 1 and report["bad_payloads"] == 1
    assert report["superseded"] == 1 and report["segments"] == 3
    assert report["namespaces"] == {namespace_fingerprint("aa").hex(): 70, namespace_fingerprint("bb").hex(): 71}
    moved = [Path(p) for p in report["moved_aside"]]
    assert moved[0].name.startswith("index.sqlite3.damaged-") and not moved[0].name.endswith(("-wal", "-shm"))
    assert all(p.exists() and p.parent == directory for p in moved)  # kept, not deleted
    read_back(directory, truth)
    after = check_store(str(directory), payloads=True)
    assert after["ok"], after["problems"]
    assert after["pages_checked"] == 141


def test_a_rebuild_recovers_mac_records_given_the_key_and_namespaces(tmp_path):
    directory = tmp_path / "store"
    truth = write_store(directory, mac_key=MAC_KEY)
    damage_index(directory)
    blind = rebuild_index(str(directory))
    assert blind["pages_published"] == 0 and blind["mac_unverified"] == 142
    report = rebuild_index(str(directory), mac_key=MAC_KEY, namespaces=["aa", "bb"])
    assert report["pages_published"] == 141 and report["bad_payloads"] == 1
    read_back(directory, truth, mac_key=MAC_KEY)
    assert check_store(str(directory), payloads=True, mac_key=MAC_KEY, namespaces=["aa", "bb"])["ok"]


def test_a_store_in_use_is_not_rebuilt_and_a_rebuild_holds_off_openers(tmp_path, capsys):
    directory = tmp_path / "store"
    with open_at(directory, "aa") as store:
        assert all(store.put(["k"], random_pages(1, seed=4)))
        with pytest.raises(StoreBusy, match="open in another process"):
            rebuild_index(str(directory))
        assert main(["rebuild", str(directory), "--no-progress"]) == 2
        assert "open in another process" in capsys.readouterr().err
        assert store.contains(["k"]) == [True]
    assert sorted(os.listdir(directory)) == ["index.sqlite3", "segments"]  # nothing moved


def test_check_finds_a_header_that_does_not_match_and_stray_files(tmp_path):
    directory = tmp_path / "store"
    with open_at(directory, "aa") as store:
        assert all(store.put(["a", "b"], random_pages(2, seed=5)))
        path, header, _ = record_offsets(store, "b")
    flip_byte(path, header + 30)  # inside the key id: the header CRC fails
    (directory / "segments" / "00000042.seg").write_bytes(b"")
    report = check_store(str(directory))
    assert not report["ok"]
    assert report["problems"] == [f"{path} slot 1: no valid record header (empty, torn or overwritten)"]
    assert report["stray_segment_files"] == ["00000042.seg"] and report["pages_bad"] == 1


def test_counters_that_disagree_with_the_pages_are_reported(tmp_path):
    directory = tmp_path / "store"
    with open_at(directory, "aa") as store:
        assert all(store.put(["a", "b"], random_pages(2, seed=6)))
    db = sqlite3.connect(directory / "index.sqlite3")
    db.execute("DELETE FROM pages WHERE key = ?", (key_id("a"),))  # behind the counters' back
    db.commit()
    db.close()
    problems = check_store(str(directory))["problems"]
    assert any("kept counters say 2 pages" in p for p in problems)
    assert any("slot states do not add up" in p for p in problems)
