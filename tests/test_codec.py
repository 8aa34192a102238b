import pytest
import torch

from kvtier import dequantize, quantize
from kvtier.format import FP8_MAX
from kvtier.format.codec import expand_scales

# Relative spacing of normal fp8 values (half an ulp) and half the smallest subnormal.
HALF_ULP = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
HALF_MIN_SUB = {"fp8_e4m3": 2.0**-10, "fp8_e5m2": 2.0**-17}
GRANS = ["per_tensor", "per_page_head", "per_token_head"]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("scale", GRANS)
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0, 1e4])
def test_round_trip_error_within_the_format_bound(dtype, scale, layout, magnitude):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(5, 8, 3, 32, generator=gen, dtype=torch.float64) * magnitude).float()
    q, s = quantize(x, dtype, scale, layout)
    assert q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and s.dtype == torch.float32
    back = dequantize(q, s, scale, layout, torch.float32).double()
    ref = x.double()
    bound = ref.abs() * HALF_ULP[dtype] + expand_scales(s.double(), scale, layout) * HALF_MIN_SUB[dtype]
    err = (back - ref).abs()
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err - bound).max())
    # Every group uses its full range: the largest element maps to fp8 max.
    assert torch.allclose(q.float().abs().amax(), torch.tensor(FP8_MAX[dtype]))


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_power_of_two_scales_round_trip_exactly(dtype):
    gen = torch.Generator().manual_seed(3)
    fp8 = torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.float8_e5m2
    grid = torch.randn(4, 8, 2, 16, generator=gen).to(fp8).float()  # values fp8 can hold
    scales = 2.0 ** torch.randint(-6, 6, (4, 2), generator=gen).float()
    x = (grid * expand_scales(scales, "per_page_head", "nhd")).to(torch.bfloat16)
    q, s = quantize(x, dtype, "per_page_head", "nhd", scales=scales)
    assert torch.equal(dequantize(q, s, "per_page_head", "nhd", torch.bfloat16), x)


def test_bf16_output_is_the_float64_product_rounded_once():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 8, 2, 16, generator=gen) * 7
    q, s = quantize(x, "fp8_e4m3", "per_token_head", "nhd")
    out = dequantize(q, s, "per_token_head", "nhd", torch.bfloat16)
    ref = (q.double() * expand_scales(s.double(), "per_token_head", "nhd")).to(torch.bfloat16)
    assert torch.equal(out, ref)


def test_zero_groups_get_scale_one():
    x = torch.randn(2, 8, 2, 16)
    x[1, :, 0, :] = 0
    q, s = quantize(x, "fp8_e4m3", "per_page_head", "nhd")
    assert s[1, 0].item() == 1.0 and s[0, 0].item() != 1.0
    assert torch.equal(q[1, :, 0, :].float(), torch.zeros(8, 16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(2, 8, 2, 16)
    x[0, 3, 1, 5] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize(x, "fp8_e4m3", "per_page_head", "nhd")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_unchecked_non_finite_input_reads_back_as_nan_never_a_finite_value(bad):
    """check_finite=False (a forward pass writing its own pages, no device sync): the bad
    element reads back as NaN; every other group keeps its exact round trip."""
    x = torch.randn(2, 8, 2, 16)
    x[0, 3, 1, 5] = bad
    q, s = quantize(x, "fp8_e4m3", "per_page_head", "nhd", check_finite=False)
    back = dequantize(q, s, "per_page_head", "nhd", torch.float32)
    assert torch.isnan(back[0, 3, 1, 5])
    good = torch.ones_like(x, dtype=torch.bool)
    good[0, :, 1, :] = False  # the bad element's (page, head) group
    x_good = x.clone()
    x_good[0, :, 1, :] = 1.0
    q_ref, s_ref = quantize(x_good, "fp8_e4m3", "per_page_head", "nhd")
    assert torch.equal(back[good], dequantize(q_ref, s_ref, "per_page_head", "nhd", torch.float32)[good])


def test_bad_arguments_raise():
    x = torch.randn(2, 8, 2, 16)
    with pytest.raises(ValueError, match="fp8 dtype"):
        quantize(x, "bf16", "per_tensor")
    with pytest.raises(ValueError, match="granularity"):
        quantize(x, "fp8_e4m3", "none")
    with pytest.raises(ValueError, match="3 trailing dims"):
        quantize(torch.randn(4, 4), "fp8_e4m3", "per_tensor")
    with pytest.raises(ValueError, match="> 0"):
        quantize(x, "fp8_e4m3", "per_tensor", scales=torch.zeros(2))
