import pytest
import torch

from kvtier import PageFormat
from kvtier.format import DTYPES
from tests.conftest import small_format


def test_sizes_of_an_fp8_per_page_head_page():
    fmt = PageFormat(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, dtype="fp8_e4m3", scale="per_page_head")
    assert fmt.plane_elems == 16 * 2 * 64
    assert fmt.plane_data_bytes == 2048
    assert fmt.data_bytes == 4 * 2 * 2048
    assert fmt.scale_bytes == 4 * 2 * 2 * 4  # layers x planes x heads x fp32
    assert fmt.page_bytes == fmt.data_bytes + fmt.scale_bytes
    assert fmt.scale_offset(0, 0) == fmt.data_bytes
    assert fmt.scale_offset(3, 1) == fmt.data_bytes + 7 * 8


def test_scale_shapes_follow_layout():
    assert small_format(scale="per_tensor").scale_shape == ()
    assert small_format(scale="per_page_head").scale_shape == (2,)
    assert small_format(scale="per_token_head", layout="nhd").scale_shape == (8, 2)
    assert small_format(scale="per_token_head", layout="hnd").scale_shape == (2, 8)
    assert small_format(layout="hnd").plane_shape == (2, 8, 32)


def test_mla_has_one_plane_and_padded_odd_sizes():
    fmt = PageFormat(num_layers=2, num_kv_heads=1, head_dim=576, page_size=1, dtype="fp8_e4m3", scale="per_token_head", mla=True)
    assert fmt.planes == 1
    assert fmt.plane_data_bytes == 576
    odd = PageFormat(num_layers=2, num_kv_heads=1, head_dim=3, page_size=1, dtype="fp8_e4m3", scale="per_tensor")
    assert odd.plane_data_bytes == 16 and odd.data_offset(1, 1) == 48


def test_fingerprint_changes_with_every_storage_field_and_is_stable():
    base = small_format()
    assert base.fingerprint == small_format().fingerprint
    variants = [
        small_format(num_layers=4),
        small_format(num_kv_heads=4),
        small_format(head_dim=64),
        small_format(page_size=16),
        small_format(dtype="fp8_e5m2"),
        small_format(scale="per_token_head"),
        small_format(layout="hnd"),
        small_format(mla=True, num_kv_heads=1),
    ]
    prints = {v.fingerprint for v in variants}
    assert len(prints) == len(variants) and base.fingerprint not in prints
    # How pages are delivered to one engine's kernel is not part of the stored bytes.
    assert small_format(device_dtype="bf16").fingerprint == base.fingerprint


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_kv_heads=-1), "num_kv_heads"),
        (dict(head_dim=2.5), "head_dim"),
        (dict(page_size=True), "page_size"),
        (dict(dtype="int8"), "dtype"),
        (dict(scale="per_block"), "scale"),
        (dict(layout="nch"), "layout"),
        (dict(dtype="fp8_e4m3", scale="none"), "scale"),
        (dict(dtype="bf16", scale="per_tensor"), "scale"),
        (dict(dtype="bf16", scale="none", device_dtype="fp8_e4m3"), "device_dtype"),
        (dict(dtype="fp16", scale="none", device_dtype="bf16"), "device_dtype"),
        (dict(mla=True), "num_kv_heads"),
    ],
)
def test_invalid_formats_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        small_format(**kwargs)


def test_unscaled_fp8_only_when_asked():
    fmt = small_format(scale="none", allow_unscaled_fp8=True)
    assert not fmt.has_scales and fmt.scale_bytes == 0


@pytest.mark.parametrize(
    "name, canonical",
    [
        ("fp8", "fp8_e4m3"),
        ("fp8_e4m3fn", "fp8_e4m3"),
        ("FP8_E4M3", "fp8_e4m3"),
        (torch.float8_e4m3fn, "fp8_e4m3"),
        ("torch.float8_e5m2", "fp8_e5m2"),
        (torch.float8_e5m2, "fp8_e5m2"),
    ],
)
def test_engine_fp8_names_make_the_same_format(name, canonical):
    fmt = small_format(dtype=name, device_dtype=torch.bfloat16)
    reference = small_format(dtype=canonical, device_dtype="bf16")
    assert (fmt.dtype, fmt.device_dtype) == (canonical, "bf16")
    assert fmt == reference and hash(fmt) == hash(reference)
    assert fmt.fingerprint == reference.fingerprint
    assert fmt.torch_dtype == DTYPES[canonical]


@pytest.mark.parametrize(
    "name, canonical",
    [("bfloat16", "bf16"), (torch.bfloat16, "bf16"), ("float16", "fp16"), ("half", "fp16"), (torch.float16, "fp16")],
)
def test_engine_wide_names_make_the_same_format(name, canonical):
    fmt = small_format(dtype=name, scale="none")
    assert fmt.dtype == fmt.device_dtype == canonical
    assert fmt.fingerprint == small_format(dtype=canonical, scale="none").fingerprint


@pytest.mark.parametrize("bad", ["auto", "fp8_inc", "fp8_e4m3fnuz", "int8", torch.float32, 8, None])
def test_unknown_dtype_names_are_refused_with_the_accepted_ones(bad):
    with pytest.raises(ValueError, match=r"PageFormat\.dtype must be one of .*'fp8_e4m3'.*'fp8'") as err:
        small_format(dtype=bad)
    assert repr(bad) in str(err.value)
    with pytest.raises(ValueError, match=r"PageFormat\.device_dtype"):
        small_format(device_dtype=bad if bad is not None else "int4")


def test_record_sizes_cached_per_format_never_stale():
    """page_bytes and the sizes under it are computed once per format object: equality and
    hashing ignore them, and a format made from another (replace, pickle) has its own."""
    import dataclasses
    import pickle

    f = PageFormat(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, dtype="fp8_e4m3", scale="per_token_head")
    g = PageFormat(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, dtype="fp8_e4m3", scale="per_token_head")
    first = (f.plane_data_bytes, f.data_bytes, f.scale_bytes, f.page_bytes)
    assert f.page_bytes == f.data_bytes + f.scale_bytes and f.data_bytes == 3 * 2 * f.plane_data_bytes
    assert f == g and hash(f) == hash(g) and f.fingerprint == g.fingerprint
    wider = dataclasses.replace(f, num_layers=6)
    assert wider.data_bytes == 2 * first[1] and wider.page_bytes != first[3]
    assert wider.fingerprint != f.fingerprint
    copy = pickle.loads(pickle.dumps(f))
    assert copy == f and (copy.plane_data_bytes, copy.data_bytes, copy.scale_bytes, copy.page_bytes) == first
