"""RemoteStore on real NIXL (POSIX backend) and real files: the data path, keys and ids,
scatter/gather buffers, sharing, capacity. Helpers and the store fixture live here and are
imported by the other tests/test_remote_*.py files."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("nixl_cu13")

from kvtier.index.keys import key_id, key_ids  # noqa: E402
from kvtier.tiers.remote import RemoteStore, RemoteUnavailable, namespace_fingerprint  # noqa: E402
from kvtier.tiers.remote import records  # noqa: E402
from kvtier.tiers.remote.segments import header_offset, payload_offset  # noqa: E402

NS = "a1b2c3d4"
PAGE = 16 << 10
REPO = Path(__file__).resolve().parents[1]

CHILD = """
import pathlib, sys, time, torch
from kvtier.tiers.remote import RemoteStore
mode, directory, marker = sys.argv[1:4]
page, ns = 16 << 10, "a1b2c3d4"
def pages(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randint(1, 256, (n, page), dtype=torch.uint8, generator=gen))
store = RemoteStore(directory, namespace=ns, page_bytes=page, segment_bytes=1 << 20)
if mode == "crash":
    def stall(keys):
        pathlib.Path(marker).touch()
        time.sleep(120)
    store.faults.before_publish = stall
    store.put([f"crash-{i}" for i in range(8)], pages(8, 7))
    sys.exit("the write was published: the parent should have killed this process")
