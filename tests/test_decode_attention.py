"""The paged decode kernel against its float64 reference, over random shapes.

On a machine without CUDA the kernel runs in Triton's interpreter; with CUDA the same tests
run the compiled kernel on the GPU.

Tolerance, and why: scores and the softmax run in fp32 from exact operands (bf16 queries,
fp8 values widen to bf16 exactly, scales apply in fp32), so the one rounding that matters is
the probabilities (times V's scale) rounded to the query dtype before the P.V product: within
one ulp each (2**-7 relative for bf16, 2**-10 for fp16), so an output moves by at most that
times the same attention taken over |V|. The tests allow exactly that, plus one ulp of the
output dtype relative to the value and 1e-5 of the |V| attention for fp32 sums and exp2.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtier.decode.attention import (
    INTERPRETED, MMA_MIN_BLOCK_N, paged_decode_attention, pdl_launches, reference_decode_attention, split_plan,
)
from kvtier.format import quantize
from kvtier.format.codec import dequantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# One ulp relative to the value: round-to-nearest on the GPU is within half of it, and
# Triton's interpreter truncates when it narrows fp32 (3.9), which stays within one.
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
PAGE_DTYPE_SCALES = [
    ("bf16", "none"),
    ("fp16", "none"),
    ("fp8_e4m3", "per_tensor"),
    ("fp8_e4m3", "per_page_head"),
    ("fp8_e4m3", "per_token_head"),
    ("fp8_e5m2", "per_tensor"),
    ("fp8_e5m2", "per_page_head"),
    ("fp8_e5m2", "per_token_head"),
]
CASES = [(dt, sc, layout) for (dt, sc), layout in itertools.product(PAGE_DTYPE_SCALES, ("nhd", "hnd"))]


def make_case(seed: int, dtype: str, scale: str, layout: str, **override):
    """Random pages, page tables, lengths and queries; every slot no sequence reads is NaN."""
    gen = torch.Generator().manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    shape = dict(
        batch=pick([1, 2, 3, 5]),
        kv_heads=pick([1, 2, 4]),
        group=pick([1, 2, 4, 8]),
        head_dim=pick([64, 128]),
        page_size=pick([1, 4, 16, 32]),
        max_len=pick([40, 130, 300]),
    )
    shape.update(override)
    batch, heads, group, head_dim, page_size = (shape[k] for k in ("batch", "kv_heads", "group", "head_dim", "page_size"))
    lens = torch.randint(1, shape["max_len"] + 1, (batch,), generator=gen)
    lens[0] = shape["max_len"]
    pages_of = [-(-int(n) // page_size) for n in lens]
    max_pages = max(pages_of)
    # Spare pages no sequence uses, and the pages handed out in a random order.
    num_pages = sum(pages_of) + 3
    order = torch.randperm(num_pages, generator=gen)
    page_table = torch.full((batch, max_pages + 1), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_of):
        page_table[b, :n] = order[used : used + n].int()
        used += n
    plane = (page_size, heads, head_dim) if layout == "nhd" else (heads, page_size, head_dim)
    k = torch.randn((num_pages, *plane), generator=gen) * 3
    v = torch.randn((num_pages, *plane), generator=gen) * 2 + 0.5
    if dtype in TORCH_DTYPES:
        q_dtype = TORCH_DTYPES[dtype]
        k_pages, v_pages, k_scales, v_scales = k.to(q_dtype), v.to(q_dtype), None, None
    else:
        q_dtype = torch.bfloat16
        k_pages, k_scales = quantize(k, dtype, scale, layout)
        v_pages, v_scales = quantize(v, dtype, scale, layout)
    _poison_unread(k_pages, v_pages, k_scales, v_scales, page_table, lens, layout, page_size, scale)
    q = torch.randn((batch, heads * group, head_dim), generator=gen).to(q_dtype)
    args = dict(
        q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, seq_lens=lens.int(),
        layout=layout, k_scales=k_scales, v_scales=v_scales, scale=scale,
    )
    return {name: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for name, t in args.items()}


def _poison_unread(k_pages, v_pages, k_scales, v_scales, page_table, lens, layout, page_size, scale) -> None:
    """NaN in every page no sequence reads and in every token past a sequence's length."""
    nan_byte = 0xFF  # NaN in bf16, fp16, e4m3fn and e5m2 alike
    read = set(int(p) for p in page_table.flatten() if p >= 0)
    for page in range(k_pages.shape[0]):
        if page not in read:
            for pages in (k_pages, v_pages):
                pages[page].view(torch.uint8).fill_(nan_byte)
            for scales in (k_scales, v_scales):
                if scales is not None:
                    scales[page] = float("nan")
    for b, n in enumerate(int(x) for x in lens):
        last = int(page_table[b, (n - 1) // page_size])
        tail = n % page_size
        if not tail:
            continue
        for pages in (k_pages, v_pages):
            rows = pages[last, tail:] if layout == "nhd" else pages[last, :, tail:]
            rows.view(torch.uint8).fill_(nan_byte)
        if scale == "per_token_head":
            for scales in (k_scales, v_scales):
                rows = scales[last, tail:] if layout == "nhd" else scales[last, :, tail:]
                rows.fill_(float("nan"))


def _abs_pages(pages: torch.Tensor) -> torch.Tensor:
    """|pages| by clearing the sign bit, in the pages' own dtype (NaN stays NaN)."""
    if pages.element_size() == 1:
        return (pages.view(torch.uint8) & 0x7F).view(pages.dtype)
    return (pages.view(torch.int16) & 0x7FFF).view(pages.dtype)


def assert_close_to_reference(out: torch.Tensor, args: dict, dot_dtype: torch.dtype | None = None) -> None:
    """|out - ref| <= ulp(dot dtype) * (attention over |V|) + ulp(out dtype) * |ref|, plus fp32 noise.

    The dot dtype is the query's unless given (fp8 pages under fp8_dot="fp16": fp16)."""
    ref = reference_decode_attention(**args)
    assert torch.isfinite(out).all(), "the kernel read a poisoned slot"
    mean_abs_v = reference_decode_attention(**dict(args, v_pages=_abs_pages(args["v_pages"])))
    bound = (ULP[dot_dtype or args["q"].dtype] + 1e-5) * mean_abs_v + ULP[out.dtype] * ref.abs()
    err = (out.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1, f"max error {err.max().item():.3g} is {worst:.2f}x its bound"


@pytest.mark.parametrize("dtype,scale,layout", CASES)
def test_matches_float64_reference(dtype, scale, layout):
    seed = CASES.index((dtype, scale, layout))
    args = make_case(seed, dtype, scale, layout)
    out = torch.empty(args["q"].shape, dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=out, num_splits=1 + seed % 4, block_n=16 << (seed % 4))
    assert_close_to_reference(out, args)


FP8_CASES = [(dt, sc) for dt, sc in PAGE_DTYPE_SCALES if dt.startswith("fp8")]


@pytest.mark.parametrize("dtype,scale", FP8_CASES)
# The extreme magnitudes are the longest interpreter sweep of the suite: make stress runs them.
@pytest.mark.parametrize(
    "q_mult,v_mult",
    [(1.0, 1.0), pytest.param(3e5, 1e-4, marks=pytest.mark.stress), pytest.param(2e-5, 4e3, marks=pytest.mark.stress)],
)
def test_fp8_dot_modes_over_extreme_magnitudes(dtype, scale, q_mult, v_mult):
    """Both dot dtypes for fp8 pages, with queries far outside fp16's range (or deep in its
    subnormals) and V's scales far from 1: the fp16 dots rescale the query by a power of two and
    the probabilities by each block's largest V scale, so they keep fp16's precision everywhere;
    converting pages to the query's dtype keeps bf16's."""
    seed = 500 + FP8_CASES.index((dtype, scale))
    args = make_case(seed, dtype, scale, "nhd", page_size=16, max_len=300, group=4, kv_heads=2)
    args["q"] = (args["q"].float() * q_mult).bfloat16()
    args["v_scales"] = args["v_scales"] * v_mult
    for fp8_dot, dot_dtype in (("fp16", torch.float16), ("query", torch.bfloat16), ("pairs", torch.float16),
                               ("pairs_vmax", torch.float16), ("pairs_lean", torch.float16), ("mma", torch.bfloat16)):
        out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**args, out=out, num_splits=3, block_n=32, fp8_dot=fp8_dot)
        assert_close_to_reference(out, args, dot_dtype)


FP8_LAYOUT_CASES = [case for case in CASES if case[0].startswith("fp8")]


@pytest.mark.parametrize("fp8_dot", ["query", "fp16", "pairs", "pairs_vmax", "pairs_lean", "mma"])
@pytest.mark.parametrize("dtype,scale,layout", FP8_LAYOUT_CASES)
def test_every_fp8_dot_mode_matches_float64_reference(dtype, scale, layout, fp8_dot):
    """Each way of running the dots over fp8 pages, over random shapes, splits and block sizes;
    "fp16" and "pairs" hold fp16's bound (their dots see the probabilities in fp16), "mma" bf16's
    (the probabilities in two e4m3 terms)."""
    seed = 700 + FP8_LAYOUT_CASES.index((dtype, scale, layout))
    args = make_case(seed, dtype, scale, layout)
    out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
    block_n = 16 << (seed % 3)
    if fp8_dot == "mma":
        block_n = max(block_n, MMA_MIN_BLOCK_N)
    paged_decode_attention(**args, out=out, num_splits=1 + seed % 3, block_n=block_n, fp8_dot=fp8_dot)
    assert_close_to_reference(out, args, torch.bfloat16 if fp8_dot in ("query", "mma") else torch.float16)


def test_mma_refuses_blocks_under_its_dot_size():
    """fp8 tensor-core dots take K >= 32 on Hopper: a smaller block_n is refused up front (Triton
    would fail to compile it for sm_90), over fp8 pages only."""
    args = make_case(961, "fp8_e4m3", "per_token_head", "nhd")
    with pytest.raises(ValueError, match="block_n >= 32"):
        paged_decode_attention(**args, block_n=16, fp8_dot="mma")


@pytest.mark.parametrize("q_dtype", ["bf16", "fp16"])
def test_mma_query_terms_over_the_query_dtype(q_dtype):
    """fp8_dot="mma" holds a bf16 query in two e4m3 terms and an fp16 one in three: an fp16
    query with every element's low mantissa bits set still meets the bound."""
    args = make_case(960, "fp8_e4m3", "per_token_head", "nhd", page_size=16, max_len=200, group=8, kv_heads=2)
    q = args["q"].float()
    if q_dtype == "fp16":
        q = (q.half().view(torch.int16) | 0x7).view(torch.float16).float()
    args["q"] = q.to(TORCH_DTYPES[q_dtype])
    out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=out, num_splits=2, block_n=64, fp8_dot="mma")
    assert_close_to_reference(out, args, torch.bfloat16)


@pytest.mark.parametrize(
    "dtype,scale,fp8_dot",
    [("bf16", "none", None), ("fp8_e4m3", "per_token_head", "pairs"), ("fp8_e5m2", "per_page_head", "query"),
     ("fp8_e4m3", "per_tensor", "mma")],
)
def test_page_ahead_gives_the_same_output(dtype, scale, fp8_dot):
    """Loading the page table one step ahead changes when the entries are read, not the sums:
    the output is bit-identical with page_ahead on and off, over splits that end mid-block."""
    args = make_case(970 + len(dtype), dtype, scale, "hnd", page_size=4, max_len=130, batch=3)
    outs = []
    for page_ahead in (False, True):
        out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**args, out=out, num_splits=3, block_n=32, fp8_dot=fp8_dot, page_ahead=page_ahead)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert_close_to_reference(outs[1], args, torch.bfloat16 if fp8_dot in ("query", "mma") else None)


