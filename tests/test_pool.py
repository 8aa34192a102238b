import threading

import pytest
import torch

from kvtier import Namespace, PageFormat, PageState, PoolExhausted, TieredPool, dequantize, key_id, prefix_keys, quantize
from tests.conftest import DTYPE_SCALES, fill_random, poison, small_format, snapshot, write_pages


def make_pool(registry, fmt=None, **kw):
    kw.setdefault("device_pages", 8)
    if "host_bytes" not in kw:  # the two size the same tier: a pool takes one
        kw.setdefault("host_pages", 32)
    return TieredPool(fmt or small_format(), device="cpu", registry=registry, **kw)


def keys_for(pool, n, seed=0):
    return prefix_keys(list(range(seed, seed + n * pool.fmt.page_size)), pool.fmt.page_size, pool.namespace)


def load_and_check(pool, keys, expected):
    slots = pool.allocate(len(keys))
    poison(pool, slots)
    handle = pool.load(keys, slots)
    handle.wait()
    assert handle.done()
    for k, s in zip(keys, slots):
        assert snapshot(pool, s) == expected[k], f"page {k[:8]} differs after the round trip"
    pool.release(slots)


@pytest.mark.parametrize("dtype, scale", DTYPE_SCALES)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_round_trip_through_host_is_bit_exact(registry, gen, dtype, scale, layout, policy):
    pool = make_pool(registry, small_format(dtype, scale, layout=layout), write_policy=policy)
    keys = keys_for(pool, 6)
    expected = write_pages(pool, keys, gen)
    assert pool.evict(tier="device") == 6
    assert pool.match(keys).device == 0 and pool.match(keys).host == 6
    load_and_check(pool, keys, expected)
    pool.close()


@pytest.mark.parametrize("scale", ["per_tensor", "per_token_head"])
def test_mla_round_trip_is_bit_exact(registry, gen, scale):
    fmt = PageFormat(num_layers=2, num_kv_heads=1, head_dim=96, page_size=4, dtype="fp8_e4m3", scale=scale, mla=True)
    pool = make_pool(registry, fmt, write_policy="write_back")
    k, v = pool.device_kv(1)
    assert v is None and k.shape == (8, 4, 1, 96)
    keys = keys_for(pool, 5)
    expected = write_pages(pool, keys, gen)
    pool.evict(tier="device")
    load_and_check(pool, keys, expected)


@pytest.mark.parametrize("scale", ["per_tensor", "per_page_head", "per_token_head"])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_bf16_device_over_fp8_storage_quantizes_down_and_upcasts_up(registry, gen, scale, layout):
    fmt = small_format("fp8_e4m3", scale, layout=layout, device_dtype="bf16")
    pool = make_pool(registry, fmt, write_policy="write_back")
    assert pool.device_scales(0) == (None, None)
    keys = keys_for(pool, 4)
    slots = pool.allocate(4)
    fill_random(pool, slots, gen)
    originals = pool.device_tier.kv[:, :, slots].clone()
    pool.commit(keys, slots)
    pool.release(slots)
    pool.evict(tier="device")
    host = pool.host_tier
    hslots = [pool._host.lookup(key_id(k)) for k in keys]
    for layer in range(fmt.num_layers):
        for plane in range(2):
            q_ref, s_ref = quantize(originals[layer, plane], "fp8_e4m3", scale, layout)
            assert torch.equal(host.data_view(layer, plane)[hslots].view(torch.uint8), q_ref.view(torch.uint8))
            assert torch.equal(host.scale_view(layer, plane)[hslots], s_ref)
    back = pool.allocate(4)
    poison(pool, back)
    pool.load(keys, back).wait()
    got = pool.device_tier.kv[:, :, back]
    for layer in range(fmt.num_layers):
        for plane in range(2):
            q, s = quantize(originals[layer, plane], "fp8_e4m3", scale, layout)
            ref64 = dequantize(q, s, scale, layout, torch.float64)
            assert torch.equal(got[layer, plane], ref64.to(torch.bfloat16))
            rel = (got[layer, plane].double() - originals[layer, plane].double()).norm() / originals[layer, plane].double().norm()
            assert rel < 0.05


def test_write_through_copies_on_commit_and_never_again(registry, gen):
    pool = make_pool(registry, write_policy="write_through")
    keys = keys_for(pool, 4)
    write_pages(pool, keys, gen)
    assert pool.flush() == 0  # waits for the copies the offload thread started after commit
    s = pool.stats()
    assert s["pages_moved"]["device_to_host"] == 4
    assert s["states"]["host"]["resident"] == 4 and s["states"]["device"]["resident"] == 4
    pool.evict(tier="device")
    pool.flush()
    assert pool.stats()["pages_moved"]["device_to_host"] == 4


