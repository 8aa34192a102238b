import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import PageState, TieredPool, metrics, prefix_keys
from tests.conftest import fill_random, small_format


def _samples(registry) -> dict:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _get(samples, name, **labels):
    labels = {"pool": "m1", "model": "default", "rank": "0", **labels}
    return samples[(name, tuple(sorted(labels.items())))]


def test_prometheus_metrics_match_stats(registry, gen):
    pool = TieredPool(small_format(), device_pages=4, host_pages=8, write_policy="write_back", registry=registry, name="m1")
    keys = prefix_keys(np.arange(48), 8, pool.namespace)
    slots = pool.allocate(4)
    fill_random(pool, slots, gen)
    pool.commit(keys[:4], slots)
    pool.release(slots)
    more = pool.allocate(2)  # evicts two dirty pages: two device->host copies
    pool.match(keys)
    s = pool.stats()
    assert s["pages_moved"]["device_to_host"] == 2 and s["evictions"]["device"] == 2
    m = _samples(registry)
    assert _get(m, "kvtier_pages_moved_total", direction="device_to_host") == 2
    assert _get(m, "kvtier_bytes_moved_total", direction="device_to_host") == 2 * pool.fmt.page_bytes
    assert _get(m, "kvtier_evictions_total", tier="device") == 2
    # keys[0:2] were evicted to host, keys[2:4] stay on device, keys[4:6] were never written.
    assert s["hits"] == {"device": 2, "host": 2, "remote": 0} and s["misses"] == 2
    assert _get(m, "kvtier_hits_total", tier="host") == 2 and _get(m, "kvtier_hits_total", tier="device") == 2
    assert _get(m, "kvtier_misses_total") == 2
    assert _get(m, "kvtier_pages", tier="device", state="filling") == 2
    assert _get(m, "kvtier_held_pages") == 2
    for reason in ("selective", "not_encodable", "close"):  # remote_unavailable: only with a remote tier
        assert _get(m, "kvtier_dropped_pages_total", reason=reason) == 0
    # One commit and one match were timed; their histograms count them.
    assert _get(m, "kvtier_call_seconds_count", op="commit") == 1
    assert _get(m, "kvtier_call_seconds_count", op="match") == 1
    assert _get(m, "kvtier_call_seconds_bucket", op="match", le="+Inf") == 1
    assert _get(m, "kvtier_call_seconds_sum", op="match") > 0
    pool.release(more)
    pool.close()
    assert not any(name == "kvtier_pages_moved_total" for name, _ in _samples(registry))


def test_pool_names_are_unique_per_registry(registry):
    a = TieredPool(small_format(), device_pages=4, host_pages=4, registry=registry, name="same")
    with pytest.raises(ValueError, match="'same' is already registered"):
        TieredPool(small_format(), device_pages=4, host_pages=4, registry=registry, name="same")
    a.close()
    TieredPool(small_format(), device_pages=4, host_pages=4, registry=registry, name="same").close()


