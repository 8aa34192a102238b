"""The decoder end to end on a real TieredPool over the model's own KV tensors.

Runs on the CPU (Triton interpreter, torch copy engine) and, with CUDA, on the GPU with the
CUDA copy engine; the same assertions hold on both. Every workload is small: the interpreter
runs each kernel program in Python.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvtier import PoolExhausted, TieredPool
from kvtier.decode.model import DecoderConfig, PagedKV, TinyDecoder
from kvtier.decode.runner import DecodeRunner, Request, shared_prefix_workload

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = DecoderConfig(vocab=256, hidden=128, layers=2, q_heads=4, kv_heads=2, head_dim=64, ffn=256, seed=7)
PAGE = 16
# Largest |logit| difference allowed between the fp8-in-kernel path and the upcast-to-bf16 path,
# and between decode and recomputing by prefill. The two paths read the same fp8 values, but
# the bf16 pages round value * scale to bf16 (half an ulp, 2**-8 relative) where the fp8 kernel
# applies the scale in fp32; through bf16 activations that moves logits of magnitude up to 3.8
# by 0.025-0.031 on this workload (per_page_head, per_token_head; CPU, 2026-12-02), and
# decode against recompute by 0.023. The bound is four times the worst of those.
PATHS_LOGIT_TOL = 0.125


@pytest.fixture(scope="module")
def model():
    return TinyDecoder(CONFIG, DEVICE)


def workload(requests=6, new_tokens=5):
    """Three system prompts of three pages each, round robin, with user turns that end mid-page."""
    return shared_prefix_workload(requests, 3, 3 * PAGE, 21, new_tokens, CONFIG.vocab, seed=3)


def run(model, requests, *, path="fp8", scale="per_page_head", layout="nhd", device_pages=200, host_pages=None,
        remote=None, batch=2, layer_ordered_loads=False):
    fmt = CONFIG.page_format(PAGE, scale=scale, layout=layout, device_dtype="bf16" if path == "bf16" else None)
    kv = PagedKV(fmt, device_pages, DEVICE)
    pool = TieredPool(fmt, host_pages=host_pages or device_pages, remote=remote, registry=CollectorRegistry(),
                      layer_ordered_loads=layer_ordered_loads, **kv.pool_args())
    with pool:
        out = DecodeRunner(model, kv, pool, keep_logits=True).run(requests, batch)
        return out, pool.stats()


def test_pool_manages_the_models_own_tensors():
    fmt = CONFIG.page_format(PAGE)
    kv = PagedKV(fmt, 8, DEVICE)
    with TieredPool(fmt, registry=None, **kv.pool_args()) as pool:
        for layer in range(CONFIG.layers):
            k, v = pool.device_kv(layer)
            ks, vs = pool.device_scales(layer)
            assert k.data_ptr() == kv.k[layer].data_ptr() and v.data_ptr() == kv.v[layer].data_ptr()
            assert ks.data_ptr() == kv.k_scales[layer].data_ptr() and vs.data_ptr() == kv.v_scales[layer].data_ptr()
        assert pool.device_tier.num_pages == 8


@pytest.mark.parametrize(
    "path,scale,layout",
    [("fp8", "per_page_head", "nhd"), ("fp8", "per_token_head", "hnd"), ("bf16", "per_page_head", "hnd"),
     ("bf16", "per_tensor", "nhd")],
)
def test_offloaded_run_matches_all_resident(model, tmp_path, path, scale, layout):
    """A device too small for the workload (pages through host and remote) gives the same logits, bit for bit."""
    pytest.importorskip("nixl_cu13", reason="the remote tier needs NIXL (pip install kvtier[nixl])")
    pytest.importorskip("crc32c", reason="the remote tier needs crc32c (pip install kvtier[nixl])")
    requests = workload()
    resident, resident_stats = run(model, requests, path=path, scale=scale, layout=layout)
    offloaded, stats = run(model, requests, path=path, scale=scale, layout=layout, device_pages=10, host_pages=10,
                           remote=tmp_path / "store")
    assert resident_stats["evictions"].get("device", 0) == 0
    assert resident_stats["hits"]["device"] > 0
    assert stats["hits"]["host"] > 0 and stats["hits"]["remote"] > 0
    assert stats["bytes_moved"]["host_to_device"] > 0 and stats["bytes_moved"]["remote_to_host"] > 0
    for a, b in zip(resident, offloaded):
        assert a.hit.total == b.hit.total
        assert a.tokens == b.tokens
        assert len(a.logits) == len(b.logits) == a.request.max_new_tokens
        for la, lb in zip(a.logits, b.logits):
            assert torch.isfinite(la).all()
            assert torch.equal(la, lb)


def test_fp8_kernel_path_and_upcast_path_agree(model):
    requests = workload(requests=4, new_tokens=8)
    fp8, _ = run(model, requests, path="fp8", scale="per_token_head")
    bf16, _ = run(model, requests, path="bf16", scale="per_token_head")
    worst = 0.0
    for a, b in zip(fp8, bf16):
        assert a.tokens == b.tokens
        if a.hit.total == 0:  # a whole-prompt prefill reads the same bf16 values on both paths
            assert torch.equal(a.logits[0], b.logits[0])
        worst = max(worst, max((la - lb).abs().max().item() for la, lb in zip(a.logits, b.logits)))
    assert 0 < worst <= PATHS_LOGIT_TOL


def test_short_turn_after_cached_pages_reads_them_in_place(model, monkeypatch):
    """Prefill after a prefix hit: the paged kernel (one row per new token) against the torch path
    that gathers the prefix and runs SDPA, on the same pages."""
    import kvtier.decode.model as model_module

    requests = workload(requests=4, new_tokens=3)
    in_place, _ = run(model, requests, scale="per_token_head")
    monkeypatch.setattr(model_module, "EXTEND_MAX_TOKENS", 0)
    gathered, _ = run(model, requests, scale="per_token_head")
    hits = [(a, b) for a, b in zip(in_place, gathered) if a.hit.total]
    assert hits, "the workload has no prefix hits"
    for a, b in zip(in_place, gathered):
        assert a.hit.total == b.hit.total and a.tokens == b.tokens
        diff = (a.logits[0] - b.logits[0]).abs().max().item()
        if a.hit.total:
            assert diff <= PATHS_LOGIT_TOL
        else:
            assert diff == 0


def test_decode_agrees_with_recomputing_the_sequence(model):
    """The last decode step's logits against a fresh prefill of the whole sequence (SDPA over the pages)."""
    request = workload(requests=1, new_tokens=20)[0]
    [done], _ = run(model, [request], scale="per_token_head", layout="hnd")
    sequence = list(request.prompt) + done.tokens[:-1]
    [again], _ = run(model, [Request(tuple(sequence), 1)], scale="per_token_head", layout="hnd")
    assert again.tokens[0] == done.tokens[-1]
    assert (again.logits[0] - done.logits[-1]).abs().max().item() <= PATHS_LOGIT_TOL