expected = pages(8, 1)
got = [torch.zeros(page, dtype=torch.uint8) for _ in range(8)]
assert store.get([f"parent-{i}" for i in range(8)], got) == [True] * 8
assert all(torch.equal(a, b) for a, b in zip(got, expected)), "parent pages differ"
assert all(store.put([f"child-{i}" for i in range(80)], pages(80, 2)))
store.close()
"""


def random_pages(n: int, seed: int, size: int = PAGE) -> list[torch.Tensor]:
    """Random page contents, never a zero byte (so zero-poisoned buffers show a miss)."""
    gen = torch.Generator().manual_seed(seed)
    return list(torch.randint(1, 256, (n, size), dtype=torch.uint8, generator=gen))


def poisoned(n: int, size: int = PAGE) -> list[torch.Tensor]:
    return [torch.zeros(size, dtype=torch.uint8) for _ in range(n)]


def same(got: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    return len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def run_child(mode: str, directory: Path, marker: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, str(directory), str(marker)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def record_offsets(store: RemoteStore, key) -> tuple[Path, int, int]:
    """(segment file, header offset, payload offset) of a key, from the documented layout."""
    (loc,) = store._index.lookup(namespace_fingerprint(store.namespace), [key_id(key)])
    stride, nslots = store._index.segment(loc.seg)
    path = Path(store.directory) / "segments" / f"{loc.seg:08d}.seg"
    return path, header_offset(loc.slot), payload_offset(stride, nslots, loc.slot)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x5A]))


@pytest.fixture
def open_store(tmp_path):
    stores = []

    def make(**kw) -> RemoteStore:
        kw.setdefault("namespace", NS)
        kw.setdefault("page_bytes", PAGE)
        kw.setdefault("segment_bytes", 1 << 20)
        store = RemoteStore(kw.pop("location", tmp_path / "store"), **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_round_trip_is_bit_exact_for_tensors_and_pointers(open_store):
    store = open_store()
    data = random_pages(12, seed=1)
    keys = [f"page-{i}" for i in range(6)] + [f"bytes-{i}".encode() for i in range(6)]
    assert store.put(keys, data) == [True] * 12
    out = poisoned(12)
    as_pointers = [(t.data_ptr(), t.numel()) for t in out[6:]]
    assert store.get(keys, out[:6] + as_pointers) == [True] * 12
    assert same(out, data)
    assert store.get(["page-0"], [torch.zeros(PAGE, dtype=torch.uint8)]) == [True]
    s = store.stats()
    assert (s["hits"], s["misses"], s["pages"], s["used_bytes"]) == (13, 0, 12, 12 * PAGE)
    assert s["bytes_written"] == s["bytes_read"] - PAGE == 12 * PAGE


def test_str_and_bytes_keys_are_two_pages(open_store):
    store = open_store()
    as_str, as_bytes = random_pages(2, seed=21)
    assert store.put(["abc"], [as_str]) == [True]
    assert store.contains(["abc", b"abc"]) == [True, False]
    assert store.put([b"abc"], [as_bytes]) == [True]
    out = poisoned(2)
    assert store.get(["abc", b"abc"], out) == [True, True]
    assert same(out, [as_str, as_bytes])
    assert store.delete(["abc"]) == [True]
    out = poisoned(1)
    assert store.contains(["abc", b"abc"]) == [False, True]
    assert store.get([b"abc"], out) == [True] and torch.equal(out[0], as_bytes)
    assert store.stats()["pages"] == 1


@pytest.mark.parametrize("bad, error, pattern", [
    (3, TypeError, "key 1: a key must be str or bytes, got int 3"),
    (2.5, TypeError, "key 1: .*float 2.5"),
    (("a", "b"), TypeError, "key 1: .*tuple"),
    ("", ValueError, "key 1: a key must not be empty"),
    (b"", ValueError, "key 1: a key must not be empty"),
])
def test_a_bad_key_raises_at_the_call_with_nothing_written(open_store, bad, error, pattern):
    store = open_store()
    data = random_pages(2, seed=22)
    with pytest.raises(error, match=pattern):
        store.put(["good", bad], data)
    with pytest.raises(error, match=pattern):
        store.contains(["good", bad])
    with pytest.raises(error, match=pattern):
        store.get(["good", bad], poisoned(2))
    with pytest.raises(error, match=pattern):
        store.delete(["good", bad])
    with pytest.raises(error, match=pattern):
        store.exists(["good", bad])
    s = store.stats()
    assert (s["pages"], s["segments"], s["reserved_slots"], s["write_failures"]) == (0, 0, 0, 0)
    assert store.contains(["good"]) == [False]
    assert not (Path(store.directory) / "segments" / "00000001.seg").exists()


def test_id_methods_are_the_key_methods_without_hashing(open_store):
    store = open_store()
    keys = ["s-0", b"b-1", "s-2"]
    data = random_pages(3, seed=23)
    ids = key_ids(keys)
    assert store.put_ids(ids, data) == [True] * 3
    assert store.contains(keys) == [True] * 3
    assert store.contains_ids(ids + [key_id("other")]) == [True, True, True, False]
    out = poisoned(3)
    assert store.get(keys, out) == [True] * 3 and same(out, data)
    out = poisoned(3)
    assert store.get_ids(ids, out) == [True] * 3 and same(out, data)
    assert store.delete_ids(ids[:1]) == [True]
    assert store.contains(keys) == [False, True, True]
    for call in (store.contains_ids, store.delete_ids):
        with pytest.raises(ValueError, match="id 1 is 15 bytes; expected 16"):
            call([ids[0], ids[1][:15]])
        with pytest.raises(TypeError, match="id 0 is a str"):
            call(["s-0"])
    with pytest.raises(ValueError, match="id 0 is 32 bytes; expected 16"):
        store.put_ids([bytes(32)], data[:1])
    with pytest.raises(ValueError, match="id 0 is 0 bytes"):
        store.get_ids([b""], poisoned(1))
    assert store.stats()["pages"] == 2


def pieces_of(page: torch.Tensor, sizes: list[int]) -> list[tuple[int, int]]:
    """(ptr, nbytes) pieces of consecutive slices of ``page`` with the given sizes."""
    assert sum(sizes) == page.numel()
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(page.data_ptr() + o, n) for o, n in zip(offsets, sizes)]


def scattered(pool: torch.Tensor, page: int, sizes: list[int], pages: int) -> list[tuple[int, int]]:
    """Pieces of one page laid out as a layer-first host pool: piece j of every page sits in
    plane j, so a page's pieces are far apart and in no address order."""
    pieces, base = [], pool.data_ptr()
    for j, size in enumerate(sizes):
        plane = sum(sizes[:j]) * pages
        pieces.append((base + plane + page * size, size))
    return pieces[::-1][::-1]


