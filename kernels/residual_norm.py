"""Residual add + RMSNorm (+ the probe's weight-less tap) in one launch.

Between the big kernels a gpt-oss layer adds a branch output to the residual stream and
normalises the sum twice per layer; as separate launches that is an add (1.5 us) and a norm
(2.5 us) each time on the H200 at batch 1 (benchmarks/results/diag_decode_b1.md). Here one
program per row reads h and the branch output once, writes the new residual and the normed
input of the next sub-layer, and, at a SingProbe tapped layer, the weight-less normalisation
of the same residual (its own eps) into the probe's feature buffer.

The numbers equal the unfused ops: the sum is rounded to the residual's dtype (as the bf16
add) before the statistics, which are fp32; the weight multiplies in fp32; one rounding.

With `quantize` the same launch also writes the normed output's FP8 form for the next GEMM:
e4m3 codes + fp32 1x128 group scales of the *rounded* output, bit-equal to
`quantize_activation_group128(x_out)`, so the qkv projection's decode GEMV reads codes instead
of quantising x in each of its programs (`fp8_linear(x_quant=...)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interpreted
from .fp8_gemm import GROUP, _quantize_tile, _round_to_bf16_grid, quantize_activation_group128_ref
from .pdl import pdl_launch_kwargs, pdl_wait_then_release


@triton.jit
def _residual_sum(H, DELTA, H_OUT, row, offs, ok, stride_h, stride_d, HAS_DELTA: tl.constexpr,
                  ROUND_BF16: tl.constexpr):
    """The row's residual at `offs`: h, or with HAS_DELTA h + delta rounded to the residual's dtype (as the
    unfused add)."""
    h = tl.load(H + row * stride_h + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + row * stride_d + offs, mask=ok, other=0.0)
        s = h.to(tl.float32) + d.to(tl.float32)
        if ROUND_BF16:
            s = _round_to_bf16_grid(s)
        h = s.to(H_OUT.dtype.element_ty)
    return h


@triton.jit
def _residual_rms_norm_kernel(
    H, DELTA, W, H_OUT, X_OUT, TAP, Q, Q_SCALE,
    n_cols, eps, tap_eps, tap_col0,
    stride_h, stride_d, stride_ho, stride_xo, stride_tap, stride_q, stride_qsm, stride_qsk,
    HAS_DELTA: tl.constexpr, HAS_TAP: tl.constexpr, BLOCK: tl.constexpr,
    SLICE: tl.constexpr,  # 0: one program per row; else program (row, j) writes columns [j*SLICE, +SLICE)
    QUANTIZE: tl.constexpr,  # also x_out's e4m3 codes and 1x128 scales (BLOCK >= 128)
    HW_ROUND: tl.constexpr,  # compiled only: the cast rounds to e4m3 (see fp8_gemm._quantize_tile)
    ROUND_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast does not round to nearest
    USE_PDL: tl.constexpr,  # kernels/pdl.py
):
    pdl_wait_then_release(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < n_cols
    h = _residual_sum(H, DELTA, H_OUT, row, offs, ok, stride_h, stride_d, HAS_DELTA, ROUND_BF16)
    hf = h.to(tl.float32)
    mean_sq = tl.sum(hf * hf, axis=0) / n_cols
    if SLICE > 0:
        # Every program of the row computes the same statistics (same loads, same reduction: same
        # bits), then only its slice: at decode one program quantising a whole 2880-wide row took
        # 3.55 us a call against 1.98 unquantised (H200, diag_decode_b1.md); sliced over 23
        # programs it takes 2.27.
        offs = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
        ok = offs < n_cols
        h = _residual_sum(H, DELTA, H_OUT, row, offs, ok, stride_h, stride_d, HAS_DELTA, ROUND_BF16)
        hf = h.to(tl.float32)
    if HAS_DELTA:
        tl.store(H_OUT + row * stride_ho + offs, h, mask=ok)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    x = w * (hf * tl.math.rsqrt(mean_sq + eps))
    if ROUND_BF16:
        x = _round_to_bf16_grid(x)
    x = x.to(X_OUT.dtype.element_ty)
    tl.store(X_OUT + row * stride_xo + offs, x, mask=ok)
    if QUANTIZE:
        # the stored (rounded) values, zeros past n_cols: the quantiser's view of x_out
        COLS: tl.constexpr = SLICE if SLICE > 0 else BLOCK
        q, scale = _quantize_tile(tl.reshape(x.to(tl.float32), (COLS // 128, 128)), HW_ROUND)
        tl.store(Q + row * stride_q + offs, tl.reshape(q, (COLS,)), mask=ok)
        if SLICE > 0:
            groups = tl.program_id(1) * (SLICE // 128) + tl.arange(0, COLS // 128)
        else:
            groups = tl.arange(0, COLS // 128)
        tl.store(Q_SCALE + row * stride_qsm + groups * stride_qsk, scale, mask=groups * 128 < n_cols)
    if HAS_TAP:
        tap = hf * tl.math.rsqrt(mean_sq + tap_eps)
        if ROUND_BF16:
            tap = _round_to_bf16_grid(tap)
        tl.store(TAP + row * stride_tap + tap_col0 + offs, tap.to(TAP.dtype.element_ty), mask=ok)


def _check(h, delta, weight, tap):
    if h.dim() != 2:
        raise ValueError(f"residual_rms_norm: h must be [T, C], got {tuple(h.shape)}")
    if delta is not None and delta.shape != h.shape:
        raise ValueError(f"residual_rms_norm: delta must be {tuple(h.shape)}, got {tuple(delta.shape)}")
    if weight.shape != (h.shape[1],):
        raise ValueError(f"residual_rms_norm: weight must be [{h.shape[1]}], got {tuple(weight.shape)}")
    if tap is not None:
        features, col0, _ = tap
        if features.dim() != 2 or features.shape[0] < h.shape[0] or not 0 <= col0 <= features.shape[1] - h.shape[1]:
            raise ValueError(f"residual_rms_norm: h {tuple(h.shape)} does not fit the tap buffer "
                             f"{tuple(features.shape)} at column {col0}")


SLICED_MAX_ROWS = 16  # quantising norms of at most this many rows: one program per (row, 128 columns)


def _quant_buffers(t: int, c: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [T, C] and fp32 scales [T, ceil(C/128)] stored MN-major, as
    `fp8_gemm.quantize_activation_group128` lays them out."""
    codes = torch.empty((t, c), dtype=torch.float8_e4m3fn, device=device)
    return codes, torch.empty((triton.cdiv(c, GROUP), t), dtype=torch.float32, device=device).t()