def assert_pairs_read_as_query_does(inputs: dict, args: dict) -> None:
    """fp8_dot="pairs" over `inputs` gives exactly "query"'s output, and that is close to the reference of `args`."""
    outs = []
    for fp8_dot in ("pairs", "query"):
        out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**inputs, out=out, num_splits=2, block_n=32, fp8_dot=fp8_dot)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert_close_to_reference(outs[0], args)


def test_pairs_with_head_dim_16_read_pages_as_query_does():
    """head_dim 16 leaves the pairs' dots an inner dimension of 8, under tl.dot's 16: read as "query"."""
    args = make_case(801, "fp8_e4m3", "per_token_head", "nhd", head_dim=16, page_size=16, max_len=90, group=4)
    assert_pairs_read_as_query_does(args, args)


def test_pairs_read_pages_at_odd_byte_offsets():
    """fp8 pages that cannot be read as 16-bit words (an engine tensor whose planes start at odd
    byte offsets) are read byte by byte instead, with the same result."""
    args = make_case(800, "fp8_e4m3", "per_token_head", "nhd", head_dim=64, page_size=16, max_len=90)
    k, v = args["k_pages"], args["v_pages"]
    raw = torch.empty((2, k.numel() + 1), dtype=torch.uint8, device=DEVICE)
    odd = dict(args)
    for i, (name, pages) in enumerate((("k_pages", k), ("v_pages", v))):
        view = raw[i, 1:].view(pages.dtype).view(pages.shape)
        view.copy_(pages)
        odd[name] = view
    assert odd["k_pages"].storage_offset() % 2 == 1
    assert_pairs_read_as_query_does(odd, args)


