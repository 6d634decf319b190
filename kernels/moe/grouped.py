"""Grouped FP8 GEMMs of the MoE for 9+ tokens (5..8 too where the pairs crowd the router's
experts) up to prefill: per sorted block of `block_m` pairs of one expert, x W1^T (`_mlp1_kernel`:
bias, clamp, SwiGLU, h requantised to e4m3 1x128 groups in its epilogue), then h W2^T (+ b2) per
pair (`_mlp2_kernel`). On the table's rows the operand tiles come by TMA; at prefill x is first
gathered into the sorted order (`_gather_rows_kernel`). The launcher is `_experts` (dispatch.py).

Why a block of sorted pairs: an expert picked by several tokens is read from HBM once per block,
not once per pair, and a block of 16 or 64 rows feeds the tensor cores.

Invariant: FP8 dots promoted to fp32 every 128 of K, block scales applied per K step (DeepGEMM's
scheme), so results differ from `moe_ref` only by fp32 summation order; split-K partials are summed
in split order by a tile's last arriver (counters zero between launches), so the bits never depend
on arrival order.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from sglang_ext.kernels.arrival_counters import arrival_counters
from sglang_ext.kernels.pdl import pdl_wait_then_release

from .common import _gpt_oss_activation, _quantize_e4m3, _round_to_bf16


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_rows_kernel(XQ, XG, SORTED_PAIRS, BLOCK_EXPERT, num_pairs, hidden, TOP_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """MoeConfig.tma: xg[r] = x codes of sorted pair r's token (zeros for padding slots), so that a
    block's x rows are one contiguous tile for the copy engine (Hopper's TMA cannot gather rows).
    BLOCK_R divides BLOCK_M: a program's rows lie in one sort block; blocks past the last segment
    (expert -1, pair ids never written) are skipped, as mlp1 skips them."""
    if tl.load(BLOCK_EXPERT + tl.program_id(0) * BLOCK_R // BLOCK_M) < 0:
        return
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    pairs = tl.load(SORTED_PAIRS + rows)
    ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    for h0 in range(0, hidden, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        in_h = (offs < hidden)[None, :]
        v = tl.load(XQ + tokens[:, None] * hidden + offs[None, :], mask=ok[:, None] & in_h, other=0.0)
        tl.store(XG + rows.to(tl.int64)[:, None] * hidden + offs[None, :], v, mask=in_h)


@triton.jit
def _mlp1_pass(XQ, XS, W1, W1S, B1, tokens, row_ok, expert, first_row, k_first, k_last, hidden, inter, limit, alpha,
               stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n, stride_b1_e,
               BLOCK_M: tl.constexpr, ROWS: tl.constexpr, HAS_B1: tl.constexpr, DOT_FP32: tl.constexpr,
               x_desc=None, w1_desc=None, block_row=0, TMA: tl.constexpr = False, X_TMA: tl.constexpr = True):
    """One pass of `_mlp1_kernel` with MoeConfig.mlp1_passes: W1 rows [first_row, first_row + ROWS)
    (ROWS <= 128 and first_row a multiple of ROWS: one 128-row scale block, so one scalar scale per K
    step) against the block's x rows over K blocks [k_first, k_last), bias and activation applied:
    h [BLOCK_M, ROWS // 2]. The sums are the one-dot path's, element for element.

    TMA (MoeConfig.tma): the W1 tile from w1_desc (W1 as [E * 2I, H]), zero-filled past H by the copy
    engine; rows of a pass past 2I read the next expert's rows (or zeros past the last) into h columns
    the store drops. With X_TMA the x tile from x_desc (x gathered into the sorted order: its rows
    block_row .. + BLOCK_M), else x's rows by pointers as without TMA."""
    BLOCK_K: tl.constexpr = 128
    offs_k = tl.arange(0, BLOCK_K)
    num_k_groups = tl.cdiv(hidden, BLOCK_K)
    w_rows = first_row + tl.arange(0, ROWS)
    w_row_ok = w_rows < 2 * inter
    a_ptrs = XQ + tokens[:, None] * hidden + k_first * BLOCK_K + offs_k[None, :]
    xs_ptrs = XS + tokens * num_k_groups
    w_ptrs = (W1 + expert * stride_w1_e + w_rows.to(tl.int64)[None, :] * stride_w1_n + k_first * BLOCK_K
              + offs_k[:, None])
    w_coord = (expert * 2 * inter + first_row).to(tl.int32)
    ws_ptr = W1S + expert * stride_w1s_e + (first_row // 128) * stride_w1s_n
    acc = tl.zeros([BLOCK_M, ROWS], dtype=tl.float32)
    for kb in range(k_first, k_last):
        if TMA:
            if X_TMA:
                a = x_desc.load([block_row, kb * BLOCK_K])
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k < hidden - kb * BLOCK_K)[None, :], other=0.0)
            w = tl.trans(w1_desc.load([w_coord, kb * BLOCK_K]))
        else:
            k_ok = offs_k < hidden - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & w_row_ok[None, :], other=0.0)
        a_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptr + kb, mask=first_row < 2 * inter, other=0.0)  # a pass past 2I: no block
        scale = a_s[:, None] * w_s
        if DOT_FP32:
            a = a.to(tl.float32)[:, :, None]
            if BLOCK_M * BLOCK_K * ROWS <= 1048576:
                prod = tl.sum(a * w.to(tl.float32)[None, :, :], axis=1)
            else:  # the interpreter's tensor cap (2^20 elements): gate and linear columns apart
                wg, wl = tl.split(tl.reshape(w.to(tl.float32), [BLOCK_K, ROWS // 2, 2]))
                prod = tl.join(tl.sum(a * wg[None, :, :], axis=1), tl.sum(a * wl[None, :, :], axis=1))
                prod = tl.reshape(prod, [BLOCK_M, ROWS])
            acc += prod * scale
        else:
            acc += tl.dot(a, w) * scale
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_B1:
        acc += tl.load(B1 + expert * stride_b1_e + w_rows, mask=w_row_ok, other=0.0).to(tl.float32)[None, :]
    acc_g, acc_l = tl.split(tl.reshape(acc, [BLOCK_M, ROWS // 2, 2]))
    return _gpt_oss_activation(acc_g, acc_l, limit, alpha)


@triton.jit
def _grouped_tile(BLOCK_EXPERT, num_blocks_m, n_dim, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (n tiles, split, m-block, n tile) and the m-block's expert (< 0: past the last segment).
    GROUP_M m-blocks visit each n tile back to back, so a weight tile is reused from L2; the split is
    slowest: every tile's first split runs first."""
    num_n = tl.cdiv(n_dim, BLOCK_N)
    pid = tl.program_id(0) % (num_blocks_m * num_n)
    split = tl.program_id(0) // (num_blocks_m * num_n)
    width = GROUP_M * num_n
    first_m = pid // width * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    expert = tl.load(BLOCK_EXPERT + pid_m)
    return num_n, split, pid_m, pid_n, expert


@triton.jit
def _split_k_range(k_dim, split, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """K = k_dim in groups of BLOCK_K, and split `split`'s share of them: (groups, k_first, k_last)."""
    num_k_groups = tl.cdiv(k_dim, BLOCK_K)
    k_per_split = tl.cdiv(num_k_groups, SPLIT_K)
    k_first = split * k_per_split
    k_last = tl.minimum(k_first + k_per_split, num_k_groups)
    return num_k_groups, k_first, k_last


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _mlp1_kernel(
    XQ, XS,  # x in e4m3 [T, H] and its group scales [T, cdiv(H, 128)]
    W1, W1S, B1,  # [E, 2I, H] e4m3, [E, cdiv(2I, 128), cdiv(H, 128)] fp32, [E, 2I]
    SORTED_PAIRS, BLOCK_EXPERT,
    HQ, HS,  # FUSED_REQUANT: h in e4m3 [rows, I] and scales [rows, cdiv(I, 128)]
    HF,  # otherwise: h fp32 [rows, I]
    PART, COUNTERS,  # SPLIT_K > 1: fp32 partials [SPLIT_K, 2, rows, I] (ONE_DOT: [SPLIT_K, rows, 2I]);
                     # int32 per tile, zero between launches
    num_pairs, hidden, inter, num_blocks_m, limit, alpha,
    stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n, stride_b1_e,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # intermediate columns: BLOCK_N gate rows + BLOCK_N linear rows of W1
    GROUP_M: tl.constexpr,
    HAS_B1: tl.constexpr,
    FUSED_REQUANT: tl.constexpr,
    DOT_FP32: tl.constexpr,  # interpreter only: the dot as an fp32 multiply-and-sum (see _experts)
    SPLIT_K: tl.constexpr,
    ONE_DOT: tl.constexpr = False,  # MoeConfig.mlp1_one_dot: one dot over 2 * BLOCK_N contiguous W1 rows
    PASSES: tl.constexpr = 1,  # MoeConfig.mlp1_passes (ONE_DOT, SPLIT_K 1): 1 or 2 passes of _mlp1_pass
    x_desc=None, w1_desc=None,  # TMA: descriptors of x gathered into sorted order and of W1 as [E * 2I, H]
    TMA: tl.constexpr = False,  # MoeConfig.tma (two passes): W1 tiles by TMA
    X_TMA: tl.constexpr = True,  # with TMA: x's tiles too (MoeConfig.tma_x), else x's rows by pointers from XQ
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: nothing before the wait (the routing, x's rows: recent launches')
):
    BLOCK_K: tl.constexpr = 128  # = the quantisation group: one scale per row per K step
    pdl_wait_then_release(USE_PDL)
    tl.static_assert(PASSES == 1 or (ONE_DOT and SPLIT_K == 1), "mlp1 passes: one-dot, no split-K")
    tl.static_assert(not TMA or PASSES == 2, "mlp1 TMA: the two-pass kernel")
    num_n, split, pid_m, pid_n, expert = _grouped_tile(BLOCK_EXPERT, num_blocks_m, inter, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions in the sorted, padded order
    pairs = tl.load(SORTED_PAIRS + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    gate_rows = (2 * cols).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    num_k_groups, k_first, k_last = _split_k_range(hidden, split, BLOCK_K, SPLIT_K)

    a_ptrs = XQ + tokens[:, None] * hidden + k_first * BLOCK_K + offs_k[None, :]
    xs_ptrs = XS + tokens * num_k_groups
    if PASSES == 2:
        # columns [c0, c0 + BLOCK_N / 2) then the rest, each h half [BLOCK_M, BLOCK_N / 2]; together
        # [BLOCK_M, BLOCK_N] in column order for the requantisation below
        ROWS: tl.constexpr = BLOCK_N  # W1 rows a pass: 2 * BLOCK_N / PASSES
        h_lo = _mlp1_pass(XQ, XS, W1, W1S, B1, tokens, row_ok, expert, pid_n * (2 * BLOCK_N), k_first, k_last,
                          hidden, inter, limit, alpha, stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n,
                          stride_b1_e, BLOCK_M, ROWS, HAS_B1, DOT_FP32, x_desc, w1_desc, pid_m * BLOCK_M, TMA, X_TMA)
        h_hi = _mlp1_pass(XQ, XS, W1, W1S, B1, tokens, row_ok, expert, pid_n * (2 * BLOCK_N) + ROWS, k_first,
                          k_last, hidden, inter, limit, alpha, stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n,
                          stride_b1_e, BLOCK_M, ROWS, HAS_B1, DOT_FP32, x_desc, w1_desc, pid_m * BLOCK_M, TMA,
                          X_TMA)
        h = tl.reshape(tl.permute(tl.join(h_lo, h_hi), (0, 2, 1)), [BLOCK_M, BLOCK_N])
    elif ONE_DOT:
        # W1 rows 2c (gate), 2c+1 (linear) of the tile's columns, contiguous as stored: one
        # [BLOCK_K, 2 * BLOCK_N] tile and one accumulator, split into gate / linear at the end
        w_rows = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
        w_row_ok = w_rows < 2 * inter
        w_ptrs = (W1 + expert * stride_w1_e + w_rows.to(tl.int64)[None, :] * stride_w1_n + k_first * BLOCK_K
                  + offs_k[:, None])
        ws_ptrs = W1S + expert * stride_w1s_e + (w_rows // 128) * stride_w1s_n
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for kb in range(k_first, k_last):
            k_ok = offs_k < hidden - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & w_row_ok[None, :], other=0.0)
            a_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptrs + kb, mask=w_row_ok, other=0.0)
            scale = a_s[:, None] * w_s[None, :]
            if DOT_FP32:
                a = a.to(tl.float32)[:, :, None]
                if BLOCK_M * BLOCK_K * 2 * BLOCK_N <= 1048576:
                    prod = tl.sum(a * w.to(tl.float32)[None, :, :], axis=1)
                else:  # the interpreter's tensor cap (2^20 elements): gate and linear columns apart
                    wg, wl = tl.split(tl.reshape(w.to(tl.float32), [BLOCK_K, BLOCK_N, 2]))
                    prod = tl.join(tl.sum(a * wg[None, :, :], axis=1), tl.sum(a * wl[None, :, :], axis=1))
                    prod = tl.reshape(prod, [BLOCK_M, 2 * BLOCK_N])
                acc += prod * scale
            else:
                acc += tl.dot(a, w) * scale
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:
        wg_ptrs = W1 + expert * stride_w1_e + gate_rows[None, :] * stride_w1_n + k_first * BLOCK_K + offs_k[:, None]
        # gate row 2c and linear row 2c+1 always share a 128-row scale block
        ws_ptrs = W1S + expert * stride_w1s_e + (gate_rows // 128) * stride_w1s_n

        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_l = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(k_first, k_last):
            k_ok = offs_k < hidden - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wl = tl.load(wg_ptrs + stride_w1_n, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            a_s = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
            w_s = tl.load(ws_ptrs + kb, mask=col_ok, other=0.0)
            scale = a_s[:, None] * w_s[None, :]
            if DOT_FP32:
                a = a.to(tl.float32)[:, :, None]
                acc_g += tl.sum(a * wg.to(tl.float32)[None, :, :], axis=1) * scale
                acc_l += tl.sum(a * wl.to(tl.float32)[None, :, :], axis=1) * scale
            else:
                acc_g += tl.dot(a, wg) * scale
                acc_l += tl.dot(a, wl) * scale
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K

    ok = row_ok[:, None] & col_ok[None, :]
    out_offs = rows.to(tl.int64)[:, None] * inter + cols[None, :]
    if SPLIT_K > 1 and PASSES == 1:
        # Deterministic split-K: every split stores its partials; the split that arrives last
        # (the counter's old value) sums all of them in split order, so the bits never depend
        # on arrival order, and resets the counter for the next launch (no memset per call).
        # A split's slab: [2, rows, I] (gate, linear), or [rows, 2I] interleaved (ONE_DOT).
        slab = num_blocks_m.to(tl.int64) * (BLOCK_M * inter)
        if ONE_DOT:
            wide_offs = rows.to(tl.int64)[:, None] * (2 * inter) + w_rows[None, :]
            wide_ok = row_ok[:, None] & w_row_ok[None, :]
            tl.store(PART + split * (2 * slab) + wide_offs, acc, mask=wide_ok)
        else:
            part_ptrs = PART + split * (2 * slab) + out_offs
            tl.store(part_ptrs, acc_g, mask=ok)
            tl.store(part_ptrs + slab, acc_l, mask=ok)
        tl.debug_barrier()  # all threads' partials before the release below
        tile = pid_m * num_n + pid_n
        arrived = tl.atomic_add(COUNTERS + tile, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLIT_K - 1:
            return
        tl.store(COUNTERS + tile, 0)
        tl.debug_barrier()  # the acquire above before any thread reads the other partials
        if ONE_DOT:
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(PART + s * (2 * slab) + wide_offs, mask=wide_ok, other=0.0, cache_modifier=".cg")
        else:
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_l = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, never a stale L1 line
                acc_g += tl.load(PART + s * (2 * slab) + out_offs, mask=ok, other=0.0, cache_modifier=".cg")
                acc_l += tl.load(PART + s * (2 * slab) + slab + out_offs, mask=ok, other=0.0,
                                 cache_modifier=".cg")

    if PASSES == 1:
        if ONE_DOT:
            if HAS_B1:
                acc += tl.load(B1 + expert * stride_b1_e + w_rows, mask=w_row_ok, other=0.0).to(tl.float32)[None, :]
            # [m, 2c + j] -> [m, c, j]: j = 0 gate, 1 linear
            acc_g, acc_l = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        elif HAS_B1:
            b1_ptrs = B1 + expert * stride_b1_e + gate_rows
            acc_g += tl.load(b1_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_l += tl.load(b1_ptrs + 1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        h = _gpt_oss_activation(acc_g, acc_l, limit, alpha)
    h = tl.where(ok, h, 0.0)
    if FUSED_REQUANT:
        GROUPS: tl.constexpr = BLOCK_N // 128
        q3, scale3 = _quantize_e4m3(tl.reshape(h, [BLOCK_M, GROUPS, 128]), 2)  # scale3 [BLOCK_M, GROUPS]
        q = tl.reshape(q3, [BLOCK_M, BLOCK_N])
        tl.store(HQ + out_offs, q, mask=ok)
        num_i_groups = tl.cdiv(inter, 128)
        groups = pid_n * GROUPS + tl.arange(0, GROUPS)
        tl.store(HS + rows.to(tl.int64)[:, None] * num_i_groups + groups[None, :], scale3,
                 mask=row_ok[:, None] & (groups < num_i_groups)[None, :])
    else:
        tl.store(HF + out_offs, h, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _mlp2_kernel(
    HQ, HS, HF,  # h as _mlp1_kernel left it (fp8 + scales, or fp32)
    W2, W2S, B2,  # [E, H, I] e4m3, [E, cdiv(H, 128), cdiv(I, 128)] fp32, [E, H]
    SORTED_PAIRS, BLOCK_EXPERT,
    PAIR_OUT,  # [SPLIT_K, T * TOP_K, H] fp32 (or bf16: MoeConfig.pair_out_bf16), row = pair index, a slab per K split
    num_pairs, hidden, inter, num_blocks_m,
    stride_w2_e, stride_w2_n, stride_w2s_e, stride_w2s_n, stride_b2_e,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_B2: tl.constexpr,
    A_IS_FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SPLIT_K: tl.constexpr,
    h_desc=None, w2_desc=None,  # TMA: descriptors of h codes [rows, I] and of W2 as [E * H, I]
    TMA: tl.constexpr = False,  # MoeConfig.tma (fp8 h): h and W2 tiles by TMA
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: nothing before the wait
):
    BLOCK_K: tl.constexpr = 128
    pdl_wait_then_release(USE_PDL)
    _, split, pid_m, pid_n, expert = _grouped_tile(BLOCK_EXPERT, num_blocks_m, hidden, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SORTED_PAIRS + rows)
    row_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    offs_k = tl.arange(0, BLOCK_K)
    num_k_groups, k_first, k_last = _split_k_range(inter, split, BLOCK_K, SPLIT_K)

    h_offs = rows.to(tl.int64)[:, None] * inter + k_first * BLOCK_K + offs_k[None, :]
    hs_ptrs = HS + rows.to(tl.int64) * num_k_groups
    w_ptrs = W2 + expert * stride_w2_e + cols.to(tl.int64)[None, :] * stride_w2_n + k_first * BLOCK_K + offs_k[:, None]
    # A tile of <= 128 columns (a power of two) lies in one 128-row scale block of W2: one scalar
    # scale per K step instead of a per-column vector (the same values). Prefill blocks only (64+
    # rows): there mlp2 read 1194 us a 120b layer at 8192 tokens before and 965-983 us after (two
    # runs). The decode rows (16-row blocks) keep the vector load: with the scalar their layers
    # read 4-8 % slower at 32-128 tokens, across two runs with other routing (1-4 points per
    # byte), so not shown to be slower, but not shown faster either.
    SCALAR_WS: tl.constexpr = BLOCK_N <= 128 and BLOCK_M >= 64
    if SCALAR_WS:
        ws_ptrs = W2S + expert * stride_w2s_e + (pid_n * BLOCK_N // 128) * stride_w2s_n
    else:
        ws_ptrs = W2S + expert * stride_w2s_e + (cols // 128) * stride_w2s_n

    tl.static_assert(not TMA or A_IS_FP8, "mlp2 TMA: fp8 h")
    # TMA: W2 rows of a tile past H are the next expert's (zeros past the last), dropped by the store
    w_coord = (expert * hidden + pid_n * BLOCK_N).to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(k_first, k_last):
        k_ok = offs_k < inter - kb * BLOCK_K
        a_mask = row_ok[:, None] & k_ok[None, :]
        if TMA:
            a = h_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            a_s = tl.load(hs_ptrs + kb, mask=row_ok, other=0.0)
            w = tl.trans(w2_desc.load([w_coord, kb * BLOCK_K]))
        elif A_IS_FP8:
            a = tl.load(HQ + h_offs, mask=a_mask, other=0.0)
            a_s = tl.load(hs_ptrs + kb, mask=row_ok, other=0.0)
        else:
            a, a_s = _quantize_e4m3(tl.load(HF + h_offs, mask=a_mask, other=0.0), 1)
        if not TMA:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if SCALAR_WS:
            scale = a_s[:, None] * tl.load(ws_ptrs + kb)
        else:
            scale = a_s[:, None] * tl.load(ws_ptrs + kb, mask=col_ok, other=0.0)[None, :]
        if DOT_FP32:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1) * scale
        else:
            acc += tl.dot(a, w) * scale
        h_offs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_B2:
        if split == 0:
            acc += tl.load(B2 + expert * stride_b2_e + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = PAIR_OUT + (split * num_pairs + pairs).to(tl.int64)[:, None] * hidden + cols[None, :]
    if PAIR_OUT.dtype.element_ty == tl.bfloat16:  # MoeConfig.pair_out_bf16
        acc = _round_to_bf16(acc)
    tl.store(out_ptrs, acc.to(PAIR_OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------
# launch state (the launcher: dispatch.py's `_experts`)
# ---------------------------------------------------------------------------------------------


GATHER_BLOCK_R = 16  # MoeConfig.tma: sorted rows per program of the x gather (block_m is a multiple)


COUNTERS_OWNER = "moe_mlp1_split_k"


def _split_counters(n: int, dev: torch.device) -> torch.Tensor:
    """n arrival counters for mlp1's split-K tiles, all zero (`arrival_counters`). Inside a capture
    that would need them made, the graph gets its own zeroed ones (the zeroing is captured too)."""
    buf = arrival_counters(COUNTERS_OWNER, dev, max(n, 4096))
    return buf if buf is not None else torch.zeros(n, dtype=torch.int32, device=dev)