def test_write_through_selective_copies_after_two_hits_and_drops_the_rest(registry, gen):
    pool = make_pool(registry, write_policy="write_through_selective")
    keys = keys_for(pool, 4)
    write_pages(pool, keys, gen)
    assert pool.stats()["pages_moved"].get("device_to_host", 0) == 0
    pool.match(keys[:2])
    assert pool.stats()["pages_moved"].get("device_to_host", 0) == 0
    pool.match(keys[:1])
    assert pool.stats()["pages_moved"]["device_to_host"] == 1  # only keys[0] was hit twice
    pool.flush()
    assert pool.stats()["pages_moved"]["device_to_host"] == 1
    assert pool.evict(tier="device") == 4
    s = pool.stats()
    assert s["dropped"] == {"selective": 3} and s["pages_moved"]["device_to_host"] == 1
    m = pool.match(keys)
    assert (m.device, m.host, m.total) == (0, 1, 1)


def test_write_back_copies_only_what_is_evicted_then_flush_copies_the_rest(registry, gen):
    pool = make_pool(registry, write_policy="write_back")
    keys = keys_for(pool, 6)
    write_pages(pool, keys, gen)
    assert pool.stats()["pages_moved"].get("device_to_host", 0) == 0
    assert pool.evict(2) == 2
    assert pool.stats()["pages_moved"]["device_to_host"] == 2
    assert pool.match(keys).host == 2
    pool.flush()
    s = pool.stats()
    assert s["pages_moved"]["device_to_host"] == 6
    assert s["states"]["device"]["dirty"] == 0 and s["states"]["device"]["resident"] == 4


def test_lru_evicts_least_recently_used_first(registry, gen):
    pool = make_pool(registry, write_policy="write_back", device_pages=4)
    keys = keys_for(pool, 4)
    for k in keys:
        write_pages(pool, [k], gen)
    pool.match([keys[0]])  # keys[0] is now the most recent
    pool.allocate(2)  # evicts two: keys[1], keys[2]
    on_device = [k for k in keys if pool._dev.lookup(key_id(k)) >= 0]
    assert on_device == [keys[0], keys[3]]


def test_write_back_under_pressure_loses_nothing(registry, gen):
    pool = make_pool(registry, write_policy="write_back", device_pages=8, host_pages=64)
    keys = keys_for(pool, 64)
    expected = {}
    for i in range(0, 64, 4):
        expected.update(write_pages(pool, keys[i : i + 4], gen))
    assert pool.match(keys).total == 64
    for i in range(0, 64, 8):
        load_and_check(pool, keys[i : i + 8], expected)
    assert pool.stats()["dropped"] == {}


def test_host_eviction_makes_the_device_copy_dirty_again(registry, gen):
    pool = make_pool(registry, write_policy="write_through", device_pages=8, host_pages=4)
    first = keys_for(pool, 4)
    write_pages(pool, first, gen)
    assert pool.flush() == 0
    assert pool.stats()["states"]["device"]["resident"] == 4
    pool.evict(tier="host")
    assert pool.stats()["states"]["device"]["dirty"] == 4
    pool.evict(tier="device")  # copies them down again instead of losing them
    assert pool.match(first).host == 4


def test_everything_held_raises_pool_exhausted(registry):
    pool = make_pool(registry, device_pages=4)
    held = pool.allocate(4)
    with pytest.raises(PoolExhausted, match="4 held by the engine"):
        pool.allocate(1)
    pool.release(held[:1])
    assert len(pool.allocate(1)) == 1


def test_acquired_pages_are_never_evicted(registry, gen):
    pool = make_pool(registry, write_policy="write_back", device_pages=4)
    keys = keys_for(pool, 4)
    write_pages(pool, keys, gen)
    slots = pool.acquire(keys[:2])
    assert slots == [pool._dev.lookup(key_id(k)) for k in keys[:2]]
    assert pool.evict(tier="device") == 2
    assert pool.match(keys).device == 2
    pool.release(slots)
    assert pool.evict(tier="device") == 2


def test_duplicate_commit_keeps_the_first_page(registry, gen):
    pool = make_pool(registry)
    keys = keys_for(pool, 2)
    expected = write_pages(pool, keys, gen)
    slots = pool.allocate(2)
    fill_random(pool, slots, gen)
    assert pool.commit(keys, slots) == 0
    assert pool.stats()["duplicate_commits"] == 2
    pool.release(slots)
    assert pool.stats()["states"]["device"]["filling"] == 0
    load_and_check(pool, keys, expected)  # device-to-device copies of the first pages


