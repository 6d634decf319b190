"""Dense layers with the bias applied inside the GEMM op (SGLang-free).

The torch path is one `F.linear(x, W, b)`: the bias is part of the same op, not a
second pass over the output. With `fp8=True` the weight is e4m3 with 128x128 block
scales (`weight_scale_inv`, the checkpoint key), activations are quantised per 1x128
group and the bias is added to the fp32 accumulator before the one rounding.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sglang_ext.kernel_select import use_triton
from sglang_ext.layers.fp8 import BLOCK, fp8_linear_torch
from sglang_ext.layers.fp8_backend import dense_fp8_linear


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

    def forward(self, x: torch.Tensor, with_bias: bool = True, x_quant=None) -> torch.Tensor:
        """`x_quant`: x's FP8 form from its producer (e4m3 codes, 1x128 scales), exactly what the
        FP8 path would compute from x: the kernel path reads it instead of quantising x; the
        torch path (and a bf16 layer) ignores it, so its numbers do not depend on it."""
        bias = self.bias if with_bias else None
        if self.fp8:
            if use_triton(x.device):
                return dense_fp8_linear(x, self.weight, self.weight_scale_inv, bias, x_quant=x_quant)
            return fp8_linear_torch(x, self.weight, self.weight_scale_inv, bias)
        return F.linear(x, self.weight, bias)


class FusedLinear:
    """Several `Linear`s that read the same input as one GEMM: y = x [W_0; W_1; ...]^T + [b_0; ...].

    Decode runs one weight-streaming kernel per projection with a fixed cost of several
    microseconds each (benchmarks/results/diag_decode_b1.md), so gpt-oss's q/k/v are one
    launch. The members keep their parameters (checkpoint keys, loading unchanged), but each
    parameter's storage becomes a view into the fused tensors: a later in-place load
    (`param.data.copy_`) updates the fused weight too. With FP8 every member starts on a
    128-row block (zero rows pad the previous member), so block scales stack row-wise.
    `is_current()` says whether the views still alias the fused storage (something that
    replaced a parameter's `.data` breaks them; the owner then fuses again)."""

    def __init__(self, members: Sequence[Linear]):
        first = members[0]
        if any(m.in_features != first.in_features or m.fp8 != first.fp8 for m in members):
            raise ValueError("FusedLinear: members must share in_features and the FP8 flag")
        if any((m.bias is None) != (first.bias is None) for m in members):
            raise ValueError("FusedLinear: members must all have a bias or all have none")
        self.fp8 = first.fp8
        align = BLOCK if self.fp8 else 1
        self.offsets, rows = [], 0
        for m in members:
            self.offsets.append(rows)
            rows += -(-m.out_features // align) * align
        w0 = first.weight
        self.weight = torch.zeros(rows, first.in_features, dtype=w0.dtype, device=w0.device)
        self.weight_scale_inv = None
        if self.fp8:
            s0 = first.weight_scale_inv
            self.weight_scale_inv = torch.ones(rows // BLOCK, s0.shape[1], dtype=s0.dtype, device=s0.device)
        self.bias = None
        if first.bias is not None:
            self.bias = torch.zeros(rows, dtype=first.bias.dtype, device=first.bias.device)
        self.members = list(members)
        for m, off in zip(self.members, self.offsets):
            n = m.out_features
            self.weight[off:off + n].copy_(m.weight.data)
            m.weight.data = self.weight[off:off + n]
            if self.fp8:
                blocks = m.weight_scale_inv.shape[0]
                self.weight_scale_inv[off // BLOCK:off // BLOCK + blocks].copy_(m.weight_scale_inv.data)
                m.weight_scale_inv.data = self.weight_scale_inv[off // BLOCK:off // BLOCK + blocks]
            if self.bias is not None:
                self.bias[off:off + n].copy_(m.bias.data)
                m.bias.data = self.bias[off:off + n]
        params = [p for m in self.members for p in (m.weight, getattr(m, "weight_scale_inv", None), m.bias)
                  if p is not None]
        self._aliases = [(p, p.data_ptr()) for p in params]

    def is_current(self) -> bool:
        return all(p.data_ptr() == ptr for p, ptr in self._aliases)

    def __call__(self, x: torch.Tensor, x_quant=None) -> list[torch.Tensor]:
        """Each member's output, as column views of one [..., rows] result (`x_quant` as in
        `Linear.forward`)."""
        if self.fp8:
            if use_triton(x.device):
                y = dense_fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, x_quant=x_quant)
            else:
                y = fp8_linear_torch(x, self.weight, self.weight_scale_inv, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return [y.narrow(-1, off, m.out_features) for m, off in zip(self.members, self.offsets)]
