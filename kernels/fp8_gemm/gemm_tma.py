"""FP8 block-128 GEMM by TMA, prefill and mid rows without split-K (`Fp8GemmConfig.tma`): A and W tiles by
descriptors (kernels/tma.py), zero-filled past K's ragged edge, no masks in the K loop. Launched by
gemm.`_launch_gemm`.

Invariant: `_fp8_gemm_kernel`'s tile and sums in its order (pre-quantised A), so the same bits."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _gemm_scale_ptrs, _gemm_tile
from .quantize import _round_to_bf16_grid


@triton.jit
def _fp8_gemm_tma_kernel(
    a_desc, b_desc,  # TMA descriptors of A e4m3 [M, K] (tiles [BLOCK_M, 128]) and B e4m3 [N, K] ([BLOCK_N, 128])
    A_SCALE, B_SCALE, BIAS, C,
    M, N, K,
    stride_asm, stride_ask, stride_bsn, stride_bsk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """`_fp8_gemm_kernel` (pre-quantised A, no split-K) with both operand tiles by TMA: a K step is
    two tile loads from descriptors, the copy engine zero-filling past K (a zero code adds nothing),
    so no masks and no address tensors in the loop. The sums are _fp8_gemm_kernel's, in its order."""
    BLOCK_K: tl.constexpr = 128
    pid = tl.program_id(0)
    pid_m, pid_n, offs_m, offs_n, rows, cols = _gemm_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    a_scale_ptrs, b_scale_ptrs = _gemm_scale_ptrs(A_SCALE, B_SCALE, rows, cols, pid_n, stride_asm, stride_bsn,
                                                  BLOCK_N)
    if HAS_BIAS:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + tl.load(BIAS + cols).to(tl.float32)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
        a_scale = tl.load(a_scale_ptrs + kb * stride_ask)
        if BLOCK_N <= 128:
            acc += tl.dot(a, tl.trans(b)) * (a_scale[:, None] * tl.load(b_scale_ptrs + kb * stride_bsk))
        else:
            acc += tl.dot(a, tl.trans(b)) * (a_scale[:, None] * tl.load(b_scale_ptrs + kb * stride_bsk)[None, :])
    if ROUND_BF16:
        acc = _round_to_bf16_grid(acc)
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
