"""FP8 block-128, every size regime: activation quantisation (x -> e4m3 codes + 1x128 fp32 scales) and the
device roundings the GEMM kernels share (e4m3 grid, bf16 grid for the interpreter, `_quantize_tile`).

Invariant: bit-equal to the torch quantiser (kernels/reference.py's): IEEE division where torch divides,
the e4m3 rounding done in fp32 before the cast (the interpreter's fp32 -> fp8 cast rounds wrongly; compiled
kernels may let the cast round, HW_ROUND: the same bits). Scales are written MN-major."""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl


GROUP = 128  # the scale block along K (activations and weights) and along N (weights)
E4M3_MAX = tl.constexpr(448.0)  # a constexpr: jit functions may read it


@triton.jit
def _round_to_e4m3_grid(v):
    """fp32 |v| <= 448 -> the nearest e4m3 value (ties to even), still fp32.

    The step of e4m3 near v is 2^(e-3) for exponent e >= -6 and 2^-9 below (subnormals);
    v / step is exact (a power of two) and below 16 in magnitude, so adding and removing
    1.5 * 2^23 rounds it to an integer with fp32's own round-to-nearest-even."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 + 3 - exponent) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    rounded = ((v * inv_step + magic) - magic) * step
    # Keep v's sign when it rounds to zero (-0.0 has its own e4m3 code, as in torch).
    sign = bits & -2147483648  # 0x80000000 as int32
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_bf16_grid(v):
    """fp32 -> nearest bf16 value (ties to even), still fp32. Used only under TRITON_INTERPRET,
    whose fp32 -> bf16 store rounds wrongly; compiled kernels use the hardware conversion."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000 as int32
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_tile(x, HW_ROUND: tl.constexpr):
    """x fp32 [R, 128] (zeros past a ragged K edge) -> (e4m3 [R, 128], scale fp32 [R]):
    scale = amax / 448 (1 for an all-zero group), q = clamp(x / scale, +-448) rounded to e4m3,
    the same operations as `reference.quantize_activation_group128`.
    HW_ROUND (compiled only): let the cast round (cvt.rn.satfinite: ties to even, the sign of a
    zero kept, as torch's cast), half the instructions of the fp32 grid rounding, which exists
    for the interpreter's wrong fp32 -> fp8 cast."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, E4M3_MAX, tl.float32)), 1.0)
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -E4M3_MAX), E4M3_MAX)
    if HW_ROUND:
        return q.to(tl.float8e4nv), scale
    return _round_to_e4m3_grid(q).to(tl.float8e4nv), scale


@triton.jit
def _quantize_group128_kernel(
    X, Q, SCALE,
    M, K,
    stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sk,
    BLOCK_ROWS: tl.constexpr,
):
    """grid (cdiv(M, BLOCK_ROWS), cdiv(K, 128)): one [BLOCK_ROWS, 128] group tile per program."""
    offs_m = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1)
    offs_k = group * 128 + tl.arange(0, 128)
    rows = offs_m.to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=mask, other=0.0)
    q, scale = _quantize_tile(x.to(tl.float32), False)
    tl.store(Q + rows[:, None] * stride_qm + offs_k[None, :] * stride_qk, q, mask=mask)
    tl.store(SCALE + rows * stride_sm + group * stride_sk, scale, mask=offs_m < M)


def quantize_activation_group128(x: torch.Tensor, out: Optional[torch.Tensor] = None,
                                 out_scale: Optional[torch.Tensor] = None,
                                 block_rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float) -> (e4m3 [M, K], scale fp32 [M, ceil(K/128)] stored MN-major).

    Same values as `reference.quantize_activation_group128` (bit-equal codes and
    scales); `out` / `out_scale` take preallocated buffers (any strides; e.g. a K-padded one)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_activation_group128: x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    k_blocks = triton.cdiv(k, GROUP)
    q = out if out is not None else torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = out_scale if out_scale is not None else torch.empty((k_blocks, m), dtype=torch.float32,
                                                                device=x.device).t()
    if q.shape != (m, k) or q.dtype != torch.float8_e4m3fn or scale.shape != (m, k_blocks):
        raise ValueError("quantize_activation_group128: bad out/out_scale")
    if m == 0 or k == 0:
        return q, scale
    _quantize_group128_kernel[(triton.cdiv(m, block_rows), k_blocks)](
        x, q, scale, m, k,
        x.stride(0), x.stride(1), q.stride(0), q.stride(1), scale.stride(0), scale.stride(1),
        BLOCK_ROWS=block_rows, num_warps=4,
    )
    return q, scale
