"""Sink attention, extend: query rows over the paged KV cache (a prefill after a cached prefix, any ragged
batch), one launch. The key loop for full layers (EXTEND_TILE); a sliding layer whose window fits one chunk of
WINDOW_ONESHOT_MAX_KEYS keys runs the one-shot window kernel (WINDOW_TILE), no key loop.

Invariant: no host read of tensor values (grids from shapes, tiles numbered on the device): CUDA-graph safe;
a key block outside the tile's causal window is never visited."""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from .common import LOG2E, _attend_key_range, _check_common, _check_scale, _extend_tile_request, _use_16bit_dots


@triton.jit
def _extend_tile_rows(
    Q, SINKS, REQ_TO_TOKEN, REQ_POOL_IDX, SEQ_LENS, Q_START, Q_LEN, TILE_END, tile, req, kv_head,
    stride_qt, stride_qh, stride_r2t,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_POS: tl.constexpr,
    HAS_SINKS: tl.constexpr, DOTS_16BIT: tl.constexpr,
):
    """An extend tile's query rows ((position, q head of the group) pairs), their q, and the softmax
    state before any key: the sink as the running max with weight 1, or an empty row."""
    BLOCK_M: tl.constexpr = BLOCK_POS * GROUP_PAD
    q_len = tl.load(Q_LEN + req).to(tl.int32)
    tile_in_req = tile - (tl.load(TILE_END + req).to(tl.int32) - tl.cdiv(q_len, BLOCK_POS))
    seq_len = tl.load(SEQ_LENS + req).to(tl.int32)
    q_start = tl.load(Q_START + req).to(tl.int64)
    req_row = tl.load(REQ_POOL_IDX + req).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    m_idx = tile_in_req * BLOCK_POS + rows // GROUP_PAD  # query index inside the request
    head_in_group = rows % GROUP_PAD
    row_ok = (m_idx < q_len) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    first_pos = seq_len - q_len
    row_pos = first_pos + m_idx
    offs_d = tl.arange(0, D)

    q_ptr = Q + (q_start + m_idx)[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
    if not DOTS_16BIT:
        q = q.to(tl.float32)

    if HAS_SINKS:
        m_i = tl.load(SINKS + q_head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # exp2(sink - m_i)
    else:
        # Finite start: a row whose keys are all masked in a block keeps alpha = exp2(0) and p = 0
        # instead of exp2(-inf - -inf) = NaN.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Positions p0..p1 of this tile.
    p0 = first_pos + tile_in_req * BLOCK_POS
    p1 = tl.minimum(p0 + BLOCK_POS - 1, seq_len - 1)
    tok_base = REQ_TO_TOKEN + req_row * stride_r2t
    return q, m_i, l_i, row_ok, row_pos, q_start + m_idx, q_head, p0, p1, tok_base


@triton.jit
def _store_extend_rows(OUT, acc, l_i, out_row, q_head, row_ok, stride_ot, stride_oh, D: tl.constexpr):
    # Every real row sees at least its own key, so l_i > 0 there; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    offs_d = tl.arange(0, D)
    o_ptr = OUT + out_row[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _sink_extend_kernel(
    Q, K, V, OUT, SINKS, REQ_TO_TOKEN, SLOT_MAP,
    REQ_POOL_IDX, SEQ_LENS, Q_START, Q_LEN, TILE_END,  # per request; TILE_END = cumsum of tile counts
    num_reqs,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_r2t,
    window_left, qk_scale_log2,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_POS: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SLOT_MAP: tl.constexpr, DOTS_16BIT: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_POS * GROUP_PAD
    tile, req = _extend_tile_request(TILE_END, num_reqs)
    if req >= num_reqs:
        return
    kv_head = tl.program_id(1)
    q, m_i, l_i, row_ok, row_pos, out_row, q_head, p0, p1, tok_base = _extend_tile_rows(
        Q, SINKS, REQ_TO_TOKEN, REQ_POOL_IDX, SEQ_LENS, Q_START, Q_LEN, TILE_END, tile, req, kv_head,
        stride_qt, stride_qh, stride_r2t, GROUP, GROUP_PAD, D, BLOCK_POS, HAS_SINKS, DOTS_16BIT)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

    # Keys [lo_any, p1] are visible to some row of the tile, [int_lo, int_hi) to all.
    windowed = window_left >= 0
    lo_any = tl.where(windowed, tl.maximum(p0 - window_left, 0), 0)
    int_lo = tl.where(windowed, tl.maximum(lo_any, p1 - window_left), 0)
    int_hi = tl.maximum(int_lo, p0 + 1)
    mid_hi = int_lo + ((int_hi - int_lo) // BLOCK_N) * BLOCK_N

    koff = kv_head * stride_kh
    voff = kv_head * stride_vh
    acc, m_i, l_i = _attend_key_range(acc, m_i, l_i, q, K, V, tok_base, SLOT_MAP, stride_kn, stride_vn, koff, voff,
                                      row_pos, lo_any, int_lo, window_left, qk_scale_log2,
                                      D, BLOCK_N, True, HAS_SLOT_MAP, DOTS_16BIT, False)
    acc, m_i, l_i = _attend_key_range(acc, m_i, l_i, q, K, V, tok_base, SLOT_MAP, stride_kn, stride_vn, koff, voff,
                                      row_pos, int_lo, mid_hi, window_left, qk_scale_log2,
                                      D, BLOCK_N, False, HAS_SLOT_MAP, DOTS_16BIT, False)
    acc, m_i, l_i = _attend_key_range(acc, m_i, l_i, q, K, V, tok_base, SLOT_MAP, stride_kn, stride_vn, koff, voff,
                                      row_pos, mid_hi, p1 + 1, window_left, qk_scale_log2,
                                      D, BLOCK_N, True, HAS_SLOT_MAP, DOTS_16BIT, False)

    _store_extend_rows(OUT, acc, l_i, out_row, q_head, row_ok, stride_ot, stride_oh, D)


@triton.jit
def _window_chunk_kv(K, V, tok_base, SLOT_MAP, key_pos, lo, hi, stride_kn, stride_vn, koff, voff,
                     D: tl.constexpr, HAS_SLOT_MAP: tl.constexpr):
    """K and V [keys, D] of the keys key_pos inside [lo, hi] (zeros elsewhere: never read, as masked loads)."""
    key_ok = (key_pos >= lo) & (key_pos <= hi)
    slot = tl.load(tok_base + key_pos, mask=key_ok, other=0).to(tl.int64)
    if HAS_SLOT_MAP:
        slot = tl.maximum(tl.load(SLOT_MAP + slot, mask=key_ok, other=0).to(tl.int64), 0)
    offs_d = tl.arange(0, D)
    k = tl.load(K + slot[:, None] * stride_kn + koff + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(V + slot[:, None] * stride_vn + voff + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _window_scores(q, k, key_pos, row_pos, lo, hi, window_left, DOTS_16BIT: tl.constexpr):
    """Raw scores (unscaled, as in _attend_key_range), -inf where the key is not visible to the row."""
    if DOTS_16BIT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    visible = ((key_pos[None, :] >= lo) & (key_pos[None, :] <= hi) & (key_pos[None, :] <= row_pos[:, None])
               & (key_pos[None, :] >= row_pos[:, None] - window_left))
    return tl.where(visible, s, float("-inf"))


@triton.jit
def _window_pv(p, v, acc, DOTS_16BIT: tl.constexpr):
    if DOTS_16BIT:
        return tl.dot(p.to(v.dtype), v, acc)
    return tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _sink_extend_window_kernel(
    Q, K, V, OUT, SINKS, REQ_TO_TOKEN, SLOT_MAP,
    REQ_POOL_IDX, SEQ_LENS, Q_START, Q_LEN, TILE_END,
    num_reqs,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_r2t,
    window_left, qk_scale_log2,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK_POS: tl.constexpr,
    WIN_KEYS: tl.constexpr,  # power of two >= window_left + 1 (and >= 16)
    LEAD_KEYS: tl.constexpr,  # power of two, WIN_KEYS + LEAD_KEYS >= window_left + BLOCK_POS (and >= 16)
    HAS_SINKS: tl.constexpr, HAS_SLOT_MAP: tl.constexpr, DOTS_16BIT: tl.constexpr,
):
    """Extend for a sliding layer whose window fits one chunk (``sink_attention_extend``'s one-shot path):
    the keys a tile of BLOCK_POS positions sees, [p0 - window_left, p1], lie in two chunks that end at
    p0 + BLOCK_POS: WIN_KEYS keys and the LEAD_KEYS before them. Every slot id, K and V of both is one load
    each, all issued before any maths, and one softmax covers both chunks and the sink: a program waits on
    memory twice (slot ids, then K/V) instead of twice per key block of a loop."""
    BLOCK_M: tl.constexpr = BLOCK_POS * GROUP_PAD
    tile, req = _extend_tile_request(TILE_END, num_reqs)
    if req >= num_reqs:
        return
    kv_head = tl.program_id(1)
    q, m_i, l_i, row_ok, row_pos, out_row, q_head, p0, p1, tok_base = _extend_tile_rows(
        Q, SINKS, REQ_TO_TOKEN, REQ_POOL_IDX, SEQ_LENS, Q_START, Q_LEN, TILE_END, tile, req, kv_head,
        stride_qt, stride_qh, stride_r2t, GROUP, GROUP_PAD, D, BLOCK_POS, HAS_SINKS, DOTS_16BIT)
    lo = tl.maximum(p0 - window_left, 0)  # keys [lo, p1] are visible to some row of the tile
    win_pos = p0 + BLOCK_POS - WIN_KEYS + tl.arange(0, WIN_KEYS)
    lead_pos = p0 + BLOCK_POS - WIN_KEYS - LEAD_KEYS + tl.arange(0, LEAD_KEYS)
    koff = kv_head * stride_kh
    voff = kv_head * stride_vh
    k_win, v_win = _window_chunk_kv(K, V, tok_base, SLOT_MAP, win_pos, lo, p1, stride_kn, stride_vn, koff, voff,
                                    D, HAS_SLOT_MAP)
    k_lead, v_lead = _window_chunk_kv(K, V, tok_base, SLOT_MAP, lead_pos, lo, p1, stride_kn, stride_vn, koff, voff,
                                      D, HAS_SLOT_MAP)
    s_win = _window_scores(q, k_win, win_pos, row_pos, lo, p1, window_left, DOTS_16BIT)
    s_lead = _window_scores(q, k_lead, lead_pos, row_pos, lo, p1, window_left, DOTS_16BIT)
    m_new = tl.maximum(m_i, tl.maximum(tl.max(s_win, axis=1), tl.max(s_lead, axis=1)) * qk_scale_log2)
    p_win = tl.exp2(s_win * qk_scale_log2 - m_new[:, None])
    p_lead = tl.exp2(s_lead * qk_scale_log2 - m_new[:, None])
    l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(p_win, axis=1) + tl.sum(p_lead, axis=1)
    acc = _window_pv(p_lead, v_lead, _window_pv(p_win, v_win, tl.zeros([BLOCK_M, D], dtype=tl.float32), DOTS_16BIT),
                     DOTS_16BIT)
    _store_extend_rows(OUT, acc, l_i, out_row, q_head, row_ok, stride_ot, stride_oh, D)


# Extend launch defaults, (query rows per program, warps). The key loop: the H200 sweep's winner at 8k
# (benchmarks/results/sweeps/bench_sink_attention_extend_sweep.md; 64 rows measured level with it in
# bench_sink_attention_extend_window.md). The one-shot window path, a sliding layer of 8192 tokens with sinks
# (bench_sink_attention_extend_window.md, device time): 64 rows / 4 warps 128-129 us, 128 / 8 137-139,
# 128 / 4 160-161, 256 / 8 190-191; the key loop 182-184.
EXTEND_TILE = (128, 4)
WINDOW_TILE = (64, 4)
WINDOW_ONESHOT_MAX_KEYS = 128  # the one-shot window path's largest chunk: its scores stay in registers


def sink_attention_extend(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start: Optional[torch.Tensor],
    q_len: torch.Tensor,
    sinks: Optional[torch.Tensor],
    window_left: int,
    scale: float,
    *,
    slot_map: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    block_m: Optional[int] = None,
    block_n: int = 64,
    num_warps: Optional[int] = None,
    num_stages: int = 3,
    window_oneshot: Optional[bool] = None,
) -> torch.Tensor:
    """Extend (prefill over a cached prefix) for a ragged batch in one launch: out [T, Hq, D] in q's dtype.

    ``q_start`` None means the requests' rows are packed in order (exclusive cumsum of ``q_len``).
    ``block_m`` query rows per program = block_m // next_pow2(group) positions x the group's heads.
    ``window_oneshot`` (None: wherever the window has at most WINDOW_ONESHOT_MAX_KEYS keys, as gpt-oss's
    sliding layers do) runs _sink_extend_window_kernel, the key loop's one-shot form; ``block_n`` and
    ``num_stages`` are the key loop's. ``block_m`` / ``num_warps`` None take the path's measured defaults
    (EXTEND_TILE / WINDOW_TILE)."""
    hq, hkv, d = _check_common(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sinks, slot_map)
    _check_scale(scale, "sink_attention_extend")
    t = q.shape[0]
    num_reqs = req_pool_indices.shape[0]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"sink_attention_extend: out must be {tuple(q.shape)} with a unit last stride")
    if t == 0 or num_reqs == 0:
        return out
    win_keys = max(16, triton.next_power_of_2(window_left + 1)) if window_left >= 0 else 0
    if window_oneshot is None:
        window_oneshot = 0 < win_keys <= WINDOW_ONESHOT_MAX_KEYS
    elif window_oneshot and window_left < 0:
        raise ValueError("sink_attention_extend: window_oneshot needs a sliding window (window_left >= 0)")
    elif window_oneshot and win_keys > WINDOW_ONESHOT_MAX_KEYS:
        raise ValueError(f"sink_attention_extend: window_oneshot holds at most {WINDOW_ONESHOT_MAX_KEYS} keys in "
                         f"registers, window_left {window_left} needs {win_keys}")
    if block_m is None and num_warps is None:
        block_m, num_warps = WINDOW_TILE if window_oneshot else EXTEND_TILE
    elif block_m is None:
        block_m = (WINDOW_TILE if window_oneshot else EXTEND_TILE)[0]
    elif num_warps is None:
        num_warps = 4 if block_m <= 128 else 8  # a caller's tile: 8 warps hold 256 rows' scores
    group = hq // hkv
    group_pad = triton.next_power_of_2(group)
    block_pos = max(1, block_m // group_pad)
    if q_start is None:
        q_start = torch.cumsum(q_len, 0) - q_len
    tile_end = torch.cumsum(torch.div(q_len + block_pos - 1, block_pos, rounding_mode="floor"), 0).to(torch.int32)
    # Each request's last tile may be partial: at most T / block_pos + B tiles in all.
    grid = (triton.cdiv(t, block_pos) + num_reqs, hkv)
    if window_oneshot:
        _sink_extend_window_kernel[grid](
            q, k_buffer, v_buffer, out, sinks if sinks is not None else q, req_to_token,
            slot_map if slot_map is not None else req_to_token,
            req_pool_indices, seq_lens, q_start, q_len, tile_end, num_reqs,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
            v_buffer.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
            int(window_left), float(scale) * LOG2E,
            GROUP=group, GROUP_PAD=group_pad, D=d, BLOCK_POS=block_pos, WIN_KEYS=win_keys,
            LEAD_KEYS=max(16, triton.next_power_of_2(block_pos)),
            HAS_SINKS=sinks is not None, HAS_SLOT_MAP=slot_map is not None,
            DOTS_16BIT=_use_16bit_dots(q.dtype, k_buffer.dtype), num_warps=num_warps, num_stages=1,
        )
        return out
    _sink_extend_kernel[grid](
        q, k_buffer, v_buffer, out, sinks if sinks is not None else q, req_to_token,
        slot_map if slot_map is not None else req_to_token,
        req_pool_indices, seq_lens, q_start, q_len, tile_end, num_reqs,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        int(window_left), float(scale) * LOG2E,
        GROUP=group, GROUP_PAD=group_pad, D=d, BLOCK_POS=block_pos, BLOCK_N=block_n,
        HAS_SINKS=sinks is not None, HAS_SLOT_MAP=slot_map is not None,
        DOTS_16BIT=_use_16bit_dots(q.dtype, k_buffer.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