@pytest.mark.parametrize("dtype,scale", [("bf16", "none"), ("fp8_e4m3", "per_token_head")])
def test_output_in_query_dtype(dtype, scale):
    args = make_case(100, dtype, scale, "nhd")
    out = paged_decode_attention(**args)
    assert out.dtype == args["q"].dtype and out.shape == args["q"].shape
    assert_close_to_reference(out, args)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_split_kv_merge(num_splits):
    """One long and several short sequences: splits past a short sequence's end write nothing the merge reads."""
    args = make_case(200 + num_splits, "fp8_e4m3", "per_page_head", "hnd", batch=3, max_len=700, page_size=16)
    splits, per_split = split_plan(3, args["k_pages"].shape[1], args["page_table"].shape[1] * 16, 32, num_splits)
    assert splits * per_split >= 700 and per_split % 32 == 0
    out = torch.empty(args["q"].shape, dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=out, num_splits=num_splits, block_n=32)
    assert_close_to_reference(out, args)


@pytest.mark.parametrize(
    "dtype,scale,fp8_dot",
    [("bf16", "none", None), ("fp8_e4m3", "per_token_head", "pairs"), ("fp8_e5m2", "per_page_head", "query"),
     ("fp8_e4m3", "per_tensor", "mma")],
)
@pytest.mark.parametrize("num_splits", [2, 7])
def test_fused_merge_matches_the_merge_kernel(dtype, scale, fp8_dot, num_splits):
    """merge="fused": the last split program of each sequence and kv head merges (short sequences
    have fewer live splits than the grid; group 4 pads query heads to 16 rows): the same sums as
    the merge kernel's, in another order, so equal within fp32 rounding and close to the reference."""
    args = make_case(990 + num_splits, dtype, scale, "nhd", batch=3, max_len=300, page_size=16, group=4)
    outs = {}
    for merge in ("kernel", "fused"):
        out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**args, out=out, num_splits=num_splits, block_n=32, fp8_dot=fp8_dot, merge=merge)
        outs[merge] = out
    assert torch.isfinite(outs["fused"]).all()
    torch.testing.assert_close(outs["fused"], outs["kernel"], rtol=2e-6, atol=2e-6)
    assert_close_to_reference(outs["fused"], args, torch.bfloat16 if fp8_dot in ("query", "mma") else None)


