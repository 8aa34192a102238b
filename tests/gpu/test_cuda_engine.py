"""CudaEngine on a real GPU: every path, dtype, granularity and layout against the CPU twin.

The reference is TorchEngine over CPU copies of the same tiers (the codec as computed on
the CPU). Destinations are poisoned with 0xFF bytes (NaN in every float dtype) before each
copy, inputs are random and never zero, slot sets are random permutations. Ordering tests
write pages on the compute stream and offload them at once through record_ready(), reuse
slots as soon as done() says so, and read each layer right after wait_layer().
Skipped as a whole on machines without CUDA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.format import FP8_MAX, PageFormat, quantize
from kvtier.format.codec import expand_scales
from kvtier.tiers import DeviceTier, HostTier
from kvtier.transfer import TorchEngine, native
from kvtier.transfer.cuda import driver as cuda_driver
from kvtier.transfer.cuda import engine as cuda_engine_module
from kvtier.transfer.cuda.copy_engine_path import batch_memcpy_runtime
from kvtier.transfer.cuda_engine import CudaEngine
from tests.gpu.random_tiers import fill_random

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="CudaEngine tests need a CUDA GPU")]

HAS_CUDA = torch.cuda.is_available()
HAS_CUPY = HAS_CUDA and native.kernels_available() and cuda_driver.available()  # what the kernel path needs
HAS_BATCH_MEMCPY = HAS_CUDA and batch_memcpy_runtime() is not None
CAN_CONVERT = HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)
POISON = 0xFF
DEVICE_PAGES = 48
HOST_PAGES = 64

PASSTHROUGH = [
    PageFormat(3, 2, 64, 16),
    PageFormat(2, 3, 37, 3, dtype="fp16", layout="hnd"),
    PageFormat(2, 1, 576, 4, mla=True),
    PageFormat(1, 8, 128, 128),  # 256 KiB planes: what auto sends to the copy engines
    PageFormat(2, 2, 32, 4, dtype="fp8_e4m3", scale="per_tensor"),
    PageFormat(3, 3, 24, 3, dtype="fp8_e5m2", scale="per_page_head", layout="hnd"),
    PageFormat(2, 3, 24, 3, dtype="fp8_e4m3", scale="per_token_head"),
    PageFormat(2, 1, 40, 5, dtype="fp8_e4m3", scale="per_token_head", mla=True, layout="hnd"),
    PageFormat(2, 2, 16, 2, dtype="fp8_e5m2", allow_unscaled_fp8=True),
]
CONVERTING = [
    PageFormat(2, 2, 64, 8, dtype="fp8_e4m3", scale="per_tensor", device_dtype="bf16"),
    PageFormat(2, 3, 32, 4, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16"),
    PageFormat(2, 3, 32, 4, dtype="fp8_e4m3", scale="per_page_head", layout="hnd", device_dtype="fp16"),
    PageFormat(2, 3, 16, 5, dtype="fp8_e5m2", scale="per_token_head", device_dtype="bf16"),
    PageFormat(2, 3, 16, 5, dtype="fp8_e5m2", scale="per_token_head", layout="hnd", device_dtype="fp16"),
    PageFormat(2, 2, 128, 16, dtype="fp8_e5m2", scale="per_page_head", device_dtype="fp16"),
    PageFormat(2, 3, 24, 3, dtype="fp8_e4m3", scale="per_token_head", device_dtype="bf16"),
    PageFormat(2, 3, 8, 4, dtype="fp8_e4m3", scale="per_page_head", device_dtype="bf16"),
    PageFormat(2, 1, 576, 4, dtype="fp8_e4m3", scale="per_token_head", mla=True, device_dtype="bf16"),
    PageFormat(2, 1, 64, 4, dtype="fp8_e4m3", scale="per_tensor", mla=True, layout="hnd", device_dtype="bf16"),
]


def _path_marks(fmt: PageFormat, path: str) -> list:
    if path == "kernel":
        return [
            pytest.mark.skipif(not HAS_CUPY, reason="kernel path needs cuda-bindings and NVRTC"),
            pytest.mark.skipif(fmt.converts and not CAN_CONVERT, reason="fp8 conversion kernels need sm_89+"),
        ]
    if path == "copy_engine":
        return [pytest.mark.skipif(not HAS_BATCH_MEMCPY, reason="copy_engine path needs cuda-bindings >= 12.8")]
    return []


CASES = [
    pytest.param(fmt, path, id=f"{path}-{fmt.describe()}", marks=_path_marks(fmt, path))
    for fmt in PASSTHROUGH + CONVERTING
    for path in ("kernel", "copy_engine", "torch")
    if not (path == "copy_engine" and fmt.converts)
]


# --- tiers ---------------------------------------------------------------------------------
class Tiers:
    """GPU tiers (pinned host) and CPU twins holding the same bytes."""

    def __init__(self, fmt: PageFormat, seed: int, device_pages: int = DEVICE_PAGES, host_pages: int = HOST_PAGES):
        gen = torch.Generator().manual_seed(seed)
        self.fmt = fmt
        self.cpu_dev = DeviceTier(fmt, device_pages, "cpu")
        self.cpu_host = HostTier(fmt, host_pages, pin=False)
        fill_random(self.cpu_dev, self.cpu_host, gen)
        self.dev = DeviceTier(fmt, device_pages, "cuda")
        self.host = HostTier(fmt, host_pages, pin=True)
        self.dev.kv.copy_(self.cpu_dev.kv)
        if self.dev.scales is not None:
            self.dev.scales.copy_(self.cpu_dev.scales)
        self.host.buffer.copy_(self.cpu_host.buffer)
        torch.cuda.synchronize()

    def poison_device(self) -> None:
        torch.cuda.synchronize()
        for t in (self.dev.kv, self.cpu_dev.kv, self.dev.scales, self.cpu_dev.scales):
            if t is not None:
                t.view(torch.uint8).fill_(POISON)
        torch.cuda.synchronize()

    def poison_host(self) -> None:
        torch.cuda.synchronize()
        self.host.buffer.fill_(POISON)
        self.cpu_host.buffer.fill_(POISON)

    def gpu_reference(self) -> tuple[DeviceTier, HostTier]:
        """GPU tiers with the CPU twins' bytes, for references that must run on the GPU."""
        dev = DeviceTier(self.fmt, self.dev.num_pages, "cuda")
        dev.kv.copy_(self.cpu_dev.kv)
        if dev.scales is not None:
            dev.scales.copy_(self.cpu_dev.scales)
        host = HostTier(self.fmt, self.host.num_pages, pin=True)
        host.buffer.copy_(self.cpu_host.buffer)
        torch.cuda.synchronize()
        return dev, host

    def close(self) -> None:
        self.host.close()
        self.cpu_host.close()