def residual_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      tap: tuple[torch.Tensor, int, float] | None = None, quantize: bool = False):
    """(h + delta rounded to h's dtype, rms_norm of it with `weight`), both [T, C] in h's dtype.

    `delta` None: no add (the first layer); the first result is `h` itself. `tap` = (features,
    column, tap_eps): also features[:T, column:column+C] = h_sum * rsqrt(mean(h_sum^2) + tap_eps)
    in features' dtype. `quantize`: a third result, (e4m3 codes [T, C], fp32 scales
    [T, ceil(C/128)]) of the returned norm, bit-equal to `quantize_activation_group128(x_out)`
    (the `x_quant` of `fp8_linear`). No host reads: graph-safe."""
    _check(h, delta, weight, tap)
    t, c = h.shape
    h_out = torch.empty_like(h) if delta is not None else h
    x_out = torch.empty_like(h)
    quant = _quant_buffers(t, c, h.device) if quantize else None
    if t == 0:
        return (h_out, x_out, quant) if quantize else (h_out, x_out)
    for name, x in (("h", h), ("delta", delta), ("features", tap[0] if tap else None)):
        if x is not None and x.stride(-1) != 1:
            raise ValueError(f"residual_rms_norm: {name} needs a unit last stride")
    features, col0, tap_eps = tap if tap is not None else (x_out, 0, 0.0)
    block = triton.next_power_of_2(c)
    if quantize:
        block = max(block, GROUP)  # whole 128-column groups
    codes, scales = quant if quantize else (x_out, x_out)
    # Decode batches split each row's quantisation over one program per 128-column group; prefill
    # rows keep one program each (there are enough rows, and each program re-reads its whole row).
    slice_cols = GROUP if quantize and t <= SLICED_MAX_ROWS and block > GROUP else 0
    grid = (t, triton.cdiv(c, slice_cols) if slice_cols else 1)
    _residual_rms_norm_kernel[grid](
        h, delta if delta is not None else h, weight, h_out, x_out, features, codes, scales,
        c, float(eps), float(tap_eps), col0,
        h.stride(0), delta.stride(0) if delta is not None else 0, h_out.stride(0), x_out.stride(0),
        features.stride(0), codes.stride(0), scales.stride(0), scales.stride(1),
        HAS_DELTA=delta is not None, HAS_TAP=tap is not None, BLOCK=block, SLICE=slice_cols,
        QUANTIZE=quantize, HW_ROUND=not interpreted(),
        ROUND_BF16=interpreted() and torch.bfloat16 in (h.dtype, features.dtype),
        num_warps=8 if block >= 4096 else 4, **pdl_launch_kwargs(h.device, t),
    )
    return (h_out, x_out, quant) if quantize else (h_out, x_out)


def residual_rms_norm_ref(h, delta, weight, eps, tap=None, quantize=False):
    """Plain torch, the unfused ops: `h + delta`, then the norm in fp32 (and the tap, and with
    `quantize` the torch quantiser's codes and scales of the rounded norm)."""
    _check(h, delta, weight, tap)
    s = h + delta if delta is not None else h
    sf = s.float()
    mean_sq = sf.pow(2).mean(dim=-1, keepdim=True)
    x = (weight.float() * (sf * torch.rsqrt(mean_sq + eps))).to(h.dtype)
    if tap is not None:
        features, col0, tap_eps = tap
        features[: h.shape[0], col0 : col0 + h.shape[1]] = (sf * torch.rsqrt(mean_sq + tap_eps)).to(features.dtype)
    if quantize:
        return s, x, quantize_activation_group128_ref(x)
    return s, x