@pytest.mark.parametrize(
    "dtype,scale,fp8_dot,num_splits",
    [("bf16", "none", None, 3), ("fp8_e4m3", "per_token_head", "pairs", 2), ("fp8_e4m3", "per_token_head", "pairs", 7),
     ("fp8_e5m2", "per_page_head", "query", 5), ("fp8_e4m3", "per_tensor", "mma", 4)],
)
def test_pdl_merge_gives_the_merge_kernels_bits(dtype, scale, fp8_dot, num_splits):
    """merge="pdl" runs the merge kernel's sums in the same order, its programs only placed earlier
    (on an sm_90 GPU; elsewhere it is the merge kernel): the same bits, over short sequences whose
    later splits are empty, in poisoned outputs, two inputs of one shape alternating call after
    call, so a merge that read partial outputs before the split kernel wrote them would find the
    other input's (the allocator hands the same scratch back) and differ."""
    cases = [make_case(1990 + num_splits + 100 * i, dtype, scale, "nhd", batch=5, max_len=600, page_size=16, group=4,
                       kv_heads=2, head_dim=128)
             for i in range(2)]
    refs = []
    for args in cases:
        ref = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**args, out=ref, num_splits=num_splits, block_n=32, fp8_dot=fp8_dot, merge="kernel")
        assert torch.isfinite(ref).all()
        assert_close_to_reference(ref, args, torch.bfloat16 if fp8_dot in ("query", "mma") else None)
        refs.append(ref)
    assert not torch.equal(refs[0], refs[1])
    for i in range(4 if DEVICE == "cpu" else 100):
        args = cases[i % 2]
        out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**args, out=out, num_splits=num_splits, block_n=32, fp8_dot=fp8_dot, merge="pdl")
        assert torch.equal(out, refs[i % 2])