def _meaningful_bytes(fmt: PageFormat) -> torch.Tensor:
    """Mask of a host record's data and scale bytes (its alignment padding left out)."""
    mask = torch.zeros(fmt.page_bytes, dtype=torch.bool)
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            at = fmt.data_offset(layer, plane)
            mask[at : at + fmt.plane_elems * fmt.elem_bytes] = True
            at = fmt.scale_offset(layer, plane)
            mask[at : at + fmt.plane_scale_bytes] = True
    return mask


def _assert_bytes_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a = actual.detach().cpu().contiguous().view(-1).view(torch.uint8)
    b = expected.detach().cpu().contiguous().view(-1).view(torch.uint8)
    assert a.shape == b.shape, f"{what}: {a.numel()} bytes vs {b.numel()} expected"
    diff = (a != b).nonzero().flatten()
    if diff.numel():
        first = diff[:6].tolist()
        raise AssertionError(
            f"{what}: {diff.numel()} of {a.numel()} bytes differ; first at {first}: "
            f"got {a[first].tolist()}, expected {b[first].tolist()}"
        )


def _assert_host_equal(host: HostTier, expected: torch.Tensor, touched: np.ndarray, padding_exact: bool, what: str) -> None:
    """Records equal on their data and scales; untouched slots (and padding, if asked) byte for byte."""
    got = host.buffer.cpu() if host.buffer.device.type != "cpu" else host.buffer
    if padding_exact:
        _assert_bytes_equal(got, expected, what)
        return
    mask = _meaningful_bytes(host.fmt)
    _assert_bytes_equal(got[:, mask], expected[:, mask], f"{what} (data and scales)")
    untouched = np.setdiff1d(np.arange(host.num_pages), touched)
    _assert_bytes_equal(got[untouched], expected[untouched], f"{what} (slots not written)")


