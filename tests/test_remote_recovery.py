"""The recovery paths destroy no durable page: an index deleted, an index that lost its last
commits, a damaged superblock, a rebuild that fails or is SIGKILLed at any step with a service
writing before the next rebuild. Real stores (NIXL POSIX), real files, real child processes.

Every page the store said it stored is read back bit-exact after the final rebuild: 0 wrong,
0 lost. ``KVTIER_RECOVERY_LONG=1`` kills the rebuild at every step (CI: 9 of its about 30);
``python tests/test_remote_recovery.py`` runs the file and prints the figures RELIABILITY.md
quotes (kills, corruptions, processes, pages verified, wrong, lost)."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import types
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("nixl_cu13")

from kvtier.tiers.remote import RemoteStore, records  # noqa: E402
from kvtier.tiers.remote.tool import check_store, main, rebuild_index  # noqa: E402
from tests.test_remote_store import PAGE, flip_byte, poisoned, random_pages, record_offsets, same  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SLOTS = 8  # per segment: many segments from few pages
LONG = os.environ.get("KVTIER_RECOVERY_LONG") == "1"
TALLY: Counter = Counter()  # the figures a direct run prints


def open_store(directory: Path, namespace: str = "aa", **kw) -> RemoteStore:
    return RemoteStore(directory, namespace=namespace, page_bytes=PAGE, segment_bytes=SLOTS * PAGE,
                       reuse_delay_s=0.0, **kw)


def write(directory: Path, truth: dict, prefix: str, count: int, seed: int) -> None:
    """Store ``count`` fresh keys; what the store says it stored joins ``truth``."""
    keys = [f"{prefix}-{i}" for i in range(count)]
    data = random_pages(count, seed=seed)
    with open_store(directory) as store:
        for key, page, ok in zip(keys, data, store.put(keys, data)):
            if ok:
                truth[key] = page


def lost_and_wrong(directory: Path, truth: dict) -> tuple[int, int]:
    keys = list(truth)
    out = poisoned(len(keys))
    with open_store(directory) as store:
        found = store.get(keys, out)
    wrong = sum(ok and not same([page], [truth[key]]) for key, ok, page in zip(keys, found, out))
    TALLY.update(pages_verified=len(keys), wrong=wrong, lost=found.count(False))
    return found.count(False), wrong


def segment_names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory / "segments"))


def test_a_deleted_index_destroys_no_page_and_check_says_how_to_recover(tmp_path, capsys):
    directory = tmp_path / "store"
    truth: dict = {}
    write(directory, truth, "old", 40, seed=1)
    assert len(truth) == 40
    before = segment_names(directory)
    TALLY.update(corruptions=1)
    for name in os.listdir(directory):
        if name.startswith("index.sqlite3"):
            os.unlink(directory / name)
    write(directory, truth, "new", 40, seed=2)  # a fresh index: its segments take new ids
    assert set(before) < set(segment_names(directory))
    report = check_store(str(directory))
    assert not report["ok"]
    assert any(f"kvtier store rebuild {directory}" in p and "hold records" in p for p in report["problems"])
    assert main(["check", str(directory), "--no-progress"]) == 1
    assert "hold records" in capsys.readouterr().out
    assert rebuild_index(str(directory))["ok"]
    assert lost_and_wrong(directory, truth) == (0, 0)
    assert check_store(str(directory), payloads=True)["ok"]


def test_an_index_that_lost_its_last_commits_destroys_no_page(tmp_path):
    directory = tmp_path / "store"
    truth: dict = {}
    write(directory, truth, "kept", 20, seed=3)
    shutil.copy(directory / "index.sqlite3", tmp_path / "older")  # closed: no WAL to copy
    write(directory, truth, "lost", 40, seed=4)  # five more segments the older index never saw
    shutil.copy(tmp_path / "older", directory / "index.sqlite3")  # a power loss took those commits
    TALLY.update(corruptions=1)
    write(directory, truth, "after", 40, seed=5)
    assert not check_store(str(directory))["ok"]
    assert rebuild_index(str(directory))["ok"]
    assert lost_and_wrong(directory, truth) == (0, 0)


def test_an_empty_segment_file_left_by_a_rolled_back_creation_is_reused(tmp_path):
    directory = tmp_path / "store"
    truth: dict = {}
    write(directory, truth, "a", SLOTS, seed=6)  # segment 1, full
    (directory / "segments" / "00000002.seg").write_bytes(b"")
    assert check_store(str(directory))["ok"]  # listed, not a failure: it holds no record
    write(directory, truth, "b", SLOTS, seed=7)
    assert segment_names(directory) == ["00000001.seg", "00000002.seg"]
    assert lost_and_wrong(directory, truth) == (0, 0)


def test_a_flipped_superblock_bit_loses_no_record_on_rebuild(tmp_path):
    directory = tmp_path / "store"
    truth: dict = {}
    write(directory, truth, "k", 3 * SLOTS, seed=8)
    torn = sorted(truth)[0]
    with open_store(directory) as store:  # one record header damaged too: that page alone goes
        path, header, _ = record_offsets(store, torn)
    flip_byte(path, header + 20)
    truth[torn] = None
    TALLY.update(corruptions=3)
    for name, offset in (("00000002.seg", 20), ("00000003.seg", 0)):
        with open(directory / "segments" / name, "r+b") as f:
            f.seek(offset)
            value = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([value ^ 0x10]))
    assert not check_store(str(directory))["ok"]
    for name in os.listdir(directory):  # the index is gone too: the shape comes from segment 1
        if name.startswith("index.sqlite3"):
            os.unlink(directory / name)
    report = rebuild_index(str(directory))
    assert report["ok"] and report["pages_published"] == 3 * SLOTS - 1 and report["torn_headers"] == 1
    assert report["superblocks_repaired"] == 2 and report["unreadable_segments"] == []
    del truth[torn]
    assert lost_and_wrong(directory, truth) == (0, 0)
    assert check_store(str(directory), payloads=True)["ok"]


def test_a_failed_rebuild_leaves_the_old_index_in_place(tmp_path):
    directory = tmp_path / "store"
    truth: dict = {}
    write(directory, truth, "k", 3 * SLOTS, seed=9)
    target = directory / "segments" / "00000002.seg"
    os.rename(target, tmp_path / "elsewhere.seg")
    os.symlink(tmp_path / "elsewhere.seg", target)
    assert main(["rebuild", str(directory), "--no-progress"]) == 2
    left = {n for n in os.listdir(directory) if n.startswith("index")}
    assert "index.sqlite3" in left and left <= {"index.sqlite3", "index.sqlite3-wal", "index.sqlite3-shm"}
    os.unlink(target)
    os.rename(tmp_path / "elsewhere.seg", target)
    assert lost_and_wrong(directory, truth) == (0, 0)
    assert check_store(str(directory))["ok"]


def test_a_rebuild_without_the_mac_key_fails_names_the_option_and_changes_nothing(tmp_path, capsys):
    directory = tmp_path / "store"
    key = bytes(range(40, 72))
    with open_store(directory, mac_key=key) as store:
        assert all(store.put(["m1", "m2"], random_pages(2, seed=10)))
    index_before = (directory / "index.sqlite3").read_bytes()
    assert main(["rebuild", str(directory), "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "--mac-key-file" in out and "NOT rebuilt" in out
    assert (directory / "index.sqlite3").read_bytes() == index_before
    with open_store(directory, mac_key=key) as store:
        assert store.contains(["m1", "m2"]) == [True, True]
    key_file = tmp_path / "key"
    key_file.write_bytes(key)
    assert main(["rebuild", str(directory), "--no-progress", "--mac-key-file", str(key_file),
                 "--namespace", "aa"]) == 0


def test_a_rebuild_keeps_the_page_the_old_index_published_whatever_the_clocks(tmp_path, monkeypatch):
    directory = tmp_path / "store"
    first, second = random_pages(2, seed=11)
    with open_store(directory) as store:
        assert store.put(["k"], [first]) == [True]
    behind = types.SimpleNamespace(time_ns=lambda: time.time_ns() - 3600 * 10**9)
    monkeypatch.setattr(records, "time", behind)  # this writer's clock runs an hour behind
    with open_store(directory) as store:
        assert store.put(["k"], [second]) == [True]  # published last: the index serves it
    monkeypatch.undo()
    report = rebuild_index(str(directory))
    assert report["ok"] and report["pages_published"] == 1 and report["superseded"] == 1
    out = poisoned(1)
    with open_store(directory) as store:
        assert store.get(["k"], out) == [True]
    assert same(out, [second])


# ---------------------------------------------------------------- SIGKILL inside rebuild
KILLER = """
import os, signal, sys
sys.path.insert(0, sys.argv[3])
directory, kill_at = sys.argv[1], int(sys.argv[2])
from kvtier.tiers.remote import tool
from kvtier.tiers.remote.index import RemoteIndex
steps = [0]
def step(*_):
    steps[0] += 1
    if steps[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
def wrap(owner, name):
    real = getattr(owner, name)
    def wrapped(*args, **kw):
        step()
        result = real(*args, **kw)
        step()
        return result
    setattr(owner, name, wrapped)
for name in ("rename", "link", "fsync", "unlink"):
    wrap(os, name)
wrap(RemoteIndex, "restore_segment")
report = tool.rebuild_index(directory, progress=step)
print("steps", steps[0], report["ok"])
"""


def rebuild_killed_at(directory: Path, kill_at: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", KILLER, str(directory), str(kill_at), str(REPO)],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.stress
def test_a_rebuild_sigkilled_at_every_step_with_writes_between_loses_no_page(tmp_path):
    """The index lost its last commits (a rebuild is due); the rebuild is SIGKILLed at step k,
    a service writes, and the next rebuild runs to the end: every page stored reads back."""
    base = tmp_path / "base"
    truth: dict = {}
    write(base, truth, "kept", 2 * SLOTS, seed=12)
    shutil.copy(base / "index.sqlite3", tmp_path / "older")
    write(base, truth, "lost", 3 * SLOTS, seed=13)
    shutil.copy(tmp_path / "older", base / "index.sqlite3")
    whole = tmp_path / "whole"
    shutil.copytree(base, whole)
    done = rebuild_killed_at(whole, 0)
    assert done.returncode == 0, done.stderr
    total = int(done.stdout.split()[1])  # steps of a rebuild that runs to the end
    # Every step in the long mode; in CI a scan step, a restore step and the whole swap.
    points = range(1, total) if LONG else sorted({1, total // 3, *range(total - 7, total)})
    for kill_at in points:
        directory = tmp_path / f"round-{kill_at}"
        shutil.copytree(base, directory)
        killed = rebuild_killed_at(directory, kill_at)
        assert killed.returncode == -signal.SIGKILL, (kill_at, killed.stdout, killed.stderr)
        TALLY.update(kills=1, processes=1)
        round_truth = dict(truth)
        write(directory, round_truth, f"between-{kill_at}", SLOTS + 3, seed=100 + kill_at)
        assert rebuild_index(str(directory))["ok"]
        assert lost_and_wrong(directory, round_truth) == (0, 0), kill_at
        shutil.rmtree(directory)


def test_a_slot_a_damaged_index_lists_as_free_and_published_is_never_reused(tmp_path):
    """A flipped bit SQLite does not detect puts a published page's slot on the free list too:
    the allocator passes it over, so every page stored before and after reads back."""
    directory = tmp_path / "store"
    truth: dict = {}
    write(directory, truth, "before", 12, seed=14)
    db = sqlite3.connect(directory / "index.sqlite3")
    published = db.execute("SELECT seg, slot, 0 FROM pages ORDER BY seg, slot LIMIT 4").fetchall()
    db.executemany("INSERT INTO free_slots SELECT ?, ?, slot_stride, ? FROM segments WHERE id = ?",
                   [(seg, slot, when, seg) for seg, slot, when in published])
    db.commit()
    db.close()
    TALLY.update(corruptions=1)
    write(directory, truth, "after", 12, seed=15)
    assert len(truth) == 24
    assert lost_and_wrong(directory, truth) == (0, 0)


def test_check_raises_no_false_alarm_on_a_live_store(tmp_path):
    """A child process rewrites, deletes and adds pages (slots reused at once) while check runs
    again and again beside it: every run says ok."""
    directory = tmp_path / "store"
    truth: dict = {}
    write(directory, truth, "base", 3 * SLOTS, seed=16)
    body = (
        "import sys, time\nsys.path.insert(0, sys.argv[2])\n"
        "from tests.test_remote_recovery import open_store\n"
        "from tests.test_remote_store import random_pages\n"
        "from pathlib import Path\n"
        "store = open_store(Path(sys.argv[1]))\n"
        "end = time.monotonic() + float(sys.argv[3])\n"
        "n = 0\n"
        "while time.monotonic() < end:\n"
        "    keys = [f'live-{(n + i) % 40}' for i in range(6)]\n"
        "    store.put(keys, random_pages(6, seed=n))\n"
        "    store.delete(keys[:2])\n"
        "    n += 1\n"
        "store.close()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", body, str(directory), str(REPO), "4"])
    TALLY.update(processes=1)
    try:
        runs = []
        while child.poll() is None:
            report = check_store(str(directory))
            runs.append(report["ok"])
            assert report["ok"], report["problems"]
        assert len(runs) >= 3, runs
    finally:
        child.wait(60)


if __name__ == "__main__":
    import json

    code = pytest.main([__file__, "-q", "-p", "no:cacheprovider"])
    here = os.path.realpath(__file__)
    tally: Counter = Counter()
    for module in list(sys.modules.values()):  # the module pytest imported holds the tally
        if module is not sys.modules["__main__"] and os.path.realpath(getattr(module, "__file__", "") or "") == here:
            tally.update(module.TALLY)
    print(json.dumps(dict(tally), indent=2))
    sys.exit(code)