def test_failed_wave_releases_its_pages(model):
    """A device that cannot hold a whole wave raises PoolExhausted and leaves no page held."""
    requests = workload(requests=3, new_tokens=4)
    fmt = CONFIG.page_format(PAGE)
    kv = PagedKV(fmt, 8, DEVICE)
    with TieredPool(fmt, host_pages=16, registry=None, **kv.pool_args()) as pool:
        runner = DecodeRunner(model, kv, pool)
        with pytest.raises(PoolExhausted):
            runner.run(requests, 3)
        assert pool.stats()["held"]["device"] == 0
        done = runner.run(requests[:1], 1)
        assert len(done[0].tokens) == 4


def test_runner_refuses_a_pool_over_other_memory(model):
    fmt = CONFIG.page_format(PAGE)
    kv = PagedKV(fmt, 8, DEVICE)
    with TieredPool(fmt, device=DEVICE, device_pages=8, registry=None) as pool:
        with pytest.raises(ValueError, match="the pool must manage the model's own KV tensors"):
            DecodeRunner(model, kv, pool)
    other = CONFIG.page_format(PAGE, scale="per_token_head")
    with TieredPool(other, registry=None, **PagedKV(other, 8, DEVICE).pool_args()) as pool:
        with pytest.raises(ValueError, match="pool format .* differs from the KV cache's"):
            DecodeRunner(model, kv, pool)


