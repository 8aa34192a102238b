"""Paged decode attention: the Triton kernel and its float64 torch reference.

Owns one query token per sequence attending to that sequence's KV pages, read in place
through a page table: GQA, split-KV with a merge stage for long contexts, pages in "nhd"
or "hnd" layout with any strides, and two dtype paths:

- fp8 pages (e4m3 / e5m2) with fp32 scales at the page format's granularity (per_tensor,
  per_page_head, per_token_head). The kernel dequantizes inside: within one program the kv
  head is fixed, so every granularity gives one scale per token, and K's scale multiplies
  that token's score column while V's scale multiplies its probability. That is the same
  product as scaling the page first, but fp8 -> fp16 (and bf16) is exact, so the tensor-core
  dot sees exact values and the scale is applied in fp32. By default ("pairs") the pages are
  read as 16-bit words of two fp8 values, each word converted by one instruction, and the dots
  run in fp16 over the even and the odd head_dim columns (_decode_split_pairs). fp8_dot="mma"
  runs both dots on fp8 tensor cores with the pages as loaded (_decode_split_mma).
- 16-bit pages (bf16 / fp16), e.g. the bf16 pages a PageFormat with device_dtype="bf16"
  delivers by upcasting fp8 records on reload.

It must never allocate or move KV pages, and never look at which tier a page came from:
the caller hands it device tensors and a page table.

On a machine without CUDA the kernels run in Triton's interpreter (numpy on the CPU), so the
same code is tested everywhere: importing this module sets TRITON_INTERPRET=1 there.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch

# Triton reads TRITON_INTERPRET when it is imported (its own library functions are jitted then),
# so the choice is made here, before the import. Without CUDA Triton cannot run a compiled kernel,
# so interpreting changes nothing else in this process; TRITON_INTERPRET=0, set explicitly, keeps
# the kernels compiled, for compiling them for a GPU offline (scripts/decode_offline_sm90.py).
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "0":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise ImportError(
            "kvtier.decode needs Triton's interpreter on a machine without CUDA, but triton was imported "
            "before it with TRITON_INTERPRET unset; set TRITON_INTERPRET=1 or import kvtier.decode first"
        )
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402
except ModuleNotFoundError as err:
    if err.name != "triton":
        raise
    raise ImportError(
        "kvtier.decode (the reference decoder) needs Triton, which is not installed: "
        "pip install 'kvtier[decode]' (or triton>=3.4; on a machine without CUDA it runs Triton's interpreter)",
        name="triton",
    ) from None

from kvtier.format.codec import expand_scales  # noqa: E402

LOG2E = 1.4426950408889634
FP8_KINDS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
SCALES = ("none", "per_tensor", "per_page_head", "per_token_head")
LAYOUTS = ("nhd", "hnd")
FP8_DOTS = ("fp16", "query", "pairs", "pairs_vmax", "pairs_lean", "pairs_stacked", "pairs_two_heads", "mma")
# How split partial outputs are merged: a second kernel (_merge_splits); the same kernel launched
# with programmatic dependent launch ("pdl": its programs are placed while the split kernel runs and
# wait for its writes at griddepcontrol.wait; sm_90 and later, "kernel" elsewhere and under the
# interpreter); or by the last program of each (sequence, kv head) inside the split kernel
# (_merge_if_last; not under fp8_dot="mma").
MERGES = ("kernel", "pdl", "fused")
# The kernel configuration a call gets where it names none, for fp8 pages and for 16-bit pages: the
# fastest of configuration searches on an H200 (BENCHMARKS.md, "Decode attention kernel").
# Chosen by scripts/decode_sweep_h200.py on an H200 (2026-12-04, BENCHMARKS.md): fp8 pages with
# three stages and the page table read a step ahead 0.69-0.83x of the HBM copy at batch 16 / 64
# from 8k tokens against 0.67-0.79x with two stages; 16-bit pages 0.87-1.03x against 0.86-0.97x.
DEFAULT_CONFIGS = {
    # H200 and H100, 2026-12-07 (scripts/decode_regs_probe.py, L2 flushed clean, BENCHMARKS.md):
    # four warps, two stages, registers capped at 128 so that four programs share an SM, read fp8
    # pages at 0.69 / 0.80 / 0.83x of the copy rate at batch 16 x 8k / 16 x 32k / 64 x 8k and
    # 0.66x at 64 x 1k on the H200, against 0.70 / 0.80 / 0.71 / 0.59x for the earlier default
    # (two warps, 255 registers, four an SM); on the H100 0.85 / 0.93 / 0.94 / 0.81x against
    # 0.85 / 0.95 / 0.94 / 0.77x. maxnreg applies where a call names no kernel shape and the
    # pages take _decode_split_pairs (default_maxnreg).
    "fp8": dict(block_n=128, num_warps=4, num_stages=2, fp8_dot="pairs", page_ahead=True, programs_per_sm=4,
                maxnreg=128),
    "16-bit": dict(block_n=64, num_warps=4, num_stages=3, page_ahead=True),
}
BLOCK_N = {fp8: DEFAULT_CONFIGS["fp8" if fp8 else "16-bit"]["block_n"] for fp8 in (True, False)}
# tl.dot needs every dimension >= 16 on NVIDIA GPUs: query heads of one kv head are padded to it.
MMA_MIN_BLOCK_N = 32  # fp8 tensor-core dots (fp8_dot="mma") take K >= 32
MIN_DOT = 16
# Split-KV cuts sequences so that the programs fill whole waves: PROGRAMS_PER_SM programs of the
# default configs stay resident on each SM (registers: about 160 a thread for fp8 pages, so three
# programs of four warps), and a plan whose last wave is less than WAVE_FILL full leaves SMs idle
# for a whole program's time (batch 64 x 8k fp8 tokens on an H200: one split, 1.29 waves, ran at
# 0.63x of the copy rate; three splits, 3.9 waves, at 0.76x). No piece is shorter than
# MIN_SPLIT_TOKENS, where the merge would cost more than the parallelism gains.
PROGRAMS_PER_SM = 3
DEFAULT_SMS = 132  # an H200's, for the plan on a machine without CUDA
WAVE_FILL = 0.9
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Triton's interpreter (3.9) multiplies bf16 dot operands as their raw uint16 bits; there the
# operands go in as fp32 after rounding to the query dtype, which is the same product.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _query_powers(q_max, qk_scale, TOP: tl.constexpr):
    """(score scale, query factor): the query times the factor, a power of two, puts its largest
    element |q_max| in [2^TOP, 2^(TOP+1)) (exact), and the score scale takes it back. TOP 13 suits
    dots in fp16, 7 query terms in e4m3 (largest finite 448)."""
    # Biased exponent e of q_max, clamped so that both powers of two below are normal.
    e = (q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.minimum(tl.maximum(e, TOP + 1), 254)
    return qk_scale * ((e - TOP) << 23).to(tl.float32, bitcast=True), ((254 + TOP - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _split_range(LENS, tokens_per_split):
    """This program's (sequence, kv head, split) and the split's tokens [start, end) (empty past
    the sequence's end)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, tl.load(LENS + b))
    return b, kvh, split, start, end


@triton.jit
def _block_pages(PT, b, stride_ptb, n0, end, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Each token's page for the block of tokens from n0 (0 past `end`)."""
    tok = n0 + tl.arange(0, BLOCK_N)
    return tl.load(PT + b * stride_ptb + tok // PAGE_SIZE, mask=tok < end, other=0).to(tl.int64)


@triton.jit
def _block_tokens(PT, b, stride_ptb, n0, end, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The block of tokens from n0: (live, each token's page, its row in the page)."""
    tok = n0 + tl.arange(0, BLOCK_N)
    return tok < end, _block_pages(PT, b, stride_ptb, n0, end, BLOCK_N, PAGE_SIZE), tok % PAGE_SIZE


@triton.jit
def _next_block(PT, b, stride_ptb, n0, end, page_ahead, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                PAGE_AHEAD: tl.constexpr):
    """(live, page, row) of the block from n0 and the page table's entries for the block after it.

    Under PAGE_AHEAD the pages come from `page_ahead`, loaded one step earlier, so that the K and
    V addresses of a step do not wait on a load issued in that step (which keeps Triton's
    pipeliner from putting the page loads a stage ahead); else they are loaded here and
    `page_ahead` is passed through."""
    tok = n0 + tl.arange(0, BLOCK_N)
    if PAGE_AHEAD:
        page = page_ahead
        page_ahead = _block_pages(PT, b, stride_ptb, n0 + BLOCK_N, end, BLOCK_N, PAGE_SIZE)
    else:
        page = _block_pages(PT, b, stride_ptb, n0, end, BLOCK_N, PAGE_SIZE)
    return tok < end, page, tok % PAGE_SIZE, page_ahead


@triton.jit
def _token_scales(S, page, row, kvh, stride_p, stride_t, stride_h, live):
    """One scale per token of a block (every granularity's strides give the token's kv head's)."""
    return tl.load(S + page * stride_p + row * stride_t + kvh * stride_h, mask=live, other=0.0)


@triton.jit
def _merge_if_last(
    MID_O, MID_LSE, LENS, OUT, CNT, b, unit, head0, tokens_per_split,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    HEADS: tl.constexpr, MERGE_H: tl.constexpr, MERGE_S: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """The merge fused into the split kernel (merge="fused"): after storing its partial output, a
    program counts itself done on CNT[b, unit] (zero before the launch; `unit` is the launch
    grid's second index), and the one that counts last merges every split of its HEADS query
    heads from `head0`, as _merge_splits would, so no second kernel runs.

    The counter's add is acq_rel at GPU scope, between barriers: every thread's stores of this
    program happen before it, and the last program's loads after it; the partial outputs are
    read at L2 (.cg), never from a stale L1 line. The last program reads all of them in one
    [MERGE_S splits, MERGE_H heads, HEAD_DIM] tile (powers of two >= the splits and HEADS), so
    the merge costs one round trip to L2 after the counter, not one per split."""
    tl.debug_barrier()
    done = tl.atomic_add(CNT + b * tl.num_programs(1) + unit, 1, sem="acq_rel", scope="gpu")
    splits = tl.cdiv(tl.load(LENS + b), tokens_per_split)
    if done == splits - 1:
        tl.debug_barrier()
        offs_s = tl.arange(0, MERGE_S)
        offs_g = tl.arange(0, MERGE_H)
        offs_d = tl.arange(0, HEAD_DIM)
        own = offs_g < HEADS
        heads = head0 + offs_g
        live = (offs_s[:, None] < splits) & own[None, :]
        lse = tl.load(MID_LSE + b * stride_lb + heads[None, :] * stride_lh + offs_s[:, None], mask=live,
                      other=float("-inf"), cache_modifier=".cg")
        top = tl.max(lse, 0)
        # Past HEADS every split is -inf (top too): where() keeps those rows' weights 0, not NaN.
        w = tl.where(live, tl.exp2(lse - top[None, :]), 0.0)
        o = tl.load(MID_O + b * stride_ob + heads[None, :, None] * stride_oh + offs_s[:, None, None] * stride_os
                    + offs_d[None, None, :], mask=live[:, :, None], other=0.0, cache_modifier=".cg")
        total = tl.sum(w, 0)
        total = tl.where(total > 0, total, 1.0)
        out = tl.sum(w[:, :, None] * o, 0) / total[:, None]
        tl.store(OUT + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=own[:, None])


@triton.jit
def _decode_split(
    Q, K, V, KS, VS, PT, LENS, MID_O, MID_LSE, OUT, CNT,
    qk_scale,
    tokens_per_split,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_ksp, stride_kst, stride_ksh,
    stride_vsp, stride_vst, stride_vsh,
    stride_ptb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    SCALED: tl.constexpr,
    F16: tl.constexpr,
    DOT_F32: tl.constexpr,
    SINGLE: tl.constexpr,
    PAGE_AHEAD: tl.constexpr = False,
    FUSED: tl.constexpr = False,
    MERGE_H: tl.constexpr = 1,
    MERGE_S: tl.constexpr = 1,
    LAUNCH_MERGE: tl.constexpr = False,
):
    """One (sequence, kv head, split): the split's partial output per query head and its log2-sum-exp.

    SINGLE (one split covers every sequence): the output itself, and no merge follows.
    F16 (fp8 pages only): both dots in fp16, which fp8 converts to in one instruction per two
    values (bf16 takes three more on sm90). fp8 -> fp16 is exact; the query is scaled by a power
    of two into fp16's range first (exact: its largest element lands in [2^13, 2^14)), and each
    block's probabilities times V's scales are divided by the block's largest scale, so they lie
    in [0, 1]; both factors come back in fp32.
    LAUNCH_MERGE (merge="pdl"): let the merge kernel's programs be placed from now on (they wait for
    this kernel's writes before reading them).
    """
    if LAUNCH_MERGE:
        tl.extra.cuda.gdc_launch_dependents()
    b, kvh, split, start, end = _split_range(LENS, tokens_per_split)
    if start < end:
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        score_scale = qk_scale
        if F16:
            q32 = q.to(tl.float32)
            score_scale, q_factor = _query_powers(tl.max(tl.max(tl.abs(q32), 1), 0), qk_scale, 13)
            q = (q32 * q_factor).to(tl.float16)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        page_ahead = 0
        if PAGE_AHEAD:
            page_ahead = _block_pages(PT, b, stride_ptb, start, end, BLOCK_N, PAGE_SIZE)
        for n0 in range(start, end, BLOCK_N):
            live, page, row, page_ahead = _next_block(
                PT, b, stride_ptb, n0, end, page_ahead, BLOCK_N, PAGE_SIZE, PAGE_AHEAD)
            k_ptr = K + page[:, None] * stride_kp + row[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
            v_ptr = V + page[:, None] * stride_vp + row[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :]
            k = tl.load(k_ptr, mask=live[:, None], other=0)
            v = tl.load(v_ptr, mask=live[:, None], other=0)
            if FP8 == 1:
                k = k.to(tl.float8e4nv, bitcast=True)
                v = v.to(tl.float8e4nv, bitcast=True)
            if FP8 == 2:
                k = k.to(tl.float8e5, bitcast=True)
                v = v.to(tl.float8e5, bitcast=True)
            k = k.to(q.dtype)  # fp16 under F16
            v = v.to(q.dtype)
            if DOT_F32:
                score = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
            else:
                score = tl.dot(q, tl.trans(k))
            if SCALED:
                k_scale = _token_scales(KS, page, row, kvh, stride_ksp, stride_kst, stride_ksh, live)
                score = score * (k_scale * score_scale)[None, :]
            else:
                score = score * score_scale
            score = tl.where(live[None, :], score, float("-inf"))
            m_new = tl.maximum(m, tl.max(score, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(score - m_new[:, None])
            s = s * alpha + tl.sum(p, 1)
            v_max = 1.0
            if SCALED:
                v_scale = _token_scales(VS, page, row, kvh, stride_vsp, stride_vst, stride_vsh, live)
                if F16:
                    v_max = tl.max(v_scale, 0)
                    v_max = tl.where(v_max > 0, v_max, 1.0)
                    p = p * (v_scale / v_max)[None, :]
                else:
                    p = p * v_scale[None, :]
            p = p.to(q.dtype)
            if DOT_F32:
                pv = tl.dot(p.to(tl.float32), v.to(tl.float32))
            else:
                pv = tl.dot(p, v)
            if F16:
                pv = pv * v_max
            acc = acc * alpha[:, None] + pv
            m = m_new
        if SINGLE:
            o_ptr = OUT + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :]
            tl.store(o_ptr, (acc / s[:, None]).to(OUT.dtype.element_ty), mask=mask_h[:, None])
        else:
            o_ptr = MID_O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
            tl.store(o_ptr, acc / s[:, None], mask=mask_h[:, None])
            tl.store(MID_LSE + b * stride_lb + heads * stride_lh + split, m + tl.log2(s), mask=mask_h)
            if FUSED:
                _merge_if_last(MID_O, MID_LSE, LENS, OUT, CNT, b, kvh, kvh * GROUP, tokens_per_split,
                               stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                               GROUP, MERGE_H, MERGE_S, HEAD_DIM)


@triton.jit
def _fp8_pairs_to_f16(x, FP8: tl.constexpr, ASM: tl.constexpr):
    """int16 words each holding two fp8 values (element 2i in the low byte) -> (even, odd) fp16 tensors.

    fp8 -> fp16 is exact for e4m3 and e5m2. On the GPU (ASM) one cvt.rn.f16x2.e4m3x2 / .e5m2x2
    (sm_89+) converts a word's two values; the interpreter, which cannot run PTX, widens each byte.
    """
    if ASM:
        if FP8 == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
                "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
            )
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e5m2x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
        )
    lo = (x & 0xFF).to(tl.uint8)
    hi = ((x >> 8) & 0xFF).to(tl.uint8)
    if FP8 == 1:
        return lo.to(tl.float8e4nv, bitcast=True).to(tl.float16), hi.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo.to(tl.float8e5, bitcast=True).to(tl.float16), hi.to(tl.float8e5, bitcast=True).to(tl.float16)


@triton.jit
def _qk_pairs(q_even, q_odd, k_even, k_odd, ASM: tl.constexpr):
    """Scores of fp16 query rows against a block's K, even and odd columns apart (_fp8_pairs_to_f16)."""
    if ASM:
        score = tl.dot(q_even, tl.trans(k_even))
        score = tl.dot(q_odd, tl.trans(k_odd), score)
    else:  # the interpreter's dot: fp32 operands holding the same values
        score = tl.dot(q_even.to(tl.float32), tl.trans(k_even.to(tl.float32)))
        score = tl.dot(q_odd.to(tl.float32), tl.trans(k_odd.to(tl.float32)), score)
    return score


@triton.jit
def _softmax_block(score, m):
    """One block of an online softmax: (m_new, alpha, weight, p). Probabilities relative to each
    row's largest score in this block, so that every row's largest is 1 and fp16 keeps its
    precision for blocks far below the running maximum; the block's weight relative to the
    running maximum multiplies the dot's result, alpha rescales what came before."""
    m_block = tl.max(score, 1)
    m_new = tl.maximum(m, m_block)
    return m_new, tl.exp2(m - m_new), tl.exp2(m_block - m_new), tl.exp2(score - m_block[:, None])


@triton.jit
def _pv_pairs(p, v_even, v_odd, acc_even, acc_odd, alpha, weight, ASM: tl.constexpr):
    """The accumulators after one block: rescaled by alpha, plus fp16 probabilities times V's
    even and odd columns times weight."""
    if ASM:
        pv_even = tl.dot(p, v_even)
        pv_odd = tl.dot(p, v_odd)
    else:
        pv_even = tl.dot(p.to(tl.float32), v_even.to(tl.float32))
        pv_odd = tl.dot(p.to(tl.float32), v_odd.to(tl.float32))
    return acc_even * alpha[:, None] + pv_even * weight[:, None], acc_odd * alpha[:, None] + pv_odd * weight[:, None]


@triton.jit
def _pairs_query(Q, b, stride_qb, stride_qh, heads, mask_h, offs_w, qk_scale):
    """A kv head's query rows for _decode_split_pairs's dots: (score scale, even columns, odd
    columns), scaled by a power of two into fp16's range (_query_powers)."""
    q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + 2 * offs_w[None, :]
    q_even = tl.load(q_ptr, mask=mask_h[:, None], other=0.0).to(tl.float32)
    q_odd = tl.load(q_ptr + 1, mask=mask_h[:, None], other=0.0).to(tl.float32)
    q_max = tl.maximum(tl.max(tl.max(tl.abs(q_even), 1), 0), tl.max(tl.max(tl.abs(q_odd), 1), 0))
    score_scale, q_factor = _query_powers(q_max, qk_scale, 13)
    return score_scale, (q_even * q_factor).to(tl.float16), (q_odd * q_factor).to(tl.float16)


@triton.jit
def _pairs_step(
    q_even, q_odd, score_scale, m, s, row_sums, v_top, acc_even, acc_odd, K, V, KS, VS, page, row, live,
    kvh, offs_w, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh,
    FP8: tl.constexpr, ASM: tl.constexpr, SPLIT_VMAX: tl.constexpr, ROW_SUMS: tl.constexpr,
):
    """One block of one kv head in _decode_split_pairs's loop: (m, s, row_sums, acc_even, acc_odd)
    after it (see that kernel for SPLIT_VMAX / v_top and ROW_SUMS / row_sums)."""
    k_ptr = K + page[:, None] * stride_kp + row[:, None] * stride_kt + kvh * stride_kh + offs_w[None, :]
    v_ptr = V + page[:, None] * stride_vp + row[:, None] * stride_vt + kvh * stride_vh + offs_w[None, :]
    k_even, k_odd = _fp8_pairs_to_f16(tl.load(k_ptr, mask=live[:, None], other=0), FP8, ASM)
    score = _qk_pairs(q_even, q_odd, k_even, k_odd, ASM)
    k_scale = _token_scales(KS, page, row, kvh, stride_ksp, stride_kst, stride_ksh, live)
    score = score * (k_scale * score_scale)[None, :]
    score = tl.where(live[None, :], score, float("-inf"))
    m_new, alpha, weight, p = _softmax_block(score, m)
    if ROW_SUMS:
        row_sums = row_sums * alpha[:, None] + p * weight[:, None]
    else:
        s = s * alpha + tl.sum(p, 1) * weight
    v_scale = _token_scales(VS, page, row, kvh, stride_vsp, stride_vst, stride_vsh, live)
    if SPLIT_VMAX:
        p = (p * (v_scale / v_top)[None, :]).to(tl.float16)
    else:
        v_max = tl.max(v_scale, 0)
        v_max = tl.where(v_max > 0, v_max, 1.0)
        weight = weight * v_max
        p = (p * (v_scale / v_max)[None, :]).to(tl.float16)
    v_even, v_odd = _fp8_pairs_to_f16(tl.load(v_ptr, mask=live[:, None], other=0), FP8, ASM)
    acc_even, acc_odd = _pv_pairs(p, v_even, v_odd, acc_even, acc_odd, alpha, weight, ASM)
    return m_new, s, row_sums, acc_even, acc_odd


@triton.jit
def _pairs_store(MID_O, MID_LSE, OUT, b, split, heads, mask_h, offs_w, m, s, divisor, acc_even, acc_odd,
                 stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                 SINGLE: tl.constexpr):
    """A kv head's rows out of _decode_split_pairs: the output (SINGLE) or the split's partial output
    and its log-sum-exp, the accumulators divided by `divisor`."""
    if SINGLE:
        o_ptr = OUT + b * stride_outb + heads[:, None] * stride_outh + 2 * offs_w[None, :]
        tl.store(o_ptr, (acc_even / divisor[:, None]).to(OUT.dtype.element_ty), mask=mask_h[:, None])
        tl.store(o_ptr + 1, (acc_odd / divisor[:, None]).to(OUT.dtype.element_ty), mask=mask_h[:, None])
    else:
        o_ptr = MID_O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + 2 * offs_w[None, :]
        tl.store(o_ptr, acc_even / divisor[:, None], mask=mask_h[:, None])
        tl.store(o_ptr + 1, acc_odd / divisor[:, None], mask=mask_h[:, None])
        tl.store(MID_LSE + b * stride_lb + heads * stride_lh + split, m + tl.log2(s), mask=mask_h)


@triton.jit
def _decode_split_pairs(
    Q, K, V, KS, VS, PT, LENS, MID_O, MID_LSE, OUT, CNT,
    qk_scale,
    tokens_per_split,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_ksp, stride_kst, stride_ksh,
    stride_vsp, stride_vst, stride_vsh,
    stride_ptb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    ASM: tl.constexpr,
    SINGLE: tl.constexpr,
    SPLIT_VMAX: tl.constexpr = False,
    ROW_SUMS: tl.constexpr = False,
    PAGE_AHEAD: tl.constexpr = False,
    FUSED: tl.constexpr = False,
    MERGE_H: tl.constexpr = 1,
    MERGE_S: tl.constexpr = 1,
    LAUNCH_MERGE: tl.constexpr = False,
):
    """_decode_split for fp8 pages read as int16 words of two values (K and V strides in words).

    Each word converts to two fp16 values in one instruction, and each dot runs twice, over the
    even and over the odd head_dim columns (the query split the same way; two accumulators, joined
    at the store). Converting in place of the loaded words lets the tiles reach the dots through
    ldmatrix, where bytes converted to bf16 are restaged one by one (sm90, Triton 3.6). The dots run
    in fp16 with the fp16 path's scaling: the query by a power of two into fp16's range, each block's
    probabilities taken relative to the row's largest score in the block and times V's scales
    divided by the block's largest scale (both factors come back in fp32). Needs head_dim >= 32
    (each dot's inner dimension, head_dim / 2, at least 16).
    Two variants take cross-warp reductions out of the loop ("pairs_lean"): SPLIT_VMAX divides
    V's scales by the split's largest (one pass over the split's scales first, reduced once)
    instead of each block's; ROW_SUMS keeps the softmax denominators per column and sums them
    once after the loop.
    """
    HALF_D: tl.constexpr = HEAD_DIM // 2
    if LAUNCH_MERGE:  # see _decode_split
        tl.extra.cuda.gdc_launch_dependents()
    b, kvh, split, start, end = _split_range(LENS, tokens_per_split)
    if start < end:
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        offs_w = tl.arange(0, HALF_D)
        score_scale, q_even, q_odd = _pairs_query(Q, b, stride_qb, stride_qh, heads, mask_h, offs_w, qk_scale)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_H], tl.float32)
        acc_even = tl.zeros([BLOCK_H, HALF_D], tl.float32)
        acc_odd = tl.zeros([BLOCK_H, HALF_D], tl.float32)
        row_sums = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        v_top = 1.0
        if SPLIT_VMAX:
            v_tops = tl.zeros([BLOCK_N], tl.float32)
            for n0 in range(start, end, BLOCK_N):
                live, page, row = _block_tokens(PT, b, stride_ptb, n0, end, BLOCK_N, PAGE_SIZE)
                v_tops = tl.maximum(v_tops, _token_scales(VS, page, row, kvh, stride_vsp, stride_vst, stride_vsh, live))
            v_top = tl.max(v_tops, 0)
            v_top = tl.where(v_top > 0, v_top, 1.0)
        page_ahead = 0
        if PAGE_AHEAD:
            page_ahead = _block_pages(PT, b, stride_ptb, start, end, BLOCK_N, PAGE_SIZE)
        for n0 in range(start, end, BLOCK_N):
            live, page, row, page_ahead = _next_block(
                PT, b, stride_ptb, n0, end, page_ahead, BLOCK_N, PAGE_SIZE, PAGE_AHEAD)
            m, s, row_sums, acc_even, acc_odd = _pairs_step(
                q_even, q_odd, score_scale, m, s, row_sums, v_top, acc_even, acc_odd, K, V, KS, VS, page, row, live,
                kvh, offs_w, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh, FP8, ASM, SPLIT_VMAX, ROW_SUMS)
        if ROW_SUMS:
            s = tl.sum(row_sums, 1)
        # The accumulators hold V's scales divided by v_top (1 but under SPLIT_VMAX).
        _pairs_store(MID_O, MID_LSE, OUT, b, split, heads, mask_h, offs_w, m, s, s / v_top, acc_even, acc_odd,
                     stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh, SINGLE)
        if FUSED and not SINGLE:
            _merge_if_last(MID_O, MID_LSE, LENS, OUT, CNT, b, kvh, kvh * GROUP, tokens_per_split,
                           stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                           GROUP, MERGE_H, MERGE_S, HEAD_DIM)


@triton.jit
def _decode_split_pairs_kv(
    Q, K, V, KS, VS, PT, LENS, MID_O, MID_LSE, OUT, CNT,
    qk_scale,
    tokens_per_split,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_ksp, stride_kst, stride_ksh,
    stride_vsp, stride_vst, stride_vsh,
    stride_ptb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    ASM: tl.constexpr,
    SINGLE: tl.constexpr,
    KVP: tl.constexpr,
    PAGE_AHEAD: tl.constexpr = False,
    FUSED: tl.constexpr = False,
    MERGE_H: tl.constexpr = 1,
    MERGE_S: tl.constexpr = 1,
):
    """_decode_split_pairs over KVP kv heads at once (kv_per_program): program (b, g, split) reads
    kv heads g*KVP .. g*KVP+KVP-1, whose query heads are KVP*GROUP consecutive rows (padded to
    BLOCK_H). A token's pages of those heads are one tile of KVP*HEAD_DIM/2 words (under "nhd"
    one contiguous piece of KVP*HEAD_DIM bytes), and the dots run over all of it with each row's
    query placed block-diagonally: a row holds its head's values in its kv head's columns and
    zeros elsewhere, so Q.K^T gives each row the scores against its own kv head (the zeros add
    exact zeros). P.V yields every row against every kv head's V; each row keeps its own kv
    head's columns. The scales are per (row, token) tiles; V's block maximum is per row.
    Fewer padded rows (GROUP 4, KVP 2: 8 of 16 rows live instead of 4) and longer pieces read,
    for twice the MMA work, which the loop has to spare."""
    HALF_D: tl.constexpr = HEAD_DIM // 2
    WORDS: tl.constexpr = KVP * HALF_D
    b, kvg, split, start, end = _split_range(LENS, tokens_per_split)
    if start < end:
        kv0 = kvg * KVP
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP * KVP
        heads = kv0 * GROUP + offs_h
        row_kv = offs_h // GROUP  # each row's kv head, counted from kv0
        offs_w = tl.arange(0, WORDS)
        word_kv = offs_w // HALF_D
        word_d = offs_w % HALF_D
        own = mask_h[:, None] & (word_kv[None, :] == row_kv[:, None])
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + 2 * word_d[None, :]
        q_even = tl.load(q_ptr, mask=own, other=0.0).to(tl.float32)
        q_odd = tl.load(q_ptr + 1, mask=own, other=0.0).to(tl.float32)
        q_max = tl.maximum(tl.max(tl.max(tl.abs(q_even), 1), 0), tl.max(tl.max(tl.abs(q_odd), 1), 0))
        score_scale, q_factor = _query_powers(q_max, qk_scale, 13)
        q_even = (q_even * q_factor).to(tl.float16)
        q_odd = (q_odd * q_factor).to(tl.float16)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_H], tl.float32)
        acc_even = tl.zeros([BLOCK_H, WORDS], tl.float32)
        acc_odd = tl.zeros([BLOCK_H, WORDS], tl.float32)
        row_heads = kv0 + tl.minimum(row_kv, KVP - 1)  # padded rows read the last kv head's scales
        page_ahead = 0
        if PAGE_AHEAD:
            page_ahead = _block_pages(PT, b, stride_ptb, start, end, BLOCK_N, PAGE_SIZE)
        for n0 in range(start, end, BLOCK_N):
            live, page, row, page_ahead = _next_block(
                PT, b, stride_ptb, n0, end, page_ahead, BLOCK_N, PAGE_SIZE, PAGE_AHEAD)
            k_ptr = K + page[:, None] * stride_kp + row[:, None] * stride_kt + (kv0 + word_kv[None, :]) * stride_kh \
                + word_d[None, :]
            v_ptr = V + page[:, None] * stride_vp + row[:, None] * stride_vt + (kv0 + word_kv[None, :]) * stride_vh \
                + word_d[None, :]
            k_even, k_odd = _fp8_pairs_to_f16(tl.load(k_ptr, mask=live[:, None], other=0), FP8, ASM)
            score = _qk_pairs(q_even, q_odd, k_even, k_odd, ASM)
            k_scale = tl.load(KS + page[None, :] * stride_ksp + row[None, :] * stride_kst + row_heads[:, None] * stride_ksh,
                              mask=live[None, :], other=0.0)
            score = score * (k_scale * score_scale)
            score = tl.where(live[None, :], score, float("-inf"))
            m_new, alpha, weight, p = _softmax_block(score, m)
            s = s * alpha + tl.sum(p, 1) * weight
            v_scale = tl.load(VS + page[None, :] * stride_vsp + row[None, :] * stride_vst + row_heads[:, None] * stride_vsh,
                              mask=live[None, :], other=0.0)
            v_max = tl.max(v_scale, 1)
            v_max = tl.where(v_max > 0, v_max, 1.0)
            weight = weight * v_max
            p = (p * (v_scale / v_max[:, None])).to(tl.float16)
            v_even, v_odd = _fp8_pairs_to_f16(tl.load(v_ptr, mask=live[:, None], other=0), FP8, ASM)
            acc_even, acc_odd = _pv_pairs(p, v_even, v_odd, acc_even, acc_odd, alpha, weight, ASM)
            m = m_new
        if SINGLE:
            o_ptr = OUT + b * stride_outb + heads[:, None] * stride_outh + 2 * word_d[None, :]
            tl.store(o_ptr, (acc_even / s[:, None]).to(OUT.dtype.element_ty), mask=own)
            tl.store(o_ptr + 1, (acc_odd / s[:, None]).to(OUT.dtype.element_ty), mask=own)
        else:
            o_ptr = MID_O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + 2 * word_d[None, :]
            tl.store(o_ptr, acc_even / s[:, None], mask=own)
            tl.store(o_ptr + 1, acc_odd / s[:, None], mask=own)
            tl.store(MID_LSE + b * stride_lb + heads * stride_lh + split, m + tl.log2(s), mask=mask_h)
            if FUSED:
                _merge_if_last(MID_O, MID_LSE, LENS, OUT, CNT, b, kvg, kvg * GROUP * KVP, tokens_per_split,
                               stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                               GROUP * KVP, MERGE_H, MERGE_S, HEAD_DIM)


@triton.jit
def _to_e4m3(x, BY_BITS: tl.constexpr):
    """fp32 `x` (|x| <= 448) rounded to the nearest e4m3 value, ties to even.

    BY_BITS rounds in fp32 first (normal values to 3 mantissa bits through their bits, subnormal
    ones to multiples of 2^-9 by adding and taking off 2^14), so the conversion only has exact
    values to convert: Triton's interpreter (3.9) rounds 127.0 to 64.0, losing the carry into the
    exponent. On the GPU one cvt.rn.satfinite does it."""
    if BY_BITS:
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) < 0.015625, (x + 16384.0) - 16384.0, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def _fp8_terms(x, TERMS: tl.constexpr, BY_BITS: tl.constexpr):
    """fp32 `x` as a sum of TERMS e4m3 tensors (hi, mid, lo; mid and lo zero when fewer terms).

    Each term rounds what the earlier ones left, so two terms hold 8 significant bits (a bf16
    value exactly, where it is within e4m3's normal range) and three hold 12 (an fp16 value)."""
    hi = _to_e4m3(x, BY_BITS)
    rest = x - hi.to(tl.float32)
    mid = _to_e4m3(rest, BY_BITS)
    lo = _to_e4m3(rest - mid.to(tl.float32), BY_BITS)
    if TERMS < 2:
        mid = tl.zeros_like(hi)
    if TERMS < 3:
        lo = tl.zeros_like(hi)
    return hi, mid, lo


@triton.jit
def _dot_terms(a, b_hi, b_mid, b_lo, acc, TERMS: tl.constexpr, DOT_F32: tl.constexpr):
    """acc + a . (b_hi + b_mid + b_lo), one dot per term (a and the terms fp8)."""
    if DOT_F32:  # the interpreter's dot: fp32 operands holding the same values
        a = a.to(tl.float32)
        b_hi = b_hi.to(tl.float32)
        b_mid = b_mid.to(tl.float32)
        b_lo = b_lo.to(tl.float32)
    acc = tl.dot(a, b_hi, acc)
    if TERMS > 1:
        acc = tl.dot(a, b_mid, acc)
    if TERMS > 2:
        acc = tl.dot(a, b_lo, acc)
    return acc


@triton.jit
def _decode_split_mma(
    Q, K, V, KS, VS, PT, LENS, MID_O, MID_LSE, OUT, CNT,
    qk_scale,
    tokens_per_split,
    stride_qb, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_ksp, stride_kst, stride_ksh,
    stride_vsp, stride_vst, stride_vsh,
    stride_ptb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    Q_TERMS: tl.constexpr,
    DOT_F32: tl.constexpr,
    SINGLE: tl.constexpr,
    PAGE_AHEAD: tl.constexpr = False,
    FUSED: tl.constexpr = False,
):
    """_decode_split for fp8 pages with both dots on fp8 tensor cores, transposed: the pages' tile
    is the dots' first operand (BLOCK_N tokens or HEAD_DIM rows, enough for a warpgroup's MMA)
    and the query heads of the kv head, padded to BLOCK_H, are the columns.

    K and V go into the dots as fp8, as loaded; the query and the probabilities become sums of
    e4m3 terms (_fp8_terms), one dot per term: the query, scaled by a power of two so its largest
    element lies in [2^7, 2^8), in Q_TERMS terms (2 hold a bf16 query exactly, 3 an fp16 one);
    the probabilities, relative to each head's largest score in the block and times V's scales
    divided by the block's largest, times 2^8, in two terms (8 significant bits, a bf16 query's
    precision). Both factors come back in fp32.
    """
    b, kvh, split, start, end = _split_range(LENS, tokens_per_split)
    if start < end:
        fp8_type: tl.constexpr = tl.float8e4nv if FP8 == 1 else tl.float8e5
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        offs_d = tl.arange(0, HEAD_DIM)
        # The query transposed: (HEAD_DIM, BLOCK_H).
        q = tl.load(Q + b * stride_qb + heads[None, :] * stride_qh + offs_d[:, None], mask=mask_h[None, :], other=0.0)
        q = q.to(tl.float32)
        score_scale, q_factor = _query_powers(tl.max(tl.max(tl.abs(q), 1), 0), qk_scale, 7)
        q_hi, q_mid, q_lo = _fp8_terms(q * q_factor, Q_TERMS, DOT_F32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([HEAD_DIM, BLOCK_H], tl.float32)
        page_ahead = 0
        if PAGE_AHEAD:
            page_ahead = _block_pages(PT, b, stride_ptb, start, end, BLOCK_N, PAGE_SIZE)
        for n0 in range(start, end, BLOCK_N):
            live, page, row, page_ahead = _next_block(
                PT, b, stride_ptb, n0, end, page_ahead, BLOCK_N, PAGE_SIZE, PAGE_AHEAD)
            k_ptr = K + page[:, None] * stride_kp + row[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :]
            k = tl.load(k_ptr, mask=live[:, None], other=0).to(fp8_type, bitcast=True)
            score = _dot_terms(k, q_hi, q_mid, q_lo, tl.zeros([BLOCK_N, BLOCK_H], tl.float32), Q_TERMS, DOT_F32)
            k_scale = _token_scales(KS, page, row, kvh, stride_ksp, stride_kst, stride_ksh, live)
            score = score * (k_scale * score_scale)[:, None]
            score = tl.where(live[:, None], score, float("-inf"))
            m_block = tl.max(score, 0)
            m_new = tl.maximum(m, m_block)
            alpha = tl.exp2(m - m_new)
            weight = tl.exp2(m_block - m_new)
            p = tl.exp2(score - m_block[None, :])
            s = s * alpha + tl.sum(p, 0) * weight
            v_scale = _token_scales(VS, page, row, kvh, stride_vsp, stride_vst, stride_vsh, live)
            v_max = tl.max(v_scale, 0)
            v_max = tl.where(v_max > 0, v_max, 1.0)
            p_hi, p_lo, _unused = _fp8_terms(p * (v_scale * (256.0 / v_max))[:, None], 2, DOT_F32)
            v_ptr = V + page[None, :] * stride_vp + row[None, :] * stride_vt + kvh * stride_vh + offs_d[:, None]
            v = tl.load(v_ptr, mask=live[None, :], other=0).to(fp8_type, bitcast=True)
            pv = _dot_terms(v, p_hi, p_lo, p_lo, tl.zeros([HEAD_DIM, BLOCK_H], tl.float32), 2, DOT_F32)
            acc = acc * alpha[None, :] + pv * (weight * (v_max / 256.0))[None, :]
            m = m_new
        if SINGLE:
            o_ptr = OUT + b * stride_outb + heads[None, :] * stride_outh + offs_d[:, None]
            tl.store(o_ptr, (acc / s[None, :]).to(OUT.dtype.element_ty), mask=mask_h[None, :])
        else:
            o_ptr = MID_O + b * stride_ob + heads[None, :] * stride_oh + split * stride_os + offs_d[:, None]
            tl.store(o_ptr, acc / s[None, :], mask=mask_h[None, :])
            tl.store(MID_LSE + b * stride_lb + heads * stride_lh + split, m + tl.log2(s), mask=mask_h)


@triton.jit
def _merge_splits(
    MID_O, MID_LSE, LENS, OUT,
    tokens_per_split,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    stride_outb, stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One (sequence, query head): the splits' partial outputs weighted by their share of the softmax.

    PDL (launched with programmatic dependent launch, merge="pdl"): the program may start before
    the split kernel ends, so it waits for that kernel's completion and writes
    (griddepcontrol.wait) before reading the partial outputs; the sequence lengths are inputs of
    both kernels, read before."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(LENS + b)
    splits = tl.cdiv(seq_len, tokens_per_split)
    offs_s = tl.arange(0, BLOCK_S)
    live = offs_s < splits
    offs_d = tl.arange(0, HEAD_DIM)
    if PDL:
        tl.extra.cuda.gdc_wait()
    lse = tl.load(MID_LSE + b * stride_lb + h * stride_lh + offs_s, mask=live, other=float("-inf"))
    o = tl.load(MID_O + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :], mask=live[:, None], other=0.0)
    w = tl.exp2(lse - tl.max(lse, 0))
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(OUT + b * stride_outb + h * stride_outh + offs_d, out.to(OUT.dtype.element_ty))


def default_maxnreg(defaults: dict, *shape) -> int | None:
    """The register cap of a call that names none: its DEFAULT_CONFIGS entry's, where it names no
    kernel shape either (`shape`: its block_n, num_warps, num_stages and fp8_dot), else none (the
    cap was measured with the default's shape only)."""
    return defaults.get("maxnreg") if all(part is None for part in shape) else None


def _plane_strides(t: torch.Tensor, layout: str) -> tuple[int, int, int]:
    """(page, token, head) element strides of a (pages, *plane_shape) tensor."""
    if layout == "nhd":
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


def _scale_strides(t: torch.Tensor, scale: str, layout: str) -> tuple[int, int, int]:
    """(page, token, head) element strides of a scale tensor; 0 where the granularity shares one scale."""
    if scale == "per_tensor":
        return t.stride(0), 0, 0
    if scale == "per_page_head":
        return t.stride(0), 0, t.stride(1)
    if layout == "nhd":
        return t.stride(0), t.stride(1), t.stride(2)
    return t.stride(0), t.stride(2), t.stride(1)


def _expected_scale_shape(scale: str, layout: str, pages: int, page_size: int, heads: int) -> tuple[int, ...]:
    if scale == "per_tensor":
        return (pages,)
    if scale == "per_page_head":
        return (pages, heads)
    return (pages, page_size, heads) if layout == "nhd" else (pages, heads, page_size)


def _check_inputs(q, k_pages, v_pages, page_table, seq_lens, layout, k_scales, v_scales, scale):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if q.dim() != 3:
        raise ValueError(f"q must be (batch, q_heads, head_dim), got shape {tuple(q.shape)}")
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must both be (pages, *plane_shape) of one shape, got {tuple(k_pages.shape)} "
            f"and {tuple(v_pages.shape)}"
        )
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages must share a dtype, got {k_pages.dtype} and {v_pages.dtype}")
    pages = k_pages.shape[0]
    page_size, heads = (k_pages.shape[1], k_pages.shape[2]) if layout == "nhd" else (k_pages.shape[2], k_pages.shape[1])
    head_dim = k_pages.shape[3]
    batch, q_heads = q.shape[0], q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} does not match the pages' head_dim {head_dim}")
    if head_dim < MIN_DOT or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two in [{MIN_DOT}, 256], got {head_dim}")
    if q_heads % heads:
        raise ValueError(f"q_heads {q_heads} must be a multiple of the pages' kv heads {heads}")
    for name, t in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim, got strides {t.stride()}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: every input must share one device")
    fp8 = k_pages.dtype in FP8_KINDS
    if fp8:
        if q.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"q must be bf16 or fp16 with fp8 pages, got {q.dtype}")
        if scale == "none":
            raise ValueError(f"fp8 pages ({k_pages.dtype}) need scales: pass scale= and k_scales / v_scales")
    else:
        if k_pages.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"pages must be bf16, fp16, float8_e4m3fn or float8_e5m2, got {k_pages.dtype}")
        if q.dtype != k_pages.dtype:
            raise ValueError(f"q dtype {q.dtype} must match 16-bit pages of dtype {k_pages.dtype}")
        if scale != "none" or k_scales is not None or v_scales is not None:
            raise ValueError(f"{k_pages.dtype} pages take no scales, got scale={scale!r}")
    if scale != "none":
        want = _expected_scale_shape(scale, layout, pages, page_size, heads)
        for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
            if t is None:
                raise ValueError(f"scale={scale!r} needs {name}, got None")
            if tuple(t.shape) != want or t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32 of shape {want} for scale={scale!r}, got {t.dtype} {tuple(t.shape)}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be int32 (batch={batch}, max_pages), got {page_table.dtype} {tuple(page_table.shape)}")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 of shape ({batch},), got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("page_table", page_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if page_table.stride(1) != 1:
        raise ValueError(f"page_table must be contiguous along its pages, got strides {page_table.stride()}")
    return page_size, heads, head_dim


