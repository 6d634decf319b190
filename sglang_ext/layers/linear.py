"""Dense layers with the bias applied inside the GEMM op (SGLang-free).

The torch path is one `F.linear(x, W, b)`: the bias is part of the same op, not a
second pass over the output. The FP8 block-128 path (FP8 issue) keeps this interface.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b with W [out, in]; parameter names `weight`/`bias` equal checkpoint keys."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def forward(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if with_bias else None)
