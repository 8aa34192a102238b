from prometheus_client import generate_latest

from kvtier import TieredPool, prefix_keys
from tests.conftest import fill_random, small_format


def test_prometheus_metrics_match_stats(registry, gen):
    pool = TieredPool(small_format(), device_pages=4, host_pages=8, write_policy="write_back", registry=registry, name="m1")
    keys = prefix_keys(list(range(48)), 8, pool.namespace)
    slots = pool.allocate(4)
    fill_random(pool, slots, gen)
    pool.commit(keys[:4], slots)
    pool.release(slots)
    more = pool.allocate(2)  # evicts two dirty pages: two device->host copies
    pool.match(keys)
    s = pool.stats()
    assert s["pages_moved"]["device_to_host"] == 2 and s["evictions"]["device"] == 2
    text = generate_latest(registry).decode()
    assert 'kvtier_pages_moved_total{direction="device_to_host",pool="m1"} 2.0' in text
    assert f'kvtier_bytes_moved_total{{direction="device_to_host",pool="m1"}} {2.0 * pool.fmt.page_bytes}' in text
    assert 'kvtier_evictions_total{pool="m1",tier="device"} 2.0' in text
    # keys[0:2] were evicted to host, keys[2:4] stay on device, keys[4:6] were never written.
    assert s["hits"] == {"device": 2, "host": 2, "remote": 0} and s["misses"] == 2
    assert 'kvtier_hits_total{pool="m1",tier="host"} 2.0' in text
    assert 'kvtier_hits_total{pool="m1",tier="device"} 2.0' in text
    assert 'kvtier_misses_total{pool="m1"} 2.0' in text
    assert 'kvtier_pages{pool="m1",state="filling",tier="device"} 2.0' in text
    pool.release(more)
    pool.close()
    assert "kvtier_pages_moved_total" not in generate_latest(registry).decode()