def _word_views(k_pages: torch.Tensor, v_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V fp8 pages as int16 words of two values (strides halve), or None where their strides
    or offsets are odd in bytes (then the pages are read byte by byte)."""
    try:
        return k_pages.view(torch.int16), v_pages.view(torch.int16)
    except RuntimeError:
        return None


def wave_slots(device: torch.device | None = None, per_sm: int | None = None) -> int:
    """Programs that run at once on `device`: its SMs x `per_sm` (default PROGRAMS_PER_SM, what
    the default configs' registers and shared memory allow)."""
    per_sm = PROGRAMS_PER_SM if per_sm is None else per_sm
    if device is None or device.type != "cuda":
        return DEFAULT_SMS * per_sm
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pdl_launches(device: torch.device) -> bool:
    """Whether kernels on `device` can be launched with programmatic dependent launch: a CUDA
    device of sm_90 or later, compiled (not interpreted) by a Triton that takes `launch_pdl`."""
    if INTERPRETED or device.type != "cuda":
        return False
    return _pdl_launches(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _pdl_launches(index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and torch.cuda.get_device_capability(index)[0] >= 9


def _cut(max_tokens: int, wanted: int, block_n: int) -> tuple[int, int]:
    per_split = -(-max_tokens // wanted)
    per_split = max(block_n, -(-per_split // block_n) * block_n)
    return -(-max_tokens // per_split), per_split


@functools.lru_cache(maxsize=4096)
def _planned(units: int, max_tokens: int, block_n: int, slots: int) -> tuple[int, int]:
    most = max(1, min(max_tokens // MIN_SPLIT_TOKENS, MAX_SPLITS))
    best, best_fill = _cut(max_tokens, 1, block_n), 0.0
    for wanted in range(1, most + 1):
        plan = _cut(max_tokens, wanted, block_n)
        waves = units * plan[0] / slots
        fill = waves / math.ceil(waves)
        if fill >= WAVE_FILL:
            return plan
        if fill > best_fill + 1e-9:
            best, best_fill = plan, fill
    return best


def split_plan(
    batch: int, kv_heads: int, max_tokens: int, block_n: int, num_splits: int | None = None, slots: int | None = None
) -> tuple[int, int]:
    """(splits, tokens per split) for sequences of up to `max_tokens` tokens.

    By default the fewest splits whose programs (batch x kv_heads x splits) fill their last wave of
    `slots` (default: wave_slots() of a machine without CUDA) at least WAVE_FILL, else the plan
    that fills it best. Tokens per split are a multiple of `block_n`, so no split starts inside a block.
    """
    if num_splits is None:
        return _planned(batch * kv_heads, max_tokens, block_n, slots or wave_slots())
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    return _cut(max_tokens, num_splits, block_n)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    layout: str = "nhd",
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    scale: str = "none",
    sm_scale: float | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_dot: str | None = None,
    page_ahead: bool | None = None,
    merge: str | None = None,
    kv_per_program: int | None = None,
    programs_per_sm: int | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its KV pages: (batch, q_heads, head_dim).

    q: (batch, q_heads, head_dim) bf16/fp16. k_pages, v_pages: (pages, *plane_shape) in
    `layout`, bf16/fp16 (then q's dtype) or fp8 with `k_scales` / `v_scales` (float32,
    (pages, *scale_shape) of granularity `scale`). page_table: int32 (batch, max_pages) of page
    indexes, entries past a sequence's last page unread. seq_lens: int32 (batch,), each >= 1
    and <= max_pages * page_size (not checked here: it would cost a device sync).
    Query head h reads kv head h // (q_heads // kv_heads). `num_splits` (default: split_plan's,
    the fewest that fill the device's waves of programs) cuts each sequence into that many KV
    ranges, merged after.
    fp8_dot: how the dots read fp8 pages: "pairs" (default: 16-bit words of two values, fp16
    dots; see _decode_split_pairs; pages whose strides or offset are odd in bytes, and head_dim
    16, are read as under "query"), "pairs_vmax" / "pairs_lean" (the same with fewer reductions
    in the loop, see _decode_split_pairs; measured against "pairs" by
    scripts/h200_kernels_at_the_limit.py), "query" (pages converted to q's dtype, as 16-bit pages are read) or "fp16"
    (see _decode_split's F16), "pairs_stacked" (the query heads of a kv head stacked over
    interleaved slices of each step so every row of the dots is live, see
    _decode_split_pairs_stacked; "pairs" where GROUP, the page size or block_n do not allow it,
    see _stacks), "pairs_two_heads" (two kv heads a program, each its own softmax, their loads
    issued together; see _decode_split_pairs_two_heads; "pairs" where the kv heads are odd), "mma" (both dots on fp8 tensor cores with the pages as they are,
    the query and the probabilities as sums of e4m3 terms: bf16's precision; see _decode_split_mma).
    block_n: KV tokens a program reads per step. page_ahead: load the page table's entries for
    the next step one step early (see _next_block). merge: how splits are merged, "kernel" (a
    second launch), "pdl" (that launch with programmatic dependent launch, so its programs are
    placed while the split kernel runs; "kernel" where pdl_launches() is False) or "fused" (the
    last split program of each sequence and kv head merges, see _merge_if_last; costs a zeroed
    int32 counter per (sequence, kv head); fp8_dot="mma" always takes "kernel"). kv_per_program: kv heads one program reads under fp8_dot="pairs" (a power of
    two dividing the kv heads; default 1): their query heads stacked as rows, see
    _decode_split_pairs_kv; other paths read one. programs_per_sm: programs of this kernel
    configuration resident on one SM, the split plan's wave (default: the dtype's DEFAULT_CONFIGS
    entry where it names one, else PROGRAMS_PER_SM). maxnreg: the most registers a thread of the
    split kernel may hold (ptxas spills the rest; None: as many as it likes, up to 255): fewer
    registers let more programs share an SM (raise programs_per_sm with it); the interpreter
    ignores it. Default: the dtype's DEFAULT_CONFIGS entry's cap where the call names none of
    block_n, num_warps, num_stages and fp8_dot and the pages take _decode_split_pairs, else
    none. block_n, num_warps, num_stages, fp8_dot and
    page_ahead default to DEFAULT_CONFIGS for the pages' dtype: at batch 16 x 16k tokens on an
    H200 (BENCHMARKS.md) fp8 pages read 3.13 TB/s with (128, 4 warps, 2 stages, "pairs") against
    2.05 with the same shape under "query", 1.76 with the best "fp16" configuration.
    Returns `out` (q's dtype or float32; a new tensor of q's dtype when None).
    """
    page_size, heads, head_dim = _check_inputs(q, k_pages, v_pages, page_table, seq_lens, layout, k_scales, v_scales, scale)
    defaults = DEFAULT_CONFIGS["fp8" if k_pages.dtype in FP8_KINDS else "16-bit"]
    default_cap = default_maxnreg(defaults, block_n, num_warps, num_stages, fp8_dot)
    block_n = defaults["block_n"] if block_n is None else block_n
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    fp8_dot = defaults.get("fp8_dot", "pairs") if fp8_dot is None else fp8_dot
    page_ahead = defaults["page_ahead"] if page_ahead is None else bool(page_ahead)
    merge = defaults.get("merge", "kernel") if merge is None else merge
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    per_sm = defaults.get("programs_per_sm", PROGRAMS_PER_SM) if programs_per_sm is None else programs_per_sm
    if isinstance(per_sm, bool) or not isinstance(per_sm, int) or per_sm < 1:
        raise ValueError(f"programs_per_sm must be an int >= 1, got {programs_per_sm!r}")
    if maxnreg is not None and (isinstance(maxnreg, bool) or not isinstance(maxnreg, int) or not 24 <= maxnreg <= 255):
        raise ValueError(f"maxnreg must be an int from 24 to 255 or None, got {maxnreg!r}")
    kvp = defaults.get("kv_per_program", 1) if kv_per_program is None else kv_per_program
    if isinstance(kvp, bool) or not isinstance(kvp, int) or kvp < 1 or kvp & (kvp - 1) or heads % kvp:
        raise ValueError(f"kv_per_program must be a power of two dividing the kv heads ({heads}), got {kv_per_program!r}")
    if block_n < MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {MIN_DOT}, got {block_n}")
    if fp8_dot not in FP8_DOTS:
        raise ValueError(f"fp8_dot must be one of {FP8_DOTS}, got {fp8_dot!r}")
    if fp8_dot == "mma" and k_pages.dtype in FP8_KINDS and block_n < MMA_MIN_BLOCK_N:
        # The probabilities' dot with V runs over block_n tokens: Hopper's fp8 tensor-core dots
        # take K >= 32, and Triton refuses to compile a smaller one for sm_90.
        raise ValueError(f"fp8_dot='mma' needs block_n >= {MMA_MIN_BLOCK_N} over fp8 pages, got {block_n}")
    batch, q_heads = q.shape[0], q.shape[1]
    group = q_heads // heads
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype not in (q.dtype, torch.float32) or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {q.dtype} or float32 {tuple(q.shape)} on {q.device}, contiguous in head_dim; "
            f"got {out.dtype} {tuple(out.shape)} on {out.device} with strides {out.stride()}"
        )
    if batch == 0:
        return out
    max_tokens = page_table.shape[1] * page_size
    fp8 = FP8_KINDS.get(k_pages.dtype, 0)
    words = _word_views(k_pages, v_pages) if fp8 and fp8_dot.startswith("pairs") and head_dim >= 2 * MIN_DOT else None
    if words is None or fp8_dot != "pairs":
        kvp = 1
    two_heads = words is not None and fp8_dot == "pairs_two_heads" and heads % 2 == 0
    groups = heads // (2 if two_heads else kvp)  # programs per sequence and split
    splits, per_split = split_plan(batch, groups, max_tokens, block_n, num_splits, wave_slots(q.device, per_sm))
    single = splits == 1
    mid_shape = (1, 1, 1) if single else (batch, q_heads, splits)
    mid_o = torch.empty((*mid_shape, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(mid_shape, dtype=torch.float32, device=q.device)
    scaled = scale != "none"
    ks_arg = k_scales if scaled else mid_lse
    vs_arg = v_scales if scaled else mid_lse
    ks_strides = _scale_strides(k_scales, scale, layout) if scaled else (0, 0, 0)
    vs_strides = _scale_strides(v_scales, scale, layout) if scaled else (0, 0, 0)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    if words is not None:
        k_arg, v_arg = words
    elif fp8:
        k_arg, v_arg = k_pages.view(torch.uint8), v_pages.view(torch.uint8)
    else:
        k_arg, v_arg = k_pages, v_pages
    stacked = words is not None and fp8_dot == "pairs_stacked" and _stacks(group, page_size, block_n)
    fused = (not single and merge == "fused" and not (fp8 and fp8_dot == "mma" and words is None) and not stacked
             and not two_heads)
    pdl = not single and merge == "pdl" and pdl_launches(q.device)
    cnt = torch.zeros((batch, groups), dtype=torch.int32, device=q.device) if fused else mid_lse
    kernel_block_n = block_n
    if two_heads:
        kernel = _decode_split_pairs_two_heads
        flags = dict(FP8=fp8, ASM=not INTERPRETED)
    elif stacked:
        kernel = _decode_split_pairs_stacked
        flags = dict(FP8=fp8, ASM=not INTERPRETED)
        kernel_block_n = block_n // (MIN_DOT // group)
    elif words is not None and kvp > 1:
        kernel = _decode_split_pairs_kv
        flags = dict(FP8=fp8, ASM=not INTERPRETED, KVP=kvp)
    elif words is not None:
        kernel = _decode_split_pairs
        flags = dict(FP8=fp8, ASM=not INTERPRETED, SPLIT_VMAX=fp8_dot in ("pairs_vmax", "pairs_lean"),
                     ROW_SUMS=fp8_dot == "pairs_lean")
    elif fp8 and fp8_dot == "mma":
        kernel = _decode_split_mma
        flags = dict(FP8=fp8, Q_TERMS=2 if q.dtype == torch.bfloat16 else 3, DOT_F32=INTERPRETED)
    else:
        kernel = _decode_split
        flags = dict(FP8=fp8, SCALED=scaled, F16=bool(fp8) and fp8_dot == "fp16", DOT_F32=INTERPRETED)
    if maxnreg is None and kernel is _decode_split_pairs:  # the kernel the default's cap was measured on
        maxnreg = default_cap
    if pdl and kernel in (_decode_split, _decode_split_pairs):
        flags["LAUNCH_MERGE"] = True  # the others end before the merge starts (their exit is the trigger)
    kernel[(batch, groups, splits)](
        q, k_arg, v_arg, ks_arg, vs_arg, page_table, seq_lens, mid_o, mid_lse, out, cnt,
        sm_scale * LOG2E,
        per_split,
        q.stride(0), q.stride(1),
        *_plane_strides(k_arg, layout),
        *_plane_strides(v_arg, layout),
        *ks_strides,
        *vs_strides,
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group,
        BLOCK_H=max(MIN_DOT, triton.next_power_of_2(group * kvp)),
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=kernel_block_n,
        SINGLE=single,
        PAGE_AHEAD=page_ahead,
        FUSED=fused,
        **({"MERGE_H": triton.next_power_of_2(group * kvp), "MERGE_S": max(2, triton.next_power_of_2(splits))}
           if fused else {}),
        **flags,
        num_warps=num_warps,
        num_stages=num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if single or fused:
        return out
    _merge_splits[(batch, q_heads)](
        mid_o, mid_lse, seq_lens, out,
        per_split,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(splits)),
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out


def dequantized_pages(pages: torch.Tensor, scales: torch.Tensor | None, scale: str, layout: str) -> torch.Tensor:
    """float64 values of (n, *plane_shape) pages: fp8 times its scales, 16-bit pages as they are."""
    if scale == "none":
        return pages.double()
    return pages.double() * expand_scales(scales.double(), scale, layout)


def reference_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    layout: str = "nhd",
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    scale: str = "none",
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The same attention in float64 with plain torch, one sequence at a time: (batch, q_heads, head_dim) float64."""
    page_size, heads, head_dim = _check_inputs(q, k_pages, v_pages, page_table, seq_lens, layout, k_scales, v_scales, scale)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    batch, q_heads = q.shape[0], q.shape[1]
    group = q_heads // heads
    out = torch.empty((batch, q_heads, head_dim), dtype=torch.float64, device=q.device)
    for b in range(batch):
        n = int(seq_lens[b])
        idx = page_table[b, : -(-n // page_size)].long()
        ks = k_scales[idx] if k_scales is not None else None
        vs = v_scales[idx] if v_scales is not None else None
        k = dequantized_pages(k_pages[idx], ks, scale, layout)
        v = dequantized_pages(v_pages[idx], vs, scale, layout)
        if layout == "hnd":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        k = k.reshape(-1, heads, head_dim)[:n]
        v = v.reshape(-1, heads, head_dim)[:n]
        qb = q[b].double().view(heads, group, head_dim)
        scores = torch.einsum("hgd,thd->hgt", qb, k) * sm_scale
        out[b] = torch.einsum("hgt,thd->hgd", scores.softmax(-1), v).reshape(q_heads, head_dim)
    return out


# fp8 kernel variants of their own module (kvtier/decode/fp8_variants.py), built on the helpers above.
from kvtier.decode.fp8_variants import (  # noqa: E402
    _decode_split_pairs_stacked,
    _decode_split_pairs_two_heads,
    _stacks,
)