def _batch(gen: np.random.Generator, count: int, limit: int, consecutive: bool) -> list[int]:
    if consecutive:
        start = int(gen.integers(0, limit - count + 1))
        return list(range(start, start + count))
    return gen.permutation(limit)[:count].tolist()


# --- bit-exactness against the CPU twin -----------------------------------------------------
@pytest.mark.parametrize("fmt,path", CASES)
def test_offload_matches_cpu_twin(fmt: PageFormat, path: str) -> None:
    rng = np.random.default_rng(1)
    for trial in range(3):
        tiers = Tiers(fmt, seed=100 + trial)
        count = int(rng.integers(1, 40))
        consecutive = trial == 1
        dslots = _batch(rng, count, DEVICE_PAGES, consecutive)
        hslots = _batch(rng, count, HOST_PAGES, consecutive)
        tiers.poison_host()
        engine = CudaEngine(tiers.dev, tiers.host, path=path)
        ticket = engine.offload(dslots, hslots, ready=engine.record_ready())
        assert engine.last_path == path
        ticket.synchronize()
        assert ticket.done()
        if fmt.converts and path == "torch":
            # The torch path quantizes with the codec on the GPU: its own reference.
            ref_dev, ref_host = tiers.gpu_reference()
            ref_host.buffer.fill_(POISON)
            TorchEngine(ref_dev, ref_host).offload(dslots, hslots)
            expected = ref_host.buffer.clone()
            ref_host.close()
        else:
            TorchEngine(tiers.cpu_dev, tiers.cpu_host).offload(dslots, hslots)
            expected = tiers.cpu_host.buffer
        _assert_host_equal(tiers.host, expected, np.array(hslots), path != "torch", f"offload {path} trial {trial}")
        engine.close()
        tiers.close()


@pytest.mark.parametrize("fmt,path", CASES)
def test_reload_matches_cpu_twin(fmt: PageFormat, path: str) -> None:
    rng = np.random.default_rng(2)
    for trial in range(3):
        tiers = Tiers(fmt, seed=200 + trial)
        count = int(rng.integers(1, 40))
        consecutive = trial == 1
        hslots = _batch(rng, count, HOST_PAGES, consecutive)
        dslots = _batch(rng, count, DEVICE_PAGES, consecutive)
        tiers.poison_device()
        engine = CudaEngine(tiers.dev, tiers.host, path=path)
        ticket = engine.reload(hslots, dslots)
        assert engine.last_path == path
        ticket.wait()  # the comparisons below read on the current stream, ordered by wait() only
        TorchEngine(tiers.cpu_dev, tiers.cpu_host).reload(hslots, dslots)
        _assert_bytes_equal(tiers.dev.kv, tiers.cpu_dev.kv, f"reload {path} pages, trial {trial}")
        if fmt.device_has_scales:
            _assert_bytes_equal(tiers.dev.scales, tiers.cpu_dev.scales, f"reload {path} scales, trial {trial}")
        assert ticket.done()
        engine.close()
        tiers.close()