def test_bad_requests_and_configs():
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
        Request((1, 2, 3), 0)
    with pytest.raises(ValueError, match="at least one token"):
        Request((), 3)
    with pytest.raises(ValueError, match="q_heads=6 must be a multiple of kv_heads=4"):
        DecoderConfig(q_heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="head_dim must be even"):
        DecoderConfig(head_dim=33)
    with pytest.raises(ValueError, match="num_pages must be a positive int, got 0"):
        PagedKV(CONFIG.page_format(PAGE), 0, DEVICE)
    with pytest.raises(ValueError, match="skew must be >= 0"):
        shared_prefix_workload(2, 1, 16, 4, 1, CONFIG.vocab, skew=-1.0)


def test_workload_reuses_system_prompts():
    robin = shared_prefix_workload(6, 3, 32, 5, 2, CONFIG.vocab, seed=1)
    assert [r.prompt[:32] for r in robin[:3]] == [r.prompt[:32] for r in robin[3:]]
    assert len({r.prompt[:32] for r in robin}) == 3 and len({r.prompt for r in robin}) == 6
    assert all(len(r.prompt) == 37 and r.max_new_tokens == 2 for r in robin)
    zipf = shared_prefix_workload(400, 8, 32, 5, 2, CONFIG.vocab, seed=1, skew=1.0)
    counts = {}
    for r in zipf:
        counts[r.prompt[:32]] = counts.get(r.prompt[:32], 0) + 1
    ranked = sorted(counts.values(), reverse=True)
    # Zipf weights 1/rank: the hottest prompt takes about 1/H(8) = 37% of requests, the coldest 5%.
    assert ranked[0] > 0.25 * 400 and ranked[-1] < 0.1 * 400


def test_host_hits_loaded_with_split_layers_match_all_resident(model, monkeypatch):
    """Host hits of several chunks (one page a chunk here): each chunk's first layer, then the
    other layers of all of them, each waited for just before its layer's attention; the logits
    are those of the all-resident run, bit for bit."""
    from kvtier.pool import loading

    requests = workload()
    resident, _ = run(model, requests, scale="per_token_head")
    monkeypatch.setattr(loading, "_FIRST_CHUNK", 1)
    monkeypatch.setattr(loading, "_LINK_BYTES_PER_S", 1.0)  # every chunk defers its other layers
    offloaded, stats = run(model, requests, scale="per_token_head", device_pages=10, host_pages=64,
                           layer_ordered_loads=True)
    assert stats["hits"]["host"] > 0 and stats["bytes_moved"]["host_to_device"] > 0
    for a, b in zip(resident, offloaded):
        assert a.hit.total == b.hit.total and a.tokens == b.tokens
        for la, lb in zip(a.logits, b.logits):
            assert torch.isfinite(la).all()
            assert torch.equal(la, lb)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host wait on the device is a CUDA notion")
