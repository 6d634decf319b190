"""Dense layers with the bias applied inside the GEMM op (SGLang-free).

The torch path is one `F.linear(x, W, b)`: the bias is part of the same op, not a
second pass over the output. With `fp8=True` the weight is e4m3 with 128x128 block
scales (`weight_scale_inv`, the checkpoint key), activations are quantised per 1x128
group and the bias is added to the fp32 accumulator before the one rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_ext.kernel_select import use_triton
from sglang_ext.layers.fp8 import BLOCK, fp8_linear_torch


class Linear(nn.Module):
    """y = x W^T + b with W [out, in]; parameter names `weight`/`bias` equal checkpoint keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None, fp8: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.fp8 = fp8
        weight_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype), requires_grad=False)
        if fp8:
            blocks = ((out_features + BLOCK - 1) // BLOCK, (in_features + BLOCK - 1) // BLOCK)
            self.weight_scale_inv = nn.Parameter(torch.empty(blocks, dtype=torch.float32), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        bias = self.bias if with_bias else None
        if self.fp8:
            if use_triton(x.device):
                from sglang_ext.kernels.fp8_gemm import fp8_linear

                return fp8_linear(x, self.weight, self.weight_scale_inv, bias)
            return fp8_linear_torch(x, self.weight, self.weight_scale_inv, bias)
        return F.linear(x, self.weight, bias)
