"""gpt-oss mixture of experts, torch path (SGLang-free).

Routing and the activation (`route`, `swiglu_oai`: SPEC §1) live with the kernels that reproduce them
(`sglang_ext.kernels.reference`); the router's softmax runs in the model dtype (bf16 for the real model:
the seed found it critical). Experts: mlp1 with bias, interleaved gate/up, the activation, mlp2 with bias,
weighted sum over the k experts.

Weights are stored as checkpoints' `[E, out, in]` after loading (`gate_up_proj`:
[E, 2I, H], `down_proj`: [E, H, I]), so each expert is one `F.linear`. With tensor
parallelism each rank holds a slice of I; the caller all-reduces and mlp2's bias is
added once, by `add_down_bias`, never on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_ext.kernel_select import use_triton
from sglang_ext.kernels.reference import (  # noqa: F401  (re-exported: the layer's maths)
    SWIGLU_ALPHA,
    dequantize_activation_group128,
    dequantize_weight_block128,
    quantize_activation_group128,
    route,
    swiglu_oai,
)

# Up to this many (token, expert) pairs the experts run as one batched matmul over
# gathered weights (decode); above it, one matmul per expert over its tokens (prefill).
GATHER_MAX_PAIRS = 32


def experts_torch(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_bias: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_bias: torch.Tensor | None,
    limit: float,
    expert_offset: int = 0,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """Sum over the k chosen experts of weight * expert(x); the sum runs in fp32, one rounding.

    `quantize_activations` rounds x and mlp2's input through e4m3 1x128 groups, as the FP8
    experts' Triton kernel does (w8a8), so the CPU path of an FP8 model computes its maths.

    `expert_offset` and the expert count of the weights select this rank's experts
    under expert parallelism; other experts contribute nothing here.
    `down_proj_bias=None` leaves mlp2's bias for the caller (tensor parallelism).
    """
    num_tokens, top_k = topk_ids.shape
    num_local = gate_up_proj.shape[0]
    if quantize_activations:
        x = _fake_quant_fp8(x)
    act = (lambda h: _fake_quant_fp8(swiglu_oai(h, limit))) if quantize_activations else (lambda h: swiglu_oai(h, limit))
    local_ids = topk_ids.reshape(-1) - expert_offset
    on_this_rank = (local_ids >= 0) & (local_ids < num_local)
    weights = topk_weights.reshape(-1).float() * on_this_rank
    pair_out = torch.empty(num_tokens * top_k, x.shape[-1], dtype=torch.float32, device=x.device)
    token_of_pair = torch.arange(num_tokens * top_k, device=x.device) // top_k
    if num_tokens * top_k <= GATHER_MAX_PAIRS:
        ids = local_ids.clamp(0, num_local - 1)
        xs = x[token_of_pair].unsqueeze(1)
        h = torch.baddbmm(gate_up_proj_bias[ids].unsqueeze(1), xs, gate_up_proj[ids].transpose(1, 2))
        h = act(h)
        if down_proj_bias is not None:
            y = torch.baddbmm(down_proj_bias[ids].unsqueeze(1), h, down_proj[ids].transpose(1, 2))
        else:
            y = torch.bmm(h, down_proj[ids].transpose(1, 2))
        pair_out = y.squeeze(1).float()
    else:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "sglang-ext: the torch MoE (bf16 experts, or SGLANG_EXT_KERNELS=torch) reads expert counts on the host "
                "and cannot be captured in a CUDA graph above 32 (token, expert) pairs: leave the decode CUDA-graph "
                "sizes at their default (batch 8 at most for a bf16 checkpoint) or launch a bf16 checkpoint with "
                "--quantization fp8 (FP8 block-128 at load: the graph-safe Triton MoE)")
        pair_out.zero_()
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids.clamp(-1, num_local) + 1, minlength=num_local + 2).tolist()
        start = counts[0]  # pairs whose expert lives on a lower rank
        for expert in range(num_local):
            n = counts[expert + 1]
            if n == 0:
                continue
            pairs = order[start : start + n]
            start += n
            h = F.linear(x[token_of_pair[pairs]], gate_up_proj[expert], gate_up_proj_bias[expert])
            h = act(h)
            bias = down_proj_bias[expert] if down_proj_bias is not None else None
            pair_out[pairs] = F.linear(h, down_proj[expert], bias).float()
    out = (pair_out * weights[:, None]).view(num_tokens, top_k, -1).sum(dim=1)
    return out.to(x.dtype)


def _fake_quant_fp8(a: torch.Tensor) -> torch.Tensor:
    shape = a.shape
    if a.numel() == 0:  # a tensor-parallel rank with no channels of I
        return a
    flat = a.reshape(-1, shape[-1])
    return dequantize_activation_group128(*quantize_activation_group128(flat)).to(a.dtype).reshape(shape)


def add_down_bias(out: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  down_proj_bias: torch.Tensor) -> torch.Tensor:
    """mlp2's bias, weighted by routing, for the tensor-parallel path (added once after the all-reduce)."""
    bias = (down_proj_bias[topk_ids].float() * topk_weights.float()[..., None]).sum(dim=1)
    return (out.float() + bias).to(out.dtype)


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor,
    w1: torch.Tensor,
    w1_scale_inv: torch.Tensor | None,
    b1: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor | None,
    b2: torch.Tensor,
    top_k: int,
    limit: float,
    expert_offset: int = 0,
    with_down_bias: bool = True,
    return_routing: bool = False,
):
    """The gpt-oss MoE block for this rank's experts: route over all experts, run the local ones.

    w1 [E_local, 2I, H], w2 [E_local, H, I]; e4m3 with block-128 `*_scale_inv` or plain
    floats (scale_inv None). `with_down_bias=False` leaves mlp2's bias to another rank
    (tensor-parallel slices of one expert add it once). FP8 experts run the Triton MoE
    where `sglang_ext.kernel_select.use_triton` says so, else the torch path on weights
    dequantised per call (callers that loop should cache, as the model does).
    `return_routing` also returns (topk_weights, topk_ids), the routing the experts ran with
    (tensor parallelism adds mlp2's bias with it after the all-reduce: no second routing).
    """
    fp8 = w1.dtype == torch.float8_e4m3fn
    if fp8 and use_triton(x.device):
        # imported here: @triton.jit reads TRITON_INTERPRET when the kernel module is first imported, which
        # must not happen before a CPU run sets it
        from sglang_ext.kernels.moe import fused_moe_fp8

        # Routing inside: for decode batches (T <= 16) one launch does the router GEMV, top-k, softmax,
        # pair sort and activation quantisation (kernels/moe/routing.py, _decode_front_kernel).
        return fused_moe_fp8(x, router_weight, router_bias, w1, w1_scale_inv, b1, w2, w2_scale_inv,
                             b2 if with_down_bias else None, top_k=top_k, limit=limit, expert_offset=expert_offset,
                             return_routing=return_routing)
    weights, ids = route(x, router_weight, router_bias, top_k)
    if fp8:
        w1 = dequantize_weight_block128(w1, w1_scale_inv, x.dtype)
        w2 = dequantize_weight_block128(w2, w2_scale_inv, x.dtype)
    out = experts_torch(x, weights, ids, w1, b1, w2, b2 if with_down_bias else None, limit, expert_offset,
                        quantize_activations=fp8)
    return (out, weights, ids) if return_routing else out
