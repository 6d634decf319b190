"""The MoE prefill's grouped FP8 GEMMs (mlp1, mlp2) in Gluon on `fp8_gluon.scaled_k_loop`: one wgmma in flight
while the previous K block's scales are applied (kernels/fp8_gluon.py says why). `MoeConfig.mlp1_gluon` /
`mlp2_gluon` put them in place of `moe._mlp1_kernel` / `_mlp2_kernel` on the TMA rows, compiled CUDA only; their
reference is `moe.moe_ref`, and on the same tiles they are meant to give the Triton kernels' bits (same products,
same sums in the same order).

Tiles: 64-row blocks. mlp1 on 4 warps runs a program's 256 W1 rows in two passes of 128 (the table's Triton row),
on 8 warps in one pass with a warpgroup on each half, sharing the x tile; mlp2 128 wide on 4 warps (the table's),
or 256 wide on 8. Status (session 21): compiled for sm_90a here (Triton 3.6 and 3.8:
benchmarks/results/diag_gluon_moe_compile*.md; spills only in the table-tile mlp1 on 3.8, 4 bytes, and the
persistent two-pass mlp1, 100-112); never run on a GPU; no table row takes them (stages gluon22, gluon22ab,
gluon22t of benchmarks/run_h200.sh measure them).
Persistent programs (`MoeConfig.gluon_persistent`) run tiles pid, pid + grid, ... and request each next tile's
first copies before the current tile's epilogue.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from sglang_ext.kernels.fp8_gluon import (BLOCK_K, K_TILE, allocate_ring, fp8_descriptor, grouped_tile,
                                          mma_layout_for, persistent_grid, release_ring, request_first_blocks,
                                          scaled_k_loop)

MLP1_PASS_ROWS = 128  # W1 rows a pass of mlp1 on one warpgroup (one scale block: a scalar weight scale per K block)


@gluon.jit
def _swiglu(acc, B1, expert, stride_b1_e, first_row, two_inter, limit, alpha, HAS_B1: gl.constexpr,
            mma_layout: gl.constexpr):
    """[BLOCK_M, ROWS] sums over W1 rows first_row.. (gate and linear interleaved as stored), bias added (rows
    past 2I: the next expert's, dropped by the store, get none), through gpt-oss's clamped SwiGLU:
    h [BLOCK_M, ROWS / 2], by `moe._gpt_oss_activation`'s operations."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    ROWS: gl.constexpr = acc.shape[1]
    if HAS_B1:
        w_rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma_layout))
        bias = gl.load(B1 + expert * stride_b1_e + w_rows, mask=w_rows < two_inter, other=0.0)
        acc += bias.to(gl.float32)[None, :]
    acc_g, acc_l = gl.split(gl.reshape(acc, [BLOCK_M, ROWS // 2, 2]))
    gate = gl.minimum(acc_g, limit)
    lin = gl.minimum(gl.maximum(acc_l, -limit), limit)
    return gate * (1 / (1 + gl.exp(-(gate * alpha)))) * (lin + 1.0)  # tl.sigmoid's expression


@gluon.jit
def _to_e4m3(q):
    """fp32 q (divided by its group's scale) -> e4m3 as `moe._quantize_e4m3`: clamped to +-448, rounded to the
    nearest e4m3 (ties to even) in fp32 by its bit operations, so the cast after it is exact."""
    q = gl.minimum(gl.maximum(q, -448.0), 448.0)
    bits = q.to(gl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(gl.float32, bitcast=True)
    subnormal = (q + 24576.0) - 24576.0
    q = gl.where(gl.abs(q) < 0.015625, subnormal, normal)
    q = (q.to(gl.int32, bitcast=True) | (bits & -2147483648)).to(gl.float32, bitcast=True)
    return q.to(gl.float8e4nv)


@gluon.jit
def _next_tile(tile, num_tiles, num_blocks_m, num_n, BLOCK_EXPERT, GROUP_M: gl.constexpr, PREFETCH: gl.constexpr):
    """This program's next tile after `tile` (tile + grid): (valid, m block, n tile, expert); valid 0 past the last
    tile, on a block past the last expert's segment, or without PREFETCH (a program a tile: no next one)."""
    nxt = tile + gl.num_programs(0)
    if not PREFETCH:
        nxt = num_tiles
    # clamped: past the last tile grouped_tile's group can be empty (a division by zero); the load below is masked
    next_m, next_n = grouped_tile(gl.minimum(nxt, num_tiles - 1), num_blocks_m, num_n, GROUP_M)
    in_range = nxt < num_tiles
    expert = gl.load(BLOCK_EXPERT + next_m, mask=in_range, other=-1)
    return (in_range & (expert >= 0)).to(gl.int32), next_m, next_n, expert


@gluon.jit
def _mlp1_tile(tile, g, requested, num_tiles, num_n, num_kb, a_bufs, w_bufs, ready, x_desc, w1_desc, XS, W1S, B1,
               SORTED_PAIRS, BLOCK_EXPERT, HQ, HS, num_pairs, inter, num_blocks_m, limit, alpha, stride_w1s_e,
               stride_w1s_n, stride_b1_e, TOP_K: gl.constexpr, GROUP_M: gl.constexpr, HAS_B1: gl.constexpr,
               mma_layout: gl.constexpr, STAGES: gl.constexpr, PREFETCH: gl.constexpr):
    """One tile of `_mlp1_gluon_kernel`; returns the ring's next block number and whether the next tile's first
    copies were requested (PREFETCH: persistent programs)."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    W_ROWS: gl.constexpr = w1_desc.block_type.shape[0]
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    pid_m, pid_n = grouped_tile(tile, num_blocks_m, num_n, GROUP_M)
    expert = gl.load(BLOCK_EXPERT + pid_m)
    if expert >= 0:  # blocks past the last expert's segment: nothing
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        pairs = gl.load(SORTED_PAIRS + rows)
        row_ok = pairs < num_pairs
        xs_ptrs = XS + (pairs // TOP_K).to(gl.int64) * num_kb
        first_row = pid_n * 256
        w_coord = expert * (2 * inter) + first_row
        ws_ptr = W1S + expert.to(gl.int64) * stride_w1s_e + (first_row // 128) * stride_w1s_n
        zero = gl.zeros([BLOCK_M, W_ROWS], gl.float32, layout=mma_layout)
        if W_ROWS == 256:
            # the second 128 rows' scale block; where they lie past 2I (columns dropped) the first's, not past
            # the tensor
            ws_hi = gl.where(first_row + 128 < 2 * inter, stride_w1s_n, 0)
            acc = scaled_k_loop(zero, x_desc, w1_desc, a_bufs, w_bufs, ready, g, pid_m * BLOCK_M, w_coord,
                                xs_ptrs, 1, row_ok, ws_ptr, ws_hi, num_kb, requested, STAGES)
            g += num_kb
            requested, next_m, next_n, next_expert = _next_tile(tile, num_tiles, num_blocks_m, num_n,
                                                                BLOCK_EXPERT, GROUP_M, PREFETCH)
            if requested != 0:
                request_first_blocks(x_desc, w1_desc, a_bufs, w_bufs, ready, g, next_m * BLOCK_M,
                                     next_expert * (2 * inter) + next_n * 256, num_kb, STAGES)
            h = _swiglu(acc, B1, expert, stride_b1_e, first_row, 2 * inter, limit, alpha, HAS_B1, mma_layout)
            h_layout: gl.constexpr = h.type.layout
            h_rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, h_layout))
            h_row_ok = gl.convert_layout(row_ok, gl.SliceLayout(1, h_layout))
            cols = pid_n * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, h_layout))
            ok = h_row_ok[:, None] & (cols < inter)[None, :]
            h = gl.where(ok, h, 0.0)
            amax = gl.max(gl.abs(h), axis=1)
            scale = gl.where(amax > 0, gl.div_rn(amax, 448.0), 1.0)
            gl.store(HQ + h_rows.to(gl.int64)[:, None] * inter + cols[None, :],
                     _to_e4m3(gl.div_rn(h, scale[:, None])), mask=ok)
        else:
            acc = scaled_k_loop(zero, x_desc, w1_desc, a_bufs, w_bufs, ready, g, pid_m * BLOCK_M, w_coord,
                                xs_ptrs, 1, row_ok, ws_ptr, 0, num_kb, requested, STAGES)
            g += num_kb
            second = first_row + W_ROWS < 2 * inter
            if second:  # the second pass's first copies land while the first pass's h is computed
                request_first_blocks(x_desc, w1_desc, a_bufs, w_bufs, ready, g, pid_m * BLOCK_M, w_coord + W_ROWS,
                                     num_kb, STAGES)
            h_lo = _swiglu(acc, B1, expert, stride_b1_e, first_row, 2 * inter, limit, alpha, HAS_B1, mma_layout)
            if second:
                acc = scaled_k_loop(zero, x_desc, w1_desc, a_bufs, w_bufs, ready, g, pid_m * BLOCK_M,
                                    w_coord + W_ROWS, xs_ptrs, 1, row_ok, ws_ptr + stride_w1s_n, 0, num_kb, 1,
                                    STAGES)
                g += num_kb
                h_hi = _swiglu(acc, B1, expert, stride_b1_e, first_row + W_ROWS, 2 * inter, limit, alpha, HAS_B1,
                               mma_layout)
            else:  # the last tile of an odd number of 64-column halves: its second half lies past I
                h_hi = gl.zeros_like(h_lo)
            requested, next_m, next_n, next_expert = _next_tile(tile, num_tiles, num_blocks_m, num_n,
                                                                BLOCK_EXPERT, GROUP_M, PREFETCH)
            if requested != 0:
                request_first_blocks(x_desc, w1_desc, a_bufs, w_bufs, ready, g, next_m * BLOCK_M,
                                     next_expert * (2 * inter) + next_n * 256, num_kb, STAGES)
            h_layout: gl.constexpr = h_lo.type.layout
            h_rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, h_layout))
            h_row_ok = gl.convert_layout(row_ok, gl.SliceLayout(1, h_layout))
            cols = pid_n * 128 + gl.arange(0, 64, layout=gl.SliceLayout(0, h_layout))
            ok_lo = h_row_ok[:, None] & (cols < inter)[None, :]
            ok_hi = h_row_ok[:, None] & (cols + 64 < inter)[None, :]
            h_lo = gl.where(ok_lo, h_lo, 0.0)
            h_hi = gl.where(ok_hi, h_hi, 0.0)
            amax = gl.maximum(gl.max(gl.abs(h_lo), axis=1), gl.max(gl.abs(h_hi), axis=1))
            scale = gl.where(amax > 0, gl.div_rn(amax, 448.0), 1.0)
            out_offs = h_rows.to(gl.int64)[:, None] * inter + cols[None, :]
            gl.store(HQ + out_offs, _to_e4m3(gl.div_rn(h_lo, scale[:, None])), mask=ok_lo)
            gl.store(HQ + out_offs + 64, _to_e4m3(gl.div_rn(h_hi, scale[:, None])), mask=ok_hi)
        gl.store(HS + h_rows.to(gl.int64) * num_n + pid_n, scale, mask=h_row_ok)
    return g, requested


@gluon.jit(do_not_specialize=["num_pairs", "num_blocks_m"])  # as the Triton twins: no compile per token count
def _mlp1_gluon_kernel(x_desc, w1_desc, XS, W1S, B1, SORTED_PAIRS, BLOCK_EXPERT, HQ, HS,
                       num_pairs, hidden, inter, num_blocks_m, limit, alpha,
                       stride_w1s_e, stride_w1s_n, stride_b1_e,
                       TOP_K: gl.constexpr, GROUP_M: gl.constexpr, HAS_B1: gl.constexpr,
                       mma_layout: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
    """`moe._mlp1_kernel` on the TMA tiles: a tile's 128 h columns (256 W1 rows), h requantised in one e4m3
    group of 128 columns a row into HQ [rows, I] / HS [rows, cdiv(I, 128)]. x's rows come gathered into the
    sorted order (x_desc), their scales by token from XS. W1 tiles of 128 rows (4 warps): two passes over K, the
    first pass's h kept in registers, as the table's Triton row; of 256 rows (8 warps, a warpgroup each half):
    one pass, both halves at once on the shared x tile (a scale per column). A program a tile, or PERSISTENT:
    tiles pid, pid + grid, ..., each next tile's first copies requested before the current tile's epilogue."""
    W_ROWS: gl.constexpr = w1_desc.block_type.shape[0]
    gl.static_assert(W_ROWS == 128 or W_ROWS == 256, "mlp1: W1 tiles of 128 rows (two passes) or 256 (one)")
    num_n = gl.cdiv(inter, 128)
    num_tiles = num_blocks_m * num_n
    num_kb = gl.cdiv(hidden, BLOCK_K)
    a_bufs, w_bufs, ready = allocate_ring(x_desc, w1_desc, STAGES)
    if PERSISTENT:
        g = gl.to_tensor(0)
        requested = gl.to_tensor(0)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            g, requested = _mlp1_tile(tile, g, requested, num_tiles, num_n, num_kb, a_bufs, w_bufs, ready, x_desc,
                                      w1_desc, XS, W1S, B1, SORTED_PAIRS, BLOCK_EXPERT, HQ, HS, num_pairs, inter,
                                      num_blocks_m, limit, alpha, stride_w1s_e, stride_w1s_n, stride_b1_e, TOP_K,
                                      GROUP_M, HAS_B1, mma_layout, STAGES, True)
    else:  # no loop around the tile: with one, the two-pass tile spilled 100 bytes a thread (ptxas, Triton 3.8)
        _mlp1_tile(gl.program_id(0), gl.to_tensor(0), gl.to_tensor(0), num_tiles, num_n, num_kb, a_bufs, w_bufs,
                   ready, x_desc, w1_desc, XS, W1S, B1, SORTED_PAIRS, BLOCK_EXPERT, HQ, HS, num_pairs, inter,
                   num_blocks_m, limit, alpha, stride_w1s_e, stride_w1s_n, stride_b1_e, TOP_K, GROUP_M, HAS_B1,
                   mma_layout, STAGES, False)
    release_ring(ready, STAGES)


@gluon.jit
def _mlp2_tile(tile, g, requested, num_tiles, num_n, num_kb, a_bufs, w_bufs, ready, h_desc, w2_desc, HS, W2S, B2,
               SORTED_PAIRS, BLOCK_EXPERT, PAIR_OUT, num_pairs, hidden, num_blocks_m, stride_w2s_e, stride_w2s_n,
               stride_b2_e, GROUP_M: gl.constexpr, HAS_B2: gl.constexpr, mma_layout: gl.constexpr,
               STAGES: gl.constexpr, PREFETCH: gl.constexpr):
    """One tile of `_mlp2_gluon_kernel` (returns as `_mlp1_tile`)."""
    BLOCK_M: gl.constexpr = h_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = w2_desc.block_type.shape[0]
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    pid_m, pid_n = grouped_tile(tile, num_blocks_m, num_n, GROUP_M)
    expert = gl.load(BLOCK_EXPERT + pid_m)
    if expert >= 0:
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_layout)
        pairs = gl.load(SORTED_PAIRS + rows)
        row_ok = pairs < num_pairs
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        col_ok = cols < hidden
        ws = W2S + expert.to(gl.int64) * stride_w2s_e + (pid_n * BLOCK_N // 128) * stride_w2s_n
        # 256 wide: the second 128 columns' scale block; past H (columns dropped) the first's, not past the
        # tensor
        ws_hi = gl.where(pid_n * BLOCK_N + 128 < hidden, stride_w2s_n, 0)
        acc = scaled_k_loop(gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_layout), h_desc, w2_desc,
                            a_bufs, w_bufs, ready, g, pid_m * BLOCK_M, expert * hidden + pid_n * BLOCK_N,
                            HS + rows.to(gl.int64) * num_kb, 1, row_ok, ws, ws_hi, num_kb, requested, STAGES)
        g += num_kb
        requested, next_m, next_n, next_expert = _next_tile(tile, num_tiles, num_blocks_m, num_n, BLOCK_EXPERT,
                                                            GROUP_M, PREFETCH)
        if requested != 0:
            request_first_blocks(h_desc, w2_desc, a_bufs, w_bufs, ready, g, next_m * BLOCK_M,
                                 next_expert * hidden + next_n * BLOCK_N, num_kb, STAGES)
        if HAS_B2:
            acc += gl.load(B2 + expert * stride_b2_e + cols, mask=col_ok, other=0.0).to(gl.float32)[None, :]
        out_ptrs = PAIR_OUT + pairs.to(gl.int64)[:, None] * hidden + cols[None, :]
        gl.store(out_ptrs, acc.to(PAIR_OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    return g, requested


@gluon.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
def _mlp2_gluon_kernel(h_desc, w2_desc, HS, W2S, B2, SORTED_PAIRS, BLOCK_EXPERT, PAIR_OUT,
                       num_pairs, hidden, inter, num_blocks_m, stride_w2s_e, stride_w2s_n, stride_b2_e,
                       GROUP_M: gl.constexpr, HAS_B2: gl.constexpr, mma_layout: gl.constexpr,
                       STAGES: gl.constexpr, PERSISTENT: gl.constexpr):
    """`moe._mlp2_kernel` on TMA tiles: y = h W2^T (+ b2) for a block of sorted rows and BLOCK_N (<= 128, or 256
    on 8 warps) output columns, stored at each pair's row of PAIR_OUT [T * TOP_K, H] in its dtype (bf16: rounded
    once, as `MoeConfig.pair_out_bf16`). Tiles per program as `_mlp1_gluon_kernel`."""
    BLOCK_N: gl.constexpr = w2_desc.block_type.shape[0]
    gl.static_assert(128 % BLOCK_N == 0 or BLOCK_N == 256, "tiles inside one 128-row W2 scale block, or 256 wide")
    num_n = gl.cdiv(hidden, BLOCK_N)
    num_tiles = num_blocks_m * num_n
    num_kb = gl.cdiv(inter, BLOCK_K)
    a_bufs, w_bufs, ready = allocate_ring(h_desc, w2_desc, STAGES)
    if PERSISTENT:
        g = gl.to_tensor(0)
        requested = gl.to_tensor(0)
        for tile in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            g, requested = _mlp2_tile(tile, g, requested, num_tiles, num_n, num_kb, a_bufs, w_bufs, ready, h_desc,
                                      w2_desc, HS, W2S, B2, SORTED_PAIRS, BLOCK_EXPERT, PAIR_OUT, num_pairs, hidden,
                                      num_blocks_m, stride_w2s_e, stride_w2s_n, stride_b2_e, GROUP_M, HAS_B2,
                                      mma_layout, STAGES, True)
    else:
        _mlp2_tile(gl.program_id(0), gl.to_tensor(0), gl.to_tensor(0), num_tiles, num_n, num_kb, a_bufs, w_bufs,
                   ready, h_desc, w2_desc, HS, W2S, B2, SORTED_PAIRS, BLOCK_EXPERT, PAIR_OUT, num_pairs, hidden,
                   num_blocks_m, stride_w2s_e, stride_w2s_n, stride_b2_e, GROUP_M, HAS_B2, mma_layout, STAGES, False)
    release_ring(ready, STAGES)


def mlp1_gluon(xg, xs, w1, w1_scale_inv, b1, sorted_pairs, block_expert, hq, hs, num_pairs, max_blocks, limit,
               alpha, top_k, block_m, warps, stages, group_m, persistent=False):
    """`_mlp1_gluon_kernel` over every (block, 128-column) tile: xg [max_blocks * block_m, H] e4m3 (x gathered
    into the sorted order, `moe._gather_rows_kernel`), xs [T, cdiv(H, 128)], w1 [E, 2I, H] contiguous; writes
    hq / hs as `moe._mlp1_kernel` with fused requantisation."""
    num_local, two_inter, hidden = w1.shape
    inter = two_inter // 2
    w_rows = 2 * MLP1_PASS_ROWS if warps == 8 else MLP1_PASS_ROWS  # 8 warps: both halves at once, one pass
    tiles = max_blocks * triton.cdiv(inter, 128)
    _mlp1_gluon_kernel[(persistent_grid(tiles, warps, xg.device) if persistent else tiles,)](
        fp8_descriptor(xg, [block_m, K_TILE]), fp8_descriptor(w1.view(-1, hidden), [w_rows, K_TILE]),
        xs, w1_scale_inv, b1 if b1 is not None else w1_scale_inv, sorted_pairs, block_expert, hq, hs,
        num_pairs, hidden, inter, max_blocks, float(limit), alpha,
        w1_scale_inv.stride(0), w1_scale_inv.stride(1), b1.stride(0) if b1 is not None else 0,
        TOP_K=top_k, GROUP_M=group_m, HAS_B1=b1 is not None, mma_layout=mma_layout_for(block_m, w_rows, warps),
        STAGES=stages, PERSISTENT=persistent, num_warps=warps)


def mlp2_gluon(hq, hs, w2, w2_scale_inv, b2, sorted_pairs, block_expert, pair_out, num_pairs, max_blocks, block_m,
               block_n, warps, stages, group_m, persistent=False):
    """`_mlp2_gluon_kernel` over every (block, block_n-column) tile: hq [max_blocks * block_m, I] e4m3 with hs,
    w2 [E, H, I] contiguous; each pair's output into pair_out [T * top_k, H]."""
    num_local, hidden, inter = w2.shape
    tiles = max_blocks * triton.cdiv(hidden, block_n)
    _mlp2_gluon_kernel[(persistent_grid(tiles, warps, hq.device) if persistent else tiles,)](
        fp8_descriptor(hq, [block_m, K_TILE]), fp8_descriptor(w2.view(-1, inter), [block_n, K_TILE]),
        hs, w2_scale_inv, b2 if b2 is not None else w2_scale_inv, sorted_pairs, block_expert, pair_out,
        num_pairs, hidden, inter, max_blocks, w2_scale_inv.stride(0), w2_scale_inv.stride(1),
        b2.stride(0) if b2 is not None else 0, GROUP_M=group_m, HAS_B2=b2 is not None,
        mma_layout=mma_layout_for(block_m, block_n, warps), STAGES=stages, PERSISTENT=persistent, num_warps=warps)

