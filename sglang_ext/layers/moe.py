"""gpt-oss mixture of experts, torch path (SGLang-free).

Routing (SPEC §1): router Linear with bias, top-k logits, softmax over those k only,
in the model dtype (bf16 for the real model: the seed found it critical). Experts:
mlp1 with bias, interleaved gate/up (even rows gate, odd rows linear),
`glu = clamp(g, max=limit); lin = clamp(l, -limit, limit); glu * sigmoid(alpha * glu) * (lin + 1)`,
mlp2 with bias, weighted sum over the k experts.

Weights are stored as checkpoints' `[E, out, in]` after loading (`gate_up_proj`:
[E, 2I, H], `down_proj`: [E, H, I]), so each expert is one `F.linear`. With tensor
parallelism each rank holds a slice of I; the caller all-reduces and mlp2's bias is
added once, by `add_down_bias`, never on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SWIGLU_ALPHA = 1.702


def route(
    x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (weights [T, k] in x.dtype, expert ids [T, k])."""
    logits = F.linear(x, router_weight, router_bias)
    top_values, top_ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top_values, dim=-1, dtype=top_values.dtype), top_ids


def swiglu_oai(gate_up: torch.Tensor, limit: float, alpha: float = SWIGLU_ALPHA) -> torch.Tensor:
    gate, lin = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    lin = lin.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (lin + 1)


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
) -> torch.Tensor:
    """Sum over the k chosen experts of weight * expert(x), in x.dtype.

    `expert_offset` and the expert count of the weights select this rank's experts
    under expert parallelism; other experts contribute nothing here.
    `down_proj_bias=None` leaves mlp2's bias for the caller (tensor parallelism).
    """
    num_tokens, top_k = topk_ids.shape
    num_local = gate_up_proj.shape[0]
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1) - expert_offset
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.clamp(min=-1) + 1, minlength=num_local + 2).tolist()
    # counts[0] counts ids below this rank's range; ids above it land past num_local.
    start = counts[0]
    for expert in range(num_local):
        n = counts[expert + 1]
        if n == 0:
            continue
        rows = order[start : start + n]
        start += n
        token_idx = rows // top_k
        h = F.linear(x[token_idx], gate_up_proj[expert], gate_up_proj_bias[expert])
        h = swiglu_oai(h, limit)
        bias = down_proj_bias[expert] if down_proj_bias is not None else None
        y = F.linear(h, down_proj[expert], bias)
        y = y * topk_weights.reshape(-1)[rows, None]
        out.index_add_(0, token_idx, y.to(x.dtype))
    return out


def add_down_bias(out: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  down_proj_bias: torch.Tensor) -> torch.Tensor:
    """mlp2's bias, weighted by routing, for the tensor-parallel path (added once after the all-reduce)."""
    bias = (down_proj_bias[topk_ids].float() * topk_weights.float()[..., None]).sum(dim=1)
    return (out.float() + bias).to(out.dtype)