@pytest.mark.parametrize("runs", [8, 1])
@pytest.mark.parametrize("fmt,path", CASES)
def test_reload_layers_matches_cpu_twin(fmt: PageFormat, path: str, runs: int, monkeypatch) -> None:
    """A split load's two calls: the first layer, then the others (one launch a layer, or with
    LAYER_RUNS 1 one launch for all of them); after each, exactly the layers copied so far match
    the twin (the rest still poison), and each ticket is done."""
    if fmt.num_layers < 2:
        pytest.skip("one layer: nothing to split")
    monkeypatch.setattr(cuda_engine_module, "LAYER_RUNS", runs)
    rng = np.random.default_rng(3)
    tiers = Tiers(fmt, seed=300)
    count = int(rng.integers(2, 40))
    hslots = _batch(rng, count, HOST_PAGES, False)
    dslots = _batch(rng, count, DEVICE_PAGES, False)
    tiers.poison_device()
    engine = CudaEngine(tiers.dev, tiers.host, path=path)
    twin = TorchEngine(tiers.cpu_dev, tiers.cpu_host)
    tickets = []
    for layers in (range(1), range(1, fmt.num_layers)):
        ticket = engine.reload_layers(hslots, dslots, layers, ready=engine.record_ready())
        for layer in layers:
            ticket.wait_layer(layer)  # the comparisons below read on the current stream
        twin.reload_layers(hslots, dslots, layers)
        _assert_bytes_equal(tiers.dev.kv, tiers.cpu_dev.kv, f"reload_layers {path} {layers} pages")
        if fmt.device_has_scales:
            _assert_bytes_equal(tiers.dev.scales, tiers.cpu_dev.scales, f"reload_layers {path} {layers} scales")
        tickets.append(ticket)
    for ticket in tickets:
        ticket.synchronize()
        assert ticket.done()
    engine.close()
    tiers.close()


@pytest.mark.parametrize("fmt", [pytest.param(f, id=f.describe()) for f in CONVERTING])
@pytest.mark.skipif(
    not (HAS_CUPY and CAN_CONVERT and HAS_BATCH_MEMCPY), reason="staged upcast needs NVRTC, sm_89+ and cuda-bindings >= 12.8"
)
def test_staged_reload_matches_cpu_twin(fmt: PageFormat) -> None:
    rng = np.random.default_rng(3)
    for trial in range(3):
        tiers = Tiers(fmt, seed=300 + trial)
        count = int(rng.integers(1, 40))
        hslots = _batch(rng, count, HOST_PAGES, trial == 1)
        dslots = _batch(rng, count, DEVICE_PAGES, trial == 1)
        tiers.poison_device()
        engine = CudaEngine(tiers.dev, tiers.host, path="staged")
        ticket = engine.reload(hslots, dslots)
        assert engine.last_path == "staged"
        for layer in range(fmt.num_layers):
            ticket.wait_layer(layer)
        TorchEngine(tiers.cpu_dev, tiers.cpu_host).reload(hslots, dslots)
        _assert_bytes_equal(tiers.dev.kv, tiers.cpu_dev.kv, f"staged reload pages, trial {trial}")
        engine.close()
        tiers.close()
    passthrough = Tiers(PASSTHROUGH[0], seed=310)
    engine = CudaEngine(passthrough.dev, passthrough.host, path="staged")
    engine.reload([1, 2], [3, 4]).synchronize()
    assert engine.last_path in ("kernel", "copy_engine")  # nothing to convert: staged acts as auto
    engine.close()
    passthrough.close()


@pytest.mark.parametrize("fmt,path", CASES)
def test_device_copy_matches_cpu_twin(fmt: PageFormat, path: str) -> None:
    rng = np.random.default_rng(3)
    tiers = Tiers(fmt, seed=300)
    order = rng.permutation(DEVICE_PAGES)
    src, dst = order[:20].tolist(), order[20:40].tolist()
    engine = CudaEngine(tiers.dev, tiers.host, path=path)
    engine.device_copy(src, dst).wait()
    TorchEngine(tiers.cpu_dev, tiers.cpu_host).device_copy(src, dst)
    _assert_bytes_equal(tiers.dev.kv, tiers.cpu_dev.kv, f"device_copy {path} pages")
    if tiers.dev.scales is not None:
        _assert_bytes_equal(tiers.dev.scales, tiers.cpu_dev.scales, f"device_copy {path} scales")
    engine.close()
    tiers.close()


