"""Sink attention, every regime (extend, prefill, decode): what the regimes share. The key loop over a run of
paged keys (extend's tiles, the decode split loop without prefetch), the extend / prefill tile numbering, the
16-bit dot choice and the launchers' shape and scale checks.

Invariant: one softmax step for every regime that loops over keys: raw scores, the scale joined to the
exponent's subtraction (so the scale must be > 0, `_check_scale`), fp32 state, log2 units (LOG2E)."""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from sglang_ext.kernels._util import interpreted


LOG2E = 1.4426950408889634  # the kernels work in log2 units: exp2 is one instruction
MAX_SPLITS = 256


@triton.jit
def _attend_key_range(
    acc, m_i, l_i,  # running output [BLOCK_M, D], max [BLOCK_M] (log2 units), denominator [BLOCK_M]
    q,  # [BLOCK_M, D]
    K, V, tok_base, SLOT_MAP,
    stride_kn, stride_vn, kv_head_off_k, kv_head_off_v,
    row_pos,  # [BLOCK_M] absolute position of each query row
    key_lo, key_hi,  # keys [key_lo, key_hi) of this run
    window_left, qk_scale_log2,
    D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,  # False only when every key of every block is visible to every row
    HAS_SLOT_MAP: tl.constexpr, DOTS_16BIT: tl.constexpr, PV_HI_LO: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in range(key_lo, key_hi, BLOCK_N):
        key_pos = start + offs_n
        if MASK:
            key_ok = key_pos < key_hi
            slot = tl.load(tok_base + key_pos, mask=key_ok, other=0).to(tl.int64)
        else:
            slot = tl.load(tok_base + key_pos).to(tl.int64)
        if HAS_SLOT_MAP:
            # Unmapped ids (-1) only occur for keys no row may see; keep them in bounds anyway.
            slot = tl.maximum(tl.load(SLOT_MAP + slot).to(tl.int64), 0)
        k_ptr = K + slot[:, None] * stride_kn + kv_head_off_k + offs_d[None, :]
        v_ptr = V + slot[:, None] * stride_vn + kv_head_off_v + offs_d[None, :]
        if MASK:
            k = tl.load(k_ptr, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_ptr, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptr)
            v = tl.load(v_ptr)
        # Raw scores: the scale (> 0, so it commutes with the max) joins the exponent's subtraction in one
        # FMA, and P.V accumulates into the rescaled accumulator, no separate add: fewer instructions per
        # score at D 64 (ncu has this loop latency-bound at two programs an SM, so it measured within noise).
        if DOTS_16BIT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        if MASK:
            visible = key_ok[None, :] & (key_pos[None, :] <= row_pos[:, None])
            visible = visible & ((window_left < 0) | (key_pos[None, :] >= row_pos[:, None] - window_left))
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if DOTS_16BIT:
            p_hi = p.to(v.dtype)
            acc = tl.dot(p_hi, v, acc)
            if PV_HI_LO:
                acc = tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v, acc)
        else:
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _extend_tile_request(TILE_END, num_reqs):
    """(tile, request) of this extend program: tiles are numbered highest first (with causal masking they
    carry the most keys, so the long programs start in the first wave instead of trailing the last one);
    the request is the number of requests whose tiles all come before the tile (num_reqs: past the last
    tile, the grid being an upper bound on the tile count)."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    req = 0
    offs_r = tl.arange(0, 128)
    for r0 in range(0, num_reqs, 128):
        ends = tl.load(TILE_END + r0 + offs_r, mask=r0 + offs_r < num_reqs, other=2147483647)
        req += tl.sum((ends <= tile).to(tl.int32), axis=0)
    return tile, req


def _use_16bit_dots(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Tensor-core dots when q and K/V share a 16-bit type. Not for bf16 under TRITON_INTERPRET: the
    interpreter's bf16 arithmetic is wrong (triton 3.8), so there bf16 is upcast at load; the same 16-bit
    code is covered by fp16 on CPU and by the gpu test on a GPU."""
    if q_dtype != kv_dtype or q_dtype not in (torch.float16, torch.bfloat16):
        return False
    return not (interpreted() and q_dtype == torch.bfloat16)


def _check_common(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sinks, slot_map):
    if q.dim() != 3:
        raise ValueError(f"sink_attention: q must be [T, Hq, D], got {tuple(q.shape)}")
    _, hq, d = q.shape
    if k_buffer.dim() != 3 or v_buffer.dim() != 3 or k_buffer.shape[2] != d or v_buffer.shape[2] != d:
        raise ValueError(f"sink_attention: k/v buffers must be [slots, Hkv, {d}], got "
                         f"{tuple(k_buffer.shape)}/{tuple(v_buffer.shape)}")
    hkv = k_buffer.shape[1]
    if v_buffer.shape[1] != hkv or hq % hkv:
        raise ValueError(f"sink_attention: {hq} q heads need a multiple of {hkv} kv heads")
    if d & (d - 1) or d < 16:
        raise ValueError(f"sink_attention: head_dim must be a power of two >= 16, got {d}")
    if req_to_token.dim() != 2 or req_to_token.stride(1) != 1:
        raise ValueError("sink_attention: req_to_token must be 2-D with a unit last stride")
    if req_pool_indices.dim() != 1 or seq_lens.shape != req_pool_indices.shape:
        raise ValueError("sink_attention: req_pool_indices and seq_lens must be [B]")
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sink_attention: sinks must be [{hq}], got {tuple(sinks.shape)}")
    if slot_map is not None and slot_map.dim() != 1:
        raise ValueError("sink_attention: slot_map must be 1-D")
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"sink_attention: {name} needs a unit last stride")
    return hq, hkv, d


def _check_scale(scale: float, who: str) -> None:
    # The kernels take the row max of unscaled scores, which is the max of the scaled ones only for scale > 0.
    if not float(scale) > 0:
        raise ValueError(f"{who}: the softmax scale must be > 0, got {scale}")
