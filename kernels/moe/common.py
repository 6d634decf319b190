"""What every MoE size regime shares: the device helpers that quantise to e4m3, apply gpt-oss's
activation and round to bf16, and the host's arithmetic and expert-weight checks.

Invariant: one definition of each rounding step, so the one-shot, GEMV and grouped paths quantise
x and h, apply the activation and round to bf16 with the same bits (and `quantize_activation_group128`'s,
which `moe_ref` uses). Triton resolves a @triton.jit callee through the calling kernel's module
globals, so every kernel module imports the helpers it calls from here by name.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from sglang_ext.kernels.reference import BLOCK as QUANT_GROUP


FP8 = torch.float8_e4m3fn


# ---------------------------------------------------------------------------------------------
# device helpers (every regime's kernels)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _quantize_e4m3(v, AXIS: tl.constexpr):
    """fp32 v in groups along AXIS -> (e4m3 values, fp32 scale per group), as fp8.py's
    quantize_*: scale = amax / 448 (IEEE division; 1 for an all-zero group), q = v / scale
    clamped to +-448, rounded to nearest e4m3, ties to even.

    The rounding is done here in fp32 and the cast after it is exact, because Triton's
    interpreter cast drops the carry when rounding crosses a power of two (31.7 -> 16): one
    code path, equal to torch's `.to(float8_e4m3fn)` on CPU and GPU. Normals keep 3 of fp32's
    23 mantissa bits; below 2^-6 e4m3 steps by 2^-9, fp32's ulp in [2^14, 2^15).
    (One helper, not three: each nested jit call costs the interpreter ~6 ms.)"""
    amax = tl.max(tl.abs(v), axis=AXIS)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = tl.math.div_rn(v, tl.expand_dims(scale, AXIS))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    bits = q.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (q + 24576.0) - 24576.0
    q = tl.where(tl.abs(q) < 0.015625, subnormal, normal)
    # a negative value that rounds to zero stays -0.0 (its own e4m3 code, as torch casts it)
    q = (q.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _gpt_oss_activation(acc_g, acc_l, limit, alpha):
    """gpt-oss's clamped SwiGLU on mlp1's fp32 gate / linear sums (every mlp1 kernel's epilogue):
    gate clamped above at `limit`, linear to +-limit, gate * sigmoid(alpha * gate) * (linear + 1)."""
    gate = tl.minimum(acc_g, limit)
    lin = tl.minimum(tl.maximum(acc_l, -limit), limit)
    return gate * tl.sigmoid(gate * alpha) * (lin + 1.0)


@triton.jit
def _round_to_bf16(v):
    """fp32 v rounded to the nearest bf16 value (ties to even), still fp32: the cast after it is
    exact. The interpreter's fp32 -> bf16 cast truncates; this keeps one code path (on a GPU
    the cast rounds the same way by itself). NaN passes through."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return tl.where(v == v, rounded, v)


# ---------------------------------------------------------------------------------------------
# host helpers
# ---------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _experts_pad(num_experts: int) -> int:
    """Expert-axis tile width: a power of two, at least 32, so expert counts of 1..32 (EP
    shards, the tests' 8) share the 32-expert model's compiled kernels."""
    return max(32, _next_pow2(num_experts))


def _check_x(name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name}: x must be [T, H] with a unit last stride, got {tuple(x.shape)}")


def _check_routing(name: str, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{name}: topk_weights and topk_ids must both be [T, k]")


def _out_buffer(name: str, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` checked against x, or a new one like x."""
    if out is None:
        return torch.empty_like(x)
    if out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be {tuple(x.shape)} with a unit last stride")
    return out


def _check_weights(hidden, w1, w1_scale_inv, b1, w2, w2_scale_inv, b2):
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe_fp8: w1/w2 must be [E, out, in], got {tuple(w1.shape)}/{tuple(w2.shape)}")
    num_local, two_inter, h1 = w1.shape
    inter = two_inter // 2
    if two_inter % 2 or h1 != hidden:
        raise ValueError(f"fused_moe_fp8: w1 must be [E, 2I, {hidden}], got {tuple(w1.shape)}")
    if tuple(w2.shape) != (num_local, hidden, inter):
        raise ValueError(f"fused_moe_fp8: w2 must be [{num_local}, {hidden}, {inter}], got {tuple(w2.shape)}")
    if w1.dtype != FP8 or w2.dtype != FP8:
        raise ValueError(f"fused_moe_fp8: expert weights must be float8_e4m3fn, got {w1.dtype}/{w2.dtype}")
    want1 = (num_local, _cdiv(two_inter, QUANT_GROUP), _cdiv(hidden, QUANT_GROUP))
    want2 = (num_local, _cdiv(hidden, QUANT_GROUP), _cdiv(inter, QUANT_GROUP))
    for name, s, want in (("w1_scale_inv", w1_scale_inv, want1), ("w2_scale_inv", w2_scale_inv, want2)):
        if tuple(s.shape) != want or s.dtype != torch.float32:
            raise ValueError(f"fused_moe_fp8: {name} must be fp32 {list(want)}, got {s.dtype} {tuple(s.shape)}")
    if b1 is not None and tuple(b1.shape) != (num_local, two_inter):
        raise ValueError(f"fused_moe_fp8: b1 must be [{num_local}, {two_inter}], got {tuple(b1.shape)}")
    if b2 is not None and tuple(b2.shape) != (num_local, hidden):
        raise ValueError(f"fused_moe_fp8: b2 must be [{num_local}, {hidden}], got {tuple(b2.shape)}")
    for name, t in (("w1", w1), ("w2", w2), ("w1_scale_inv", w1_scale_inv), ("w2_scale_inv", w2_scale_inv),
                    ("b1", b1), ("b2", b2)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"fused_moe_fp8: {name} needs a unit last stride")
    return num_local, inter