def test_load_of_a_missing_key_moves_nothing(registry, gen):
    pool = make_pool(registry)
    keys = keys_for(pool, 3)
    write_pages(pool, keys[:2], gen)
    slots = pool.allocate(3)
    before = pool.stats()
    with pytest.raises(KeyError, match="1 of 3 keys"):
        pool.load(keys, slots)
    after = pool.stats()
    assert before["pages_moved"] == after["pages_moved"] and before["states"] == after["states"]


def test_bad_inputs_give_clear_errors(registry, gen):
    pool = make_pool(registry)
    with pytest.raises(ValueError, match="int >= 0"):
        pool.allocate(-1)
    slots = pool.allocate(2)
    keys = keys_for(pool, 2)
    with pytest.raises(ValueError, match="2 keys for 1 slots"):
        pool.commit(keys, slots[:1])
    with pytest.raises(ValueError, match="out of range"):
        pool.commit(keys[:1], [99])
    with pytest.raises(ValueError, match="must not repeat"):
        pool.commit([keys[0], keys[0]], slots)
    free_slot = next(s for s in range(8) if s not in slots)
    with pytest.raises(ValueError, match=f"slot {free_slot} must be an allocated"):
        pool.commit(keys[:1], [free_slot])
    with pytest.raises(ValueError, match="not held"):
        pool.release([free_slot])
    with pytest.raises(ValueError, match="tier must be"):
        pool.evict(tier="remote")
    with pytest.raises(ValueError, match="write_policy"):
        make_pool(registry, write_policy="write_around")
    with pytest.raises(IndexError, match="layer 3"):
        pool.device_kv(3)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.allocate(1)


def test_host_tier_sized_in_bytes(registry):
    fmt = small_format()
    pool = make_pool(registry, fmt, host_bytes=10 * fmt.page_bytes + 7)
    assert pool.host_tier.num_pages == 10 and pool.stats()["states"]["host"]["free"] == 10
    with pytest.raises(ValueError, match="host_bytes must be an int of at least one page"):
        make_pool(registry, fmt, host_bytes=fmt.page_bytes - 1)


def test_illegal_transition_raises(registry):
    from kvtier.index import IllegalTransition

    pool = make_pool(registry)
    with pytest.raises(IllegalTransition, match="FREE -> RESIDENT"):
        pool._dev.set_state(0, PageState.RESIDENT)


def test_namespaces_never_share_keys():
    fmt = small_format()
    tokens = list(range(64))
    base = prefix_keys(tokens, 8, Namespace("m", fmt.fingerprint, 0))
    others = [
        prefix_keys(tokens, 8, Namespace("m2", fmt.fingerprint, 0)),
        prefix_keys(tokens, 8, Namespace("m", small_format(dtype="fp8_e5m2").fingerprint, 0)),
        prefix_keys(tokens, 8, Namespace("m", small_format(scale="per_token_head").fingerprint, 0)),
        prefix_keys(tokens, 8, Namespace("m", small_format(page_size=16).fingerprint, 0)),
        prefix_keys(tokens, 8, Namespace("m", fmt.fingerprint, 1)),
    ]
    for keys in others:
        assert not set(keys) & set(base)
    # Chaining: a continued chain equals the whole chain.
    assert prefix_keys(tokens[32:], 8, Namespace("m", fmt.fingerprint, 0), prior=base[3]) == base[4:]
    assert len(prefix_keys(tokens[:13], 8, Namespace("m", fmt.fingerprint, 0))) == 1


def test_prefix_keys_are_the_documented_chain_and_older_schemes_miss():
    """Scheme 3: key_i = BLAKE2s-256(key_{i-1} || page i's token ids as little-endian uint32),
    key_{-1} the namespace digest, which names the scheme; scheme 2's SHA-256 chain over a
    scheme-2 namespace never equals it."""
    import hashlib
    import struct

    ns = Namespace("m", small_format().fingerprint, 0)
    tokens = [7, 2**32 - 1, 0, 123456, 42, 99]
    prev = bytes.fromhex(ns.digest)
    want = []
    for lo in range(0, 6, 2):
        prev = hashlib.blake2s(prev + struct.pack("<2I", *tokens[lo : lo + 2])).digest()
        want.append(prev)
    assert prefix_keys(tokens, 2, ns) == want
    assert ns.digest == hashlib.sha256(
        f"kvtier-ns|keys=3|model=m|format={ns.fingerprint}|rank=0".encode()).hexdigest()
    old_start = bytes.fromhex(hashlib.sha256(f"kvtier-ns|keys=2|model=m|format={ns.fingerprint}|rank=0".encode()).hexdigest())
    old = hashlib.sha256(old_start + struct.pack("<2I", *tokens[:2])).digest()
    assert old not in want