@pytest.mark.parametrize("sizes", [
    [PAGE],                                  # MLA page_first: one piece
    [PAGE // 2 + 2048, PAGE // 2 - 2048],    # MHA page_first, asymmetric K / V heads
    [2048] * 8,                              # MHA layer_first, L = 4: K and V per layer
    [1024, 3072, 512, 3584, 2048, 2048, 4096],  # unequal pieces of any size
])
def test_scatter_gather_round_trips_bit_exact_into_poisoned_pieces(open_store, sizes):
    store = open_store()
    n = 5
    source = torch.randint(1, 256, (n * PAGE,), dtype=torch.uint8, generator=torch.Generator().manual_seed(len(sizes)))
    store.register_host_memory(source)
    pages = [source[i * PAGE : (i + 1) * PAGE] for i in range(n)]
    keys = [f"sg-{len(sizes)}-{i}" for i in range(n)]
    assert store.put(keys, [pieces_of(p, sizes) for p in pages]) == [True] * n
    # Read into a layer-first pool: pieces of one page scattered over planes.
    dest = torch.zeros(n * PAGE, dtype=torch.uint8)
    assert store.get(keys, [scattered(dest, i, sizes, n) for i in range(n)]) == [True] * n
    for i in range(n):
        got = torch.cat([dest[p - dest.data_ptr() : p - dest.data_ptr() + size]
                         for p, size in scattered(dest, i, sizes, n)])
        assert torch.equal(got, pages[i]), f"page {i} differs"
    # The record is the concatenation: a contiguous reader sees the same bytes.
    out = poisoned(n)
    assert store.get(keys, out) == [True] * n and same(out, pages)
    store.unregister_host_memory(source)


def test_pieces_of_a_small_page_and_2k_pieces_share_one_aligned_slot(open_store):
    page = 6 << 10  # not a multiple of the 4 KiB slot alignment
    store = open_store(page_bytes=page)
    data = random_pages(4, seed=24, size=page)
    assert store.put([f"s{i}" for i in range(4)], [pieces_of(d, [2048] * 3) for d in data]) == [True] * 4
    out = poisoned(4, page)
    assert store.get([f"s{i}" for i in range(4)], [pieces_of(o, [4096, 2048]) for o in out]) == [True] * 4
    assert same(out, data)
    assert store.slot_stride == 8192
    _, _, first = record_offsets(store, "s0")
    _, _, second = record_offsets(store, "s1")
    assert first % 4096 == 0 and second - first == 8192


def test_a_page_of_pieces_is_present_only_when_every_piece_was_written(open_store):
    # One page per request: a failed request takes all pieces of its page with it.
    store = open_store(pipeline_bytes=PAGE)
    data = random_pages(3, seed=25)
    sizes = [4096, 2048, 6144, 4096]
    store.faults.arm("error_after_io", count=1, op="WRITE")
    assert store.put(["p0", "p1", "p2"], [pieces_of(d, sizes) for d in data]) == [False, True, True]
    assert store.contains(["p0", "p1", "p2"]) == [False, True, True]
    out = poisoned(3)
    assert store.get(["p0", "p1", "p2"], [pieces_of(o, sizes) for o in out]) == [False, True, True]
    assert same(out[1:], data[1:])
    assert store.stats()["write_failures"] == 1


def test_pieces_that_do_not_sum_to_page_bytes_raise_naming_both_numbers(open_store):
    store = open_store()
    page = random_pages(1, seed=26)[0]
    with pytest.raises(ValueError, match=f"buffer 0: 2 pieces of {PAGE - 1024} bytes in all; expected page_bytes={PAGE}"):
        store.put(["k"], [pieces_of(page, [PAGE // 2, PAGE // 2 - 1024] + [1024])[:2]])
    with pytest.raises(ValueError, match=f"buffer 1: 2 pieces of {PAGE + 4096} bytes"):
        store.get(["a", "b"], [page, [(page.data_ptr(), PAGE), (page.data_ptr(), 4096)]])
    with pytest.raises(ValueError, match="buffer 0 is an empty list"):
        store.put(["k"], [[]])
    with pytest.raises(ValueError, match="buffer 0 piece 1 of 0 bytes"):
        store.put(["k"], [[(page.data_ptr(), PAGE), (page.data_ptr(), 0)]])
    with pytest.raises(TypeError, match="buffer 0 piece 0 of type str"):
        store.put(["k"], [["abc"]])
    assert store.stats()["pages"] == 0


def test_a_key_twice_in_one_put_keeps_the_later_page(open_store):
    store = open_store()
    first, second = random_pages(2, seed=17)
    assert store.put(["dup", "dup"], [first, second]) == [True, True]
    out = poisoned(1)
    assert store.get(["dup"], out) == [True] and torch.equal(out[0], second)
    s = store.stats()
    assert (s["pages"], s["used_bytes"], s["free_slots"], s["reserved_slots"]) == (1, PAGE, 1, 0)


def test_exists_counts_leading_hits_and_contains_each(open_store):
    store = open_store()
    store.put(["a", "b", "c"], random_pages(3, seed=2))
    assert store.exists(["a", "b", "missing", "c"]) == 2
    assert store.exists(["missing", "a"]) == 0
    assert store.exists(["c", "b", "a"]) == 3
    assert store.exists([]) == 0
    assert store.contains(["a", "missing", "c"]) == [True, False, True]
    out = poisoned(3)
    assert store.get(["a", "missing", "c"], out) == [True, False, True]
    assert not out[1].any()
    assert store.stats()["misses"] == 1


def test_large_batches_move_in_pipelined_requests(open_store, tmp_path):
    size = 256 << 10  # 24 pages = 6 MiB: checksums run on the thread pool
    piped = open_store(page_bytes=size, pipeline_bytes=1 << 20, segment_bytes=4 << 20)
    whole = open_store(page_bytes=size, location=tmp_path / "whole", segment_bytes=4 << 20)
    data = random_pages(24, seed=3, size=size)
    keys = [f"big-{i}" for i in range(24)]
    for store in (piped, whole):
        assert store.put(keys, data) == [True] * 24
        out = poisoned(24, size)
        assert store.get(keys, out) == [True] * 24
        assert same(out, data)
    piped.faults.arm("error", count=1, op="READ")  # the first of six requests fails
    out = poisoned(24, size)
    assert piped.get(keys, out) == [False] * 4 + [True] * 20
    assert same(out[4:], data[4:]) and piped.stats()["read_failures"] == 4


def test_two_processes_share_one_store(open_store, tmp_path):
    store = open_store()
    mine = random_pages(8, seed=1)
    assert all(store.put([f"parent-{i}" for i in range(8)], mine))
    child = run_child("share", store.directory, tmp_path / "unused")
    output, _ = child.communicate(timeout=120)
    assert child.returncode == 0, output
    # The child filled more than one segment; this store opens the new one on first use.
    theirs = random_pages(80, seed=2)
    out = poisoned(80)
    assert store.get([f"child-{i}" for i in range(80)], out) == [True] * 80
    assert same(out, theirs)
    assert store.stats()["segments"] >= 2


def test_a_reopened_store_serves_everything_committed(open_store, tmp_path):
    first = open_store(location=f"file://{tmp_path / 'store'}")
    data = random_pages(20, seed=4)
    keys = [f"k{i}" for i in range(20)]
    assert all(first.put(keys, data))
    first.close()
    again = open_store()
    out = poisoned(20)
    assert again.get(keys, out) == [True] * 20
    assert same(out, data)
    assert again.stats()["pages"] == 20


def test_namespaces_are_isolated_and_clear_is_scoped(open_store):
    a = open_store(namespace="aa")
    b = open_store(namespace="BB01")
    keys = ["same-0", "same-1", "same-2"]
    data_a, data_b = random_pages(3, seed=11), random_pages(3, seed=12)
    a.put(keys, data_a)
    assert b.contains(keys) == [False] * 3
    assert b.get(keys, poisoned(3)) == [False] * 3
    b.put(keys, data_b)
    out = poisoned(3)
    assert a.get(keys, out) == [True] * 3 and same(out, data_a)
    assert b.get(keys, out) == [True] * 3 and same(out, data_b)
    assert b.clear() == 3
    assert b.contains(keys) == [False] * 3
    assert a.get(keys, out) == [True] * 3 and same(out, data_a)
    assert a.stats()["store_pages"] == 3
    assert a.delete(["same-0", "never"]) == [True, False]
    assert a.contains(keys) == [False, True, True]


def test_capacity_evicts_in_exact_lru_order(open_store):
    store = open_store(capacity_bytes=4 * PAGE, high_watermark=1.0, low_watermark=1.0)
    data = dict(zip("abcdefgh", random_pages(8, seed=13)))
    for key in "abcd":
        assert store.put([key], [data[key]]) == [True]
    assert store.get(["a"], poisoned(1)) == [True]  # a is now the most recent
    store.put(["e"], [data["e"]])
    assert store.contains(list("abcde")) == [True, False, True, True, True]
    store.get(["c"], poisoned(1))
    store.put(["f"], [data["f"]])  # LRU order was d, a, e, c
    assert store.contains(list("acdef")) == [True, True, False, True, True]
    store.put(["g", "h"], [data["g"], data["h"]])  # evicts a and e
    assert store.contains(list("acefgh")) == [False, True, False, True, True, True]
    s = store.stats()
    assert (s["evictions"], s["pages"], s["used_bytes"]) == (4, 4, 4 * PAGE)
    out = poisoned(4)
    assert store.get(list("cfgh"), out) == [True] * 4
    assert same(out, [data[k] for k in "cfgh"])


def test_watermarks_evict_down_to_the_low_mark_and_reject_what_cannot_fit(open_store, tmp_path):
    store = open_store(capacity_bytes=10 * PAGE, high_watermark=0.8, low_watermark=0.5)
    data = random_pages(9, seed=14)
    for i in range(8):
        store.put([f"p{i}"], [data[i]])
    assert store.stats()["evictions"] == 0
    store.put(["p8"], [data[8]])  # 9 pages > 8: evict to 5 - 1 = 4 resident, then add one
    assert store.contains([f"p{i}" for i in range(9)]) == [False] * 4 + [True] * 5
    tiny = open_store(capacity_bytes=2 * PAGE, location=tmp_path / "tiny",
                      high_watermark=1.0, low_watermark=1.0)
    assert tiny.put(["x", "y", "z"], data[:3]) == [True, True, False]
    assert tiny.stats()["rejected_writes"] == 1


def test_threads_never_read_torn_or_foreign_pages(open_store):
    # Two handles (two NIXL agents, two index connections) stand in for two processes; the
    # capacity forces eviction and a zero reuse delay makes freed slots come back at once.
    stores = [open_store(capacity_bytes=24 * PAGE, reuse_delay_s=0.0) for _ in range(2)]
    nkeys, errors, hits = 40, [], [0]

    def page_for(key_id: int, version: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(key_id * 1_000_003 + version)
        page = torch.randint(1, 256, (PAGE,), dtype=torch.uint8, generator=gen)
        page[:16] = torch.tensor(list(key_id.to_bytes(8, "little") + version.to_bytes(8, "little")))
        return page

    def worker(store: RemoteStore, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                ids = rng.sample(range(nkeys), 6)
                keys = [f"key-{i}" for i in ids]
                if rng.random() < 0.5:
                    store.put(keys, [page_for(i, rng.randrange(1 << 30)) for i in ids])
                    continue
                out = poisoned(6)
                for i, ok, page in zip(ids, store.get(keys, out), out):
                    if ok:
                        key_id = int.from_bytes(page[:8].numpy().tobytes(), "little")
                        version = int.from_bytes(page[8:16].numpy().tobytes(), "little")
                        assert key_id == i, f"key-{i} returned the page of key-{key_id}"
                        assert torch.equal(page, page_for(i, version)), f"key-{i} torn"
                        hits[0] += 1
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(stores[i % 2], i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert hits[0] > 0
    for store in stores:
        s = store.stats()
        assert (s["corrupt_reads"], s["read_failures"], s["write_failures"]) == (0, 0, 0)
        assert s["reserved_slots"] == 0 and s["used_bytes"] <= 24 * PAGE


def test_registered_host_memory_is_used_in_place(open_store):
    store = open_store()
    pool = torch.randint(1, 256, (8 * PAGE,), dtype=torch.uint8)
    store.register_host_memory(pool)
    pages = list(pool.view(8, PAGE))
    keys = [f"h{i}" for i in range(8)]
    expected = [p.clone() for p in pages]
    assert all(store.put(keys, pages))
    pool.zero_()
    assert store.get(keys, pages) == [True] * 8 and same(pages, expected)
    store.unregister_host_memory(pool)
    with pytest.raises(ValueError, match="was not registered"):
        store.unregister_host_memory(pool)


def test_gds_falls_back_to_posix_when_unavailable(open_store, caplog):
    with caplog.at_level("WARNING", logger="kvtier.tiers.remote"):
        store = open_store(backend="GDS")
    assert store.backend == "POSIX"
    assert sum("falling back to POSIX" in r.message for r in caplog.records) == 1
    data = random_pages(2, seed=16)
    store.put(["g0", "g1"], data)
    out = poisoned(2)
    assert store.get(["g0", "g1"], out) == [True, True] and same(out, data)


def test_missing_nixl_raises_remote_unavailable_with_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl_cu13._api", None)
    monkeypatch.setitem(sys.modules, "nixl_cu12._api", None)
    with pytest.raises(RemoteUnavailable) as raised:
        RemoteStore(tmp_path, namespace=NS, page_bytes=PAGE)
    assert "pip install --no-deps nixl-cu13==1.5.1 (CUDA 13" in str(raised.value)
    assert "pip install --no-deps nixl-cu12==1.5.1 (CUDA 12)" in str(raised.value)


def test_missing_crc32c_raises_remote_unavailable_with_the_install_line(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "crc32c", None)
    with pytest.raises(RemoteUnavailable, match="crc32c, which is not installed.*pip install crc32c"):
        RemoteStore(tmp_path, namespace=NS, page_bytes=PAGE)


def test_bad_arguments_name_the_value_and_the_expectation(open_store, tmp_path):
    with pytest.raises(ValueError, match="'xyz'.*hex"):
        open_store(namespace="xyz")
    with pytest.raises(ValueError, match="low=0.9 high=0.5"):
        open_store(high_watermark=0.5, low_watermark=0.9)
    with pytest.raises(ValueError, match="'NFS'"):
        open_store(backend="NFS")
    with pytest.raises(ValueError, match="'s3'"):
        open_store(location="s3://bucket/x")
    store = open_store()
    with pytest.raises(ValueError, match=f"buffer 0 of 4096 bytes; expected page_bytes={PAGE}"):
        store.put(["k"], [torch.zeros(4096, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="2 buffers for 1 keys"):
        store.put(["k"], poisoned(2))
    with pytest.raises(ValueError, match="contiguous"):
        store.get(["k"], [torch.zeros(2 * PAGE, dtype=torch.uint8)[::2]])
    with pytest.raises(TypeError, match="key 0: a key must be str or bytes, got int 3"):
        store.contains([3])
    with pytest.raises(TypeError, match="buffer 0 piece 0 of type int"):
        store.put(["k"], [[0] * PAGE])
    with pytest.raises(ValueError, match="buffer 0 of 8 bytes"):
        store.put(["k"], [(0x1000, 8)])
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.contains(["k"])


def test_default_capacity_is_half_the_free_space_plus_what_the_store_holds(open_store, tmp_path, monkeypatch, caplog):
    import kvtier.tiers.remote.store as store_module

    first = open_store(capacity_bytes=100 * PAGE)
    assert all(first.put(["a", "b", "c"], random_pages(3, seed=27)))
    assert first.capacity_bytes == first.stats()["capacity_bytes"] == 100 * PAGE
    first.close()
    free_blocks = 1000
    real = os.statvfs(tmp_path)
    fake = os.statvfs_result(tuple(real)[:4] + (free_blocks,) + tuple(real)[5:])
    monkeypatch.setattr(store_module.os, "statvfs", lambda path: fake if str(path) == first.directory else real)
    with caplog.at_level("INFO", logger="kvtier.tiers.remote"):
        again = open_store()
    expected = free_blocks * fake.f_frsize // 2 + 3 * PAGE
    assert again.capacity_bytes == again.stats()["capacity_bytes"] == expected
    logged = [r.getMessage() for r in caplog.records if "capacity_bytes not given" in r.getMessage()]
    assert len(logged) == 1 and first.directory in logged[0] and "50%" in logged[0]


@pytest.mark.parametrize("level, loud", [(None, False), ("INFO", True)])
def test_opening_a_store_prints_nothing_unless_nixl_log_level_asks(tmp_path, level, loud):
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    if level is not None:
        env["NIXL_LOG_LEVEL"] = level
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    code = (
        "import sys\n"
        "from kvtier.tiers.remote import RemoteStore\n"
        "RemoteStore(sys.argv[1], namespace='ab', page_bytes=4096).close()\n"
        "print('opened')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "opened"
    if loud:
        assert "NIXL INFO" in done.stdout + done.stderr
    else:
        assert (done.stdout, done.stderr) == ("opened\n", "")