# --- conversion numerics --------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [pytest.param(f, id=f.describe()) for f in CONVERTING])
@pytest.mark.skipif(not (HAS_CUPY and CAN_CONVERT), reason="fused conversion kernels need NVRTC and sm_89+")
def test_quantize_on_offload_against_float64_and_codec(fmt: PageFormat) -> None:
    tiers = Tiers(fmt, seed=400)
    dslots = list(range(5, 21))
    hslots = list(range(30, 46))
    engine = CudaEngine(tiers.dev, tiers.host, path="kernel")
    engine.offload(dslots, hslots, ready=engine.record_ready()).synchronize()
    fmax = FP8_MAX[fmt.dtype]
    # Half a step of the fp8 grid, relative for normals and absolute (times scale) for subnormals.
    relative, subnormal = (2.0**-4, 2.0**-10) if fmt.dtype == "fp8_e4m3" else (2.0**-3, 2.0**-17)
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            x = tiers.cpu_dev.kv[layer, plane][dslots].double()
            q = tiers.host.data_view(layer, plane)[hslots]
            s = tiers.host.scale_view(layer, plane)[hslots]
            codec_q, codec_s = quantize(x.to(fmt.device_torch_dtype), fmt.dtype, fmt.scale, fmt.layout)
            _assert_bytes_equal(q, codec_q, f"layer {layer} plane {plane} fp8 codes vs codec")
            _assert_bytes_equal(s, codec_s, f"layer {layer} plane {plane} scales vs codec")
            scale64 = expand_scales(s.double(), fmt.scale, fmt.layout)
            back = q.double() * scale64
            # The slack covers the fp32 division before rounding to fp8.
            bound = torch.maximum(x.abs() * relative, scale64 * subnormal) * (1 + 1e-6)
            worst = ((back - x).abs() - bound).max().item()
            assert worst <= 0, f"layer {layer} plane {plane}: dequantized error exceeds half an fp8 step by {worst}"
            amax = x.abs().amax(dim=tuple(range(1, 4))) if fmt.scale == "per_tensor" else None
            if amax is not None:
                assert torch.allclose(s.double(), amax / fmax, rtol=2**-23, atol=0)
    engine.close()
    tiers.close()


@pytest.mark.parametrize("fmt", [pytest.param(f, id=f.describe()) for f in CONVERTING])
@pytest.mark.skipif(not (HAS_CUPY and CAN_CONVERT), reason="fused conversion kernels need NVRTC and sm_89+")
def test_upcast_on_reload_against_float64(fmt: PageFormat) -> None:
    tiers = Tiers(fmt, seed=500)
    hslots = list(range(3, 19))
    dslots = list(range(40, 24, -1))
    tiers.poison_device()
    engine = CudaEngine(tiers.dev, tiers.host, path="kernel")
    engine.reload(hslots, dslots).synchronize()
    precision = 2.0**-8 if fmt.device_dtype == "bf16" else 2.0**-11
    for layer in range(fmt.num_layers):
        for plane in range(fmt.planes):
            q = tiers.host.data_view(layer, plane)[hslots].double()
            s = expand_scales(tiers.host.scale_view(layer, plane)[hslots].double(), fmt.scale, fmt.layout)
            exact = q * s
            got = tiers.dev.kv[layer, plane][dslots].double().cpu()
            # fp32 product, then one rounding to the wide dtype (subnormal fp16 steps are 2**-24).
            bound = exact.abs() * precision * (1 + 1e-4) + 2.0**-24
            worst = ((got - exact).abs() - bound).max().item()
            assert worst <= 0, f"layer {layer} plane {plane}: upcast error exceeds half a {fmt.device_dtype} ulp by {worst}"
    engine.close()
    tiers.close()


def test_codec_scales_agree_between_cpu_and_gpu() -> None:
    x = (torch.rand(64, 16, 4, 128, generator=torch.Generator().manual_seed(9)) * 7 + 0.1).to(torch.bfloat16)
    _, cpu_scales = quantize(x, "fp8_e4m3", "per_token_head")
    _, gpu_scales = quantize(x.cuda(), "fp8_e4m3", "per_token_head")
    _assert_bytes_equal(gpu_scales, cpu_scales, "per_token_head scales, GPU codec vs CPU codec")


# --- ordering ---------------------------------------------------------------------------------
ORDER_FORMAT = PageFormat(2, 2, 64, 16)  # 4 KiB planes, 16 KiB records


def _ordering_paths() -> list:
    return [pytest.param(p, marks=_path_marks(ORDER_FORMAT, p)) for p in ("kernel", "copy_engine", "torch")]