def test_pools_of_different_formats_do_not_hit_each_other(registry, gen):
    a = make_pool(registry, small_format("fp8_e4m3"), model="m")
    b = make_pool(registry, small_format("fp8_e5m2"), model="m")
    tokens = list(range(32))
    write_pages(a, prefix_keys(tokens, 8, a.namespace), gen)
    assert b.match(prefix_keys(tokens, 8, b.namespace)).total == 0
    assert a.match(prefix_keys(tokens, 8, a.namespace)).total == 4


def test_close_flushes_dirty_pages(registry, gen):
    pool = make_pool(registry, write_policy="write_back")
    write_pages(pool, keys_for(pool, 5), gen)
    pool.close()
    assert pool.stats()["pages_moved"]["device_to_host"] == 5
    pool.close()


def test_reload_transform_runs_on_landed_pages(registry, gen):
    seen = []

    def transform(layer, plane, pages, slots):
        seen.append((layer, plane, sorted(slots.tolist())))
        pages[slots] = pages[slots] * 2

    fmt = small_format("bf16", "none")
    pool = make_pool(registry, fmt, write_policy="write_back", transform=transform)
    keys = keys_for(pool, 2)
    slots = pool.allocate(2)
    fill_random(pool, slots, gen)
    orig = pool.device_tier.kv[:, :, slots].clone()
    pool.commit(keys, slots)
    pool.release(slots)
    pool.evict(tier="device")
    back = pool.allocate(2)
    pool.load(keys, back).wait()
    assert torch.equal(pool.device_tier.kv[:, :, back], orig * 2)
    assert sorted(seen) == sorted((l, p, sorted(back)) for l in range(3) for p in range(2))


def _page_for(pool, key):
    """Deterministic page content of a key, so any thread can check any page."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:6], "little"))
    fmt = pool.fmt
    data = (torch.randn(fmt.num_layers, fmt.planes, *fmt.plane_shape, generator=g) * 3).to(fmt.device_torch_dtype)
    scales = torch.rand(fmt.num_layers, fmt.planes, *fmt.scale_shape, generator=g) + 0.01
    return data, scales


def run_stress(pool, threads=4, iterations=60, lossless=False):
    """Threads commit, match and load at once; every loaded page must be the page of its key.

    lossless: every page stays loadable from some tier, so a load may never miss.
    Returns how many pages were loaded and checked.
    """
    dev = pool.device_tier
    errors = []
    loaded = [0]

    def worker(tid):
        try:
            rng = torch.Generator().manual_seed(tid)
            mine = []
            for it in range(iterations):
                start = tid * 100_000 + it * 64
                keys = prefix_keys(list(range(start, start + 64)), 8, pool.namespace)
                slots = pool.allocate(len(keys))
                for k, s in zip(keys, slots):
                    data, scales = _page_for(pool, k)
                    dev.kv[:, :, s] = data
                    dev.scales[:, :, s] = scales
                pool.commit(keys, slots)
                pool.release(slots)
                mine.extend(keys)
                pool_of = mine if lossless else mine[-48:]
                pick = [pool_of[int(i)] for i in torch.randint(0, len(pool_of), (6,), generator=rng)]
                pick = list(dict.fromkeys(pick))
                m = pool.match(pick)
                assert 0 <= m.device <= m.total <= len(pick)
                if pool.remote is not None and it % 3 == 0:
                    pool.prefetch_to_host(mine[: 8 * (it // 3 + 1)])  # old pages, racing the loads
                try:
                    handle = pool.load(pick)
                except KeyError:
                    if lossless:
                        raise
                    continue  # dropped or evicted from every tier: allowed without a remote tier
                except PoolExhausted:
                    continue
                handle.wait()
                for k, s in zip(pick, handle.slots):
                    data, scales = _page_for(pool, k)
                    if not (torch.equal(dev.kv[:, :, s].view(torch.uint8), data.view(torch.uint8)) and torch.equal(dev.scales[:, :, s], scales)):
                        errors.append(f"thread {tid}: key {k[:8]} in slot {s} holds another page")
                loaded[0] += len(pick)
                pool.release(handle.slots)
        except Exception as exc:  # surfaced below with the thread's id
            errors.append(f"thread {tid}: {exc!r}")

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors, errors[:5]
    pool._dev.check()
    pool._host.check()
    s = pool.stats()
    assert s["held"]["device"] == 0
    assert s["states"]["device"]["filling"] == 0
    return loaded[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_threads_committing_matching_and_loading_never_mix_pages(registry, policy):
    pool = make_pool(registry, small_format(), write_policy=policy, device_pages=64, host_pages=128)
    assert run_stress(pool) > 0  # how many loads find their pages depends on the interleaving
    pool.flush()
    assert pool.stats()["inflight"] == 0 and pool.stats()["states"]["device"]["loading"] == 0
    pool.close()
