import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import TieredPool, prefix_keys
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
    assert _get(m, "kvtier_remote_breaker_state") == 0
    for reason in ("selective", "remote_unavailable", "not_encodable", "close"):
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
