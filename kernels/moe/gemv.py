"""The decode GEMV path of the MoE (`MoeConfig.gemv`, the table's 5..8-token row): each sorted
block of `block_m` (1..4) pairs of one expert is a set of GEMV rows. A program (K split, block,
row tile) streams a weight slab of 64-128 rows x 2-8 K blocks once through cp.async stages,
swap-AB against a block-diagonal x tile (`_gemv_slab`), both scales loaded once before its K loop;
`_combine_kernel` (combine.py) then weights the pairs.

Why: at batch 1 the grouped `_mlp1_kernel` (200 registers, 184 programs, 1.4 an SM) waited each K
iteration on x and scale loads Triton does not pipeline: 58% of copy bandwidth (H200, ncu), mlp2 52%.

Invariant: the last arriver of each 128-column h group (mlp1) or output tile (mlp2) sums every
split's fp32 partials in fixed order and resets its counter, so the bits never depend on arrival
order and no memset runs per call.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from sglang_ext.kernels.arrival_counters import arrival_counters
from sglang_ext.kernels.pdl import pdl_launch_kwargs
from sglang_ext.kernels.reference import BLOCK as QUANT_GROUP, SWIGLU_ALPHA

from .combine import COMBINE_BLOCK_T, _combine_kernel
from .common import FP8, _cdiv, _gpt_oss_activation, _next_pow2, _quantize_e4m3


@triton.jit
def _gemv_slab(W_ROWS, w_row_ok, X_COLS, x_col_ok, col_kb, sc, k_len, kb_count,
               ROWS: tl.constexpr, BLOCK_W: tl.constexpr, NCOL: tl.constexpr, DOT_FP32: tl.constexpr):
    """One program's weight slab (BLOCK_W rows x kb_count <= NCOL // ROWS K blocks) times its ROWS
    activation rows -> [ROWS, BLOCK_W] fp32: per 128-block sums, each scaled by a_scale * w_scale.

    W_ROWS [BLOCK_W]: pointers to the rows at the slab's first K; X_COLS [NCOL]: the pointer of
    each x-side column at that K, column c = (block c // ROWS, row c % ROWS); col_kb its block (-1:
    a padding column); x_col_ok false for padding and for rows past the pairs; sc [NCOL] the
    column's a_scale * w_scale (0 where not ok); k_len: valid K from the slab's start.

    Swap-AB, as fp8_gemm's decode GEMV: the weight is the MMA's 64+-row side, x the
    NCOL >= 16 side: iteration i loads x only into block i's columns (the rest are masked, so
    the copy writes zeros without reading), so column (i, r) of dot_i is block i's sum for row r
    and every other column an exact 0. Each column thus collects its one block, scaled by a
    loop-invariant factor, and one sum over the block axis after the loop gives the rows. The x
    tile rides the weight's cp.async stages: nothing in the loop waits on any other load (in
    `_mlp1_kernel` each iteration waited for its x and weight scales, never pipelined)."""
    offs_k = tl.arange(0, 128)
    CB: tl.constexpr = NCOL // ROWS  # column blocks: >= the slab's K blocks
    acc_c = tl.zeros([BLOCK_W, NCOL], dtype=tl.float32)
    w_ptrs = W_ROWS[:, None] + offs_k[None, :]
    x_ptrs = X_COLS[:, None] + offs_k[None, :]
    for i in range(0, kb_count):
        k_ok = offs_k < k_len - i * 128
        w = tl.load(w_ptrs, mask=w_row_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(x_ptrs, mask=(x_col_ok & (col_kb == i))[:, None] & k_ok[None, :], other=0.0)
        if DOT_FP32:  # interpreter: exact products, fp32 sums (its tl.dot is a slow numpy loop)
            d = tl.sum(w.to(tl.float32)[:, None, :] * xt.to(tl.float32)[None, :, :], axis=2)
        else:
            d = tl.dot(w, tl.trans(xt))  # [BLOCK_W, NCOL]
        acc_c += d * sc[None, :]
        w_ptrs += 128
        x_ptrs += 128
    return tl.trans(tl.sum(tl.reshape(acc_c, [BLOCK_W, CB, ROWS]), axis=1))


@triton.jit
def _gemv_program(SORTED_PAIRS, BLOCK_EXPERT, num_blocks, ROWS: tl.constexpr, NCOL: tl.constexpr,
                  SPLITS: tl.constexpr):
    """Program -> (split, block, tile), the split fastest: an h group's (mlp2: an output tile's) programs
    run close together, so its last arriver's epilogue overlaps other programs' streaming rather than all
    of them waiting for the last wave; then the block: programs of a duplicated expert run side by side
    (the second read of a slab hits L2). Also the x-side columns, c = (K block c // ROWS of this program,
    row c % ROWS of the block), with each one's pair, and the block's expert (< 0: an unused block):
    (split, block, tile, offs_c, col_row, col_pair, expert). The pairs load is issued beside the
    expert's (in bounds; an unused block's slots are never used), so the x copies wait one L2 round
    trip, not two in series."""
    pid = tl.program_id(0)
    split = pid % SPLITS
    block = (pid // SPLITS) % num_blocks
    tile = pid // SPLITS // num_blocks
    offs_c = tl.arange(0, NCOL)
    col_row = block * ROWS + offs_c % ROWS
    col_pair = tl.load(SORTED_PAIRS + col_row)
    expert = tl.load(BLOCK_EXPERT + block)
    return split, block, tile, offs_c, col_row, col_pair, expert


@triton.jit
def _gemv_columns(offs_c, col_pair, split, k_dim, num_pairs, ROWS: tl.constexpr, KBP: tl.constexpr):
    """This split's part of K = k_dim: (K blocks in all, its first K block, its K blocks, each x-side
    column's K block within the split (-1: padding), whether the column is loaded)."""
    num_kb = tl.cdiv(k_dim, 128)
    k_first = split * KBP
    kb_count = tl.minimum(KBP, num_kb - k_first)
    col_kb = tl.where((offs_c < KBP * ROWS) & (offs_c // ROWS < kb_count), offs_c // ROWS, -1)
    col_ok = (col_pair < num_pairs) & (col_kb >= 0)
    return num_kb, k_first, kb_count, col_kb, col_ok


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _mlp1_gemv_kernel(
    XQ, XS,  # x e4m3 [T, H], scales [T, cdiv(H, 128)]
    W1, W1S, B1,  # [E, 2I, H] e4m3, [E, cdiv(2I, 128), cdiv(H, 128)] fp32, [E, 2I]
    SORTED_PAIRS, BLOCK_EXPERT,  # the sort's layout with BLOCK_M = ROWS
    HQ, HS,  # out: h e4m3 [rows, I], scales [rows, cdiv(I, 128)] (rows in the sorted order)
    PART, COUNTERS,  # fp32 [SPLITS, rows, 2I]; int32 per (block, h group), zero between launches
    num_pairs, hidden, inter, num_blocks, limit, alpha,
    stride_w1_e, stride_w1_n, stride_w1s_e, stride_w1s_n, stride_b1_e,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,  # pairs per program: one sorted block, all of one expert
    BLOCK_W: tl.constexpr,  # W1 rows per program (<= 128: one scale block; interleaved gate/linear)
    KBP: tl.constexpr,  # K blocks per program
    NCOL: tl.constexpr,  # x-side MMA columns: max(16, next_pow2(KBP * ROWS))
    SPLITS: tl.constexpr,  # cdiv(cdiv(H, 128), KBP)
    RED_CHUNK: tl.constexpr,  # splits per load in the last arriver's sum
    HAS_B1: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: wait before anything (the routing is the previous launch's)
):
    """Decode mlp1: program (split, block, tile) streams BLOCK_W rows of its block's expert over
    KBP K blocks and stores the fp32 partial; the last of the (tiles of one 128-column h group) x
    (splits) programs to arrive sums their partials (all splits per load, in fixed order: bits
    independent of arrival order), adds b1, applies the gpt-oss activation and requantises the
    group; then resets its counter (no memset per call)."""
    if USE_PDL:  # kernels/pdl.py: the routing is the previous launch's (inline: no nested call to interpret)
        gdc_wait()
        gdc_launch_dependents()
    split, block, tile, offs_c, col_row, col_pair, expert = _gemv_program(SORTED_PAIRS, BLOCK_EXPERT, num_blocks,
                                                                         ROWS, NCOL, SPLITS)
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    two_inter = 2 * inter
    num_kb, k_first, kb_count, col_kb, col_ok = _gemv_columns(offs_c, col_pair, split, hidden, num_pairs, ROWS, KBP)
    col_token = (col_pair // TOP_K).to(tl.int64)
    wrows = tile * BLOCK_W + tl.arange(0, BLOCK_W)
    w_row_ok = wrows < two_inter
    # both scales for all of this program's blocks, once, off the K loop
    x_scale = tl.load(XS + col_token * num_kb + k_first + col_kb, mask=col_ok, other=0.0)
    w_scale = tl.load(W1S + expert * stride_w1s_e + (tile * BLOCK_W // 128) * stride_w1s_n + k_first + col_kb,
                      mask=col_ok, other=0.0)
    w_rows = W1 + expert * stride_w1_e + wrows.to(tl.int64) * stride_w1_n + k_first * 128
    x_cols = XQ + col_token * hidden + k_first * 128
    acc = _gemv_slab(w_rows, w_row_ok, x_cols, col_ok, col_kb, x_scale * w_scale, hidden - k_first * 128,
                     kb_count, ROWS, BLOCK_W, NCOL, DOT_FP32)  # [ROWS, BLOCK_W]

    offs_r = tl.arange(0, ROWS)
    rows = (block * ROWS + offs_r).to(tl.int64)
    row_ok = tl.load(SORTED_PAIRS + rows) < num_pairs
    slab = num_blocks.to(tl.int64) * (ROWS * two_inter)
    tl.store(PART + split * slab + rows[:, None] * two_inter + wrows[None, :], acc,
             mask=row_ok[:, None] & w_row_ok[None, :])
    # last arriver of the h group: the partials stored by all threads before the release
    group = tile * BLOCK_W // 256
    tiles_in_group = tl.cdiv(tl.minimum(256, two_inter - group * 256), BLOCK_W)
    counter = COUNTERS + block * tl.cdiv(inter, 128) + group
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived != tiles_in_group * SPLITS - 1:
        return
    tl.store(counter, 0)
    tl.debug_barrier()  # the acquire above before any thread reads the other partials

    # every split's partials of the group, RED_CHUNK splits per load, gate and linear rows apart
    offs_c = tl.arange(0, 128)
    cols = group * 128 + offs_c  # intermediate columns: W1 rows 2c (gate) and 2c + 1 (linear)
    c_ok = cols < inter
    offs_s = tl.arange(0, RED_CHUNK)
    ok3 = row_ok[None, :, None] & c_ok[None, None, :]
    g_ptrs = PART + rows[None, :, None] * two_inter + 2 * cols[None, None, :]
    acc_g = tl.zeros([ROWS, 128], dtype=tl.float32)
    acc_l = tl.zeros([ROWS, 128], dtype=tl.float32)
    for s0 in tl.static_range(0, SPLITS, RED_CHUNK):
        s = s0 + offs_s
        ptrs = g_ptrs + (s.to(tl.int64) * slab)[:, None, None]
        ok = (s < SPLITS)[:, None, None] & ok3
        acc_g += tl.sum(tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        acc_l += tl.sum(tl.load(ptrs + 1, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    if HAS_B1:
        b1_ptrs = B1 + expert * stride_b1_e + 2 * cols
        acc_g += tl.load(b1_ptrs, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        acc_l += tl.load(b1_ptrs + 1, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    h = _gpt_oss_activation(acc_g, acc_l, limit, alpha)
    ok = row_ok[:, None] & c_ok[None, :]
    q, scale = _quantize_e4m3(tl.where(ok, h, 0.0), 1)
    tl.store(HQ + rows[:, None] * inter + cols[None, :], q, mask=ok)
    tl.store(HS + rows * tl.cdiv(inter, 128) + group, scale, mask=row_ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _mlp2_gemv_kernel(
    HQ, HS,  # h as `_mlp1_gemv_kernel` left it
    W2, W2S, B2,  # [E, H, I] e4m3, [E, cdiv(H, 128), cdiv(I, 128)] fp32, [E, H]
    SORTED_PAIRS, BLOCK_EXPERT,
    PAIR_OUT,  # fp32 [T * TOP_K, H]: y per pair (b2 included)
    PART, COUNTERS,  # fp32 [SPLITS, rows, H]; int32 per (block, n tile)
    num_pairs, hidden, inter, num_blocks,
    stride_w2_e, stride_w2_n, stride_w2s_e, stride_w2s_n, stride_b2_e,
    TOP_K: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # W2 rows (output columns) per program, <= 128
    KBP: tl.constexpr,
    NCOL: tl.constexpr,
    SPLITS: tl.constexpr,
    RED_CHUNK: tl.constexpr,
    HAS_B2: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: wait and release once the slab's addresses are known
):
    """Decode mlp2: as `_mlp1_gemv_kernel`, over W2; the last of a (block, n tile)'s splits sums
    their partials in fixed order and adds b2 (no split: the program itself)."""
    num_n = tl.cdiv(hidden, BLOCK_N)
    split, block, tile, offs_c, col_row, col_pair, expert = _gemv_program(SORTED_PAIRS, BLOCK_EXPERT, num_blocks,
                                                                         ROWS, NCOL, SPLITS)
    # An unused block exits before any wait and stores nothing. If every block is unused (no local pair), the
    # launch ends without waiting for mlp1: harmless, since mlp1's blocks are all unused then too and it
    # stores nothing.
    if expert < 0:
        return
    expert = expert.to(tl.int64)
    num_kb, k_first, kb_count, col_kb, col_ok = _gemv_columns(offs_c, col_pair, split, inter, num_pairs, ROWS, KBP)
    col_row = col_row.to(tl.int64)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < hidden
    w_scale = tl.load(W2S + expert * stride_w2s_e + (tile * BLOCK_N // 128) * stride_w2s_n + k_first + col_kb,
                      mask=col_ok, other=0.0)
    w_rows = W2 + expert * stride_w2_e + cols.to(tl.int64) * stride_w2_n + k_first * 128
    if USE_PDL:  # kernels/pdl.py: h is the previous launch's
        gdc_wait()
        gdc_launch_dependents()
    x_scale = tl.load(HS + col_row * num_kb + k_first + col_kb, mask=col_ok, other=0.0)  # h's: after the wait
    x_cols = HQ + col_row * inter + k_first * 128
    acc = _gemv_slab(w_rows, n_ok, x_cols, col_ok, col_kb, x_scale * w_scale, inter - k_first * 128,
                     kb_count, ROWS, BLOCK_N, NCOL, DOT_FP32)  # [ROWS, BLOCK_N]

    offs_r = tl.arange(0, ROWS)
    rows = (block * ROWS + offs_r).to(tl.int64)
    pairs = tl.load(SORTED_PAIRS + rows)
    row_ok = pairs < num_pairs
    ok = row_ok[:, None] & n_ok[None, :]
    if SPLITS > 1:
        slab = num_blocks.to(tl.int64) * (ROWS * hidden)
        part_ptrs = PART + rows[:, None] * hidden + cols[None, :]
        tl.store(part_ptrs + split * slab, acc, mask=ok)
        counter = COUNTERS + block * num_n + tile
        tl.debug_barrier()
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLITS - 1:
            return
        tl.store(counter, 0)
        tl.debug_barrier()
        offs_s = tl.arange(0, RED_CHUNK)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for s0 in tl.static_range(0, SPLITS, RED_CHUNK):
            s = s0 + offs_s
            acc += tl.sum(tl.load(part_ptrs[None, :, :] + (s.to(tl.int64) * slab)[:, None, None],
                                  mask=(s < SPLITS)[:, None, None] & ok[None, :, :], other=0.0,
                                  cache_modifier=".cg"), axis=0)
    if HAS_B2:
        acc += tl.load(B2 + expert * stride_b2_e + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = PAIR_OUT + pairs.to(tl.int64)[:, None] * hidden + cols[None, :]
    tl.store(y_ptrs, acc, mask=ok)


# ---------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------


GEMV_COUNTERS_OWNER = "moe_gemv"  # mlp1's and mlp2's GEMV kernels: one stream, each leaves zeros
# The last arriver's sum loads at most this many fp32 partials per thread at once.
GEMV_REDUCE_MAX_REGS = 64


def gemv_shape(k_dim: int, rows: int, split_k: int) -> tuple[int, int, int]:
    """(K blocks per program, splits, x-side columns) of a GEMV launch over K = k_dim: the
    config's split, no empty trailing split; NCOL = (K blocks, rows) columns as a power of two,
    at least 16 for the MMA."""
    num_kb = _cdiv(k_dim, QUANT_GROUP)
    kbp = _cdiv(num_kb, min(split_k, num_kb))
    ncol = _next_pow2(kbp * rows)
    return kbp, _cdiv(num_kb, kbp), max(16, ncol)


def _gemv_red_chunk(splits: int, per_split_values: int, warps: int) -> int:
    cap = max(1, GEMV_REDUCE_MAX_REGS * 32 * warps // per_split_values)
    return min(_next_pow2(splits), 1 << (cap.bit_length() - 1))


def _counters(owner: str, n: int, dev: torch.device) -> torch.Tensor:
    buf = arrival_counters(owner, dev, max(n, 4096))
    return buf if buf is not None else torch.zeros(n, dtype=torch.int32, device=dev)


def _experts_gemv(x, topk_weights, topk_ids, xq, xs, sorted_pairs, block_expert, max_blocks, w1, w1_scale_inv, b1,
                  w2, w2_scale_inv, b2, limit, expert_offset, num_local, inter, config, out):
    """The decode GEMV path: `_mlp1_gemv_kernel`, `_mlp2_gemv_kernel`, `_combine_kernel`."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dev = x.device
    bm = config.block_m
    rows = max_blocks * bm
    interpreted = dev.type == "cpu"
    chain = pdl_launch_kwargs(dev, num_tokens, "moe")  # kernels/pdl.py: each launch a dependent of the one before
    block_w = 2 * config.mlp1_block_n
    kbp1, splits1, ncol1 = gemv_shape(hidden, bm, config.mlp1_split_k)
    kbp2, splits2, ncol2 = gemv_shape(inter, bm, config.mlp2_split_k)
    hq = torch.empty((rows, inter), dtype=FP8, device=dev)
    hs = torch.empty((rows, _cdiv(inter, QUANT_GROUP)), dtype=torch.float32, device=dev)
    part1 = torch.empty((splits1, rows, 2 * inter), dtype=torch.float32, device=dev)
    block_n = config.mlp2_block_n
    n2 = _cdiv(hidden, block_n)
    # mlp1: one per (block, h group); mlp2: per (block, n tile)
    counters = _counters(GEMV_COUNTERS_OWNER, max(max_blocks * _cdiv(inter, QUANT_GROUP), max_blocks * n2), dev)
    _mlp1_gemv_kernel[(splits1 * max_blocks * _cdiv(2 * inter, block_w),)](
        xq, xs, w1, w1_scale_inv, b1 if b1 is not None else w1_scale_inv, sorted_pairs, block_expert,
        hq, hs, part1, counters,
        num_pairs, hidden, inter, max_blocks, float(limit), SWIGLU_ALPHA,
        w1.stride(0), w1.stride(1), w1_scale_inv.stride(0), w1_scale_inv.stride(1),
        b1.stride(0) if b1 is not None else 0,
        TOP_K=top_k, ROWS=bm, BLOCK_W=block_w, KBP=kbp1, NCOL=ncol1, SPLITS=splits1,
        RED_CHUNK=_gemv_red_chunk(splits1, 2 * bm * QUANT_GROUP, config.mlp1_warps),
        HAS_B1=b1 is not None, DOT_FP32=interpreted,
        num_warps=config.mlp1_warps, num_stages=config.mlp1_stages, **chain,
    )
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=dev)
    part2 = torch.empty((splits2, rows, hidden), dtype=torch.float32, device=dev) if splits2 > 1 else pair_out
    _mlp2_gemv_kernel[(splits2 * max_blocks * n2,)](
        hq, hs, w2, w2_scale_inv, b2 if b2 is not None else w2_scale_inv, sorted_pairs, block_expert,
        pair_out, part2, counters,
        num_pairs, hidden, inter, max_blocks,
        w2.stride(0), w2.stride(1), w2_scale_inv.stride(0), w2_scale_inv.stride(1),
        b2.stride(0) if b2 is not None else 0,
        TOP_K=top_k, ROWS=bm, BLOCK_N=block_n, KBP=kbp2, NCOL=ncol2, SPLITS=splits2,
        RED_CHUNK=_gemv_red_chunk(splits2, bm * block_n, config.mlp2_warps),
        HAS_B2=b2 is not None, DOT_FP32=interpreted,
        num_warps=config.mlp2_warps, num_stages=config.mlp2_stages, **chain,
    )
    block_h = min(1024, _next_pow2(hidden))
    _combine_kernel[(_cdiv(num_tokens, COMBINE_BLOCK_T), _cdiv(hidden, block_h))](
        pair_out, topk_weights, topk_ids, out, num_tokens, hidden, out.stride(0), expert_offset, num_local,
        TOP_K=top_k, BLOCK_T=COMBINE_BLOCK_T, BLOCK_H=block_h, SPLIT_K=1, num_warps=4,
        **pdl_launch_kwargs(dev, num_tokens, "moe_combine"),
    )
    return out
