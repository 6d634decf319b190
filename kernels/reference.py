"""The plain-torch maths the kernels reproduce, shared with the SGLang-free torch layers,
which import it from here: kernels/ depends on nothing above it.

FP8 e4m3 with 128x128 block scales (weights) and 1x128 group scales (activations). Conventions (SPEC §2;
the `quantization_config` {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]} of DeepSeek-style
checkpoints):
  - a weight [N, K] is stored as e4m3 values plus `weight_scale_inv` fp32
    [ceil(N/128), ceil(K/128)]: w ≈ w_fp8 * scale_inv of its block;
  - 2880 = 22.5 x 128: blocks cover a ragged edge with a *ragged last block* (64 wide),
    not padding. The stored tensor keeps its true shape, so checkpoints and shards need
    no padded copies; the GEMM masks the edge (Triton) or the torch path slices it.
    Padding would add 2.2% bytes to every 2880-wide weight for no accuracy gain (the
    ragged block has its own scale either way);
  - activations are quantised per token in groups of 128 along K (same ragged edge),
    scale = amax / 448 per group.
The torch path computes exactly what an FP8 GEMM with fp32 accumulation computes: the
products of dequantised e4m3 operands summed in fp32, then the bias, one rounding.

gpt-oss routing and activation (SPEC §1): router Linear with bias, top-k logits, softmax over
those k only, in the model dtype (bf16 for the real model); mlp1's interleaved gate/linear rows
(even rows gate, odd rows linear) through
`glu = clamp(g, max=limit); lin = clamp(l, -limit, limit); glu * sigmoid(alpha * glu) * (lin + 1)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
BLOCK = 128


def _div_448(amax: torch.Tensor) -> torch.Tensor:
    # A tensor divisor, not a Python number: on CUDA torch turns division by a host scalar into
    # multiplication by its rounded reciprocal, which differs from amax / 448 in the last bit for
    # some amax, so the GPU reference would disagree with the kernels' IEEE division (and the CPU).
    return amax / torch.full_like(amax, E4M3_MAX)


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def quantize_weight_block128(w: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], scale_inv fp32 [..., ceil(N/128), ceil(K/128)]).

    `pow2_scales` rounds each block's scale up to a power of two: then values that are
    already a few mantissa bits times a power of two (MXFP4's) survive bit-exactly when the
    block's exponent spread fits e4m3; amax/448 scales use the range fully but round them."""
    *lead, n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    wf = w.float()
    padded = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = wf
    tiles = padded.unflatten(-2, (nb, BLOCK)).unflatten(-1, (kb, BLOCK))  # [..., nb, 128, kb, 128]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale_inv = torch.where(amax > 0, _div_448(amax), torch.ones_like(amax))
    if pow2_scales:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    # In place on the padded copy (its own storage): a stack of experts needs one fp32 copy of scratch, not three.
    q = tiles.div_(scale_inv[..., :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = q.flatten(-4, -3).flatten(-2, -1)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), scale_inv


def dequantize_weight_block128(q: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    *lead, n, k = q.shape
    expand = scale_inv.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (q.float() * expand).to(dtype)


def quantize_activation_group128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], scale fp32 [T, ceil(K/128)]), one scale per token per 128 columns."""
    t, k = x.shape
    kb = _blocks(k)
    padded = torch.zeros(t, kb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(t, kb, BLOCK)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, _div_448(amax), torch.ones_like(amax))
    q = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(t, kb * BLOCK)[:, :k]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_activation_group128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :k]


def fp8_linear_torch(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None, quantize_activations: bool = True) -> torch.Tensor:
    """y = x W^T + b with W in e4m3 block-128; x quantised per 1x128 group unless told not to."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xf = dequantize_activation_group128(*quantize_activation_group128(x2)) if quantize_activations else x2.float()
    y = xf @ dequantize_weight_block128(w_fp8, w_scale_inv).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, -1)


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