@pytest.mark.parametrize("path", _ordering_paths())
def test_offload_right_after_producer_kernel(path: str) -> None:
    """Pages written on the compute stream and offloaded at once via record_ready(), 200 times."""
    fmt, iterations, per_iter = ORDER_FORMAT, 200, 8
    dev = DeviceTier(fmt, 2 * per_iter, "cuda")
    host = HostTier(fmt, iterations * per_iter, pin=True)
    host.buffer.fill_(POISON)
    engine = CudaEngine(dev, host, path=path)
    raw = dev.kv.view(fmt.num_layers, fmt.planes, dev.num_pages, -1).view(torch.uint8)
    gen = torch.Generator(device="cuda").manual_seed(5)
    payloads = torch.randint(0, 256, (iterations, fmt.num_layers, fmt.planes, per_iter, raw.shape[-1]),
                             dtype=torch.uint8, device="cuda", generator=gen)
    slot_sets = [list(range(0, per_iter)), list(range(per_iter, 2 * per_iter))]
    slot_tensors = [torch.tensor(s, device="cuda") for s in slot_sets]
    last_reader = [None, None]
    tickets = []
    for it in range(iterations):
        which = it % 2
        if last_reader[which] is not None:
            last_reader[which].wait()  # the next writer of these slots runs after the copy read them
        torch.cuda._sleep(20_000)  # tens of microseconds: an unordered offload would overtake the write
        raw[:, :, slot_tensors[which]] = payloads[it]
        host_slots = list(range(it * per_iter, (it + 1) * per_iter))
        ticket = engine.offload(slot_sets[which], host_slots, ready=engine.record_ready())
        last_reader[which] = ticket
        tickets.append(ticket)
    for ticket in tickets:
        ticket.synchronize()
    expected = payloads.cpu()
    for it in range(iterations):
        rows = slice(it * per_iter, (it + 1) * per_iter)
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                _assert_bytes_equal(host.raw_plane(layer, plane)[rows], expected[it, layer, plane],
                                    f"{path}: iteration {it} layer {layer} plane {plane}")
    engine.close()
    host.close()


@pytest.mark.parametrize("path", _ordering_paths())
def test_slots_reused_as_soon_as_done(path: str) -> None:
    """done() means every byte landed: overwriting a copy's source right after must not leak in."""
    fmt, per_iter = ORDER_FORMAT, 32
    tiers = Tiers(fmt, seed=600, device_pages=2 * per_iter, host_pages=2 * per_iter)
    engine = CudaEngine(tiers.dev, tiers.host, path=path)
    raw = tiers.dev.kv.view(fmt.num_layers, fmt.planes, tiers.dev.num_pages, -1).view(torch.uint8)
    for it in range(20):
        dslots = list(range(per_iter)) if it % 2 else list(range(per_iter, 2 * per_iter))
        hslots = list(range(per_iter, 2 * per_iter)) if it % 2 else list(range(per_iter))
        expected = raw[:, :, dslots].cpu()
        ticket = engine.offload(dslots, hslots, ready=engine.record_ready())
        while not ticket.done():
            pass
        raw[:, :, dslots] = POISON  # the device slots are free again: the next writer runs now
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                _assert_bytes_equal(tiers.host.raw_plane(layer, plane)[hslots], expected[layer, plane],
                                    f"{path} offload {it}: layer {layer} plane {plane}")
        raw[:, :, dslots] = torch.randint(0, 255, raw[:, :, dslots].shape, dtype=torch.uint8, device="cuda")

        host_before = tiers.host.buffer[hslots].clone()
        # The random write above is still queued on the compute stream: order the reload after it.
        ticket = engine.reload(hslots, dslots, ready=engine.record_ready())
        while not ticket.done():
            pass
        tiers.host.buffer[hslots] = POISON  # the host slots are free again
        for layer in range(fmt.num_layers):
            for plane in range(fmt.planes):
                at = fmt.data_offset(layer, plane)
                want = host_before[:, at : at + fmt.plane_elems * fmt.elem_bytes]
                _assert_bytes_equal(raw[layer, plane, dslots], want, f"{path} reload {it}: layer {layer} plane {plane}")
    engine.close()
    tiers.close()