@pytest.mark.parametrize("scale", ["per_page_head", "per_token_head", "per_tensor"])
def test_a_decode_step_never_waits_for_the_device(model, scale):
    """A decode step queues its work and returns: no read-back and no copy from pageable memory
    (which would wait for everything queued before it, pages still landing from a load
    included). torch's sync debug mode turns any such wait into an error."""
    fmt = CONFIG.page_format(PAGE, scale=scale)
    batch, pages = 3, 4
    kv = PagedKV(fmt, batch * pages, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    table = torch.randperm(batch * pages, generator=gen, device=DEVICE).view(batch, pages).to(torch.int32)
    tails = torch.randn((CONFIG.layers, 2, batch, PAGE, CONFIG.kv_heads, CONFIG.head_dim), generator=gen,
                        device=DEVICE).to(torch.bfloat16)
    for layer in range(CONFIG.layers):  # every page written once, so attention reads real values
        kv.write_pages(layer, table.view(-1).long(), tails[layer, 0].repeat(pages, 1, 1, 1), tails[layer, 1].repeat(pages, 1, 1, 1))
    tokens = torch.randint(CONFIG.vocab, (batch,), generator=gen, device=DEVICE)
    positions = torch.tensor([pages * PAGE - 3, pages * PAGE - 1, 2 * PAGE], device=DEVICE)
    expected = model.decode(kv, tokens, positions, table, tails.clone())  # warm: rope tables, kernels compiled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = model.decode(kv, tokens, positions, table, tails.clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)  # same inputs, same step


def _decode_inputs(fmt, batch, pages, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    table = torch.randperm(batch * pages, generator=gen, device=DEVICE).view(batch, pages).to(torch.int32)
    tails = torch.randn((CONFIG.layers, 2, batch, PAGE, CONFIG.kv_heads, CONFIG.head_dim), generator=gen,
                        device=DEVICE).to(torch.bfloat16)
    tokens = torch.randint(CONFIG.vocab, (batch,), generator=gen, device=DEVICE)
    return table, tails, tokens


def test_decode_graphs_need_cuda(model):
    from kvtier.decode.graphs import DecodeGraphs

    fmt = CONFIG.page_format(PAGE)
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    kv = PagedKV(fmt, 4, "cpu")
    tails = torch.zeros((CONFIG.layers, 2, 2, PAGE, CONFIG.kv_heads, CONFIG.head_dim), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="CUDA device"):
        DecodeGraphs(model, kv, tails, 2, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("scale", ["per_page_head", "per_token_head"])
def test_decode_graphs_replay_the_eager_step(model, scale):
    """Steps replayed from the graphs give the eager steps' logits, pages, scales and tails, with
    wait_layer(i) called once a layer, in order, before layer i's attention; shapes other than
    the captured ones are refused."""
    from kvtier.decode.graphs import DecodeGraphs

    fmt = CONFIG.page_format(PAGE, scale=scale)
    batch, pages = 3, 4
    table, tails, tokens = _decode_inputs(fmt, batch, pages, 21)
    eager_kv, graph_kv = PagedKV(fmt, batch * pages, DEVICE), PagedKV(fmt, batch * pages, DEVICE)
    for kv in (eager_kv, graph_kv):
        for layer in range(CONFIG.layers):
            kv.write_pages(layer, table.view(-1).long(), tails[layer, 0].repeat(pages, 1, 1, 1),
                           tails[layer, 1].repeat(pages, 1, 1, 1))
    eager_tails, graph_tails = tails.clone(), tails.clone()
    graphs = DecodeGraphs(model, graph_kv, graph_tails, batch, pages)
    calls = []
    start = torch.tensor([2 * PAGE + 13, 3 * PAGE - 3, PAGE + 1], device=DEVICE)
    for step in range(4):  # the second step is the first replay; one sequence fills its page on the way
        positions = start + step
        expected = model.decode(eager_kv, tokens, positions, table, eager_tails)
        got = graphs.step(tokens, positions, table, wait_layer=calls.append)
        assert graphs.captured
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        assert calls == list(range(CONFIG.layers))
        calls.clear()
        tokens = expected.argmax(-1)
    torch.cuda.synchronize()
    assert torch.equal(graph_tails, eager_tails)
    for layer in range(CONFIG.layers):
        assert torch.equal(graph_kv.k[layer].view(torch.uint8), eager_kv.k[layer].view(torch.uint8))
        assert torch.equal(graph_kv.v[layer].view(torch.uint8), eager_kv.v[layer].view(torch.uint8))
        assert torch.equal(graph_kv.k_scales[layer], eager_kv.k_scales[layer])
    with pytest.raises(ValueError, match="page table"):
        graphs.step(tokens, start, table[:, :2])
