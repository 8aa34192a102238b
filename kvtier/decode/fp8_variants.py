"""fp8 variants of the paged decode kernel that keep every row of the dots busy or read longer
pieces: fp8_dot="pairs_stacked" (_decode_split_pairs_stacked) and "pairs_two_heads"
(_decode_split_pairs_two_heads). Both read pages as kvtier.decode.attention's "pairs" kernel does
(int16 words of two fp8 values, fp16 dots over the even and the odd head_dim columns) and hold
its numerics (fp16's bound against the float64 reference); paged_decode_attention chooses them.

Imported by kvtier.decode.attention after its helpers are defined (that module sets Triton's
interpreter up on a machine without CUDA before triton is imported).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtier.decode.attention import (
    MIN_DOT,
    _block_pages,
    _fp8_pairs_to_f16,
    _next_block,
    _pairs_query,
    _pairs_step,
    _pairs_store,
    _pv_pairs,
    _qk_pairs,
    _query_powers,
    _split_range,
)


def _stacks(group: int, page_size: int, block_n: int) -> bool:
    """Whether fp8_dot="pairs_stacked" applies: a power-of-two GROUP below MIN_DOT (so SUB =
    MIN_DOT / GROUP slices), SUB dividing the page size (a tile row's tokens share a page), and
    block_n / SUB >= MIN_DOT tile rows a step; elsewhere "pairs" runs."""
    if group < 1 or group & (group - 1) or group >= MIN_DOT:
        return False
    sub = MIN_DOT // group
    return page_size % sub == 0 and block_n % sub == 0 and block_n // sub >= MIN_DOT


@triton.jit
def _decode_split_pairs_two_heads(
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
    PAGE_AHEAD: tl.constexpr = False,
    FUSED: tl.constexpr = False,
):
    """_decode_split_pairs over two adjacent kv heads a program (fp8_dot="pairs_two_heads"), each
    with its own query rows, softmax and accumulators, as two programs would run them, but with
    each step's loads of both heads issued together: under "nhd" a token's two heads are 256
    contiguous bytes, read at once instead of as two 128-byte pieces by programs apart in time."""
    HALF_D: tl.constexpr = HEAD_DIM // 2
    b, kvg, split, start, end = _split_range(LENS, tokens_per_split)
    if start < end:
        kv0 = 2 * kvg
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP
        heads0 = kv0 * GROUP + offs_h
        heads1 = heads0 + GROUP
        offs_w = tl.arange(0, HALF_D)
        score_scale0, q0_even, q0_odd = _pairs_query(Q, b, stride_qb, stride_qh, heads0, mask_h, offs_w, qk_scale)
        score_scale1, q1_even, q1_odd = _pairs_query(Q, b, stride_qb, stride_qh, heads1, mask_h, offs_w, qk_scale)
        m0 = tl.full([BLOCK_H], float("-inf"), tl.float32)
        s0 = tl.zeros([BLOCK_H], tl.float32)
        a0_even = tl.zeros([BLOCK_H, HALF_D], tl.float32)
        a0_odd = tl.zeros([BLOCK_H, HALF_D], tl.float32)
        m1 = tl.full([BLOCK_H], float("-inf"), tl.float32)
        s1 = tl.zeros([BLOCK_H], tl.float32)
        a1_even = tl.zeros([BLOCK_H, HALF_D], tl.float32)
        a1_odd = tl.zeros([BLOCK_H, HALF_D], tl.float32)
        page_ahead = 0
        if PAGE_AHEAD:
            page_ahead = _block_pages(PT, b, stride_ptb, start, end, BLOCK_N, PAGE_SIZE)
        for n0 in range(start, end, BLOCK_N):
            live, page, row, page_ahead = _next_block(
                PT, b, stride_ptb, n0, end, page_ahead, BLOCK_N, PAGE_SIZE, PAGE_AHEAD)
            # Each head as _decode_split_pairs's loop runs it (no row sums, V's scales per block).
            m0, s0, _, a0_even, a0_odd = _pairs_step(
                q0_even, q0_odd, score_scale0, m0, s0, 0.0, 1.0, a0_even, a0_odd, K, V, KS, VS, page, row, live,
                kv0, offs_w, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh, FP8, ASM, False, False)
            m1, s1, _, a1_even, a1_odd = _pairs_step(
                q1_even, q1_odd, score_scale1, m1, s1, 0.0, 1.0, a1_even, a1_odd, K, V, KS, VS, page, row, live,
                kv0 + 1, offs_w, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                stride_ksp, stride_kst, stride_ksh, stride_vsp, stride_vst, stride_vsh, FP8, ASM, False, False)
        _pairs_store(MID_O, MID_LSE, OUT, b, split, heads0, mask_h, offs_w, m0, s0, s0, a0_even, a0_odd,
                     stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh, SINGLE)
        _pairs_store(MID_O, MID_LSE, OUT, b, split, heads1, mask_h, offs_w, m1, s1, s1, a1_even, a1_odd,
                     stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh, SINGLE)


@triton.jit
def _stacked_pages(PT, b, stride_ptb, n0, end, ROWS: tl.constexpr, SUB: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """The page of each tile row's SUB tokens for the step from n0 (0 past `end`)."""
    first = n0 + tl.arange(0, ROWS) * SUB
    return tl.load(PT + b * stride_ptb + first // PAGE_SIZE, mask=first < end, other=0).to(tl.int64)


@triton.jit
def _decode_split_pairs_stacked(
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
    PAGE_AHEAD: tl.constexpr = False,
    FUSED: tl.constexpr = False,
):
    """_decode_split_pairs with every row of the dots live (fp8_dot="pairs_stacked"): the GROUP
    query heads of one kv head are stacked SUB = BLOCK_H / GROUP times as rows, row j * GROUP + g
    being head g over the step's tokens n0 + SUB * t + j (t = 0 .. BLOCK_N - 1): SUB interleaved
    slices of the step, each with its own running softmax (m, s) per row.

    A step reads K and V as one tile of BLOCK_N rows by SUB * HEAD_DIM / 2 words: row t holds the
    SUB consecutive tokens n0 + SUB * t .. + SUB - 1 (one page: SUB divides the page size), token j
    in columns j * HEAD_DIM / 2 ... The query is placed block-diagonally (row j * GROUP + g holds
    head g's values in slice j's columns, zeros elsewhere), so Q.K^T gives each row its own
    slice's scores; P.V gives every row against every slice's values and each row keeps its own
    slice's columns at the end. The dots do the same MMA work a token as _decode_split_pairs's
    (whose rows past GROUP are padding), while the softmax's element-wise work runs on BLOCK_H x
    BLOCK_N scores for SUB * BLOCK_N tokens, 1 / SUB of it. After the loop each head's SUB slices
    are merged by their log-sum-exp (as splits are)."""
    HALF_D: tl.constexpr = HEAD_DIM // 2
    SUB: tl.constexpr = BLOCK_H // GROUP
    WORDS: tl.constexpr = SUB * HALF_D
    STEP: tl.constexpr = SUB * BLOCK_N
    b, kvh, split, start, end = _split_range(LENS, tokens_per_split)
    if start < end:
        offs_r = tl.arange(0, BLOCK_H)
        r_sub = offs_r // GROUP
        r_head = offs_r % GROUP
        offs_c = tl.arange(0, WORDS)
        c_sub = offs_c // HALF_D
        c_word = offs_c % HALF_D
        own = r_sub[:, None] == c_sub[None, :]
        q_ptr = Q + b * stride_qb + (kvh * GROUP + r_head)[:, None] * stride_qh + 2 * c_word[None, :]
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
        offs_t = tl.arange(0, BLOCK_N)
        k_cols = kvh * stride_kh + c_sub * stride_kt + c_word
        v_cols = kvh * stride_vh + c_sub * stride_vt + c_word
        page_ahead = 0
        if PAGE_AHEAD:
            page_ahead = _stacked_pages(PT, b, stride_ptb, start, end, BLOCK_N, SUB, PAGE_SIZE)
        for n0 in range(start, end, STEP):
            first = n0 + offs_t * SUB
            if PAGE_AHEAD:
                page = page_ahead
                page_ahead = _stacked_pages(PT, b, stride_ptb, n0 + STEP, end, BLOCK_N, SUB, PAGE_SIZE)
            else:
                page = _stacked_pages(PT, b, stride_ptb, n0, end, BLOCK_N, SUB, PAGE_SIZE)
            in_page = first % PAGE_SIZE
            live_kv = (first[:, None] + c_sub[None, :]) < end
            k_ptr = K + page[:, None] * stride_kp + in_page[:, None] * stride_kt + k_cols[None, :]
            k_even, k_odd = _fp8_pairs_to_f16(tl.load(k_ptr, mask=live_kv, other=0), FP8, ASM)
            score = _qk_pairs(q_even, q_odd, k_even, k_odd, ASM)
            live = (first[None, :] + r_sub[:, None]) < end
            row_of = page[None, :] * stride_ksp + (in_page[None, :] + r_sub[:, None]) * stride_kst + kvh * stride_ksh
            k_scale = tl.load(KS + row_of, mask=live, other=0.0)
            score = score * (k_scale * score_scale)
            score = tl.where(live, score, float("-inf"))
            # A slice may have no token left in the last step (and none at all in a split of fewer
            # than SUB tokens): its rows keep m = -inf and add nothing.
            m_block = tl.max(score, 1)
            m_new = tl.maximum(m, m_block)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_ref)
            weight = tl.exp2(m_block - m_ref)
            p = tl.exp2(score - tl.where(m_block == float("-inf"), 0.0, m_block)[:, None])
            s = s * alpha + tl.sum(p, 1) * weight
            v_of = page[None, :] * stride_vsp + (in_page[None, :] + r_sub[:, None]) * stride_vst + kvh * stride_vsh
            v_scale = tl.load(VS + v_of, mask=live, other=0.0)
            v_max = tl.max(v_scale, 1)
            v_max = tl.where(v_max > 0, v_max, 1.0)
            weight = weight * v_max
            p = (p * (v_scale / v_max[:, None])).to(tl.float16)
            v_ptr = V + page[:, None] * stride_vp + in_page[:, None] * stride_vt + v_cols[None, :]
            v_even, v_odd = _fp8_pairs_to_f16(tl.load(v_ptr, mask=live_kv, other=0), FP8, ASM)
            acc_even, acc_odd = _pv_pairs(p, v_even, v_odd, acc_even, acc_odd, alpha, weight, ASM)
            m = m_new
        # Each row's own slice's columns, then each head's SUB slices merged by log-sum-exp.
        o_even = tl.sum(tl.reshape(tl.where(own, acc_even, 0.0), [BLOCK_H, SUB, HALF_D]), 1)
        o_odd = tl.sum(tl.reshape(tl.where(own, acc_odd, 0.0), [BLOCK_H, SUB, HALF_D]), 1)
        m2 = tl.reshape(m, [SUB, GROUP])
        top = tl.max(m2, 0)  # finite: slice 0 holds the split's first token
        w = tl.exp2(m2 - top[None, :])
        total = tl.sum(tl.reshape(s, [SUB, GROUP]) * w, 0)
        o_even = tl.sum(tl.reshape(o_even, [SUB, GROUP, HALF_D]) * w[:, :, None], 0) / total[:, None]
        o_odd = tl.sum(tl.reshape(o_odd, [SUB, GROUP, HALF_D]) * w[:, :, None], 0) / total[:, None]
        heads = kvh * GROUP + tl.arange(0, GROUP)
        offs_w = tl.arange(0, HALF_D)
        if SINGLE:
            o_ptr = OUT + b * stride_outb + heads[:, None] * stride_outh + 2 * offs_w[None, :]
            tl.store(o_ptr, o_even.to(OUT.dtype.element_ty))
            tl.store(o_ptr + 1, o_odd.to(OUT.dtype.element_ty))
        else:
            o_ptr = MID_O + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + 2 * offs_w[None, :]
            tl.store(o_ptr, o_even)
            tl.store(o_ptr + 1, o_odd)
            tl.store(MID_LSE + b * stride_lb + heads * stride_lh + split, top + tl.log2(total))