@pytest.mark.parametrize("path", _ordering_paths())
def test_wait_layer_then_read_layer(path: str) -> None:
    fmt = PageFormat(8, 4, 128, 32)  # 32 KiB planes, 8 layers: long enough to be caught reading early
    pages = 64
    tiers = Tiers(fmt, seed=700, device_pages=pages, host_pages=pages)
    tiers.poison_device()
    calls = []

    def transform(layer: int, plane: int, kv: torch.Tensor, slots: torch.Tensor) -> None:
        calls.append((layer, plane, torch.cuda.current_stream().cuda_stream))
        kv[slots] = kv[slots].flip(-1)  # bit-exact on both devices (doubling a NaN is not)

    engine = CudaEngine(tiers.dev, tiers.host, transform=transform, path=path)
    hslots = list(range(pages))[::-1]
    dslots = list(range(pages))
    ticket = engine.reload(hslots, dslots)
    seen = []
    for layer in range(fmt.num_layers):
        ticket.wait_layer(layer)
        seen.append(tiers.dev.kv[layer].clone())  # on the current stream, ordered by wait_layer only
    with pytest.raises(IndexError):
        ticket.wait_layer(fmt.num_layers)
    ticket.synchronize()
    def twin_transform(layer: int, plane: int, kv: torch.Tensor, slots: torch.Tensor) -> None:
        kv.index_copy_(0, slots, kv[slots].flip(-1))

    TorchEngine(tiers.cpu_dev, tiers.cpu_host, transform=twin_transform).reload(hslots, dslots)
    for layer in range(fmt.num_layers):
        _assert_bytes_equal(seen[layer], tiers.cpu_dev.kv[layer], f"{path}: layer {layer} read after wait_layer")
    expected_calls = [(layer, plane) for layer in range(fmt.num_layers) for plane in range(fmt.planes)]
    assert [(layer, plane) for layer, plane, _ in calls] == expected_calls
    assert {stream for _, _, stream in calls} == {engine.reload_stream.cuda_stream}
    engine.close()
    tiers.close()


# --- paths, launches and refusals ------------------------------------------------------------
@pytest.mark.skipif(not HAS_BATCH_MEMCPY, reason="needs cudaMemcpyBatchAsync")
def test_auto_keeps_large_pieces_on_the_copy_engines_in_both_directions_at_once() -> None:
    """An offload held on the copy engines (behind a GPU sleep) and a reload that arrives
    meanwhile both take the copy engines (measured fastest both ways from 256 KiB pieces) and
    land bit-exact."""
    tiers = Tiers(PASSTHROUGH[3], seed=802, device_pages=8, host_pages=8)
    twin = TorchEngine(tiers.cpu_dev, tiers.cpu_host)
    engine = CudaEngine(tiers.dev, tiers.host)
    torch.cuda._sleep(50_000_000)  # about 25 ms: the offload below waits behind it
    offload = engine.offload([0, 1], [4, 5], ready=engine.record_ready())
    assert engine.last_path == "copy_engine" and not offload.done()
    reload = engine.reload([6, 7], [2, 3])
    assert engine.last_path == "copy_engine"
    offload.synchronize()
    reload.synchronize()
    twin.offload([0, 1], [4, 5]).synchronize()
    twin.reload([6, 7], [2, 3]).synchronize()
    _assert_bytes_equal(tiers.host.buffer, tiers.cpu_host.buffer, "host records after the offload")
    _assert_bytes_equal(tiers.dev.kv, tiers.cpu_dev.kv, "device pages after the reload beside it")
    engine.close()
    tiers.close()


