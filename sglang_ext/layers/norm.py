"""RMSNorm as gpt-oss computes it: statistics in fp32, weight applied in fp32, one rounding."""

from __future__ import annotations

import torch

from sglang_ext.kernel_select import compiled_on_cuda, use_triton
from sglang_ext.layers.fp8 import quantize_activation_group128
from sglang_ext.probe.model import rms_normalize


@compiled_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        xf = weight.float() * xf
    return xf.to(x.dtype)


def residual_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      tap: tuple[torch.Tensor, int, float] | None = None, quantize: bool = False):
    """(s, rms_norm(s, weight)) for the residual sum s = h + delta (delta None: s = h).

    `tap` = (features, column, tap_eps): also writes the probe's weight-less normalisation of s,
    s * rsqrt(mean(s^2) + tap_eps), into features[:T, column:column + C]. `quantize`: a third
    result, the norm's FP8 form (e4m3 codes, fp32 1x128 scales) exactly as
    `quantize_activation_group128` gives it, for `fp8_linear(x_quant=...)`. On the kernel path one
    launch does all of it (`sglang_ext.kernels.residual_norm`); elsewhere the unfused ops."""
    if use_triton(h.device):
        # @triton.jit reads TRITON_INTERPRET at import
        from sglang_ext.kernels.residual_norm import residual_rms_norm as fused

        return fused(h, delta, weight, eps, tap, quantize=quantize)
    s = h + delta if delta is not None else h
    if tap is not None:
        features, col0, tap_eps = tap
        features[: s.shape[0], col0 : col0 + s.shape[1]] = rms_normalize(s, tap_eps).to(features.dtype)
    x = rms_norm(s, weight, eps)
    if quantize:
        return s, x, quantize_activation_group128(x)
    return s, x