def _families(registry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


REMOTE_ONLY_FAMILIES = {"kvtier_remote_failures", "kvtier_backup_queue_pages", "kvtier_remote_breaker_state",
                        "kvtier_remote_breaker_opens"}


def test_a_pool_without_a_remote_tier_exports_no_remote_series(registry, gen):
    pool = TieredPool(small_format(), device_pages=4, host_pages=8, registry=registry, name="m1")
    keys = prefix_keys(np.arange(32), 8, pool.namespace)
    slots = pool.allocate(4)
    fill_random(pool, slots, gen)
    pool.commit(keys, slots)
    pool.release(slots)
    pool.match(keys)
    pool.release(pool.load(keys[:2]).slots)
    families = _families(registry)
    assert not REMOTE_ONLY_FAMILIES & families.keys()
    assert not any(name.startswith("kvtier_remote_store_") for name in families)
    samples = [s for f in families.values() for s in f.samples]
    assert not any("remote" in value for s in samples for value in s.labels.values())
    # What the pool does have is all there: every local tier, direction, reason, page state and call.
    m = _samples(registry)
    assert (_get(m, "kvtier_hits_total", tier="device"), _get(m, "kvtier_hits_total", tier="host")) == (4, 0)
    for tier in ("device", "host"):
        _get(m, "kvtier_evictions_total", tier=tier)
        assert sum(_get(m, "kvtier_pages", tier=tier, state=st.name.lower()) for st in PageState) == \
            {"device": 4, "host": 8}[tier]
    for d in ("device_to_host", "host_to_device", "device_to_device"):
        _get(m, "kvtier_pages_moved_total", direction=d)
        _get(m, "kvtier_bytes_moved_total", direction=d)
    for reason in ("selective", "not_encodable", "close"):
        _get(m, "kvtier_dropped_pages_total", reason=reason)
    for op in ("load", "commit", "match"):
        assert _get(m, "kvtier_call_seconds_count", op=op) == 1
        assert len([k for k in m if k[0] == "kvtier_call_seconds_bucket" and ("op", op) in k[1]]) == 12
    assert {dict(labels)["op"] for name, labels in m if name == "kvtier_call_seconds_sum"} == {"load", "commit", "match"}
    pool.close()
    assert not _families(registry), "a registry without pools exports no kvtier families"


def test_a_pool_with_a_remote_tier_exports_its_remote_series(registry, gen, tmp_path):
    pytest.importorskip("nixl_cu13")
    local = TieredPool(small_format(), device_pages=4, host_pages=8, registry=registry, name="local")
    pool = TieredPool(small_format(), device_pages=4, host_pages=8, registry=registry, name="m1",
                      write_policy="write_through", remote=str(tmp_path))
    keys = prefix_keys(np.arange(32), 8, pool.namespace)
    slots = pool.allocate(4)
    fill_random(pool, slots, gen)
    pool.commit(keys, slots)
    pool.release(slots)
    pool.flush()
    families = _families(registry)
    assert REMOTE_ONLY_FAMILIES <= families.keys()
    m = _samples(registry)
    assert _get(m, "kvtier_hits_total", tier="remote") == 0
    assert _get(m, "kvtier_pages_moved_total", direction="host_to_remote") == 4
    assert _get(m, "kvtier_dropped_pages_total", reason="remote_unavailable") == 0
    assert _get(m, "kvtier_remote_failures_total", op="write") == 0
    assert _get(m, "kvtier_remote_breaker_state") == 0 and _get(m, "kvtier_backup_queue_pages") == 0
    assert _get(m, "kvtier_call_seconds_count", op="remote_put") >= 1
    assert _get(m, "kvtier_call_seconds_bucket", op="remote_get", le="+Inf") == 0
    assert _get(m, "kvtier_remote_store_namespace_pages") == pool.remote_stats()["pages"] == 4
    assert _get(m, "kvtier_remote_store_pages") == pool.remote_stats()["store_pages"] == 4
    assert _get(m, "kvtier_remote_store_namespace_used_bytes") == _get(m, "kvtier_remote_store_used_bytes") > 0
    # The pool without a remote tier beside it still has none of these series.
    assert not any(("pool", "local") in labels and any("remote" in v for _, v in labels) for _, labels in m)
    assert not any(("pool", "local") in labels for name, labels in m if name.startswith("kvtier_remote_"))
    pool.close()
    local.close()


def _traffic(pool, gen, pages: int) -> None:
    """Commit `pages` pages through a device tier of half as many: evictions, copies down, hits."""
    keys = prefix_keys(np.arange(pages * pool.fmt.page_size), pool.fmt.page_size, pool.namespace)
    for chunk in (keys[: pages // 2], keys[pages // 2 :]):
        slots = pool.allocate(len(chunk))
        fill_random(pool, slots, gen)
        pool.commit(chunk, slots)
        pool.release(slots)
    pool.match(keys)
    pool.release(pool.load(keys[:2]).slots)
    pool.flush()


def _parsed(text: bytes) -> dict:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            out[(family.name, family.type, family.documentation, sample.name,
                 tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_exposition_writes_what_generate_latest_writes(registry, gen, tmp_path):
    """Same families, HELP/TYPE lines, samples and values, byte for byte: label values that need
    escaping, values of a million and more (Go's exponent form), local and remote pools side by side."""
    fmt = small_format(head_dim=256, page_size=32)
    pools = [TieredPool(fmt, device_pages=8, host_pages=32, write_policy="write_back", registry=registry,
                        name='odd "name" \\ with\nnewline ü', model="draft", rank=1)]
    try:
        import nixl_cu13  # noqa: F401
        pools.append(TieredPool(fmt, device_pages=8, host_pages=32, write_policy="write_through", registry=registry,
                                name="remote", remote=str(tmp_path)))
    except ImportError:
        pass
    for pool in pools:
        _traffic(pool, gen, 16)
    assert pools[0].stats()["bytes_moved"]["device_to_host"] >= 1_000_000
    # Nothing runs between the two scrapes, so both see the same counters and histograms.
    text, fast = generate_latest(registry), metrics.exposition(registry)
    assert fast == text
    parsed = _parsed(fast)
    assert parsed == _parsed(text) and len(parsed) == (70 if len(pools) == 1 else 70 + 124)
    assert _get({k[3:]: v for k, v in parsed.items()}, "kvtier_bytes_moved_total", pool=pools[0].name, model="draft",
                rank="1", direction="device_to_host") == pools[0].stats()["bytes_moved"]["device_to_host"]
    # The pools themselves, registered anywhere: the same text.
    assert metrics.exposition(pools) == fast
    for pool in pools:
        pool.close()
    assert metrics.exposition(registry) == generate_latest(registry) == b""


def test_exposition_of_pools_without_a_registry(gen):
    pool = TieredPool(small_format(), device_pages=4, host_pages=8, registry=None, name="alone")
    _traffic(pool, gen, 8)
    other = CollectorRegistry()
    twin = TieredPool(small_format(), device_pages=4, host_pages=8, registry=other, name="alone")
    samples = _parsed(metrics.exposition([pool]))
    assert samples.keys() == _parsed(generate_latest(other)).keys()
    s = pool.stats()
    key = ("kvtier_hits", "counter", "Pages of matched prefixes, by the nearest tier holding them (MatchResult)",
           "kvtier_hits_total", (("model", "default"), ("pool", "alone"), ("rank", "0"), ("tier", "device")))
    assert samples[key] == s["hits"]["device"] > 0
    pool.close()
    twin.close()


def test_the_readme_names_exported_metrics_only_with_hand_written_help(registry, tmp_path):
    """Every kvtier_* name the README gives is a name Prometheus shows (TYPE lines: counters with
    _total); `_suffix` shorthands after a full kvtier_remote_store_* name count as that prefix."""
    import re
    from pathlib import Path

    pytest.importorskip("nixl_cu13")
    pool = TieredPool(small_format(), device_pages=4, host_pages=8, registry=registry, name="m1", remote=str(tmp_path))
    text = generate_latest(registry).decode()
    pool.close()
    exported = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    named = set(re.findall(r"`(kvtier_[a-z_]*[a-z])[{`]", readme))
    section = readme[readme.index("### Metrics") : readme.index("\n## ", readme.index("### Metrics"))]
    named |= {"kvtier_remote_store" + short for short in re.findall(r"`(_[a-z_]+)`", section)}
    assert "kvtier_dropped_pages_total" in named and "kvtier_remote_store_namespace_pages" in named
    cluster = {name for name in named if name.startswith("kvtier_tier_")}  # tests/test_cluster_tier.py
    assert named - cluster <= exported, sorted(named - cluster - exported)
    assert not [name for name in exported if "store_store" in name]
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    assert all(len(doc) > 20 and not doc.startswith("Remote page store ") for doc in helps.values()), helps