def test_pdl_launches_only_where_compiled_for_sm90():
    """The interpreter and CPU tensors never take programmatic dependent launch."""
    assert not pdl_launches(torch.device("cpu"))
    if INTERPRETED and torch.cuda.is_available():
        assert not pdl_launches(torch.device("cuda"))


def test_fused_merge_with_one_split_and_bad_names():
    args = make_case(995, "fp8_e4m3", "per_token_head", "nhd", batch=2, max_len=130)
    out = paged_decode_attention(**args, num_splits=1, merge="fused")
    assert_close_to_reference(out, args)
    with pytest.raises(ValueError, match="merge must be one of"):
        paged_decode_attention(**args, merge="tree")


@pytest.mark.parametrize(
    "dtype,scale,layout,kvp,group,num_splits,merge",
    [("fp8_e4m3", "per_token_head", "nhd", 2, 4, 3, "kernel"), ("fp8_e4m3", "per_page_head", "hnd", 2, 1, 1, "kernel"),
     ("fp8_e5m2", "per_tensor", "nhd", 4, 2, 2, "fused"), ("fp8_e4m3", "per_token_head", "nhd", 2, 8, 2, "fused")],
)
def test_kv_heads_stacked_per_program(dtype, scale, layout, kvp, group, num_splits, merge):
    """kv_per_program > 1: the query heads of several kv heads stacked as rows, each row's query
    block-diagonal over the kv heads' columns; the same bound as one kv head a program."""
    args = make_case(1200 + kvp + group, dtype, scale, layout, batch=3, kv_heads=4, group=group, max_len=300, page_size=16)
    out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=out, num_splits=num_splits, block_n=32, kv_per_program=kvp, merge=merge)
    assert_close_to_reference(out, args)
    one = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=one, num_splits=num_splits, block_n=32, merge=merge)
    torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5)


def test_kv_per_program_must_divide_the_kv_heads():
    args = make_case(1300, "fp8_e4m3", "per_token_head", "nhd", kv_heads=2)
    for bad in (3, 4, 0, True):
        with pytest.raises(ValueError, match="kv_per_program"):
            paged_decode_attention(**args, kv_per_program=bad)


def test_programs_per_sm_sets_the_split_plan():
    """The plan's wave follows programs_per_sm: more programs an SM, more splits for the same shape."""
    from kvtier.decode import attention

    assert attention.split_plan(16, 8, 8192, 128, slots=attention.wave_slots(None, 2))[0] < \
        attention.split_plan(16, 8, 8192, 128, slots=attention.wave_slots(None, 12))[0]
    args = make_case(1400, "fp8_e4m3", "per_token_head", "nhd", batch=2, max_len=300)
    for per_sm in (1, 12):
        out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**args, out=out, programs_per_sm=per_sm)
        assert_close_to_reference(out, args)
    with pytest.raises(ValueError, match="programs_per_sm"):
        paged_decode_attention(**args, programs_per_sm=0)


