"""FP8 block-128 GEMV, decode (M <= 16 rows a launch): the split-K GEMV (`_fp8_gemv_kernel`), its x-once form
(`_fp8_gemv_kernel_xonce`), the one-shot GEMV for M <= 4 (`_fp8_gemv_oneshot_kernel`), their shared store and
last-arriver sum (`_gemv_epilogue`), and their launchers.

Invariant: weight bytes are the whole cost, so every weight byte is read once per launch, all token rows ride
in each program; per K block the exact e4m3 products summed in fp32 and scaled once, split 0 starting at the
bias, splits summed in split order, one rounding."""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from sglang_ext.kernels._util import interpreted, num_sms
from sglang_ext.kernels.pdl import pdl_launch_kwargs, pdl_wait_then_release

from .common import MAX_SPLIT_TILES, _split_counters, _splitk_sum_kernel
from .config import GEMV_MAX_ROWS, ONESHOT_MAX_ROWS, Fp8GemvConfig, gemv_config, gemv_splits
from .quantize import GROUP, _quantize_tile, _round_to_bf16_grid


@triton.jit
def _fp8_gemv_kernel(
    X, X_SCALE, W, W_SCALE, BIAS, C, PART, COUNTERS,
    M, N, K, KB_PER_SPLIT,
    stride_xm, stride_xk, stride_xsm, stride_xsk,
    stride_wn, stride_wk, stride_wsn, stride_wsk,
    stride_cm, stride_cn,
    ROWS: tl.constexpr,  # a power of two >= M, <= 16: every token row in one program
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,  # tensor cores (swap-AB: W is the 64-row side of the MMA), else FMA
    QUANTIZE_X: tl.constexpr,  # X is x (any float): quantise each 1x128 group once per K block
    HW_ROUND: tl.constexpr,  # compiled only: the cast rounds to e4m3 (see _quantize_tile)
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,  # grid[1] > 1: fp32 partials in PART [SPLIT, M, N]
    INLINE_REDUCE: tl.constexpr,
    RED_CHUNK: tl.constexpr,  # the last arriver's splits per load (see _gemv_epilogue)
    ROUND_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: nothing before the wait
):
    """Decode (M <= 16): C[M, N] = X[M, K] W[N, K]^T, one program per (BLOCK_N columns, K split).

    Weight bytes are the whole cost, so the grid is sized by N tiles x K splits to keep every
    SM streaming several [BLOCK_N, 128] slabs (K-contiguous rows: wide coalesced loads) at once,
    and all M rows ride along in one program: each weight byte is read once, each x group is
    quantised once per N tile (ROWS rows, not a padded 16-row tile). FMA: e4m3 products are
    exact in fp32 and summed in fp32 per 128-block. USE_DOT: W is the A operand ([BLOCK_N, 128],
    64 rows feed Hopper's wgmma) and the x rows, repeated up to 16, the B operand, so no MMA
    row is spent on padding rows of x. Either way each block's sum is scaled once by
    a_scale * w_scale; split 0 starts at the bias; split-K reduces as `_fp8_gemm_kernel` does."""
    pdl_wait_then_release(USE_PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    OUT_ROWS: tl.constexpr = 16 if USE_DOT else ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (offs_n % N).to(tl.int64)  # past the N edge: reload a real row, dropped at the store
    offs_r = tl.arange(0, ROWS)
    r_ok = offs_r < M
    offs_k = tl.arange(0, 128)
    kb_lo = split * KB_PER_SPLIT
    kb_hi = tl.minimum(kb_lo + KB_PER_SPLIT, tl.cdiv(K, 128))

    w_ptrs = W + cols[:, None] * stride_wn + (kb_lo * 128 + offs_k)[None, :] * stride_wk
    x_ptrs = X + offs_r.to(tl.int64)[:, None] * stride_xm + (kb_lo * 128 + offs_k)[None, :] * stride_xk
    xs_ptrs = X_SCALE + offs_r * stride_xsm + kb_lo * stride_xsk
    if BLOCK_N <= 128:  # a power of two <= 128 never straddles a 128-row scale block of W
        ws_ptrs = W_SCALE + (pid_n * BLOCK_N // 128) * stride_wsn + kb_lo * stride_wsk
    else:
        ws_ptrs = W_SCALE + (cols // 128) * stride_wsn + kb_lo * stride_wsk

    if USE_DOT:
        acc = tl.zeros((BLOCK_N, OUT_ROWS), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=split == 0, other=0.0).to(tl.float32)
        if USE_DOT:
            acc += bias[:, None]
        else:
            acc += bias[None, :]

    k_left = K - kb_lo * 128
    for _ in range(kb_lo, kb_hi):
        k_ok = offs_k < k_left  # all true but in the ragged last block
        w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANTIZE_X:
            q, xs = _quantize_tile(x.to(tl.float32), HW_ROUND)
        else:
            q = x
            xs = tl.load(xs_ptrs, mask=r_ok, other=0.0)
        ws = tl.load(ws_ptrs)
        if USE_DOT:
            if ROWS < 16:  # repeat the rows to the MMA's minimum 16 (row j holds x row j % ROWS)
                q = tl.reshape(tl.broadcast_to(q[None, :, :], (16 // ROWS, ROWS, 128)), (16, 128))
                xs = tl.reshape(tl.broadcast_to(xs[None, :], (16 // ROWS, ROWS)), (16,))
            d = tl.dot(w, tl.trans(q))  # [BLOCK_N, 16]
            if BLOCK_N <= 128:
                acc += d * (xs[None, :] * ws)
            else:
                acc += d * (ws[:, None] * xs[None, :])
        else:
            wf = w.to(tl.float32)
            if ROWS == 1:
                d = tl.sum(wf * q.to(tl.float32), axis=1)[None, :]
            else:
                # Row by row over the one converted slab: a [ROWS, BLOCK_N, 128] product would not
                # fit in registers (255 and spills at 4 x 64 already).
                qf = q.to(tl.float32)
                d = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
                for r in tl.static_range(ROWS):
                    q_r = tl.sum(tl.where(offs_r[:, None] == r, qf, 0.0), axis=0)  # row r, exact
                    d_r = tl.sum(wf * q_r[None, :], axis=1)
                    d = tl.where(offs_r[:, None] == r, d_r[None, :], d)
            if BLOCK_N <= 128:
                acc += d * (xs[:, None] * ws)
            else:
                acc += d * (xs[:, None] * ws[None, :])
        w_ptrs += 128 * stride_wk
        x_ptrs += 128 * stride_xk
        xs_ptrs += stride_xsk
        ws_ptrs += stride_wsk
        k_left -= 128

    if USE_DOT:
        acc = tl.trans(acc)  # [16, BLOCK_N]; rows < M are x rows 0..M-1 (M <= ROWS)
    _gemv_epilogue(acc, C, PART, COUNTERS, pid_n, split, num_splits, M, N, offs_n, cols, stride_cm, stride_cn,
                   OUT_ROWS, ROWS, BLOCK_N, SPLIT_K, INLINE_REDUCE, RED_CHUNK, ROUND_BF16)


@triton.jit
def _x_groups(x, xs, ROWS: tl.constexpr, KBP: tl.constexpr, QUANTIZE_X: tl.constexpr, HW_ROUND: tl.constexpr):
    """x [ROWS, KBP, 128] -> (e4m3 codes [ROWS, KBP, 128], scales [ROWS, KBP]): quantised here, or
    x already codes and `xs` its scales."""
    if QUANTIZE_X:
        q, s = _quantize_tile(tl.reshape(x.to(tl.float32), (ROWS * KBP, 128)), HW_ROUND)
        q = tl.reshape(q, (ROWS, KBP, 128))
        s = tl.reshape(s, (ROWS, KBP))
    else:
        q = x
        s = xs
    return q, s


@triton.jit
def _fp8_gemv_kernel_xonce(
    X, X_SCALE, W, W_SCALE, BIAS, C, PART, COUNTERS,
    M, N, K,
    stride_xm, stride_xk, stride_xsm, stride_xsk,
    stride_wn, stride_wk, stride_wsn, stride_wsk,
    stride_cm, stride_cn,
    ROWS: tl.constexpr,  # a power of two >= M, <= 16
    BLOCK_N: tl.constexpr,
    KBP: tl.constexpr,  # K blocks per program (a power of two): all of this program's K range
    USE_DOT: tl.constexpr,  # tensor cores, else FMA
    BATCHED: tl.constexpr,  # USE_DOT: one dot batched over the KBP blocks, not a K loop
    NCOL: tl.constexpr,  # the K loop's x-side MMA columns: max(16, KBP * ROWS)
    QUANTIZE_X: tl.constexpr,
    HW_ROUND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INLINE_REDUCE: tl.constexpr,
    RED_CHUNK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: nothing before the wait
):
    """Decode (M <= 16), x once per program: program (n tile, split) owns K blocks
    [split * KBP, split * KBP + KBP); it loads x, both scales and the bias for all of them and
    quantises every x group in one pass before any weight work, so nothing but the weight
    stream stands between it and its MMAs.

    Why: in `_fp8_gemv_kernel` each K block is a dependent chain: x and the scales are too narrow
    for Triton to pipeline, so every iteration waits a memory latency, then quantises (a
    cross-thread max), stages x in shared memory and waits its MMA; at decode sizes (~4 blocks
    per program) that chain, not bandwidth, sets the time.

    Block maths, all exact per-block sums of e4m3 products scaled by a_scale * w_scale in fp32,
    summed over the blocks, the bias added once (split 0), one rounding:
      - tensor cores (default): a K loop over the KBP weight blocks (cp.async stages: with
        num_stages > KBP the whole slab is in flight at once) against one loop-invariant x tile:
        MMA column (rep, kb, r) holds x row r of block kb, and iteration i zeroes the columns of
        the other blocks, so column c of dot_i is block i's sum for its row (the same wgmma
        chain as `_fp8_gemv_kernel`'s per-block dot) and every other column an exact 0; one
        fp32 multiply by the per-column a_scale * w_scale then adds it to its own column;
        rep > 0 columns (padding to the MMA's 16) stay 0. No per-iteration loads but the weight.
      - BATCHED: no loop at all, the [KBP, BLOCK_N, 128] slab in one load and one dot batched
        over the blocks (Triton lowers it to mma.sync on f16 operands, exact for e4m3).
      - FMA: no loop, the slab in one load (registers, no shared memory), per-block fp32 sums."""
    pdl_wait_then_release(USE_PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    KLOOP: tl.constexpr = USE_DOT and not BATCHED
    OUT_ROWS: tl.constexpr = 16 if BATCHED and USE_DOT else ROWS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (offs_n % N).to(tl.int64)  # past the N edge: reload a real row, dropped at the store
    offs_r = tl.arange(0, ROWS)
    r_ok = offs_r < M
    offs_b = tl.arange(0, KBP)
    offs_k = tl.arange(0, 128)
    kb = split * KBP + offs_b
    kk = kb[:, None] * 128 + offs_k[None, :]  # [KBP, 128]
    k_ok = kk < K  # false past K: the ragged last block and blocks past the last one

    # Everything but the weight first, in one go (x, the scales and the bias issued after the
    # weight loads would wait behind them).
    x = tl.load(X + offs_r.to(tl.int64)[:, None, None] * stride_xm + kk[None, :, :] * stride_xk,
                mask=r_ok[:, None, None] & k_ok[None, :, :], other=0.0)  # [ROWS, KBP, 128]
    kb_ok = kb < tl.cdiv(K, 128)
    if BLOCK_N <= 128:  # a power of two <= 128 never straddles a 128-row scale block of W
        ws = tl.load(W_SCALE + (pid_n * BLOCK_N // 128) * stride_wsn + kb * stride_wsk, mask=kb_ok, other=0.0)
    else:
        ws = tl.load(W_SCALE + (cols // 128)[None, :] * stride_wsn + kb[:, None] * stride_wsk,
                     mask=kb_ok[:, None], other=0.0)  # [KBP, BLOCK_N]
    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=split == 0, other=0.0).to(tl.float32)
    if QUANTIZE_X:
        xs = tl.zeros((ROWS, KBP), dtype=tl.float32)  # computed from x by _x_groups
    else:
        xs = tl.load(X_SCALE + offs_r[:, None] * stride_xsm + kb[None, :] * stride_xsk,
                     mask=r_ok[:, None] & kb_ok[None, :], other=0.0)
    if not KLOOP:  # [KBP, BLOCK_N, 128] in one load
        w = tl.load(W + cols[None, :, None] * stride_wn + kk[:, None, :] * stride_wk,
                    mask=k_ok[:, None, :], other=0.0)

    if KLOOP:
        REP: tl.constexpr = NCOL // (KBP * ROWS)
        CB: tl.constexpr = NCOL // ROWS  # column blocks (rep, kb)
        offs_c = tl.arange(0, NCOL)
        col_kb = tl.where(offs_c < KBP * ROWS, offs_c // ROWS, -1)  # the block of each column
        w_ptrs = W + cols[:, None] * stride_wn + (split * (KBP * 128) + offs_k)[None, :] * stride_wk
        k_left = K - split * (KBP * 128)
        acc_c = tl.zeros((BLOCK_N, NCOL), dtype=tl.float32)
        xcols = tl.zeros((NCOL, 128), dtype=tl.uint8)
        if BLOCK_N <= 128:
            sc = tl.zeros((NCOL,), dtype=tl.float32)
        else:
            sc = tl.zeros((BLOCK_N, NCOL), dtype=tl.float32)
        for i in range(0, tl.minimum(KBP, tl.cdiv(k_left, 128))):  # the last split may have fewer
            if i == 0:
                # x's quantisation and MMA tile in the first iteration rather than before the loop:
                # Triton issues the weight stages' cp.async (the pipeline prologue) just ahead of
                # the loop, and anything there that waits on x would hold them back a latency
                q, xs = _x_groups(x, xs, ROWS, KBP, QUANTIZE_X, HW_ROUND)
                xs_t = tl.permute(xs, (1, 0))  # [KBP, ROWS]
                qbits = tl.permute(q.to(tl.uint8, bitcast=True), (1, 0, 2))  # [KBP, ROWS, 128]
                xcols = tl.reshape(tl.broadcast_to(qbits[None, :, :, :], (REP, KBP, ROWS, 128)), (NCOL, 128))
                if BLOCK_N <= 128:
                    sc = tl.reshape(tl.broadcast_to((xs_t * ws[:, None])[None, :, :], (REP, KBP, ROWS)), (NCOL,))
                else:
                    sc = tl.permute(xs_t[:, :, None] * ws[:, None, :], (2, 0, 1))  # [BLOCK_N, KBP, ROWS]
                    sc = tl.reshape(tl.broadcast_to(sc[:, None, :, :], (BLOCK_N, REP, KBP, ROWS)), (BLOCK_N, NCOL))
            w = tl.load(w_ptrs, mask=(offs_k < k_left)[None, :], other=0.0)
            xi = tl.where((col_kb == i)[:, None], xcols, tl.zeros_like(xcols)).to(tl.float8e4nv, bitcast=True)
            d = tl.dot(w, tl.trans(xi))  # [BLOCK_N, NCOL]: block i's sums in its columns, 0 elsewhere
            if BLOCK_N <= 128:
                acc_c += d * sc[None, :]
            else:
                acc_c += d * sc
            w_ptrs += 128 * stride_wk
            k_left -= 128
        acc = tl.trans(tl.sum(tl.reshape(acc_c, (BLOCK_N, CB, ROWS)), axis=1))  # [ROWS, BLOCK_N]
    elif USE_DOT:
        # swap-AB per K block: W [BLOCK_N, 128] x x^T [128, 16] (rows repeated up to 16, as in
        # _fp8_gemv_kernel), batched over the KBP blocks
        q, xs = _x_groups(x, xs, ROWS, KBP, QUANTIZE_X, HW_ROUND)
        qb = tl.permute(q, (1, 0, 2))  # [KBP, ROWS, 128]
        xsb = tl.permute(xs, (1, 0))  # [KBP, ROWS]
        if ROWS < 16:
            qb = tl.reshape(tl.broadcast_to(qb[:, None, :, :], (KBP, 16 // ROWS, ROWS, 128)), (KBP, 16, 128))
            xsb = tl.reshape(tl.broadcast_to(xsb[:, None, :], (KBP, 16 // ROWS, ROWS)), (KBP, 16))
        d = tl.dot(w, tl.permute(qb, (0, 2, 1)))  # [KBP, BLOCK_N, 16]
        if BLOCK_N <= 128:
            d = d * (xsb * ws[:, None])[:, None, :]
        else:
            d = d * (ws[:, :, None] * xsb[:, None, :])
        acc = tl.trans(tl.sum(d, axis=0))  # [16, BLOCK_N]
    else:
        q, xs = _x_groups(x, xs, ROWS, KBP, QUANTIZE_X, HW_ROUND)
        wf = w.to(tl.float32)
        qf = q.to(tl.float32)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for r in tl.static_range(ROWS):
            if ROWS == 1:
                q_r = tl.reshape(qf, (KBP, 128))
                xs_r = tl.reshape(xs, (KBP,))
            else:  # row r, exactly (the other rows add zeros)
                q_r = tl.sum(tl.where(offs_r[:, None, None] == r, qf, 0.0), axis=0)
                xs_r = tl.sum(tl.where(offs_r[:, None] == r, xs, 0.0), axis=0)
            d_r = tl.sum(wf * q_r[:, None, :], axis=2)  # [KBP, BLOCK_N]: exact products, fp32 sums
            if BLOCK_N <= 128:
                d_r = d_r * (xs_r * ws)[:, None]
            else:
                d_r = d_r * (xs_r[:, None] * ws)
            acc = tl.where(offs_r[:, None] == r, tl.sum(d_r, axis=0)[None, :], acc)
    if HAS_BIAS:
        acc += bias[None, :]
    _gemv_epilogue(acc, C, PART, COUNTERS, pid_n, split, num_splits, M, N, offs_n, cols, stride_cm, stride_cn,
                   OUT_ROWS, ROWS, BLOCK_N, SPLIT_K, INLINE_REDUCE, RED_CHUNK, ROUND_BF16)


@triton.jit
def _gemv_epilogue(
    acc, C, PART, COUNTERS, pid_n, split, num_splits, M, N, offs_n, cols, stride_cm, stride_cn,
    OUT_ROWS: tl.constexpr,  # acc is [OUT_ROWS, BLOCK_N]; rows < M are the output rows
    ROWS: tl.constexpr,  # a power of two >= M: the rows the chunked reduction loads
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INLINE_REDUCE: tl.constexpr,
    RED_CHUNK: tl.constexpr,  # splits summed per load by the last arriver (1: one load per split)
    ROUND_BF16: tl.constexpr,
):
    """The decode kernels' store: C directly, or this split's fp32 partial in PART [SPLIT, M, N]
    and, with INLINE_REDUCE, the tile's last arriver sums every split's partial into C."""
    out_r = tl.arange(0, OUT_ROWS)
    rows = out_r.to(tl.int64)
    c_mask = (out_r < M)[:, None] & (offs_n < N)[None, :]
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    if SPLIT_K:
        part_ptrs = PART + rows[:, None] * N + cols[None, :]
        tl.store(part_ptrs + split.to(tl.int64) * M * N, acc, mask=c_mask)
        if INLINE_REDUCE:
            # as in _fp8_gemm_kernel: partials ordered before the acq_rel counter bump
            tl.debug_barrier()
            arrived = tl.atomic_add(COUNTERS + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                if RED_CHUNK == 1:
                    total = tl.zeros((OUT_ROWS, BLOCK_N), dtype=tl.float32)
                    for _ in range(0, num_splits):
                        total += tl.load(part_ptrs, mask=c_mask, other=0.0, cache_modifier=".cg")
                        part_ptrs += M * N
                    if ROUND_BF16:
                        total = _round_to_bf16_grid(total)
                    tl.store(c_ptrs, total.to(C.dtype.element_ty), mask=c_mask)
                else:
                    # One masked [RED_CHUNK, ROWS, BLOCK_N] load per RED_CHUNK splits: the serial
                    # loop pays one L2 round trip per split (o's 11 splits: ~11 x 0.3 us on the
                    # critical path of the last program); a fixed-shape tree sum stays deterministic.
                    offs_s = tl.arange(0, RED_CHUNK)
                    red_r = tl.arange(0, ROWS)
                    red_mask = (red_r < M)[:, None] & (offs_n < N)[None, :]
                    red_ptrs = PART + red_r.to(tl.int64)[:, None] * N + cols[None, :]
                    total = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
                    for s0 in range(0, num_splits, RED_CHUNK):
                        s = s0 + offs_s
                        p = tl.load(red_ptrs[None, :, :] + (s.to(tl.int64) * M * N)[:, None, None],
                                    mask=(s < num_splits)[:, None, None] & red_mask[None, :, :], other=0.0,
                                    cache_modifier=".cg")
                        total += tl.sum(p, axis=0)
                    if ROUND_BF16:
                        total = _round_to_bf16_grid(total)
                    tl.store(C + red_r.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn,
                             total.to(C.dtype.element_ty), mask=red_mask)
                tl.atomic_xchg(COUNTERS + pid_n, 0)
    else:
        if ROUND_BF16:
            acc = _round_to_bf16_grid(acc)
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


@triton.jit
def _oneshot_x(X, X_SCALE, row, M, K, stride_xm, stride_xk, stride_xsm, stride_xsk,
               C1: tl.constexpr, C2: tl.constexpr, QUANTIZE_X: tl.constexpr):
    """Token row `row`'s x over K blocks [0, C1) and [C1, C1 + C2) (masked past K and past M):
    (xa [C1, 128], scales [C1], xb [C2, 128], scales [C2]); x upcast to fp32 right after the load
    (its quantisation waits until the weight loads are issued), or e4m3 codes and their scales.
    C2 == 0: the second pair repeats the first (never used)."""
    offs_k = tl.arange(0, 128)
    ba = tl.arange(0, C1)
    ka = ba[:, None] * 128 + offs_k[None, :]
    xa = tl.load(X + row * stride_xm + ka * stride_xk, mask=(ka < K) & (row < M), other=0.0)
    if QUANTIZE_X:
        xa = xa.to(tl.float32)
        sa = tl.zeros((C1,), dtype=tl.float32)  # computed by _oneshot_row
    else:
        sa = tl.load(X_SCALE + row * stride_xsm + ba * stride_xsk, mask=(ba * 128 < K) & (row < M), other=0.0)
    xb = xa
    sb = sa
    if C2 > 0:
        bb = C1 + tl.arange(0, C2)
        kb = bb[:, None] * 128 + offs_k[None, :]
        xb = tl.load(X + row * stride_xm + kb * stride_xk, mask=(kb < K) & (row < M), other=0.0)
        if QUANTIZE_X:
            xb = xb.to(tl.float32)
            sb = tl.zeros((C2,), dtype=tl.float32)
        else:
            sb = tl.load(X_SCALE + row * stride_xsm + bb * stride_xsk, mask=(bb * 128 < K) & (row < M), other=0.0)
    return xa, sa, xb, sb


@triton.jit
def _oneshot_row(wa, wsa, xa, sa, wb, wsb, xb, sb, C2: tl.constexpr, QUANTIZE_X: tl.constexpr,
                 HW_ROUND: tl.constexpr):
    """One token row against the program's weight slab: per K block the exact e4m3 products
    summed in fp32, times a_scale * w_scale, summed over the blocks -> fp32 [BLOCK_N]."""
    if QUANTIZE_X:
        xa, sa = _quantize_tile(xa, HW_ROUND)
    d = tl.sum(wa.to(tl.float32) * xa.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_N, C1]
    acc = tl.sum(d * (sa * wsa)[None, :], axis=1)
    if C2 > 0:
        if QUANTIZE_X:
            xb, sb = _quantize_tile(xb, HW_ROUND)
        d = tl.sum(wb.to(tl.float32) * xb.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_N, C2]
        acc += tl.sum(d * (sb * wsb)[None, :], axis=1)
    return acc


@triton.jit
def _oneshot_store(C, acc, bias, row, M, N, offs_n, cols, stride_cm, stride_cn, HAS_BIAS: tl.constexpr,
                   ROUND_BF16: tl.constexpr):
    """The bias added to the fp32 sum, one rounding, token row `row`'s store."""
    if HAS_BIAS:
        acc += bias
    if ROUND_BF16:
        acc = _round_to_bf16_grid(acc)
    tl.store(C + row * stride_cm + cols * stride_cn, acc.to(C.dtype.element_ty), mask=(offs_n < N) & (row < M))


@triton.jit
def _oneshot_x_rows(X, X_SCALE, M, K, stride_xm, stride_xk, stride_xsm, stride_xsk,
                    ROWS: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, QUANTIZE_X: tl.constexpr):
    """`_oneshot_x` of rows 0..ROWS-1; the rows past ROWS repeat row 0 (never used)."""
    xa0, sa0, xb0, sb0 = _oneshot_x(X, X_SCALE, 0, M, K, stride_xm, stride_xk, stride_xsm, stride_xsk,
                                    C1, C2, QUANTIZE_X)
    xa1, sa1, xb1, sb1 = xa0, sa0, xb0, sb0
    xa2, sa2, xb2, sb2 = xa0, sa0, xb0, sb0
    xa3, sa3, xb3, sb3 = xa0, sa0, xb0, sb0
    if ROWS > 1:
        xa1, sa1, xb1, sb1 = _oneshot_x(X, X_SCALE, 1, M, K, stride_xm, stride_xk, stride_xsm, stride_xsk,
                                        C1, C2, QUANTIZE_X)
    if ROWS > 2:
        xa2, sa2, xb2, sb2 = _oneshot_x(X, X_SCALE, 2, M, K, stride_xm, stride_xk, stride_xsm, stride_xsk,
                                        C1, C2, QUANTIZE_X)
        xa3, sa3, xb3, sb3 = _oneshot_x(X, X_SCALE, 3, M, K, stride_xm, stride_xk, stride_xsm, stride_xsk,
                                        C1, C2, QUANTIZE_X)
    return xa0, sa0, xb0, sb0, xa1, sa1, xb1, sb1, xa2, sa2, xb2, sb2, xa3, sa3, xb3, sb3


@triton.jit
def _fp8_gemv_oneshot_kernel(
    X, X_SCALE, W, W_SCALE, BIAS, C,
    M, N, K,
    stride_xm, stride_xk, stride_xsm, stride_xsk,
    stride_wn, stride_wk, stride_wsn, stride_wsk,
    stride_cm, stride_cn,
    ROWS: tl.constexpr,  # 1, 2 or 4 (a power of two >= M): every token row against one weight slab
    BLOCK_N: tl.constexpr,  # a power of two <= 128 (one weight scale row per program)
    C1: tl.constexpr,  # K blocks of the first load, a power of two (`pow2_chunks`)
    C2: tl.constexpr,  # K blocks of the second load, a power of two or 0; past K masked
    QUANTIZE_X: tl.constexpr,  # X is x (any float): each program quantises its rows (`_quantize_tile`)
    HW_ROUND: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,  # kernels/pdl.py: the weight side before the wait, x after it
):
    """Decode (M <= 4), one shot: program p owns weight rows [p BLOCK_N, p BLOCK_N + BLOCK_N) and
    ALL of K: no K loop, no split, so no fp32 partials, no arrival counter and no last-arriver
    tail (the split-K kernels' ~3 us over a plain read of the same bytes at M = 1:
    benchmarks/results/diag_floor.md). It issues every x-side load first (x or its codes and
    scales, the weight scales, the bias), then its whole weight slab in two loads of C1 and C2
    K blocks, and only then computes: FMA blocks in fp32 (each e4m3 product exact), each block's
    sum times a_scale * w_scale, the blocks summed, the bias added, one rounding. Narrow tiles
    (2-16 rows) give enough programs to keep HBM busy. Pre-quantised x (QUANTIZE_X False) is
    the fast form: with x quantised in-kernel every program redoes all of x (M x K divisions),
    which cancels the gain once there are many programs (qkv: 640)."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (offs_n % N).to(tl.int64)  # past the N edge: reload a real row, dropped at the store
    # the x side first: its latency overlaps the weight's instead of following it (with PDL x is
    # the previous kernel's output, so it comes after the weight slab and the wait instead)
    if not USE_PDL:
        xa0, sa0, xb0, sb0, xa1, sa1, xb1, sb1, xa2, sa2, xb2, sb2, xa3, sa3, xb3, sb3 = _oneshot_x_rows(
            X, X_SCALE, M, K, stride_xm, stride_xk, stride_xsm, stride_xsk, ROWS, C1, C2, QUANTIZE_X)
    offs_k = tl.arange(0, 128)
    ba = tl.arange(0, C1)
    ka = ba[:, None] * 128 + offs_k[None, :]
    ws_row = W_SCALE + (pid_n * BLOCK_N // 128) * stride_wsn  # BLOCK_N <= 128 never straddles a block
    wsa = tl.load(ws_row + ba * stride_wsk, mask=ba * 128 < K, other=0.0)
    bias = tl.load(BIAS + cols).to(tl.float32) if HAS_BIAS else None
    if C2 > 0:
        bb = C1 + tl.arange(0, C2)
        kb = bb[:, None] * 128 + offs_k[None, :]
        wsb = tl.load(ws_row + bb * stride_wsk, mask=bb * 128 < K, other=0.0)
    # then the whole weight slab, in at most two loads
    w_rows = W + cols[:, None, None] * stride_wn
    wa = tl.load(w_rows + ka[None, :, :] * stride_wk, mask=(ka < K)[None, :, :], other=0.0)
    wb = wa
    if C2 > 0:
        wb = tl.load(w_rows + kb[None, :, :] * stride_wk, mask=(kb < K)[None, :, :], other=0.0)
    else:
        wsb = wsa
    if USE_PDL:
        pdl_wait_then_release(USE_PDL)
        xa0, sa0, xb0, sb0, xa1, sa1, xb1, sb1, xa2, sa2, xb2, sb2, xa3, sa3, xb3, sb3 = _oneshot_x_rows(
            X, X_SCALE, M, K, stride_xm, stride_xk, stride_xsm, stride_xsk, ROWS, C1, C2, QUANTIZE_X)
    acc = _oneshot_row(wa, wsa, xa0, sa0, wb, wsb, xb0, sb0, C2, QUANTIZE_X, HW_ROUND)
    _oneshot_store(C, acc, bias, 0, M, N, offs_n, cols, stride_cm, stride_cn, HAS_BIAS, ROUND_BF16)
    if ROWS > 1:
        acc = _oneshot_row(wa, wsa, xa1, sa1, wb, wsb, xb1, sb1, C2, QUANTIZE_X, HW_ROUND)
        _oneshot_store(C, acc, bias, 1, M, N, offs_n, cols, stride_cm, stride_cn, HAS_BIAS, ROUND_BF16)
    if ROWS > 2:
        acc = _oneshot_row(wa, wsa, xa2, sa2, wb, wsb, xb2, sb2, C2, QUANTIZE_X, HW_ROUND)
        _oneshot_store(C, acc, bias, 2, M, N, offs_n, cols, stride_cm, stride_cn, HAS_BIAS, ROUND_BF16)
        acc = _oneshot_row(wa, wsa, xa3, sa3, wb, wsb, xb3, sb3, C2, QUANTIZE_X, HW_ROUND)
        _oneshot_store(C, acc, bias, 3, M, N, offs_n, cols, stride_cm, stride_cn, HAS_BIAS, ROUND_BF16)


# The vectorised split-K sum loads at most this many fp32 partials per thread at once.
VECTOR_REDUCE_MAX_REGS = 64


def _red_chunk(cfg: Fp8GemvConfig, split: int, rows_p2: int) -> int:
    """Splits per load in the last arriver's sum: 1 (the serial loop) or, with `vector_reduce`,
    as many as fit `VECTOR_REDUCE_MAX_REGS` registers per thread (all of them at M <= 4)."""
    if not cfg.vector_reduce or split <= 1:
        return 1
    cap = max(2, VECTOR_REDUCE_MAX_REGS * 32 * cfg.num_warps // (rows_p2 * cfg.block_n))
    return min(triton.next_power_of_2(split), 1 << (cap.bit_length() - 1))


INTERPRETED_ONESHOT_BLOCK_N = 16


def pow2_chunks(k_blocks: int) -> tuple[int, int]:
    """K blocks -> (C1, C2): the one-shot kernel's two slab loads, C1 the largest power of two
    <= k_blocks, C2 a power of two covering the rest (0 if none): 23 -> (16, 8), 32 -> (32, 0)."""
    k_blocks = max(k_blocks, 1)
    c1 = 1 << (k_blocks.bit_length() - 1)
    rest = k_blocks - c1
    return c1, (0 if rest == 0 else 1 << (rest - 1).bit_length())


def _launch_oneshot(x, x_scale, w_fp8, w_scale_inv, bias, out, cfg: Fp8GemvConfig, quantize_x: bool):
    """`_fp8_gemv_oneshot_kernel` over row chunks of <= 4 (one launch for M <= 4; past that each
    chunk reads the weight again)."""
    m, k = x.shape
    n = w_fp8.shape[0]
    bn = cfg.block_n
    if not 1 <= bn <= GROUP or bn & (bn - 1):
        raise ValueError(f"fp8 one-shot GEMV: block_n must be a power of two <= {GROUP}, got {bn}")
    if interpreted() and cfg == gemv_config(m, n, k, x.device, x_prequantized=not quantize_x):
        # The interpreter pays per program, and each output element's sums do not depend on the
        # tile width, so the served model's interpreted runs (tests) take the heuristic's pick
        # 16 rows wide: the same bits, several times fewer programs. Explicit configs run as given.
        bn = max(bn, INTERPRETED_ONESHOT_BLOCK_N)
    c1, c2 = pow2_chunks(triton.cdiv(k, GROUP))
    for r0 in range(0, m, ONESHOT_MAX_ROWS):
        rows = min(ONESHOT_MAX_ROWS, m - r0)
        xc, oc = x[r0:r0 + rows], out[r0:r0 + rows]
        xsc = x_scale[r0:r0 + rows] if x_scale is not None else None
        _fp8_gemv_oneshot_kernel[(triton.cdiv(n, bn),)](
            xc, xsc if xsc is not None else xc, w_fp8, w_scale_inv, bias if bias is not None else w_scale_inv, oc,
            rows, n, k,
            xc.stride(0), xc.stride(1), *((0, 0) if xsc is None else (xsc.stride(0), xsc.stride(1))),
            w_fp8.stride(0), w_fp8.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
            oc.stride(0), oc.stride(1),
            ROWS=triton.next_power_of_2(rows), BLOCK_N=bn, C1=c1, C2=c2, QUANTIZE_X=quantize_x,
            HW_ROUND=cfg.hw_round and not interpreted(), HAS_BIAS=bias is not None,
            ROUND_BF16=interpreted() and out.dtype == torch.bfloat16, num_warps=cfg.num_warps,
            **pdl_launch_kwargs(x.device, rows),
        )
    return out


def _launch_gemv(x, x_scale, w_fp8, w_scale_inv, bias, out, cfg: Fp8GemvConfig, quantize_x: bool):
    """The decode kernel over row chunks of <= 16 (one launch for decode's M <= 16)."""
    if cfg.oneshot:
        return _launch_oneshot(x, x_scale, w_fp8, w_scale_inv, bias, out, cfg, quantize_x)
    m, k = x.shape
    n = w_fp8.shape[0]
    round_bf16 = interpreted() and out.dtype == torch.bfloat16
    for r0 in range(0, m, GEMV_MAX_ROWS):
        rows = min(GEMV_MAX_ROWS, m - r0)
        xc, oc = x[r0:r0 + rows], out[r0:r0 + rows]
        xsc = x_scale[r0:r0 + rows] if x_scale is not None else None
        split, per_split = gemv_splits(cfg, rows, n, k, num_sms(x.device))
        tiles = triton.cdiv(n, cfg.block_n)
        rows_p2 = triton.next_power_of_2(rows)
        part = counters = None
        if split > 1:
            part = torch.empty((split, rows, n), dtype=torch.float32, device=x.device)
            if cfg.inline_reduce and tiles <= MAX_SPLIT_TILES:
                counters = _split_counters(x.device)
        xs_strides = (0, 0) if xsc is None else (xsc.stride(0), xsc.stride(1))
        args = (xc, xsc if xsc is not None else xc, w_fp8, w_scale_inv,
                bias if bias is not None else w_scale_inv, oc,
                part if part is not None else oc, counters if counters is not None else w_scale_inv,
                rows, n, k)
        strides = (xc.stride(0), xc.stride(1), *xs_strides,
                   w_fp8.stride(0), w_fp8.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
                   oc.stride(0), oc.stride(1))
        flags = dict(ROWS=rows_p2, BLOCK_N=cfg.block_n, USE_DOT=cfg.use_dot,
                     QUANTIZE_X=quantize_x, HW_ROUND=cfg.hw_round and not interpreted(),
                     HAS_BIAS=bias is not None, SPLIT_K=split > 1, INLINE_REDUCE=counters is not None,
                     RED_CHUNK=_red_chunk(cfg, split, rows_p2), ROUND_BF16=round_bf16,
                     num_warps=cfg.num_warps,
                     # the whole launch's rows: past PDL_MAX_ROWS (an explicit config's chunks) no PDL
                     **pdl_launch_kwargs(x.device, m, "gemv_xonce" if cfg.x_once else "gemv"))
        if cfg.x_once:
            _fp8_gemv_kernel_xonce[(tiles, split)](
                *args, *strides, KBP=per_split, BATCHED=cfg.batched_dot,
                NCOL=max(16, per_split * rows_p2), num_stages=cfg.num_stages, **flags)
        else:
            _fp8_gemv_kernel[(tiles, split)](*args, per_split, *strides, num_stages=cfg.num_stages, **flags)
        if split > 1 and counters is None:
            _splitk_sum_kernel[(triton.cdiv(rows, 16), triton.cdiv(n, 128))](
                part, oc, rows, n, split, oc.stride(0), oc.stride(1),
                BLOCK_M=16, BLOCK_N=128, ROUND_BF16=round_bf16, num_warps=4,
            )
    return out
