"""FP8 block-128, shared by the GEMM (M > 16) and GEMV (M <= 16) regimes: the grouped tile order and a GEMM
tile's rows, columns and scale pointers (the pointer and TMA kernels alike), the split-K sum as a second launch
and the arrival counters of the inline sum, the weight / output checks.

Invariant: split-K partials are summed in split order, however they are summed (last arriver or
`_splitk_sum_kernel`), then rounded once: deterministic, the same bits either way."""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from sglang_ext.kernels.arrival_counters import arrival_counters

from .quantize import GROUP, _round_to_bf16_grid


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid` in grouped order: GROUP_M row tiles share each column
    tile back to back, while its weights are in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_in_group = GROUP_M * tiles_n
    first_m = (pid // tiles_in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % tiles_in_group) % group_rows, (pid % tiles_in_group) // group_rows


@triton.jit
def _gemm_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The GEMM tile of program `pid` (grouped order): its row / column tiles, offsets, and the rows / columns
    it reads, where those past the edge read a real row / column again (no masks in the K loop; the store
    drops them)."""
    pid_m, pid_n = _grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_m, pid_n, offs_m, offs_n, (offs_m % M).to(tl.int64), (offs_n % N).to(tl.int64)


@triton.jit
def _gemm_scale_ptrs(A_SCALE, B_SCALE, rows, cols, pid_n, stride_asm, stride_bsn, BLOCK_N: tl.constexpr):
    """The first K block's scale pointers of a GEMM tile: per row of A, and of B one scalar (BLOCK_N a power
    of two <= 128 never straddles a 128-row scale block) or one per column."""
    a_scale_ptrs = A_SCALE + rows * stride_asm
    if BLOCK_N <= 128:
        b_scale_ptrs = B_SCALE + (pid_n * BLOCK_N // 128) * stride_bsn
    else:
        b_scale_ptrs = B_SCALE + (cols // 128) * stride_bsn
    return a_scale_ptrs, b_scale_ptrs


@triton.jit
def _splitk_sum_kernel(
    PART, C, M, N, SPLIT_K,
    stride_cm, stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """C = sum over splits of PART [SPLIT_K, M, N] fp32, in split order, then one rounding."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    offs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part_ptrs = PART + offs
    for _ in range(SPLIT_K):
        acc += tl.load(part_ptrs, mask=mask, other=0.0)
        part_ptrs += M * N
    if ROUND_BF16:
        acc = _round_to_bf16_grid(acc)
    tl.store(C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(C.dtype.element_ty), mask=mask)


def _check_weight(w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, k: int) -> int:
    if w_fp8.dim() != 2 or w_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemm: weight must be e4m3 [N, K], got {w_fp8.dtype} {tuple(w_fp8.shape)}")
    n, wk = w_fp8.shape
    if wk != k:
        raise ValueError(f"fp8_gemm: activation K={k} but weight is [{n}, {wk}]")
    want = (triton.cdiv(n, GROUP), triton.cdiv(k, GROUP))
    if tuple(w_scale_inv.shape) != want or w_scale_inv.dtype != torch.float32:
        raise ValueError(f"fp8_gemm: weight_scale_inv must be fp32 {want}, got "
                         f"{w_scale_inv.dtype} {tuple(w_scale_inv.shape)}")
    return n


COUNTERS_OWNER = "fp8_gemm_split_k"
MAX_SPLIT_TILES = 1 << 14


def _split_counters(device: torch.device) -> Optional[torch.Tensor]:
    """The inline split-K reduction's arrival counters (`arrival_counters`); None inside a capture
    that would need them made, and the caller uses the sum kernel."""
    return arrival_counters(COUNTERS_OWNER, device, MAX_SPLIT_TILES)


def _out_buffer(out, m, n, dtype, device, who):
    if out is None:
        return torch.empty((m, n), dtype=dtype, device=device)
    if out.shape != (m, n) or out.dtype != dtype:
        raise ValueError(f"{who}: out must be {dtype} [{m}, {n}], got {out.dtype} {tuple(out.shape)}")
    return out