def test_maxnreg_is_checked_and_keeps_the_result():
    """maxnreg caps the split kernel's registers on a GPU (the interpreter ignores it): any valid
    cap gives the reference's result, a bad one is refused before a launch."""
    args = make_case(1500, "fp8_e4m3", "per_token_head", "nhd", batch=2, max_len=200)
    for cap in (128, 255):
        out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**args, out=out, maxnreg=cap, programs_per_sm=5)
        assert_close_to_reference(out, args)
    for bad in (0, 23, 256, 128.0, True, "128"):
        with pytest.raises(ValueError, match="maxnreg"):
            paged_decode_attention(**args, maxnreg=bad)


def test_the_default_register_cap_goes_with_the_default_kernel_shape_only():
    from kvtier.decode.attention import DEFAULT_CONFIGS, default_maxnreg

    fp8, bf16 = DEFAULT_CONFIGS["fp8"], DEFAULT_CONFIGS["16-bit"]
    assert default_maxnreg(fp8, None, None, None, None) == fp8["maxnreg"] == 128
    for named in ((64, None, None, None), (None, 2, None, None), (None, None, 3, None), (None, None, None, "mma")):
        assert default_maxnreg(fp8, *named) is None
    assert default_maxnreg(bf16, None, None, None, None) is None


def test_pages_read_in_place_through_strides():
    """K and V interleaved in one engine tensor (pages, 2, *plane): views with a page stride twice the plane's."""
    args = make_case(300, "fp8_e5m2", "per_token_head", "nhd", head_dim=64, page_size=16, max_len=90)
    k, v = args["k_pages"], args["v_pages"]
    both = torch.stack([k, v], dim=1)
    ks, vs = args["k_scales"], args["v_scales"]
    scales = torch.stack([ks, vs], dim=-1)
    strided = dict(args, k_pages=both[:, 0], v_pages=both[:, 1], k_scales=scales[..., 0], v_scales=scales[..., 1])
    assert not strided["k_pages"].is_contiguous() and not strided["k_scales"].is_contiguous()
    out = torch.empty(args["q"].shape, dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**strided, out=out, num_splits=2, block_n=16)
    assert_close_to_reference(out, args)


def test_fp8_in_kernel_matches_upcast_bf16_pages():
    """The fp8 path (scales applied in the kernel) and the bf16 path over the same pages upcast first."""
    args = make_case(400, "fp8_e4m3", "per_token_head", "nhd", head_dim=128, page_size=16, max_len=200)
    upcast = dict(
        args,
        k_pages=dequantize(args["k_pages"], args["k_scales"], "per_token_head", "nhd", torch.bfloat16),
        v_pages=dequantize(args["v_pages"], args["v_scales"], "per_token_head", "nhd", torch.bfloat16),
        k_scales=None, v_scales=None, scale="none",
    )
    out_fp8 = torch.empty(args["q"].shape, dtype=torch.float32, device=DEVICE)
    out_bf16 = torch.empty_like(out_fp8)
    paged_decode_attention(**args, out=out_fp8, num_splits=2)
    paged_decode_attention(**upcast, out=out_bf16, num_splits=2)
    # The upcast pages round each dequantized value to bf16 (half an ulp, 2**-8) before the kernel sees it.
    assert_close_to_reference(out_bf16, upcast)
    assert_close_to_reference(out_fp8, args)
    mean_abs_v = reference_decode_attention(**dict(upcast, v_pages=_abs_pages(upcast["v_pages"])))
    assert ((out_fp8 - out_bf16).abs() <= (2 * 2.0**-7 + 2.0**-8) * mean_abs_v).all()


