"""FP8 block-128 in plain torch, every regime: the launchers' contracts (`fp8_gemm`, `fp8_linear`, the
activation quantiser) on the project's torch quantiser and dequantiser (kernels/reference.py). Invariant: the
same maths as the kernels (dequantised e4m3 operands, fp32 products and sums, the bias, one rounding)."""

from __future__ import annotations

from typing import Optional

import torch

from sglang_ext.kernels import reference as fp8_torch


def quantize_activation_group128_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_torch.quantize_activation_group128(x)


def fp8_gemm_ref(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                 bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise both operands, multiply in fp32, add the bias, round once."""
    y = fp8_torch.dequantize_activation_group128(a_fp8, a_scale) @ \
        fp8_torch.dequantize_weight_block128(w_fp8, w_scale_inv).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear_ref(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    y = fp8_torch.fp8_linear_torch(x.float(), w_fp8, w_scale_inv, bias)
    return y.to(out_dtype or x.dtype)
