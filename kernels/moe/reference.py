"""`moe_ref`: the fused MoE in plain torch, the oracle of every regime's kernels (tests, benchmarks).

Invariant: the kernels' operands exactly (weights dequantised per 128x128 block, x and h through
e4m3 1x128 groups, fp32 GEMMs, bias, `swiglu_oai`, fp32 combine, one rounding to x's dtype), so a
kernel may differ from it only by fp32 summation order (and, with `pair_out_bf16`, by each pair's
bf16 rounding, which it reproduces). The maths comes from kernels/reference.py, never from
sglang_ext.layers.
"""

from __future__ import annotations

import torch

from sglang_ext.kernels.reference import (
    dequantize_activation_group128,
    dequantize_weight_block128,
    quantize_activation_group128,
    route,
    swiglu_oai,
)


def _fake_quant(a: torch.Tensor) -> torch.Tensor:
    """a [N, K] through e4m3 1x128 groups and back, fp32 (what the kernel's dots see)."""
    return dequantize_activation_group128(*quantize_activation_group128(a))


def moe_ref(
    x: torch.Tensor,
    router_weight: torch.Tensor | None,
    router_bias: torch.Tensor | None,
    w1: torch.Tensor,
    w1_scale_inv: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    b2: torch.Tensor | None,
    top_k: int = 4,
    limit: float = 7.0,
    expert_offset: int = 0,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    quantize_activations: bool = True,
    pair_out_bf16: bool = False,
) -> torch.Tensor:
    """`fused_moe_fp8` in plain torch: routing by `route` (or `routing` = (weights, ids) given),
    weights dequantised per block, x and h quantised per 1x128 group (`quantize_activations`),
    fp32 GEMMs, bias, `swiglu_oai` in fp32, fp32 combine (of each pair's output rounded to bf16 first
    with `pair_out_bf16`, as MoeConfig.pair_out_bf16), one rounding to x's dtype. One expert
    at a time (dequantised weights of all experts at full size would not fit)."""
    if routing is None:
        routing = route(x, router_weight, router_bias, top_k)
    topk_weights, topk_ids = routing
    num_tokens, top_k = topk_ids.shape
    num_local = w1.shape[0]
    xf = _fake_quant(x.float()) if quantize_activations else x.float()
    local_ids = topk_ids.reshape(-1).long() - expert_offset
    pair_out = torch.zeros(num_tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    on_this_rank = (local_ids >= 0) & (local_ids < num_local)
    for expert in torch.unique(local_ids[on_this_rank]).tolist():
        pairs = torch.nonzero(local_ids == expert).flatten()
        h = xf[pairs // top_k] @ dequantize_weight_block128(w1[expert], w1_scale_inv[expert]).t()
        if b1 is not None:
            h = h + b1[expert].float()
        h = swiglu_oai(h, limit)
        if quantize_activations:
            h = _fake_quant(h)
        y = h @ dequantize_weight_block128(w2[expert], w2_scale_inv[expert]).t()
        if b2 is not None:
            y = y + b2[expert].float()
        pair_out[pairs] = y.to(torch.bfloat16).float() if pair_out_bf16 else y
    weights = topk_weights.reshape(-1).float() * on_this_rank
    return (pair_out * weights[:, None]).view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