def test_split_plan_defaults():
    """The fewest splits whose programs fill their last wave (396 slots: 132 SMs x 3) at least 90%."""
    assert split_plan(1, 1, 32768, 64, slots=396) == (64, 512)  # one kv head: as many splits as allowed
    # 512 programs are 1.29 waves (the last 29% full); three splits make 3.88.
    assert split_plan(64, 8, 32768, 64, slots=396) == (3, 10944)
    assert split_plan(64, 8, 32768, 64, slots=512) == (1, 32768)  # exactly one wave
    assert split_plan(4, 8, 300, 64, slots=396) == (1, 320)  # never under 256 tokens a split
    # No split count fills 90% of a wave of 16 x splits programs: the best fill, 352 / 396.
    assert split_plan(2, 8, 8192, 64, slots=396) == (22, 384)
    assert split_plan(16, 8, 8192, 128, slots=396) == (3, 2816)
    assert split_plan(16, 8, 8192, 128, num_splits=5) == (5, 1664)


def _valid(**override):
    args = make_case(500, "fp8_e4m3", "per_page_head", "nhd", batch=2, kv_heads=2, group=2, head_dim=64, page_size=4, max_len=20)
    args.update(override)
    return args


@pytest.mark.parametrize(
    "override,message",
    [
        (lambda a: dict(layout="xyz"), "layout must be one of"),
        (lambda a: dict(scale="none", k_scales=None, v_scales=None), "fp8 pages (torch.float8_e4m3fn) need scales"),
        (lambda a: dict(k_scales=None), "needs k_scales, got None"),
        (lambda a: dict(v_scales=a["v_scales"][:, :1]), "v_scales must be float32 of shape"),
        (lambda a: dict(q=a["q"][:, :3]), "q_heads 3 must be a multiple of the pages' kv heads 2"),
        (lambda a: dict(q=a["q"][..., :32]), "q head_dim 32 does not match the pages' head_dim 64"),
        (lambda a: dict(q=a["q"].float()), "q must be bf16 or fp16 with fp8 pages"),
        (lambda a: dict(page_table=a["page_table"].long()), "page_table must be int32"),
        (lambda a: dict(seq_lens=a["seq_lens"][:1]), "seq_lens must be int32 of shape (2,)"),
        (lambda a: dict(v_pages=a["v_pages"][:-1]), "k_pages and v_pages must both be"),
        (
            lambda a: dict(k_pages=a["k_pages"].float().bfloat16(), v_pages=a["v_pages"].float().bfloat16()),
            "torch.bfloat16 pages take no scales",
        ),
    ],
)
def test_bad_input_names_the_mismatch(override, message):
    args = _valid()
    args.update(override(args))
    with pytest.raises(ValueError) as info:
        paged_decode_attention(**args)
    assert message in str(info.value)


def test_bad_head_dim_and_block():
    k = torch.zeros((4, 4, 1, 48), dtype=torch.bfloat16, device=DEVICE)
    q = torch.zeros((1, 1, 48), dtype=torch.bfloat16, device=DEVICE)
    table = torch.zeros((1, 1), dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim must be a power of two in \\[16, 256\\], got 48"):
        paged_decode_attention(q, k, k, table, lens)
    args = _valid()
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16, got 24"):
        paged_decode_attention(**args, block_n=24)
    with pytest.raises(ValueError, match="fp8_dot must be one of"):
        paged_decode_attention(**args, fp8_dot="bf16")
    with pytest.raises(ValueError, match="num_splits must be an int >= 1, got 0"):
        paged_decode_attention(**args, num_splits=0)


@pytest.mark.parametrize("fp8_dot", ["pairs", "pairs_vmax", "pairs_lean"])
def test_pairs_variants_with_v_scales_spread_over_four_decades(fp8_dot):
    """Per-token V scales from 2^-14 to 1 within one split: "pairs_vmax" and "pairs_lean" divide
    them by the split's largest, so small-scale tokens' probabilities reach fp16 far below 1;
    their contribution is as small as their scale, and the output holds fp16's bound."""
    args = make_case(950, "fp8_e4m3", "per_token_head", "nhd", page_size=16, max_len=300, group=4, kv_heads=2, batch=2)
    gen = torch.Generator().manual_seed(951)
    spread = torch.pow(2.0, -14 * torch.rand(args["v_scales"].shape, generator=gen))
    args["v_scales"] = args["v_scales"] * spread
    out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=out, num_splits=1, block_n=32, fp8_dot=fp8_dot)
    assert_close_to_reference(out, args, torch.float16)


