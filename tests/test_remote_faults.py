"""Fault suite of the remote store: real processes killed with SIGKILL at the write path's crash
points, corruption of every kind of file, several processes and threads on one store, a full
disk, an unwritable directory. It counts pages verified, wrong pages (always 0) and durable pages
lost (always 0).

A page's bytes are a function of its key, so any page read can be checked, whoever wrote it.
A page is durable once a ``put`` returned True for it; writers append such keys to an ack file
(fsync'd) before going on, so the verifier knows what must be there.

    python tests/test_remote_faults.py [--json out.json]   # runs every scenario, prints the figures
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import tempfile
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

pytest.importorskip("nixl_cu13")

from kvtier.tiers.remote import RemoteStore, StoreCorrupt  # noqa: E402
from kvtier.tiers.remote.tool import check_store, rebuild_index  # noqa: E402

NS = "fa017e57"
PAGE = 16 << 10
SEGMENT = 1 << 20
FIGURES = dict.fromkeys(
    ("kills", "crash_points", "corruptions", "processes", "threads", "pages_verified",
     "wrong_pages", "durable_pages_lost"), 0,
)
_CRASH_POINTS: set[str] = set()


def page_for(key: str) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
    page = torch.randint(1, 256, (PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    tag = key.encode()[:64]
    page[: len(tag)] = torch.tensor(list(tag), dtype=torch.uint8)
    return page


def open_store(directory, **kw) -> RemoteStore:
    kw.setdefault("capacity_bytes", 1 << 40)  # no eviction: every durable page must stay
    return RemoteStore(directory, namespace=NS, page_bytes=PAGE, segment_bytes=SEGMENT, **kw)


def acked(directory: Path) -> set[str]:
    keys = set()
    for ack in directory.parent.glob(f"{directory.name}.ack*"):
        keys.update(line for line in ack.read_text().splitlines() if line)
    return keys


def verify(directory: Path, keys, must_have=(), **kw) -> dict:
    """Read ``keys``; every page found must be its key's bytes, every key of ``must_have``
    must be found."""
    keys = sorted(set(keys) | set(must_have))
    wrong = lost = verified = 0
    with open_store(directory, **kw) as store:
        for start in range(0, len(keys), 64):
            batch = keys[start : start + 64]
            out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in batch]
            for key, ok, page in zip(batch, store.get(batch, out), out):
                if ok:
                    verified += 1
                    wrong += not torch.equal(page, page_for(key))
                elif key in must_have:
                    lost += 1
    return {"pages_verified": verified, "wrong_pages": wrong, "durable_pages_lost": lost}


def add(figures: dict) -> dict:
    for name, value in figures.items():
        FIGURES[name] += value
    return figures


# ----------------------------------------------------------------------------- child processes
def child(mode: str, directory: str, name: str, marker: str, extra: str) -> None:
    """A writer (or reader) process; ``mode`` says where it stops or how it runs."""
    directory = Path(directory)
    ack_path = directory.parent / f"{directory.name}.ack-{name}"
    if mode == "full-disk":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(extra), int(extra)))
    if mode == "unwritable" and os.geteuid() == 0:
        # Root ignores directory modes: run as the unprivileged user that owns the store.
        os.setgid(65534)
        os.setuid(65534)
        os.environ["HOME"] = str(directory.parent)  # NIXL looks for ~/.nixl.cfg
    store = open_store(directory, allow_foreign_owner=mode == "unwritable")
    ack = open(ack_path, "a")

    def put(keys: list[str]) -> list[bool]:
        done = store.put(keys, [page_for(k) for k in keys])
        ack.writelines(k + "\n" for k, ok in zip(keys, done) if ok)
        ack.flush()
        os.fsync(ack.fileno())
        return done

    def stall(*_):
        Path(marker).touch()
        time.sleep(600)

    if mode == "before_publish":
        put([f"{name}-pre-{i}" for i in range(20)])
        store.faults.before_publish = stall
        put([f"{name}-crash-{i}" for i in range(20)])
    elif mode == "mid_request":
        put([f"{name}-pre-{i}" for i in range(20)])
        store.faults.mid_request = lambda op: op == "WRITE" and stall()
        put([f"{name}-crash-{i}" for i in range(20)])
    elif mode in ("random", "shared"):
        # Two threads, each putting batches and reading back what the whole store holds.
        def work(thread: int) -> None:
            rng = random.Random(f"{name}-{thread}")
            for round_ in range(10**6):
                put([f"{name}-{thread}-{round_}-{i}" for i in range(rng.randrange(1, 24))])
                if mode == "shared":
                    keys = [f"shared-{rng.randrange(200)}" for _ in range(8)]
                    put(keys)
                    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in keys]
                    for key, ok, page in zip(keys, store.get(keys, out), out):
                        if ok and not torch.equal(page, page_for(key)):
                            os.write(2, f"WRONG PAGE {key}\n".encode())
                            os._exit(3)
                if round_ == 2:
                    Path(marker).touch()
                if mode == "shared" and round_ == 6:
                    return

        threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif mode == "full-disk":
        outcomes = [put([f"{name}-{b}-{i}" for i in range(2)]) for b in range(24)]
        failed = sum(not ok for batch in outcomes for ok in batch)
        s = store.stats()
        print(json.dumps({"failed": failed, "write_failures": s["write_failures"],
                          "reserved": s["reserved_slots"]}))
    elif mode == "unwritable":
        put([f"{name}-{i}" for i in range(40)])  # fills the first segment: 63 slots
        segments = directory / "segments"
        segments.chmod(0o500)
        refused = put([f"{name}-more-{i}" for i in range(40)])  # needs a new segment file
        readable = store.get([f"{name}-{i}" for i in range(40)], [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(40)])
        s = store.stats()
        segments.chmod(0o700)
        again = put([f"{name}-more-{i}" for i in range(40)])
        print(json.dumps({"refused": refused.count(False), "readable": sum(readable),
                          "reserved": s["reserved_slots"], "again": sum(again)}))
    store.close()


def spawn(mode: str, directory: Path, name: str, marker: Path, extra: str = "") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "child", mode, str(directory), name, str(marker), extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def kill_when(process: subprocess.Popen, marker: Path, delay_s: float = 0.0) -> None:
    deadline = time.monotonic() + 120
    while not marker.exists():
        if process.poll() is not None:
            raise AssertionError(f"child exited {process.returncode}: {process.communicate()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("child never reached its crash point")
        time.sleep(0.01)
    time.sleep(delay_s)
    process.send_signal(signal.SIGKILL)
    process.wait()
    FIGURES["kills"] += 1


# ----------------------------------------------------------------------------- scenarios
def scenario_kills(root: Path) -> dict:
    """Writers killed before publication, inside a write request, and at random moments while
    two threads write; after each kill the store is checked and every durable page read."""
    directory = root / "kills"
    plan = [("before_publish", 0.0), ("mid_request", 0.0)] + [("random", d) for d in (0.0, 0.1, 0.25)]
    figures = dict.fromkeys(("pages_verified", "wrong_pages", "durable_pages_lost"), 0)
    written: set[str] = set()
    for n, (point, delay) in enumerate(plan):
        marker = root / f"kill-{n}"
        process = spawn(point, directory, f"w{n}", marker)
        kill_when(process, marker, delay)
        _CRASH_POINTS.add(point)
        FIGURES["processes"] += 1
        FIGURES["threads"] += 2 if point == "random" else 1
        report = check_store(str(directory), payloads=True)
        assert report["ok"], report["problems"]
        written |= {f"w{n}-pre-{i}" for i in range(20)} | {f"w{n}-crash-{i}" for i in range(20)}
        durable = acked(directory)
        result = verify(directory, written | durable, must_have=durable)
        for name in figures:
            figures[name] += result[name]
    return add(figures)


def scenario_processes(root: Path) -> dict:
    """Four processes (two threads each) on one store writing their own and shared keys and
    reading the shared ones back; one is killed mid-run."""
    directory = root / "shared"
    markers = [root / f"shared-{i}" for i in range(4)]
    processes = [spawn("shared", directory, f"p{i}", markers[i]) for i in range(4)]
    kill_when(processes[3], markers[3], 0.1)
    for process in processes[:3]:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err
    _CRASH_POINTS.add("random")
    FIGURES["processes"] += 4
    FIGURES["threads"] += 8
    assert check_store(str(directory), payloads=True)["ok"]
    durable = acked(directory)
    shared = {f"shared-{i}" for i in range(200)}
    return add(verify(directory, shared | durable, must_have=durable))


def _fresh(root: Path, name: str, count: int) -> tuple[Path, list[str]]:
    directory = root / name
    keys = [f"{name}-{i}" for i in range(count)]
    with open_store(directory) as store:
        assert all(store.put(keys, [page_for(k) for k in keys]))
    return directory, keys


def _records(directory: Path, keys) -> dict[str, tuple[Path, int, int]]:
    """(segment file, header offset, payload offset) of each key, from the documented layout."""
    from kvtier.index.keys import key_ids
    from kvtier.tiers.remote import namespace_fingerprint
    from kvtier.tiers.remote.segments import header_offset, payload_offset

    keys = list(keys)
    found = {}
    with open_store(directory) as store:
        for key, loc in zip(keys, store._index.lookup(namespace_fingerprint(NS), key_ids(keys))):
            stride, nslots = store._index.segment(loc.seg)
            path = directory / "segments" / f"{loc.seg:08d}.seg"
            found[key] = (path, header_offset(loc.slot), payload_offset(stride, nslots, loc.slot))
    return found


def _flip(path: Path, offset: int, length: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(length))
        f.seek(offset)
        f.write(bytes(b ^ 0xA5 for b in data))


def scenario_corruptions(root: Path) -> dict:
    """Every kind of file damaged on purpose: payload bytes, record headers, a block of the
    header table, the superblock, truncation, the index file, the WAL. Damaged records are
    misses (never wrong bytes); the rest survives, the index after ``kvtier store rebuild``."""
    figures = dict.fromkeys(("pages_verified", "wrong_pages", "durable_pages_lost"), 0)
    rng = random.Random(7)

    def tally(result: dict) -> None:
        for name in figures:
            figures[name] += result[name]

    # Payload and header bytes, one record each, 12 + 12 tries.
    directory, keys = _fresh(root, "records", 100)
    where = _records(directory, keys)
    damaged = set()
    for kind in ("payload", "header"):
        for key in rng.sample([k for k in keys if k not in damaged], 12):
            path, header, payload = where[key]
            _flip(path, payload + rng.randrange(PAGE) if kind == "payload" else header + rng.randrange(64))
            damaged.add(key)
            FIGURES["corruptions"] += 1
    result = verify(directory, keys, must_have=set(keys) - damaged)
    assert result["pages_verified"] == len(keys) - len(damaged)
    tally(result)

    # A 4 KiB block of the header table (64 records' headers), and the superblock.
    directory, keys = _fresh(root, "table", 100)
    where = _records(directory, keys)
    path = where[keys[0]][0]
    with open(path, "r+b") as f:
        f.seek(4096)
        f.write(os.urandom(4096))
    FIGURES["corruptions"] += 1
    in_first = {k for k in keys if where[k][0] == path}
    assert not check_store(str(directory))["ok"]
    tally(verify(directory, keys, must_have=set(keys) - in_first))
    assert check_store(str(directory))["ok"]  # the damaged records left the index as they failed
    _flip(path, 0, 16)  # the superblock: a rebuild cannot use this file, the rest stays
    FIGURES["corruptions"] += 1
    report = rebuild_index(str(directory))
    assert len(report["unreadable_segments"]) == 1
    tally(verify(directory, keys, must_have=set(keys) - in_first))

    # Truncation in the middle of a segment file.
    directory, keys = _fresh(root, "truncated", 100)
    where = _records(directory, keys)
    path, _, payload = where[keys[30]]
    cut = payload + PAGE // 3
    os.truncate(path, cut)
    FIGURES["corruptions"] += 1
    lost = {k for k in keys if where[k][0] == path and where[k][2] + PAGE > cut}
    tally(verify(directory, keys, must_have=set(keys) - lost))

    # The index file, twice: overwritten bytes, then rebuilt from the segments.
    for n in range(2):
        directory, keys = _fresh(root, f"index-{n}", 90)
        index = directory / "index.sqlite3"
        with open(index, "r+b") as f:
            f.seek(rng.randrange(0, 4096) if n else 0)
            f.write(os.urandom(512))
        FIGURES["corruptions"] += 1
        try:
            open_store(directory).close()
            broken = not check_store(str(directory))["ok"]
        except StoreCorrupt:
            broken = True
        assert broken
        rebuild_index(str(directory))
        assert check_store(str(directory), payloads=True)["ok"]
        tally(verify(directory, keys, must_have=keys))

    # The WAL: a writer killed with commits still in its WAL, then a frame damaged. SQLite
    # drops the commits from the damaged frame on; a rebuild brings their pages back.
    for n in range(2):
        directory = root / f"wal-{n}"
        marker = root / f"wal-{n}-marker"
        process = spawn("random", directory, f"wal{n}", marker)
        kill_when(process, marker, 0.1)
        _CRASH_POINTS.add("random")
        FIGURES["processes"] += 1
        FIGURES["threads"] += 2
        wal = directory / "index.sqlite3-wal"
        assert wal.exists() and wal.stat().st_size > 32 + 24 + 4096
        _flip(wal, 32 + 24 + rng.randrange(4096), 8)  # inside the first frame's page
        FIGURES["corruptions"] += 1
        durable = acked(directory)
        rebuild_index(str(directory))
        assert check_store(str(directory), payloads=True)["ok"]
        tally(verify(directory, durable, must_have=durable))
    return add(figures)


def scenario_full_disk(root: Path) -> dict:
    """A writer whose files may not grow past 3 MiB (RLIMIT_FSIZE; EFBIG as a full disk
    answers ENOSPC), then a loop of injected ENOSPC from the NIXL seam."""
    directory = root / "full"
    first = [f"first-{i}" for i in range(40)]  # the first segment exists, 23 of its 63 slots free
    with open_store(directory) as store:
        assert all(store.put(first, [page_for(k) for k in first]))
    (root / "full.ack-parent").write_text("".join(k + "\n" for k in first))
    marker = root / "full-marker"
    # Segment files are created sparse at full size (1 MiB): under a 768 KiB limit the next new
    # segment cannot be created, and writes into the first segment's free slots past 768 KiB
    # fail inside the NIXL request (EFBIG), while those below it succeed.
    process = spawn("full-disk", directory, "f", marker, str(768 << 10))
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err
    FIGURES["processes"] += 1
    FIGURES["threads"] += 1
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["failed"] > 0 and outcome["failed"] == outcome["write_failures"]
    assert outcome["reserved"] == 0
    durable = acked(directory)
    assert set(first) < durable and len(durable) < 40 + 23
    figures = verify(directory, durable | {f"f-{b}-{i}" for b in range(24) for i in range(2)}, must_have=durable)
    with open_store(directory) as store:
        store.faults.arm("enospc", count=5, op="WRITE")
        for n in range(5):
            assert store.put([f"enospc-{n}"], [page_for(f"enospc-{n}")]) == [False]
        assert store.put(["enospc-after"], [page_for("enospc-after")]) == [True]
        s = store.stats()
        assert (s["reserved_slots"], s["write_failures"]) == (0, 5)
    result = verify(directory, durable | {"enospc-after"}, must_have=durable | {"enospc-after"})
    for name in figures:
        figures[name] += result[name]
    return add(figures)


def scenario_unwritable(root: Path) -> dict:
    """A store whose segments/ directory stops being writable while it runs: the put that needs
    a new segment file fails cleanly, nothing is reserved, what was written stays readable, and
    writes work again once the directory is writable."""
    base = root
    if os.geteuid() == 0:
        # The child runs as uid 65534, which must reach the store: a directory of its own
        # directly under the system's temporary directory.
        base = Path(tempfile.mkdtemp(prefix="kvtier-unwritable-"))
        os.chown(base, 65534, 65534)
    try:
        directory = base / "unwritable"
        process = spawn("unwritable", directory, "u", base / "u-marker")
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err
        FIGURES["processes"] += 1
        FIGURES["threads"] += 1
        # 40 pages fill 40 of the first segment's 63 slots; of 40 more, 23 fit there and 17
        # need a new segment file, which the unwritable directory refuses: that put fails
        # whole (its reservation is given back), and succeeds once the directory is writable.
        outcome = json.loads(out.strip().splitlines()[-1])
        assert outcome == {"refused": 40, "readable": 40, "reserved": 0, "again": 40}, outcome
        durable = acked(directory)
        assert len(durable) == 80
        return add(verify(directory, durable, must_have=durable, allow_foreign_owner=True))
    finally:
        if base is not root:
            shutil.rmtree(base)


SCENARIOS = {
    "kills": scenario_kills,
    "processes": scenario_processes,
    "corruptions": scenario_corruptions,
    "full_disk": scenario_full_disk,
    "unwritable": scenario_unwritable,
}


@pytest.mark.stress
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_fault_scenario_serves_no_wrong_page_and_loses_no_durable_page(tmp_path, name):
    result = SCENARIOS[name](tmp_path)
    assert result["wrong_pages"] == 0, result
    assert result["durable_pages_lost"] == 0, result
    assert result["pages_verified"] > 0, result


def main(argv: list[str]) -> int:
    if argv[:1] == ["child"]:
        child(*argv[1:6])
        return 0
    import argparse
    import platform

    parser = argparse.ArgumentParser(description="the remote store's fault suite, with its figures")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        for name, scenario in SCENARIOS.items():
            os.mkdir(Path(root) / name)
            began = time.monotonic()
            result = scenario(Path(root) / name)
            print(f"{name}: {result}, {time.monotonic() - began:.1f} s", file=sys.stderr)
    FIGURES["crash_points"] = len(_CRASH_POINTS)
    seconds = time.monotonic() - started
    columns = ("kills", "crash_points", "corruptions", "processes", "threads", "pages_verified",
               "wrong_pages", "durable_pages_lost")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---:|" * len(columns))
    print("| " + " | ".join(str(FIGURES[c]) for c in columns) + " |")
    print(f"crash points: {sorted(_CRASH_POINTS)}; {seconds:.1f} s; {platform.platform()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(FIGURES, crash_point_names=sorted(_CRASH_POINTS), seconds=seconds,
                           date=time.strftime("%Y-%m-%d"), platform=platform.platform()), f, indent=2)
    return 0 if FIGURES["wrong_pages"] == FIGURES["durable_pages_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
