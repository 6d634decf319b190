"""RMSNorm as gpt-oss computes it: statistics in fp32, weight applied in fp32, one rounding."""

from __future__ import annotations

import torch

from sglang_ext.kernel_select import compiled_on_cuda


@compiled_on_cuda
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        xf = weight.float() * xf
    return xf.to(x.dtype)