@pytest.mark.parametrize(
    "dtype,scale,layout,group,page_size,block_n,num_splits,max_len",
    [("fp8_e4m3", "per_token_head", "nhd", 4, 16, 64, 3, 300), ("fp8_e4m3", "per_page_head", "hnd", 2, 16, 128, 2, 300),
     ("fp8_e5m2", "per_tensor", "nhd", 8, 4, 32, 1, 130), ("fp8_e4m3", "per_token_head", "hnd", 1, 16, 256, 2, 300),
     ("fp8_e4m3", "per_token_head", "nhd", 4, 4, 64, 5, 40)],
)
def test_query_heads_stacked_over_slices_of_a_step(dtype, scale, layout, group, page_size, block_n, num_splits, max_len):
    """fp8_dot="pairs_stacked": the query heads stacked as rows over interleaved slices of each step's
    tokens, every slice its own softmax merged at the end, including splits and last steps where
    a slice has no token (lengths 1 .. max_len, 5 splits of 40 tokens); fp16's bound, as "pairs"."""
    args = make_case(1300 + group + block_n, dtype, scale, layout, batch=5, kv_heads=2, group=group, max_len=max_len,
                     page_size=page_size, head_dim=64)
    args["seq_lens"][1] = 1
    args["seq_lens"][2] = min(3, max_len)
    out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=out, num_splits=num_splits, block_n=block_n, fp8_dot="pairs_stacked")
    assert_close_to_reference(out, args, torch.float16)


@pytest.mark.parametrize(
    "dtype,scale,layout,group,num_splits",
    [("fp8_e4m3", "per_token_head", "nhd", 4, 3), ("fp8_e5m2", "per_page_head", "hnd", 2, 1), ("fp8_e4m3", "per_tensor", "nhd", 8, 2)],
)
def test_two_kv_heads_a_program(dtype, scale, layout, group, num_splits):
    """fp8_dot="pairs_two_heads": two kv heads a program, each its own softmax: the output of one
    head a program (the same operations a head; compiled code may fuse them differently, so to
    1e-5), and within fp16's bound of the reference."""
    args = make_case(1400 + group, dtype, scale, layout, batch=3, kv_heads=4, group=group, max_len=300, page_size=16)
    out = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=out, num_splits=num_splits, block_n=32, fp8_dot="pairs_two_heads")
    assert_close_to_reference(out, args, torch.float16)
    one = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
    paged_decode_attention(**args, out=one, num_splits=num_splits, block_n=32, fp8_dot="pairs")
    torch.testing.assert_close(out, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fp8_dot,override", [("pairs_stacked", dict(group=3)), ("pairs_stacked", dict(page_size=2)),
                                              ("pairs_two_heads", dict(kv_heads=3))])
def test_stacked_and_two_heads_fall_back_to_pairs(fp8_dot, override):
    """Where a variant cannot run (a group that is not a power of two, a page smaller than the slices,
    an odd number of kv heads) the call runs "pairs" itself: the same output, to the bit."""
    shape = dict(batch=2, kv_heads=2, group=4, max_len=130, page_size=16, head_dim=64) | override
    args = make_case(1500 + len(str(override)), "fp8_e4m3", "per_token_head", "nhd", **shape)
    outs = {}
    for mode in (fp8_dot, "pairs"):
        outs[mode] = torch.full(args["q"].shape, float("nan"), dtype=torch.float32, device=DEVICE)
        paged_decode_attention(**args, out=outs[mode], num_splits=2, block_n=64, fp8_dot=mode)
    assert torch.equal(outs[fp8_dot], outs["pairs"])
    assert_close_to_reference(outs["pairs"], args, torch.float16)
