"""RoPE on q and k and the KV-cache write, in one launch.

A decode step otherwise spends five launches per layer between the qkv GEMM and attention
(RoPE on q, RoPE on k, a contiguous copy of v, two indexed stores into the cache: 9.6 us of
a gpt-oss-120b batch-1 layer on the H200, benchmarks/results/diag_decode_b1.md); this kernel
reads q, k, v once from the GEMM output (any row stride), writes roped q for attention, and
roped k and v straight into their cache slots.

RoPE is gpt-oss's (the torch layer `apply_rope`, layers/rope.py): halves, not interleaved pairs;
cos_sin rows hold cos in the first half and sin in the second (fp32); maths in fp32 with one
explicit FMA per element (`rope_first_half` / `rope_second_half`, shared with the one-shot decode
attention, which can do this work in its own launch), one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interpreted
from .fp8_gemm import _round_to_bf16_grid
from .pdl import pdl_launch_kwargs, pdl_wait_then_release


@triton.jit
def rope_first_half(x1, x2, cos, sin):
    """x1 cos - x2 sin with one explicit FMA: every kernel that rotates (this one, the one-shot decode
    attention's RopeKV path) gets the same bits, whatever FMA contraction its compiler would pick."""
    return tl.fma(x1, cos, -(x2 * sin))


@triton.jit
def rope_second_half(x2, x1, cos, sin):
    """x2 cos + x1 sin, as rope_first_half."""
    return tl.fma(x2, cos, x1 * sin)


@triton.jit
def _rope_heads(SRC, DST, mask, cos, sin, HALF: tl.constexpr, ROUND_BF16: tl.constexpr):
    """DST = RoPE(SRC) for a [heads, 2 * HALF] tile of row pointers (first halves), fp32 maths,
    one rounding to DST's dtype."""
    x1 = tl.load(SRC, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(SRC + HALF, mask=mask, other=0.0).to(tl.float32)
    a = rope_first_half(x1, x2, cos[None, :], sin[None, :])
    b = rope_second_half(x2, x1, cos[None, :], sin[None, :])
    if ROUND_BF16:
        a, b = _round_to_bf16_grid(a), _round_to_bf16_grid(b)
    tl.store(DST, a.to(DST.dtype.element_ty), mask=mask)
    tl.store(DST + HALF, b.to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kv_kernel(
    Q, K, V, COS_SIN, LOC, Q_OUT, K_CACHE, V_CACHE, K_OUT,
    num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_ot, stride_oh, stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, stride_ko_t, stride_ko_h,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_K_OUT: tl.constexpr,  # roped k also into K_OUT [T, Hkv, D] (a prefill's attention reads it as rows)
    ROUND_BF16: tl.constexpr,  # interpreter only: its fp32 -> bf16 cast does not round to nearest
    USE_PDL: tl.constexpr = False,  # kernels/pdl.py: cos/sin (gathered at the step's start) before the wait
):
    """grid (tokens, cdiv(Hq, BLOCK_H) + cdiv(Hkv, BLOCK_H)): BLOCK_H heads of one token per
    program; the first programs rotate q heads, the rest rotate k heads and copy v heads."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(COS_SIN + t * stride_cs + offs_d)
    sin = tl.load(COS_SIN + t * stride_cs + HALF + offs_d)
    pdl_wait_then_release(USE_PDL)
    if hb < q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads < num_q_heads)[:, None]
        _rope_heads(Q + t * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    Q_OUT + t * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                    mask, cos, sin, HALF, ROUND_BF16)
    else:
        heads = (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads < num_kv_heads)[:, None]
        slot = tl.load(LOC + t).to(tl.int64)
        _rope_heads(K + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :],
                    K_CACHE + slot * stride_kc_s + heads[:, None] * stride_kc_h + offs_d[None, :],
                    mask, cos, sin, HALF, ROUND_BF16)
        if HAS_K_OUT:  # the same maths again (the same bits), stored as this forward's row
            _rope_heads(K + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :],
                        K_OUT + t * stride_ko_t + heads[:, None] * stride_ko_h + offs_d[None, :],
                        mask, cos, sin, HALF, ROUND_BF16)
        vsrc = V + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :]
        vdst = V_CACHE + slot * stride_vc_s + heads[:, None] * stride_vc_h + offs_d[None, :]
        tl.store(vdst, tl.load(vsrc, mask=mask, other=0.0).to(V_CACHE.dtype.element_ty), mask=mask)
        tl.store(vdst + HALF, tl.load(vsrc + HALF, mask=mask, other=0.0).to(V_CACHE.dtype.element_ty), mask=mask)


def check_rope_kv(q, k, v, cos_sin, k_cache, v_cache, loc, unit_last_stride: bool = False):
    """rope_store_kv's shape checks (also sink_attention_decode's, which can do this work in its launch);
    unit_last_stride: the kernels' layout rule too (the reference takes any strides)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"rope_kv: q, k, v must be [tokens, heads, head_dim], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    t, _, d = q.shape
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"rope_kv: k and v must be [{t}, Hkv, {d}] (even head_dim), got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if tuple(cos_sin.shape) != (t, d):
        raise ValueError(f"rope_kv: cos_sin must be [{t}, {d}], got {tuple(cos_sin.shape)}")
    if k_cache.dim() != 3 or k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"rope_kv: caches must be [slots, {k.shape[1]}, {d}], got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if tuple(loc.shape) != (t,):
        raise ValueError(f"rope_kv: loc must be [{t}], got {tuple(loc.shape)}")
    if unit_last_stride:
        for name, x in (("q", q), ("k", k), ("v", v), ("cos_sin", cos_sin), ("k_cache", k_cache),
                        ("v_cache", v_cache)):
            if x.stride(-1) != 1:
                raise ValueError(f"rope_kv: {name} must be contiguous in its last dim")


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                  q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None) -> torch.Tensor:
    """Roped q [T, Hq, D] (into `q_out` if given); roped k and v stored at k_cache[loc[t]],
    v_cache[loc[t]] ([slots, Hkv, D], their dtype), and roped k also into `k_out` [T, Hkv, D] if given
    (a prefill's attention then reads this forward's keys as rows, not through slot ids). q, k, v may be
    strided views (the last dim contiguous); cos_sin [T, D] fp32 rows of the RoPE cache. No host reads:
    graph-safe."""
    # an empty batch launches nothing, so its layout does not matter
    check_rope_kv(q, k, v, cos_sin, k_cache, v_cache, loc, unit_last_stride=q.shape[0] > 0)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if q_out is None:
        q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    if q_out.stride(-1) != 1:
        raise ValueError("rope_kv: q_out must be contiguous in its last dim")
    if k_out is not None and (k_out.shape != k.shape or k_out.stride(-1) != 1 or k_out.dtype != k_cache.dtype):
        raise ValueError(f"rope_kv: k_out must be {k_cache.dtype} {tuple(k.shape)}, contiguous in its last dim")
    block_h = 8
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h))
    _rope_kv_kernel[grid](
        q, k, v, cos_sin, loc, q_out, k_cache, v_cache, k_out if k_out is not None else k_cache, hq, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), *(k_out.stride()[:2] if k_out is not None else (0, 0)),
        HALF=d // 2, BLOCK_H=block_h, HAS_K_OUT=k_out is not None, num_warps=1 if d * block_h <= 1024 else 4,
        ROUND_BF16=interpreted() and torch.bfloat16 in (q_out.dtype, k_cache.dtype),
        **pdl_launch_kwargs(q.device, t),
    )
    return q_out


def _rope_ref(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half].float(), cos_sin[:, None, half:].float()
    xf = x.float()
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rope_store_kv_ref(q, k, v, cos_sin, k_cache, v_cache, loc, q_out=None, k_out=None):
    """Plain torch: the same contract (q_out returned; the caches and k_out written in place)."""
    check_rope_kv(q, k, v, cos_sin, k_cache, v_cache, loc)
    roped_q = _rope_ref(q, cos_sin).to(q.dtype)
    idx = loc.long()
    k_cache[idx] = _rope_ref(k, cos_sin).to(k_cache.dtype)
    if k_out is not None:
        k_out.copy_(k_cache[idx])
    v_cache[idx] = v.to(v_cache.dtype)
    if q_out is not None:
        q_out.copy_(roped_q)
        return q_out
    return roped_q