@pytest.mark.skipif(not HAS_BATCH_MEMCPY, reason="needs cudaMemcpyBatchAsync")
@pytest.mark.parametrize("fmt", [PASSTHROUGH[0], PASSTHROUGH[3], PASSTHROUGH[6]], ids=lambda f: f.describe())
def test_copy_engines_through_libcuda_and_through_bindings_move_the_same_bytes(fmt: PageFormat) -> None:
    """The copy-engine path submits through libcuda (ctypes, numpy arrays) where the driver has
    cuMemcpyBatchAsync, and through cuda.bindings' runtime wrapper otherwise: both land every
    byte where the CPU twin does, offload and per-layer reload, into poisoned destinations."""
    tiers = Tiers(fmt, seed=803)
    twin = TorchEngine(tiers.cpu_dev, tiers.cpu_host)
    engine = CudaEngine(tiers.dev, tiers.host, path="copy_engine")
    assert engine.copy_engine.batch is not None, "a CUDA 12.8+ driver exposes cuMemcpyBatchAsync to ctypes"
    gen = np.random.default_rng(803)
    for route in ("libcuda", "bindings"):
        if route == "bindings":
            engine.copy_engine.batch = None
        dev_slots = gen.permutation(DEVICE_PAGES)[:20].tolist()
        host_slots = gen.permutation(HOST_PAGES)[:20].tolist()
        tiers.poison_host()
        engine.offload(dev_slots, host_slots).synchronize()
        twin.offload(dev_slots, host_slots).synchronize()
        assert engine.last_path == "copy_engine"
        _assert_bytes_equal(tiers.host.buffer, tiers.cpu_host.buffer, f"host records after a {route} offload")
        tiers.poison_device()
        ticket = engine.reload(host_slots[::-1], dev_slots)
        for layer in range(fmt.num_layers):
            ticket.wait_layer(layer)
        ticket.synchronize()
        twin.reload(host_slots[::-1], dev_slots).synchronize()
        _assert_bytes_equal(tiers.dev.kv, tiers.cpu_dev.kv, f"device pages after a {route} reload")
        if tiers.dev.scales is not None:
            _assert_bytes_equal(tiers.dev.scales, tiers.cpu_dev.scales, f"device scales after a {route} reload")
    engine.close()
    tiers.close()


def test_auto_path_and_launch_shape() -> None:
    small = Tiers(PASSTHROUGH[0], seed=800)
    engine = CudaEngine(small.dev, small.host)
    engine.offload([1, 2, 3], [4, 5, 6]).synchronize()
    assert engine.last_path == ("kernel" if HAS_CUPY else "torch")
    if HAS_CUPY:
        shape = engine.last_launch
        assert shape is not None and 1 <= shape.blocks <= engine.max_blocks and shape.sms <= engine.sm_count
        assert shape.threads == 256 and shape.kernel.startswith("copy_offload_w")
    engine.close()
    small.close()

    big = Tiers(PASSTHROUGH[3], seed=801, device_pages=8, host_pages=8)
    engine = CudaEngine(big.dev, big.host)
    engine.reload([0, 1], [2, 3]).synchronize()
    assert engine.last_path == ("copy_engine" if HAS_BATCH_MEMCPY else "kernel" if HAS_CUPY else "torch")
    engine.close()
    big.close()

    conv = Tiers(CONVERTING[0], seed=802, device_pages=8, host_pages=8)
    engine = CudaEngine(conv.dev, conv.host, max_blocks=3)
    engine.reload([0, 1], [2, 3]).synchronize()
    assert engine.last_path == ("kernel" if HAS_CUPY and CAN_CONVERT else "torch")
    if engine.last_path == "kernel":
        assert engine.last_launch.blocks <= 3 and engine.last_launch.kernel.startswith("upcast_e4m3_bf16")
    with pytest.raises(ValueError, match="copy_engine"):
        CudaEngine(conv.dev, conv.host, path="copy_engine").offload([0], [0])
    engine.close()
    conv.close()


def test_refusals_name_the_bad_value() -> None:
    tiers = Tiers(PASSTHROUGH[0], seed=900, device_pages=8, host_pages=8)
    with pytest.raises(ValueError, match="pinned"):
        CudaEngine(tiers.dev, HostTier(tiers.fmt, 8, pin=False))
    with pytest.raises(ValueError, match="path"):
        CudaEngine(tiers.dev, tiers.host, path="dma")
    engine = CudaEngine(tiers.dev, tiers.host)
    with pytest.raises(IndexError, match="8"):
        engine.offload([0, 8], [0, 1])
    with pytest.raises(ValueError, match="repeat"):
        engine.reload([0, 1], [3, 3])
    with pytest.raises(ValueError, match="length"):
        engine.offload([0, 1], [0])
    with pytest.raises(ValueError, match="overlap"):
        engine.device_copy([0, 1], [1, 2])
    assert engine.offload([], []).done()
    engine.close()
    tiers.close()
