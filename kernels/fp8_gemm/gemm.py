"""FP8 block-128 GEMM, M > 16 (mid rows and prefill): one [BLOCK_M, BLOCK_N] output tile per program on pointer
loads, split-K where N alone gives too few tiles (17..256 rows of narrow N), x quantised in the K loop on
request (`fuse_quant`); `_launch_gemm` launches every M > 16 tile, the TMA kernel (gemm_tma) where the config
asks for it and the operands suit the copy engine.

Invariant: K steps of one 128 scale group, each block's dot promoted to fp32 and scaled once
(a_scale * w_scale), the bias in the accumulator's start (split 0), one rounding: the TMA kernel's sums in the
same order, so the same bits."""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from sglang_ext.kernels._util import interpreted
from sglang_ext.kernels.tma import descriptor, tma_2d_ok

from .common import MAX_SPLIT_TILES, _gemm_scale_ptrs, _gemm_tile, _split_counters, _splitk_sum_kernel
from .config import Fp8GemmConfig
from .gemm_tma import _fp8_gemm_tma_kernel
from .quantize import GROUP, _quantize_tile, _round_to_bf16_grid


@triton.jit
def _fp8_gemm_kernel(
    A, A_SCALE, B, B_SCALE, BIAS, C, PART, COUNTERS,
    M, N, K,
    stride_am, stride_ak, stride_asm, stride_ask,
    stride_bn, stride_bk, stride_bsn, stride_bsk,
    stride_cm, stride_cn, stride_part_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    QUANTIZE_A: tl.constexpr,  # A is x (any float): quantise each 1x128 group in the K loop
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,  # grid[1] > 1: fp32 partials in PART [SPLIT, M, N]
    INLINE_REDUCE: tl.constexpr,  # split-K: the last split of a tile to finish sums the partials
    ROUND_BF16: tl.constexpr,  # interpreter only: round to bf16 in fp32 before the store
):
    """C[M, N] = A[M, K] B[N, K]^T with 1x128 scales on A and 128x128 scales on B, bias fused.

    grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits); BLOCK_K is the scale group, 128.
    Split-K with INLINE_REDUCE: each split stores its partial, then bumps the tile's arrival
    counter; the split that arrives last adds all partials in split order (deterministic) and
    stores C, then resets the counter for the next launch (one launch, no separate sum kernel).
    Without it, `_splitk_sum_kernel` does the sum."""
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    pid_m, pid_n, offs_m, offs_n, rows, cols = _gemm_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + cols[None, :] * stride_bn + offs_k[:, None] * stride_bk
    a_scale_ptrs, b_scale_ptrs = _gemm_scale_ptrs(A_SCALE, B_SCALE, rows, cols, pid_n, stride_asm, stride_bsn,
                                                  BLOCK_N)

    k_blocks = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_blocks, num_splits)
    kb_lo = split * per_split
    kb_hi = tl.minimum(kb_lo + per_split, k_blocks)

    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=split == 0, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + bias[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    a_ptrs += kb_lo * BLOCK_K * stride_ak
    b_ptrs += kb_lo * BLOCK_K * stride_bk
    a_scale_ptrs += kb_lo * stride_ask
    b_scale_ptrs += kb_lo * stride_bsk
    k_left = K - kb_lo * BLOCK_K
    for _ in range(kb_lo, kb_hi):
        k_ok = offs_k < k_left  # all true but in the ragged last block
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if QUANTIZE_A:
            a, a_scale = _quantize_tile(a.to(tl.float32), False)
        else:
            a_scale = tl.load(a_scale_ptrs)
        b_scale = tl.load(b_scale_ptrs)
        if BLOCK_N <= 128:
            acc += tl.dot(a, b) * (a_scale[:, None] * b_scale)
        else:
            acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
        a_scale_ptrs += stride_ask
        b_scale_ptrs += stride_bsk
        k_left -= BLOCK_K

    c_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    if SPLIT_K:
        part_ptrs = PART + rows[:, None] * N + cols[None, :]
        tl.store(part_ptrs + split.to(tl.int64) * stride_part_split, acc, mask=c_mask)
        if INLINE_REDUCE:
            # Every thread's partial store is ordered before the barrier, and the barrier before
            # the counter's release (acq_rel, gpu scope): the last arriver sees all partials.
            tl.debug_barrier()
            arrived = tl.atomic_add(COUNTERS + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for _ in range(0, num_splits):
                    # .cg: read L2, where the other SMs' partials are, never a stale L1 line
                    total += tl.load(part_ptrs, mask=c_mask, other=0.0, cache_modifier=".cg")
                    part_ptrs += stride_part_split
                if ROUND_BF16:
                    total = _round_to_bf16_grid(total)
                tl.store(c_ptrs, total.to(C.dtype.element_ty), mask=c_mask)
                tl.atomic_xchg(COUNTERS + pid, 0)
    else:
        if ROUND_BF16:
            acc = _round_to_bf16_grid(acc)
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)


def _launch_gemm(a, a_scale, w_fp8, w_scale_inv, bias, out, cfg: Fp8GemmConfig, quantize_a: bool):
    m, k = a.shape
    n = w_fp8.shape[0]
    round_bf16 = interpreted() and out.dtype == torch.bfloat16
    split = max(1, min(cfg.split_k, triton.cdiv(k, GROUP)))
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    a_scale_strides = (0, 0) if a_scale is None else (a_scale.stride(0), a_scale.stride(1))
    if cfg.tma and not quantize_a and split == 1 and tma_2d_ok(a) and tma_2d_ok(w_fp8):
        _fp8_gemm_tma_kernel[(tiles,)](
            descriptor(a, [cfg.block_m, GROUP]), descriptor(w_fp8, [cfg.block_n, GROUP]), a_scale, w_scale_inv,
            bias if bias is not None else w_scale_inv, out, m, n, k, *a_scale_strides,
            w_scale_inv.stride(0), w_scale_inv.stride(1), out.stride(0), out.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m, HAS_BIAS=bias is not None,
            ROUND_BF16=round_bf16, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        return out
    part = counters = None
    if split > 1:
        part = torch.empty((split, m, n), dtype=torch.float32, device=a.device)
        if cfg.inline_reduce and tiles <= MAX_SPLIT_TILES:
            counters = _split_counters(a.device)
    _fp8_gemm_kernel[(tiles, split)](
        a, a_scale if a_scale is not None else a, w_fp8, w_scale_inv,
        bias if bias is not None else w_scale_inv, out,
        part if part is not None else out, counters if counters is not None else w_scale_inv,
        m, n, k,
        a.stride(0), a.stride(1), *a_scale_strides,
        w_fp8.stride(0), w_fp8.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        out.stride(0), out.stride(1), m * n,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        QUANTIZE_A=quantize_a, HAS_BIAS=bias is not None, SPLIT_K=split > 1,
        INLINE_REDUCE=counters is not None, ROUND_BF16=round_bf16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1 and counters is None:
        block_m, block_n = 16, 128
        _splitk_sum_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            part, out, m, n, split, out.stride(0), out.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, ROUND_BF16=round_bf16, num_warps=4,
        )
    return out
