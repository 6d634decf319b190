"""Paged attention with per-head sinks and an inclusive sliding window (gpt-oss), for extend and decode.

Semantics are those of the torch layer ``sink_attention_torch`` (layers/sink_attention.py; SPEC §1):
``window_left`` is the number of *earlier* keys a query sees (127 for gpt-oss's sliding layers: key j is
visible to query i iff i - 127 <= j <= i), negative means full causal; every query head has one sink
logit that joins the softmax denominator once and carries no value. GQA: q head h reads kv head
h // (Hq // Hkv).

KV layout as in SGLang: ``k_buffer``/``v_buffer`` [num_slots, Hkv, D]; position p of request b lives in
slot ``req_to_token[req_pool_indices[b], p]`` (through ``slot_map`` first when given: the hybrid SWA
pool keeps its sliding layers in a smaller sub-pool addressed by translated slot ids). Request b owns
the flattened query rows ``q_start[b] .. q_start[b] + q_len[b] - 1``, at its last ``q_len[b]`` positions
of ``seq_lens[b]`` (keys after this forward's KV write).

Both launchers read no tensor values on the host (grids come from shapes), so both can be captured in
a CUDA graph:
  - extend: one program per (tile of BLOCK_M // group query positions of one request, kv head); the
    tile's query rows are (position, q head of the group) pairs, so one K/V block read serves all heads
    of the group. Tiles of all requests are numbered on the device (cumsum of per-request tile counts)
    and each program finds its request by counting, so ragged batches run in one launch with no host
    max length. Key blocks outside the causal window of the tile are never visited; blocks entirely
    visible to every row run without masks. Scores stay unscaled until the exponent (one FMA) and P.V
    accumulates into the rescaled accumulator. A sliding layer whose window fits one chunk of keys
    (gpt-oss: 128) runs the same tiles one-shot (_sink_extend_window_kernel): every slot id, K and V
    the tile sees in one load each, no key loop (1.3x the loop on an H200).
  - prefill (``sink_attention_prefill``, a layer whose requests have no cached prefix): keys are this
    forward's own rows, so a program (BM positions of one request, one q head) reads K/V by TMA with no
    slot ids, the blocks before its diagonal unmasked; on an H200 at 8k, 1253 vs the key loop's 1735 us a full
    layer in its prototype (benchmarks/results/diag_extend_fa.md) and 25.5 vs 33.5 ms over the 18 full layers
    of the 120b prefill (bench_prefill_tp1.md), the same bits at the default tile. A sliding layer's tile
    reads only the blocks from its window's far edge on, masked there: 123.5 vs the window kernel's 131.3 us
    (diag_extend_window.md), one path for every no-prefix prefill. ``paged_attention(no_prefix=True)`` and
    the SGLang backend take it.
  - decode: flash-decoding; one program per (request, kv head, split) serves the kv head's whole GQA
    group. The grid's split count is a host constant (from the batch and req_to_token's width, so
    CUDA-graph safe); how many splits a request uses, each at least a few key blocks, is decided on the
    device from its length. The partial results are merged, and the sink added to the denominator
    once, either by the last split of a (request, kv head) to arrive (fused: one launch) or by a second
    merge kernel, whichever the configuration measured faster at (decode_config). Sliding layers only
    read their last window_left + 1 keys, one block in one program.
  - one-shot decode (DecodeConfig.oneshot, for small batches): one program per (request, kv head, chunk
    of a fixed power-of-two number of keys), no key loop: its q, slot ids, K and V are each one load, all
    issued before any maths, so a program is three dependent trips to memory and the parallelism is in
    the grid (max_context / chunk splits, capped). The merge kernel finishes, as above. With ``rope``
    (RopeKV: this step's unrotated k / v, their cos/sin rows and cache slots) it also does
    kernels/rope_kv.py's work for the step's token, one launch fewer, and loads every earlier key's K
    before its PDL wait. The split loop does the same work in its launch (its last used split stores the
    new k / v before it reads its keys); extend calls rope_store_kv first.

Precision: scores, softmax and accumulators are fp32. fp32 inputs use IEEE fp32 dots. When q and K/V are
both bf16 (or both fp16) the dots run on tensor cores: Q.K^T products are exact in the fp32 accumulator;
in extend the probabilities enter P.V rounded to 16 bits (as in FlashAttention); in decode, which is
bound by memory and not by dots, they enter as a hi + lo pair of 16-bit values (~16 mantissa bits).

``paged_attention`` picks extend or decode from shapes alone (the model-step harness's entry);
``sink_attention_ref`` is the same contract in plain torch (fp32), the CPU fallback and the test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch

import triton
import triton.language as tl

from sglang_ext.kernels._util import interpreted, num_sms
from sglang_ext.kernels.arrival_counters import arrival_counters
from sglang_ext.kernels.fp8_gemm import _round_to_bf16_grid
from sglang_ext.kernels.pdl import pdl_launch_kwargs, pdl_wait_then_release
from sglang_ext.kernels.rope_kv import check_rope_kv, rope_first_half, rope_second_half, rope_store_kv

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


@triton.jit
def _prefill_block(acc, m_i, l_i, q, k_desc, v_desc, row, col, key0, offs_m, qk_scale_log2, window_left,
                   BN: tl.constexpr, MASK: tl.constexpr, WINDOW: tl.constexpr, DOTS_16BIT: tl.constexpr):
    """One block of BN keys (rows row..row+BN-1 of this forward's K/V, positions key0..key0+BN-1)
    into the running softmax of a prefill tile (as _attend_key_range: raw scores, one FMA to the exponent).
    WINDOW: keys older than window_left positions before the query's are masked too."""
    k = k_desc.load([row, col])
    v = v_desc.load([row, col])
    if DOTS_16BIT:
        s = tl.dot(q, tl.trans(k))
    else:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if MASK:  # the diagonal: key position <= query position
        s = tl.where((key0 + tl.arange(0, BN))[None, :] <= offs_m[:, None], s, float("-inf"))
    if WINDOW:  # the window's far edge: key position >= query position - window_left
        s = tl.where((key0 + tl.arange(0, BN))[None, :] >= offs_m[:, None] - window_left, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale_log2)
    p = tl.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOTS_16BIT:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    else:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _sink_prefill_kernel(
    q_desc, k_desc, v_desc,  # this forward's rows: q [T, Hq*D], k / v [T, Hkv*D] (strided views allowed)
    OUT, SINKS, Q_START, Q_LEN, TILE_END, num_reqs, qk_scale_log2, stride_ot, stride_oh, window_left,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
    HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr, DOTS_16BIT: tl.constexpr,
):
    """Prefill without a cached prefix, causal (``sink_attention_prefill``): program (tile, q head) owns
    BM consecutive positions of one request and one q head; its keys are the request's own rows of this
    forward's K/V, read by TMA (no slot ids), the blocks before the tile unmasked, the diagonal masked; the
    sink starts the running max with weight 1. Tiles are numbered longest first (_extend_tile_request).
    WINDOW (a sliding layer): only the blocks from the window's far edge on, masked at that edge."""
    tile, req = _extend_tile_request(TILE_END, num_reqs)
    if req >= num_reqs:
        return
    h = tl.program_id(1)
    col = (h // GROUP) * D
    q_len = tl.load(Q_LEN + req).to(tl.int32)
    row0 = tl.load(Q_START + req).to(tl.int32)
    m0 = (tile - (tl.load(TILE_END + req).to(tl.int32) - tl.cdiv(q_len, BM))) * BM
    offs_m = m0 + tl.arange(0, BM)
    q = q_desc.load([row0 + m0, h * D])
    if not DOTS_16BIT:
        q = q.to(tl.float32)
    if HAS_SINKS:
        m_i = tl.zeros([BM], dtype=tl.float32) + tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        l_i = tl.full([BM], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    key_lo = 0
    if WINDOW:
        key_lo = tl.maximum(m0 - window_left, 0) // BN * BN
    for key0 in tl.range(key_lo, m0, BN, num_stages=STAGES):
        acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, k_desc, v_desc, row0 + key0, col, key0, offs_m,
                                       qk_scale_log2, window_left, BN, False, WINDOW, DOTS_16BIT)
    for key0 in tl.range(m0, tl.minimum(m0 + BM, q_len), BN, num_stages=STAGES):
        acc, m_i, l_i = _prefill_block(acc, m_i, l_i, q, k_desc, v_desc, row0 + key0, col, key0, offs_m,
                                       qk_scale_log2, window_left, BN, True, WINDOW, DOTS_16BIT)
    out = acc / l_i[:, None]  # every real row sees its own key: l_i > 0
    offs_d = tl.arange(0, D)
    o_ptr = OUT + (row0 + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=(offs_m < q_len)[:, None])


@triton.jit
def _load_slots(tok_base, SLOT_MAP, key_pos, key_hi, HAS_SLOT_MAP: tl.constexpr):
    key_ok = key_pos < key_hi
    slot = tl.load(tok_base + key_pos, mask=key_ok, other=0).to(tl.int64)
    if HAS_SLOT_MAP:
        slot = tl.maximum(tl.load(SLOT_MAP + slot, mask=key_ok, other=0).to(tl.int64), 0)
    return slot


@triton.jit
def _load_kv(K, V, slot, key_ok, stride_kn, stride_vn, kv_head_off_k, kv_head_off_v, D: tl.constexpr):
    offs_d = tl.arange(0, D)
    k = tl.load(K + slot[:, None] * stride_kn + kv_head_off_k + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(V + slot[:, None] * stride_vn + kv_head_off_v + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _decode_key_range_prefetch(
    acc, m_i, l_i, q, K, V, tok_base, SLOT_MAP,
    stride_kn, stride_vn, kv_head_off_k, kv_head_off_v,
    key_lo, key_hi, qk_scale_log2,
    D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SLOT_MAP: tl.constexpr, DOTS_16BIT: tl.constexpr,
):
    """_attend_key_range for one decode row whose keys [key_lo, key_hi) are all visible, software-
    pipelined by hand: a block's K/V loads are issued one iteration ahead of its maths and its slot ids
    two ahead. The gathers (slot id, then K/V) are dependent trips to memory that the compiler does not
    pipeline, and a decode program is little but those trips: without this each program has one
    block in flight at a time and waits twice per block. Loads past key_hi are masked off (no traffic)."""
    offs_n = tl.arange(0, BLOCK_N)
    slot = _load_slots(tok_base, SLOT_MAP, key_lo + offs_n, key_hi, HAS_SLOT_MAP)
    k, v = _load_kv(K, V, slot, key_lo + offs_n < key_hi, stride_kn, stride_vn, kv_head_off_k, kv_head_off_v, D)
    slot_next = _load_slots(tok_base, SLOT_MAP, key_lo + BLOCK_N + offs_n, key_hi, HAS_SLOT_MAP)
    for start in range(key_lo, key_hi, BLOCK_N):
        k_next, v_next = _load_kv(K, V, slot_next, start + BLOCK_N + offs_n < key_hi, stride_kn, stride_vn,
                                  kv_head_off_k, kv_head_off_v, D)
        slot_next = _load_slots(tok_base, SLOT_MAP, start + 2 * BLOCK_N + offs_n, key_hi, HAS_SLOT_MAP)
        if DOTS_16BIT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        s = tl.where((start + offs_n < key_hi)[None, :], s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if DOTS_16BIT:
            p_hi = p.to(v.dtype)
            pv = tl.dot(p_hi, v) + tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
        k = k_next
        v = v_next
    return acc, m_i, l_i


@triton.jit
def _split_range(seq_len, window_left, split, num_splits, min_split_blocks, BLOCK_N: tl.constexpr):
    """Keys [k_lo, k_hi) of one split and how many splits of this request carry keys (n_used >= 1).
    Computed on the device from seq_len alone, identically by every split and by the merge: a short
    context uses fewer, fuller splits (at least min_split_blocks blocks each, so a split's partial
    write stays small beside its K/V reads), and splits past n_used exit at once."""
    hi = seq_len
    lo = tl.where(window_left >= 0, tl.maximum(hi - 1 - window_left, 0), 0)
    n_keys = tl.maximum(hi - lo, 0)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(n_keys, BLOCK_N), num_splits), min_split_blocks) * BLOCK_N
    n_used = tl.maximum(tl.cdiv(n_keys, per_split), 1)
    k_lo = lo + split * per_split
    k_hi = tl.minimum(k_lo + per_split, hi)
    return k_lo, k_hi, n_used


@triton.jit
def _load_partials(PART_O, PART_LSE, base, s0, load_hi, offs_h, head_ok,
                   GROUP: tl.constexpr, D: tl.constexpr, S_CHUNK: tl.constexpr):
    """Partials of splits s0 .. s0 + S_CHUNK - 1 (below load_hi) of some q heads, in one load:
    lse [S_CHUNK, HEADS], output [S_CHUNK, HEADS, D]."""
    split = s0 + tl.arange(0, S_CHUNK)
    row = (base + split)[:, None] * GROUP + offs_h[None, :]
    ld = (split < load_hi)[:, None] & head_ok[None, :]
    # .cg: other SMs wrote these; read them from L2, never from a stale L1 line.
    lse = tl.load(PART_LSE + row, mask=ld, other=float("-inf"), cache_modifier=".cg")
    part = tl.load(PART_O + row[:, :, None] * D + tl.arange(0, D)[None, None, :], mask=ld[:, :, None], other=0.0,
                   cache_modifier=".cg")
    return lse, part


@triton.jit
def _fold_partials(m, den, acc, lse, part, s0, n_used, head_ok, S_CHUNK: tl.constexpr):
    """Those splits folded into the running (max, denominator, output) of the heads, reduced over the
    split axis. Rows at or past n_used, and rows whose lse is -inf (a split past n_used marks its row so
    for the merge kernel), weigh zero, whatever their output row holds (never written: any bits)."""
    use = ((s0 + tl.arange(0, S_CHUNK)) < n_used)[:, None] & head_ok[None, :] & (lse > float("-inf"))
    # where, not a zero weight: an unwritten row may hold NaN (0 * NaN is NaN), in its lse too.
    lse = tl.where(use, lse, float("-inf"))
    part = tl.where(use[:, :, None], part, 0.0)
    m_new = tl.maximum(m, tl.max(lse, axis=0))  # m starts finite, so m_new is too: no -inf - -inf
    alpha = tl.exp2(m - m_new)
    w = tl.exp2(lse - m_new[None, :])
    den = den * alpha + tl.sum(w, axis=0)
    acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * part, axis=0)
    return m_new, den, acc


@triton.jit
def _merge_start(SINKS, kv_head, offs_h, head_ok, GROUP: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                 HAS_SINKS: tl.constexpr):
    """Running (max, denominator, output) before any split. The sink seeds the max and the denominator
    (exp2(sink - sink) = 1): it joins them exactly once, whatever the splits."""
    if HAS_SINKS:
        m = tl.load(SINKS + kv_head * GROUP + offs_h, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        den = tl.full([HEADS], 1.0, dtype=tl.float32)
    else:
        m = tl.full([HEADS], -1.0e30, dtype=tl.float32)
        den = tl.zeros([HEADS], dtype=tl.float32)
    return m, den, tl.zeros([HEADS, D], dtype=tl.float32)


@triton.jit
def _merge_splits(PART_O, PART_LSE, SINKS, b, kv_head, num_kv_heads, head0, n_used, num_splits,
                  GROUP: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, S_CHUNK: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """Final output [HEADS, D] of q heads head0 .. head0 + HEADS - 1 of the group of (request b, kv head)
    from its n_used partials: one pass, S_CHUNK splits per load, an online softmax across loads. The
    result depends only on S_CHUNK, not on which program runs it."""
    offs_h = head0 + tl.arange(0, HEADS)
    head_ok = offs_h < GROUP
    # PART_* [B, Hkv, num_splits, GROUP(, D)]: one group's partials are contiguous.
    base = (b * num_kv_heads + kv_head) * num_splits
    m, den, acc = _merge_start(SINKS, kv_head, offs_h, head_ok, GROUP, HEADS, D, HAS_SINKS)
    for s0 in range(0, n_used, S_CHUNK):
        lse, part = _load_partials(PART_O, PART_LSE, base, s0, n_used, offs_h, head_ok, GROUP, D, S_CHUNK)
        m, den, acc = _fold_partials(m, den, acc, lse, part, s0, n_used, head_ok, S_CHUNK)
    return acc / tl.where(den > 0, den, 1.0)[:, None]


@triton.jit
def _sink_decode_kernel(
    Q, K, V, OUT, PART_O, PART_LSE, COUNTERS, SINKS, REQ_TO_TOKEN, SLOT_MAP, REQ_POOL_IDX, SEQ_LENS,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_r2t,
    window_left, qk_scale_log2, num_splits, min_split_blocks,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, MERGE_S: tl.constexpr, FUSED_MERGE: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SLOT_MAP: tl.constexpr, DOTS_16BIT: tl.constexpr,
    K_NEW=None, V_NEW=None, COS_SIN=None, LOC=None,
    stride_knt=0, stride_knh=0, stride_vnt=0, stride_vnh=0, stride_cs=0,
    ROPE: tl.constexpr = False, ROUND_BF16: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """One (request, kv head, split): the GROUP q heads of the kv head against one run of keys, so each
    K/V block is read once for the whole group. A request whose keys fit one split writes the final
    output here (sink included). Otherwise each split writes a partial output and its log2-sum-exp
    without the sink; with FUSED_MERGE the split that arrives last at the (request, kv head) counter
    merges them (no second launch, which at small batch costs as much as the reads), else the merge
    kernel does.

    ROPE (RopeKV, as the one-shot kernel's): Q is the unrotated q and K_NEW / V_NEW this step's unrotated
    k and v; every program rotates its group's q heads, and the last used split (the one whose keys end
    at the newest position) rotates k, stores k and v at LOC[b] (rope_kv's maths and roundings: the same
    bits as rope_store_kv before the launch) and then, past a CTA barrier that makes the stores visible to
    its own threads, reads its keys as usual, the newest one from the cache it just wrote. No other
    program reads that slot.

    USE_PDL (kernels/pdl.py): the request's length and row, written before the step, are loaded before
    the wait; q (the previous launch's) and the keys (rope_kv, the previous launch without RopeKV, writes
    the newest one) after it, and with them the slot ids (written before the step, so they could go first:
    not tried)."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    req_row = tl.load(REQ_POOL_IDX + b).to(tl.int64)
    pdl_wait_then_release(USE_PDL)
    k_lo, k_hi, n_used = _split_range(seq_len, window_left, split, num_splits, min_split_blocks, BLOCK_N)
    if split >= n_used:
        if SPLIT and not FUSED_MERGE:
            # For the merge kernel, which loads every split's row before it knows n_used: an lse of -inf
            # marks this row as empty (its output row stays unwritten).
            offs_g = tl.arange(0, GROUP_PAD)
            tl.store(PART_LSE + ((b * tl.num_programs(1) + kv_head) * num_splits + split) * GROUP + offs_g,
                     tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32), mask=offs_g < GROUP)
        return
    single = n_used == 1

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    head_ok = offs_h < GROUP
    q_head = kv_head * GROUP + offs_h
    if ROPE:
        cos, sin = _rope_cos_sin(COS_SIN + b * stride_cs, offs_d, D)
        q = _rope_rows(Q + b * stride_qt + q_head[:, None] * stride_qh, offs_d, head_ok[:, None], cos, sin, D,
                       ROUND_BF16).to(Q.dtype.element_ty)
        q = tl.where(head_ok[:, None], q, 0.0)
        if split == n_used - 1:  # the split holding the newest key stores it (rope_kv's write)
            k_new = _rope_rows(K_NEW + b * stride_knt + kv_head * stride_knh, offs_d, offs_d < D, cos, sin, D,
                               ROUND_BF16).to(K.dtype.element_ty)
            v_new = tl.load(V_NEW + b * stride_vnt + kv_head * stride_vnh + offs_d).to(V.dtype.element_ty)
            slot_new = tl.load(LOC + b).to(tl.int64)
            tl.store(K + slot_new * stride_kn + kv_head * stride_kh + offs_d, k_new)
            tl.store(V + slot_new * stride_vn + kv_head * stride_vh + offs_d, v_new)
            tl.debug_barrier()  # bar.sync: the stores above before any thread of the program loads keys
    else:
        q = tl.load(Q + b * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :], mask=head_ok[:, None],
                    other=0.0)
    if not DOTS_16BIT:
        q = q.to(tl.float32)
    if HAS_SINKS:
        sink = tl.load(SINKS + q_head, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(single, sink, -1.0e30)
        l_i = tl.where(single, 1.0, 0.0) + tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    if PREFETCH:
        acc, m_i, l_i = _decode_key_range_prefetch(
            acc, m_i, l_i, q, K, V, REQ_TO_TOKEN + req_row * stride_r2t, SLOT_MAP, stride_kn, stride_vn,
            kv_head * stride_kh, kv_head * stride_vh, k_lo, k_hi, qk_scale_log2, D, BLOCK_N, HAS_SLOT_MAP, DOTS_16BIT)
    else:
        row_pos = tl.full([BLOCK_H], 0, dtype=tl.int32) + (seq_len - 1)
        acc, m_i, l_i = _attend_key_range(acc, m_i, l_i, q, K, V, REQ_TO_TOKEN + req_row * stride_r2t, SLOT_MAP,
                                          stride_kn, stride_vn, kv_head * stride_kh, kv_head * stride_vh,
                                          row_pos, k_lo, k_hi, window_left, qk_scale_log2,
                                          D, BLOCK_N, True, HAS_SLOT_MAP, DOTS_16BIT, True)
    has_keys = l_i > 0  # False only for a zero-length CUDA-graph padding row without sinks
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if not SPLIT:  # num_splits == 1: no partial code in this variant
        o_ptr = OUT + b * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=head_ok[:, None])
    else:
        if single:
            o_ptr = OUT + b * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=head_ok[:, None])
        else:
            # Every used split has at least one key, so l_i > 0 and the lse is finite.
            row = ((b * tl.num_programs(1) + kv_head) * num_splits + split) * GROUP + offs_h
            tl.store(PART_O + row[:, None] * D + offs_d[None, :], out, mask=head_ok[:, None])
            tl.store(PART_LSE + row, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), mask=head_ok)
            if FUSED_MERGE:
                # Every thread's partial store is ordered before the barrier, and the barrier before the
                # counter's release (acq_rel, gpu scope): the last arriver sees all partials.
                # Counters return to zero: n_used is a function of (seq_len, window_left, num_splits,
                # min_split_blocks), the same in every program of the group; n_used <= num_splits, so all
                # n_used splits exist; each of them, and no other, adds 1 exactly once (splits past n_used
                # returned above, n_used == 1 took the branch without a counter); the scalar atomic runs
                # once per program and its old value reaches every thread. So exactly one program reads
                # n_used - 1, after all n_used adds, and its reset is the counter's last write.
                tl.debug_barrier()
                counter = COUNTERS + b * tl.num_programs(1) + kv_head
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == n_used - 1:
                    merged = _merge_splits(PART_O, PART_LSE, SINKS, b, kv_head, tl.num_programs(1), 0, n_used,
                                           num_splits, GROUP, GROUP_PAD, D, MERGE_S, HAS_SINKS)
                    offs_g = tl.arange(0, GROUP_PAD)
                    tl.store(OUT + b * stride_ot + (kv_head * GROUP + offs_g)[:, None] * stride_oh + offs_d[None, :],
                             merged.to(OUT.dtype.element_ty), mask=(offs_g < GROUP)[:, None])
                    tl.atomic_xchg(counter, 0)  # ready for the next launch (or graph replay)


@triton.jit
def _sink_decode_merge_kernel(
    PART_O, PART_LSE, SINKS, OUT, SEQ_LENS, stride_ot, stride_oh, window_left, num_splits, min_split_blocks,
    GROUP: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
    S_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr, SPECULATE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """The merge as a second launch, one program per (request, kv head, HEADS q heads of its group): when
    no arrival counters can be had (first call inside a CUDA-graph capture), or where decode_config
    measured it faster. Few heads per program when splits are many: at batch 1 one program per q head
    spreads the partials' reads over 64 SMs instead of looping over them on 8."""
    pdl_wait_then_release(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    head0 = tl.program_id(2) * HEADS
    offs_h = head0 + tl.arange(0, HEADS)
    head_ok = offs_h < GROUP
    if SPECULATE:
        # All num_splits rows in one load, issued before the seq_lens load: at small batch this kernel is
        # a chain of dependent trips to memory, and n_used (from seq_lens) only decides the store, so
        # both loads are in flight at once. Rows past n_used carry an lse of -inf (written by their
        # split). The source order matters: with seq_lens loaded first, the compiler put the n_used
        # arithmetic ahead of the partials' loads and the warp waited there; loaded after the fold, it
        # was a trip of its own at the end.
        lse, part = _load_partials(PART_O, PART_LSE, (b * tl.num_programs(1) + kv_head) * num_splits, 0,
                                   num_splits, offs_h, head_ok, GROUP, D, S_CHUNK)
        seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
        m, den, acc = _merge_start(SINKS, kv_head, offs_h, head_ok, GROUP, HEADS, D, HAS_SINKS)
        m, den, acc = _fold_partials(m, den, acc, lse, part, 0, num_splits, head_ok, S_CHUNK)
        merged = acc / tl.where(den > 0, den, 1.0)[:, None]
        _, _, n_used = _split_range(seq_len, window_left, 0, num_splits, min_split_blocks, BLOCK_N)
    else:
        seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
        _, _, n_used = _split_range(seq_len, window_left, 0, num_splits, min_split_blocks, BLOCK_N)
        merged = _merge_splits(PART_O, PART_LSE, SINKS, b, kv_head, tl.num_programs(1), head0, n_used, num_splits,
                               GROUP, HEADS, D, S_CHUNK, HAS_SINKS)
    # n_used == 1: the one split wrote the output (and what was merged here is unwritten rows).
    tl.store(OUT + b * stride_ot + (kv_head * GROUP + offs_h)[:, None] * stride_oh + tl.arange(0, D)[None, :],
             merged.to(OUT.dtype.element_ty), mask=head_ok[:, None] & (n_used > 1))


@triton.jit
def _oneshot_ptrs(tok_base, SLOT_MAP, K, V, stride_kn, stride_vn, kv_head_off_k, kv_head_off_v, start, key_hi,
                  D: tl.constexpr, CHUNK: tl.constexpr, HAS_SLOT_MAP: tl.constexpr):
    """K and V addresses [CHUNK, D] of keys start .. start + CHUNK - 1 (slot ids in one load) and which of
    them are below key_hi. Both address tiles are made here, before either load: made later, V's layout
    conversion of the slot ids would wait behind K's use."""
    key_pos = start + tl.arange(0, CHUNK)
    key_ok = key_pos < key_hi
    slot = _load_slots(tok_base, SLOT_MAP, key_pos, key_hi, HAS_SLOT_MAP)
    offs_d = tl.arange(0, D)
    k_ptr = K + slot[:, None] * stride_kn + kv_head_off_k + offs_d[None, :]
    v_ptr = V + slot[:, None] * stride_vn + kv_head_off_v + offs_d[None, :]
    return k_ptr, v_ptr, key_ok


@triton.jit
def _oneshot_fold(acc, m_i, l_i, q, k, v, v_ptr, key_ok, qk_scale_log2, is_new, v_new,
                  V_LATE: tl.constexpr, DOTS_16BIT: tl.constexpr, ROPE: tl.constexpr):
    """One chunk's keys (K tile k [CHUNK, D], V tile v, or with V_LATE v_ptr: V loaded here, after the
    scores) folded into (acc, m_i, l_i); keys with key_ok False score -inf. With ROPE and V_LATE the row
    is_new (this step's key) takes v_new instead of the cache's.

    K enters through a select. The compiler places the conversion that feeds a dot operand right after the
    load that produced it, and that conversion waits for the data: fed straight from its load, K's would
    stall the program on K before the V (and q) loads after it are issued, one trip to memory each. A select
    is not a load, so K's conversion stays here, after every load of the chunk."""
    k = tl.where(key_ok[:, None], k, 0.0)
    if DOTS_16BIT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    s = tl.where(key_ok[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))  # m_i is finite (sink or -1e30): no -inf - -inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if V_LATE:
        if ROPE:
            v = tl.load(v_ptr, mask=(key_ok & ~is_new)[:, None], other=0.0)
            v = tl.where(is_new[:, None], v_new[None, :], v)
        else:
            v = tl.load(v_ptr, mask=key_ok[:, None], other=0.0)
    if DOTS_16BIT:
        p_hi = p.to(v.dtype)
        pv = tl.dot(p_hi, v) + tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v)
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _rope_cos_sin(CS_ROW, offs_d, D: tl.constexpr):
    """cos and sin [D] of one token for the half-split rotation: element d uses entry d % (D / 2) of the
    row's cos half (first D / 2 values) and sin half (the rest), as kernels/rope_kv.py."""
    half = offs_d % (D // 2)
    return tl.load(CS_ROW + half), tl.load(CS_ROW + D // 2 + half)


@triton.jit
def _rope_rows(ROW_PTRS, offs_d, mask, cos, sin, D: tl.constexpr, ROUND_BF16: tl.constexpr):
    """RoPE of rows [.., D] at ROW_PTRS (+ offs_d) in fp32, each element with its rotation partner
    (d +- D / 2) loaded beside it: the first half x1 cos - x2 sin, the second x2 cos + x1 sin, by
    kernels/rope_kv.py's own helpers (the same FMAs, so the same bits), returned in fp32 (ROUND_BF16: on
    the bf16 grid, for the interpreter)."""
    first = offs_d < D // 2
    partner = tl.where(first, offs_d + D // 2, offs_d - D // 2)
    x = tl.load(ROW_PTRS + offs_d, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(ROW_PTRS + partner, mask=mask, other=0.0).to(tl.float32)
    r = tl.where(first, rope_first_half(x, p, cos, sin), rope_second_half(x, p, cos, sin))
    if ROUND_BF16:
        r = _round_to_bf16_grid(r)
    return r


@triton.jit
def _sink_decode_oneshot_kernel(
    Q, K, V, OUT, PART_O, PART_LSE, SINKS, REQ_TO_TOKEN, SLOT_MAP, REQ_POOL_IDX, SEQ_LENS,
    K_NEW, V_NEW, COS_SIN, LOC,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_r2t,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cs,
    window_left, qk_scale_log2, num_splits, min_split_blocks,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
    SPLIT: tl.constexpr, MARK_EMPTY: tl.constexpr, V_LATE: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SLOT_MAP: tl.constexpr, DOTS_16BIT: tl.constexpr,
    ROPE: tl.constexpr = False, ROUND_BF16: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """The one-shot decode (DecodeConfig.oneshot): one (request, kv head, split) whose split is one chunk of
    CHUNK keys, read without a loop, as three dependent trips to memory: the request's row and length; the
    chunk's slot ids; then K and V [CHUNK, D] in one load each, with q of the GQA group and the sinks. Then
    scores [BLOCK_H, CHUNK], the chunk's max, denominator and P.V. The grid (chunks x kv heads x requests,
    several programs per SM at small batch) keeps the reads in flight that one program's loop would
    serialise. With V_LATE, V's load waits for the scores instead (a fourth trip, fewer registers held).

    Split boundaries are _split_range's with BLOCK_N = CHUNK, which the merge kernel recomputes: a split
    owns exactly one chunk while the request has at most num_splits * CHUNK keys (the window's, in a
    sliding layer); past that (num_splits capped by MAX_SPLITS) each split owns several consecutive chunks
    and folds them in a loop, each chunk one-shot.

    Partials as _sink_decode_kernel writes them: a request with one used split writes its output here, sink
    included; otherwise each split writes its normalised output and log2-sum-exp without the sink, and
    _sink_decode_merge_kernel adds the sink once. A split past the request's chunks exits, marking its lse
    -inf first if the merge loads every split's row (MARK_EMPTY: the merge tile covers all splits).

    ROPE: the launch also does kernels/rope_kv.py's work for this step's token (one launch fewer). Q is
    then the unrotated q and K_NEW / V_NEW the token's unrotated k and v (rows of the qkv GEMM's output);
    every program rotates its group's q heads and the new k (rope_kv's maths and roundings, so the same
    bits), the last used split stores k and v at LOC[b] (what rope_kv would have written), and the newest
    key enters the chunk from registers instead of the cache. Every other key was written by earlier
    steps, so under PDL its K/V loads are issued before the wait (kernels/pdl.py, rule 1): they overlap
    the qkv GEMM instead of following it (with V_LATE only K's: V's load follows the scores, as without
    ROPE, and takes the new v for the newest key)."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    req_row = tl.load(REQ_POOL_IDX + b).to(tl.int64)
    k_lo, k_hi, n_used = _split_range(seq_len, window_left, split, num_splits, min_split_blocks, CHUNK)
    tok_base = REQ_TO_TOKEN + req_row * stride_r2t
    koff = kv_head * stride_kh
    voff = kv_head * stride_vh
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    head_ok = offs_h < GROUP
    q_head = kv_head * GROUP + offs_h
    if ROPE:
        newest = seq_len - 1  # this step's key: from registers, never read from the cache
        k_ptr, v_ptr, key_ok = _oneshot_ptrs(tok_base, SLOT_MAP, K, V, stride_kn, stride_vn, koff, voff, k_lo, k_hi,
                                             D, CHUNK, HAS_SLOT_MAP)
        is_new = (k_lo + tl.arange(0, CHUNK)) == newest
        k = tl.load(k_ptr, mask=(key_ok & ~is_new)[:, None], other=0.0)
        if not V_LATE:
            v = tl.load(v_ptr, mask=(key_ok & ~is_new)[:, None], other=0.0)
        cos, sin = _rope_cos_sin(COS_SIN + b * stride_cs, offs_d, D)
        pdl_wait_then_release(USE_PDL)
    elif USE_PDL:
        # kernels/pdl.py: the request's row, length and slot ids are written before the step (two or
        # more launches back), so the first two trips overlap the previous kernel; K/V (the newest
        # key is the previous kernel's) and q after the wait
        k_ptr, v_ptr, key_ok = _oneshot_ptrs(tok_base, SLOT_MAP, K, V, stride_kn, stride_vn, koff, voff, k_lo, k_hi,
                                             D, CHUNK, HAS_SLOT_MAP)
        pdl_wait_then_release(USE_PDL)
    if split >= n_used:
        if MARK_EMPTY:
            offs_g = tl.arange(0, GROUP_PAD)
            tl.store(PART_LSE + ((b * tl.num_programs(1) + kv_head) * num_splits + split) * GROUP + offs_g,
                     tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32), mask=offs_g < GROUP)
        return
    single = n_used == 1

    if ROPE:
        q = _rope_rows(Q + b * stride_qt + q_head[:, None] * stride_qh, offs_d, head_ok[:, None], cos, sin, D,
                       ROUND_BF16).to(Q.dtype.element_ty)
        k_new = _rope_rows(K_NEW + b * stride_knt + kv_head * stride_knh, offs_d, offs_d < D, cos, sin, D,
                           ROUND_BF16).to(K.dtype.element_ty)
        v_new = tl.load(V_NEW + b * stride_vnt + kv_head * stride_vnh + offs_d).to(V.dtype.element_ty)
        if split == n_used - 1:  # the split holding the newest key stores it (rope_kv's write)
            slot_new = tl.load(LOC + b).to(tl.int64)
            tl.store(K + slot_new * stride_kn + koff + offs_d, k_new)
            tl.store(V + slot_new * stride_vn + voff + offs_d, v_new)
        k = tl.where(is_new[:, None], k_new[None, :], k)
        if V_LATE:
            v = k  # not read: _oneshot_fold loads V (and takes v_new for the newest key)
        else:
            v = tl.where(is_new[:, None], v_new[None, :], v)
    else:
        if not USE_PDL:
            k_ptr, v_ptr, key_ok = _oneshot_ptrs(tok_base, SLOT_MAP, K, V, stride_kn, stride_vn, koff, voff, k_lo,
                                                 k_hi, D, CHUNK, HAS_SLOT_MAP)
        k = tl.load(k_ptr, mask=key_ok[:, None], other=0.0)
        # q after K, so that it rides K's trip (it has no address to wait for), and through a select, as K in
        # _oneshot_fold: loaded last, V alone may feed its conversion straight from the load.
        q = tl.load(Q + b * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :], mask=head_ok[:, None],
                    other=0.0)
        if V_LATE:
            v = k  # not read: _oneshot_fold loads V
        else:
            v = tl.load(v_ptr, mask=key_ok[:, None], other=0.0)
        is_new = key_ok  # ROPE's arguments of _oneshot_fold, unused without it
        v_new = offs_d
    if HAS_SINKS:
        sink = tl.load(SINKS + q_head, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    q = tl.where(head_ok[:, None], q, 0.0)
    if not DOTS_16BIT:
        q = q.to(tl.float32)
    if HAS_SINKS:
        m_i = tl.where(single, sink, -1.0e30)
        l_i = tl.where(single, 1.0, 0.0) + tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    acc, m_i, l_i = _oneshot_fold(acc, m_i, l_i, q, k, v, v_ptr, key_ok, qk_scale_log2, is_new, v_new, V_LATE,
                                  DOTS_16BIT, ROPE)
    # Only when the request has more than num_splits * CHUNK keys: the split's further chunks.
    for start in range(k_lo + CHUNK, k_hi, CHUNK):
        k_ptr, v_ptr, key_ok = _oneshot_ptrs(tok_base, SLOT_MAP, K, V, stride_kn, stride_vn, koff, voff, start,
                                             k_hi, D, CHUNK, HAS_SLOT_MAP)
        if ROPE:
            is_new = (start + tl.arange(0, CHUNK)) == newest
            k = tl.where(is_new[:, None], k_new[None, :], tl.load(k_ptr, mask=(key_ok & ~is_new)[:, None], other=0.0))
            if V_LATE:
                v = k
            else:
                v = tl.where(is_new[:, None], v_new[None, :],
                             tl.load(v_ptr, mask=(key_ok & ~is_new)[:, None], other=0.0))
        else:
            k = tl.load(k_ptr, mask=key_ok[:, None], other=0.0)
            if V_LATE:
                v = k
            else:
                v = tl.load(v_ptr, mask=key_ok[:, None], other=0.0)
        acc, m_i, l_i = _oneshot_fold(acc, m_i, l_i, q, k, v, v_ptr, key_ok, qk_scale_log2, is_new, v_new, V_LATE,
                                      DOTS_16BIT, ROPE)
    has_keys = l_i > 0  # False only for a zero-length CUDA-graph padding row without sinks
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_ptr = OUT + b * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT:  # num_splits == 1: no partial code in this variant
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=head_ok[:, None])
    else:
        if single:
            tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=head_ok[:, None])
        else:
            # Every used split has at least one key, so l_i > 0 and the lse is finite.
            row = ((b * tl.num_programs(1) + kv_head) * num_splits + split) * GROUP + offs_h
            tl.store(PART_O + row[:, None] * D + offs_d[None, :], out, mask=head_ok[:, None])
            tl.store(PART_LSE + row, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), mask=head_ok)


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------


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


# Extend launch defaults, (query rows per program, warps). The key loop: the H200 sweep's winner at 8k
# (benchmarks/results/sweeps/bench_sink_attention_extend_sweep.md; 64 rows measured level with it in
# bench_sink_attention_extend_window.md). The one-shot window path, a sliding layer of 8192 tokens with sinks
# (bench_sink_attention_extend_window.md, device time): 64 rows / 4 warps 128-129 us, 128 / 8 137-139,
# 128 / 4 160-161, 256 / 8 190-191; the key loop 182-184.
EXTEND_TILE = (128, 4)
WINDOW_TILE = (64, 4)
WINDOW_ONESHOT_MAX_KEYS = 128  # the one-shot window path's largest chunk: its scores stay in registers


def _check_scale(scale: float, who: str) -> None:
    # The kernels take the row max of unscaled scores, which is the max of the scaled ones only for scale > 0.
    if not float(scale) > 0:
        raise ValueError(f"{who}: the softmax scale must be > 0, got {scale}")


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


# The prefill kernel's tile (positions, keys a block, warps, stages): the fastest of diag_extend_fa's textbook
# configs on an H200 (8192 tokens, full layer: 1253 us against the key loop's 1735, 439 vs 317 TFLOP/s,
# benchmarks/results/diag_extend_fa.md); BM must be a multiple of BN (whole blocks before the diagonal).
PREFILL_TILE = (64, 64, 4, 3)
# A sliding layer's (window_left 127): each tile reads 3 blocks of 64 keys, a latency-bound launch; two stages
# measured 123.5 us against 134.1 at three and the one-shot window kernel's 131.3 (8192 tokens, H200,
# benchmarks/results/diag_extend_window.md).
PREFILL_WINDOW_TILE = (64, 64, 4, 2)


def _prefill_views(q, k, v):
    """(q, k, v) as 2-D [T, heads * D] views, or None where the copy engine cannot tile one."""
    from sglang_ext.kernels.tma import tma_2d_ok

    views = []
    for x in (q, k, v):
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            return None
        x2 = x.as_strided((x.shape[0], x.shape[1] * x.shape[2]), (x.stride(0), 1))
        if not tma_2d_ok(x2):
            return None
        views.append(x2)
    return views


# Head sizes the prefill kernel takes: those run on a GPU or in the tests (gpt-oss 64, the tiny model 16); a
# wider head's tiles at the default stages may not fit in shared memory, so it keeps the key loop.
PREFILL_HEAD_DIMS = (16, 32, 64)


def _prefill_shapes_ok(q, k, v) -> bool:
    return (q.dim() == 3 and k.dim() == 3 and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and k.shape == v.shape
            and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and q.shape[2] in PREFILL_HEAD_DIMS
            and q.shape[1] % k.shape[1] == 0)


def prefill_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``sink_attention_prefill`` runs these operands: 16-bit or fp32 q/k/v of one dtype, a head size
    of PREFILL_HEAD_DIMS, and non-empty rows the copy engine can tile; full-causal and sliding layers alike."""
    return _prefill_shapes_ok(q, k, v) and _prefill_views(q, k, v) is not None


def sink_attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_start: Optional[torch.Tensor],
    q_len: torch.Tensor,
    sinks: Optional[torch.Tensor],
    scale: float,
    *,
    window_left: int = -1,
    out: Optional[torch.Tensor] = None,
    tile: Optional[tuple] = None,
) -> torch.Tensor:
    """Causal attention of a ragged batch of prefills with no cached prefix, in one launch: request b's
    queries and keys are rows q_start[b] .. q_start[b] + q_len[b] - 1 of q [T, Hq, D] and of this forward's
    roped k / v [T, Hkv, D] (strided views allowed, `prefill_applies`), so no slot ids are read and K/V come
    by TMA. The same contract as ``sink_attention_extend`` on a cache holding those rows (its bits on an
    H200 for full layers, diag_extend_fa.md), ``window_left`` >= 0 included (a sliding layer: each tile reads
    the blocks from its window's far edge on). ``tile`` = (BM, BN, warps, stages), PREFILL_TILE by default
    (PREFILL_WINDOW_TILE with a window)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _check_scale(scale, "sink_attention_prefill")
    bad = (f"sink_attention_prefill: q {tuple(q.shape)} {q.dtype} / k {tuple(k.shape)} / v {tuple(v.shape)} are "
           f"not TMA-tileable [T, heads, D] rows of one 16-bit or fp32 dtype with D in {PREFILL_HEAD_DIMS}")
    if not _prefill_shapes_ok(q, k, v):
        raise ValueError(bad)
    t, hq, d = q.shape
    bm, bn, warps, stages = tile or (PREFILL_WINDOW_TILE if window_left >= 0 else PREFILL_TILE)
    if bm % bn:
        raise ValueError(f"sink_attention_prefill: the tile's {bm} positions must be a multiple of its {bn} keys")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"sink_attention_prefill: out must be {tuple(q.shape)} with a unit last stride")
    num_reqs = q_len.shape[0]
    if t == 0 or num_reqs == 0:
        return out
    views = _prefill_views(q, k, v)
    if views is None:
        raise ValueError(bad)
    q2, k2, v2 = views
    if q_start is None:
        q_start = torch.cumsum(q_len, 0) - q_len
    tile_end = torch.cumsum(torch.div(q_len + bm - 1, bm, rounding_mode="floor"), 0).to(torch.int32)
    _sink_prefill_kernel[(triton.cdiv(t, bm) + num_reqs, hq)](
        TensorDescriptor.from_tensor(q2, [bm, d]), TensorDescriptor.from_tensor(k2, [bn, d]),
        TensorDescriptor.from_tensor(v2, [bn, d]),
        out, sinks if sinks is not None else q, q_start, q_len, tile_end, num_reqs, float(scale) * LOG2E,
        out.stride(0), out.stride(1), max(int(window_left), 0),
        GROUP=hq // k.shape[1], D=d, BM=bm, BN=bn, STAGES=stages, HAS_SINKS=sinks is not None,
        WINDOW=window_left >= 0, DOTS_16BIT=_use_16bit_dots(q.dtype, k.dtype), num_warps=warps,
    )
    return out


@dataclass(frozen=True)
class DecodeConfig:
    """Launch choices of the decode kernel; all host constants, so a CUDA graph captures one of them
    per batch size. ``num_splits`` is the most splits of one (request, kv head); how many carry keys
    is decided on the device from its length (``_split_range``). ``merge_heads`` / ``merge_splits``
    override the merge's tile (_merge_tile), for tests and sweeps."""
    num_splits: int = 1
    block_n: int = 64
    min_split_blocks: int = 2
    num_warps: int = 4
    num_stages: int = 3
    fused_merge: bool = True
    prefetch: bool = True  # next block's K/V loads in flight during this block's maths
    # The merge's tile (0: _merge_tile's choice): q heads per merge-kernel program, splits per load.
    merge_heads: int = 0
    merge_splits: int = 0
    # The one-shot decode (_sink_decode_oneshot_kernel): each split is one chunk of block_n keys (a power of
    # two >= 16) read in one K and one V load, no key loop; num_splits covers max_context / block_n chunks up
    # to MAX_SPLITS (oneshot_config). Its merge is always the merge kernel (fused_merge and prefetch are not
    # read). v_late: V's load is issued after the scores instead of with K.
    oneshot: bool = False
    v_late: bool = False
    # One-shot only: a register cap per thread (ptxas maxnreg; 0: none), so that more programs fit an SM
    # (65536 registers: 4 programs of 4 warps need <= 128 each, and the batch-1 8k grid is 512 programs).
    max_regs: int = 0


SHORT_KEYS = 256  # at most this many keys (a gpt-oss sliding layer: 128): one pass, no split
LONG_KEYS = 8192  # above this max context the batch-1 and batch-4 choices change (sweep below)


class OneshotPick(NamedTuple):
    """A one-shot decode variant (oneshot_config's arguments): keys per split, V after the scores, warps,
    the split cap."""
    chunk: int = 128
    v_late: bool = False
    num_warps: int = 4
    max_splits: int = MAX_SPLITS
    max_regs: int = 0


ONESHOT_MAX_BATCH = 4
# Where decode_config returns the one-shot decode instead of the split loop: (batch, keys) -> OneshotPick
# for batch 1 .. ONESHOT_MAX_BATCH (batch 3 takes batch 4's entry), keys "short" (at most SHORT_KEYS: the
# sliding layers), "<=8k" or ">8k" (max_context past LONG_KEYS: serving, where max_context is the model's
# context length). A missing entry keeps the split loop's choice. Empty until the H200 sweep of the
# one-shot variants (benchmarks/bench_sink_attention.py --decode-sweep --oneshot) names winners; then e.g.
#   ONESHOT_PICKS = {(b, k): OneshotPick(chunk=128) for b in (1, 2, 4) for k in ("<=8k", ">8k")}
#
# H200 sweep (benchmarks/results/sweeps/bench_sink_attention_decode_oneshot.md, 2026-11-30): the one-shot
# decode wins only by a little, and only here: batch 1 at max context <= 8k, full layers, chunk 128 / V late
# 12.2 vs 13.1 us; sliding layers (one 128-key chunk) 3.8 vs 4.0 us (batch 1), 4.2 vs 4.4 (2), 4.8 vs 5.0
# (4). Everywhere else the split loop is faster (batch 2-4 at 8k by 5-14 %, every 32k point); at batch 1
# with max context 131072 it was 1.05x at 8k but slower at 32k, so ">8k" keeps the split loop. Its
# programs still wait three memory latencies in a row (length -> slot ids -> K/V), which the merge
# launch adds to: the read floor of 16.8 MB is 5.6 us (diag_floor.md).
#
# Why the register cap (benchmarks/results/diag_sink_decode.md, ncu): at 135
# registers that pick ran 3 programs an SM, so its 512 programs took two waves (1.29 waves a launch); with
# RoPE + the KV write in the launch (RopeKV) it held 192-242. Capped at 128 (4 spills) the 8k grid fits one
# wave: fused 11.6 us vs 14.7 uncapped (unfused chain 15.1); in the whole step, paired graphs, 120b batch 1
# -78 us against the unfused step, 20b -49, logits bit-equal (diag_rope_fusion.md; uncapped -30 / -26).
ONESHOT_PICKS: dict = {(1, "<=8k"): OneshotPick(chunk=128, v_late=True, max_regs=128),
                       **{(b, "short"): OneshotPick(chunk=128) for b in (1, 2, 4)}}


def _keys_kind(keys: int) -> str:
    return "short" if keys <= SHORT_KEYS else ">8k" if keys > LONG_KEYS else "<=8k"


def oneshot_config(batch: int, num_kv_heads: int, window_left: int, max_context: int, chunk: int = 128,
                   v_late: bool = False, num_warps: int = 4, max_splits: int = MAX_SPLITS,
                   max_regs: int = 0) -> DecodeConfig:
    """The one-shot decode from host-known values only (CUDA-graph safe): one split per ``chunk`` keys
    that a request may have (max_context, or the window's keys), at most ``max_splits``; a request longer
    than max_splits * chunk keys folds several chunks per split. ``batch`` and ``num_kv_heads`` do not
    enter (the grid grows with them), kept for decode_config's signature."""
    del batch, num_kv_heads
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"oneshot_config: chunk must be a power of two >= 16, got {chunk}")
    keys = max_context if window_left < 0 else min(max_context, window_left + 1)
    splits = max(1, min(max_splits, triton.cdiv(keys, chunk)))
    return DecodeConfig(num_splits=splits, block_n=chunk, min_split_blocks=1, num_warps=num_warps, num_stages=1,
                        fused_merge=False, prefetch=False, oneshot=True, v_late=v_late, max_regs=max_regs)


def decode_config(batch: int, num_kv_heads: int, window_left: int, max_context: int,
                  device: torch.device) -> DecodeConfig:
    """Decode launch choices from host-known values only (CUDA-graph safe): the batch, the window and
    ``max_context`` (req_to_token's width, an upper bound on any request's length; under SGLang that is
    the model's context length, so serving takes the "> 8k" rows).

    Decode reads every key once and is bound by memory, so the grid must hold enough programs to keep
    the HBM busy, but every split adds a partial write and read. The rule follows the H200 sweep
    (benchmarks/results/sweeps/bench_sink_attention_decode_sweep.md, gpt-oss 64/8 heads, D 64, bf16,
    triton 3.6; "p/SM" = splits for p programs per SM, capped by max_context / (64 * m) for m blocks
    at least per split). Each choice is that sweep's winner at its points (tests check this against the
    .json):

      sliding (<= 256 keys)   one program per (request, kv head), one 128-key block, 4 warps:
                              4.5-7.0 us at batch 1-32 (old 2 splits + merge kernel: 7.4-12.2; 8 warps
                              4.6-7.6)
      batch 1, ctx <= 8k      old: 2/SM, m1, merge kernel, no prefetch: 21.8 us (4/SM m2 w2: 24.0)
      batch 1, ctx > 8k       4/SM, m2, 2 warps, fused merge, prefetch: 39.8 us at 32k (old 44.9)
      batch 2                 same: 23.7 us at 8k (old 25.9), 53.7 at 32k (old 69.6)
      batch 3-4, ctx <= 8k    same: 32.7 us at batch 4 (old 39.5)
      batch 3-4, ctx > 8k     4/SM, m2, 4 warps, fused merge, no prefetch: 94.1 us at 32k (old 117.4;
                              2 warps with prefetch 113.7)
      batch 5-15              8/SM, m2, 4 warps, fused merge, no prefetch: batch 8: 59.0 us at 8k
                              (old 61.4), 172.4 at 32k (old 200.4)
      batch >= 16             old: 164.5 us at batch 32, 8k (best new 174.9), 589.6 at 32k (678.4).
                              Batch 16 was not measured; it takes the old choice, the safe side.

    Since the merge kernel loads every split at once (no serial loop: 2-3 us, was 9.8 at batch 1),
    it beats the fused last-arriver merge wherever both were timed
    (benchmarks/results/sweeps/bench_sink_attention_merge.md): batch 1, 4/SM m2 w2 prefetch: 13.1 vs
    24.5 us at 8k, 28.9 vs 40.6 at 32k; batch 8: 49.3 vs 64.9 at 8k, 156.9 vs 203.3 at 32k. So the
    rows above that said "fused merge" keep their split/warp/prefetch choice and use the merge kernel.

    At batch 1 .. ONESHOT_MAX_BATCH, an entry of ONESHOT_PICKS replaces the rows above with the one-shot
    decode (oneshot_config).
    """
    keys = max_context if window_left < 0 else min(max_context, window_left + 1)
    if batch <= ONESHOT_MAX_BATCH:
        pick = ONESHOT_PICKS.get((4 if batch == 3 else batch, _keys_kind(keys)))
        if pick is not None:
            return oneshot_config(batch, num_kv_heads, window_left, max_context, *pick)
    if keys <= SHORT_KEYS:
        block_n = max(16, min(128, triton.next_power_of_2(max(keys, 1))))
        return DecodeConfig(num_splits=1, block_n=block_n, num_warps=4, prefetch=False)
    sms = num_sms(device, off_gpu=1)

    def splits(programs_per_sm: int, min_split_blocks: int, cap: int = MAX_SPLITS) -> int:
        return max(1, min(cap, triton.cdiv(programs_per_sm * sms, batch * num_kv_heads),
                          triton.cdiv(keys, 64 * min_split_blocks)))

    long = keys > LONG_KEYS
    if batch >= 16 or (batch == 1 and not long):
        # ~2 programs per SM (at most 32 splits), one key block at least per split, the plain key loop
        return DecodeConfig(num_splits=splits(2, 1, cap=32), block_n=64, min_split_blocks=1, num_warps=4,
                            num_stages=3, fused_merge=False, prefetch=False)
    if batch <= 2 or (batch <= 4 and not long):
        return DecodeConfig(num_splits=splits(4, 2), block_n=64, min_split_blocks=2, num_warps=2, num_stages=3,
                            fused_merge=False, prefetch=True)
    return DecodeConfig(num_splits=splits(4 if batch <= 4 else 8, 2), block_n=64, min_split_blocks=2, num_warps=4,
                        num_stages=3, fused_merge=False, prefetch=False)


MERGE_LOAD_PER_THREAD = 64  # fp32 partial values one merge load brings to each thread (registers)
MERGE_PROGRAM_ELEMS = 2048  # merge kernel: group q heads into one program until its load holds this many


def _merge_tile(config: DecodeConfig, group: int, d: int, num_warps: int, fused: bool) -> tuple:
    """(q heads per merge program, splits per merge load), powers of two. The merge reads every split's
    partial once and is bound by how many bytes its programs have in flight, so each load is as large as
    the registers allow (MERGE_LOAD_PER_THREAD). The fused merge runs in a decode program: the whole
    group per load. The merge kernel: every split in one load where that fits (up to 128 splits at D 64),
    and fewer heads per program the more splits there are (batch 1, 32 splits: one q head per program,
    64 programs on 64 SMs instead of 8 looping), so large batches with 2-3 splits still get a group per
    program rather than a program per handful of values."""
    group_pad = triton.next_power_of_2(group)
    values = MERGE_LOAD_PER_THREAD * 32 * num_warps
    if fused:
        # Not capped by the split count: the decode kernel keeps one compiled variant for all batches.
        chunk = config.merge_splits or max(1, values // (group_pad * d))
        return group_pad, triton.next_power_of_2(chunk)
    chunk = min(triton.next_power_of_2(config.num_splits),
                triton.next_power_of_2(config.merge_splits or max(1, values // d)))
    heads = config.merge_heads or max(1, MERGE_PROGRAM_ELEMS // (chunk * d))
    return min(group_pad, triton.next_power_of_2(heads)), chunk


def launch_merge(part_o: torch.Tensor, part_lse: torch.Tensor, sinks: Optional[torch.Tensor], out: torch.Tensor,
                 seq_lens: torch.Tensor, window_left: int, config: DecodeConfig, num_warps: int = 4) -> None:
    """The merge kernel over the partials part_o [B, Hkv, splits, group, D] and part_lse [B, Hkv, splits,
    group] of a decode launch with ``config`` (split boundaries are recomputed from seq_lens); writes out
    [B, Hq, D] for requests that used more than one split. Separate from sink_attention_decode so that a
    benchmark can time the merge alone."""
    batch, hkv, splits, group, d = part_o.shape
    heads, chunk = _merge_tile(config, group, d, num_warps, fused=False)
    _sink_decode_merge_kernel[(batch, hkv, triton.cdiv(group, heads))](
        part_o, part_lse, sinks if sinks is not None else out, out, seq_lens, out.stride(0), out.stride(1),
        int(window_left), splits, config.min_split_blocks,
        GROUP=group, HEADS=heads, D=d, BLOCK_N=config.block_n, S_CHUNK=chunk, HAS_SINKS=sinks is not None,
        SPECULATE=chunk >= splits, num_warps=num_warps, **pdl_launch_kwargs(out.device, batch),
    )


class RopeKV(NamedTuple):
    """This step's unrotated k and v rows [B, Hkv, D] (views of the qkv GEMM's output, unit last stride),
    their RoPE rows ``cos_sin`` [B, D] (fp32, kernels/rope_kv.py's layout) and the cache slots ``loc`` [B]
    they go to. Given to ``sink_attention_decode(rope=...)`` with q unrotated: the decode then does
    rope_kv's work too, in its own launch (one-shot or split loop; rope_store_kv first with the fusion off)."""
    k: torch.Tensor
    v: torch.Tensor
    cos_sin: torch.Tensor
    loc: torch.Tensor


_rope_fusion_override: Optional[bool] = None  # set_rope_fusion(): benchmarks compare both in one process


def set_rope_fusion(enabled: Optional[bool]) -> None:
    """Force the decode's RoPE + KV write (RopeKV) inside its own launch (one-shot and split loop) on or off
    from now on (None: back to the default, on: measured faster, see ONESHOT_PICKS' comment). Off,
    rope_store_kv runs first. CUDA graphs keep what they captured."""
    global _rope_fusion_override
    _rope_fusion_override = enabled


def rope_fusion_enabled() -> bool:
    return _rope_fusion_override is not False


COUNTERS_OWNER = "sink_attention_merge"
MAX_COUNTERS = 1 << 16  # (request, kv head) pairs of one launch


def _split_counters(device: torch.device) -> Optional[torch.Tensor]:
    """The fused merge's arrival counters (`arrival_counters`); None inside a capture that would
    need them made, and the caller uses the merge kernel."""
    return arrival_counters(COUNTERS_OWNER, device, MAX_COUNTERS)


def sink_attention_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: Optional[torch.Tensor],
    window_left: int,
    scale: float,
    *,
    slot_map: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    config: Optional[DecodeConfig] = None,
    num_splits: Optional[int] = None,
    block_n: Optional[int] = None,
    min_split_blocks: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    fused_merge: Optional[bool] = None,
    prefetch: Optional[bool] = None,
    merge_heads: Optional[int] = None,
    merge_splits: Optional[int] = None,
    oneshot: Optional[bool] = None,
    v_late: Optional[bool] = None,
    rope: Optional[RopeKV] = None,
) -> torch.Tensor:
    """One query row per request (row b = request b, at position seq_lens[b] - 1): out [B, Hq, D] in q's
    dtype. ``config`` None picks from the batch, the window, req_to_token's width and the SM count
    (decode_config); the keyword arguments override single fields of it. With ``rope`` (RopeKV), q is
    unrotated and this step's k / v are not in the cache yet: they are rotated and stored as
    ``rope_store_kv`` would, inside the decode's launch (``_sink_decode_oneshot_kernel``'s or
    ``_sink_decode_kernel``'s ROPE), or by rope_store_kv before it with the fusion off
    (set_rope_fusion(False)); either way k_buffer / v_buffer hold them afterwards."""
    hq, hkv, d = _check_common(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sinks, slot_map)
    _check_scale(scale, "sink_attention_decode")
    batch = q.shape[0]
    if req_pool_indices.shape[0] != batch:
        raise ValueError(f"sink_attention_decode: {batch} q rows for {req_pool_indices.shape[0]} requests")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"sink_attention_decode: out must be {tuple(q.shape)} with a unit last stride")
    if batch == 0:
        return out
    if config is None:
        config = decode_config(batch, hkv, window_left, req_to_token.shape[1], q.device)
    overrides = dict(num_splits=num_splits, block_n=block_n, min_split_blocks=min_split_blocks,
                     num_warps=num_warps, num_stages=num_stages, fused_merge=fused_merge, prefetch=prefetch,
                     merge_heads=merge_heads, merge_splits=merge_splits, oneshot=oneshot, v_late=v_late)
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if rope is not None:
        if not rope_fusion_enabled():
            q = rope_store_kv(q, rope.k, rope.v, rope.cos_sin, k_buffer, v_buffer, rope.loc)  # checks them
            rope = None
        else:
            check_rope_kv(q, rope.k, rope.v, rope.cos_sin, k_buffer, v_buffer, rope.loc, unit_last_stride=True)
    if config.num_splits < 1 or config.min_split_blocks < 1 or config.merge_heads < 0 or config.merge_splits < 0:
        raise ValueError(f"sink_attention_decode: num_splits and min_split_blocks must be >= 1, the merge tile "
                         f">= 0, got {config}")
    if config.max_regs < 0:
        raise ValueError(f"sink_attention_decode: max_regs must be >= 0 (0: no cap), got {config.max_regs}")
    if config.oneshot and (config.block_n < 16 or config.block_n & (config.block_n - 1)):
        raise ValueError(f"sink_attention_decode: the one-shot chunk (block_n) must be a power of two >= 16, "
                         f"got {config.block_n}")
    splits = config.num_splits
    group = hq // hkv
    counters = None
    if splits > 1:
        part_o = torch.empty((batch, hkv, splits, group, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, hkv, splits, group), dtype=torch.float32, device=q.device)
        if config.fused_merge and not config.oneshot and batch * hkv <= MAX_COUNTERS:
            counters = _split_counters(q.device)
    else:
        part_o = part_lse = out
    sinks_arg = sinks if sinks is not None else q
    if config.oneshot:
        if rope is not None:
            rope_args = (rope.k, rope.v, rope.cos_sin, rope.loc)
            rope_strides = (rope.k.stride(0), rope.k.stride(1), rope.v.stride(0), rope.v.stride(1),
                            rope.cos_sin.stride(0))
        else:
            rope_args, rope_strides = (q, q, q, seq_lens), (0, 0, 0, 0, 0)
        _sink_decode_oneshot_kernel[(batch, hkv, splits)](
            q, k_buffer, v_buffer, out, part_o, part_lse, sinks_arg, req_to_token,
            slot_map if slot_map is not None else req_to_token, req_pool_indices, seq_lens, *rope_args,
            q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
            v_buffer.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0), *rope_strides,
            int(window_left), float(scale) * LOG2E, splits, config.min_split_blocks,
            GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_H=max(16, triton.next_power_of_2(group)),
            D=d, CHUNK=config.block_n, SPLIT=splits > 1,
            # Empty splits mark their lse only for a merge that loads every split's row (launch_merge's tile).
            MARK_EMPTY=splits > 1 and _merge_tile(config, group, d, 4, fused=False)[1] >= splits,
            V_LATE=config.v_late, HAS_SINKS=sinks is not None, HAS_SLOT_MAP=slot_map is not None,
            DOTS_16BIT=_use_16bit_dots(q.dtype, k_buffer.dtype), ROPE=rope is not None,
            ROUND_BF16=rope is not None and interpreted() and torch.bfloat16 in (q.dtype, k_buffer.dtype),
            num_warps=config.num_warps, num_stages=config.num_stages,
            **({"maxnreg": config.max_regs} if config.max_regs and not interpreted() else {}),
            **pdl_launch_kwargs(q.device, batch),
        )
        if splits > 1:
            launch_merge(part_o, part_lse, sinks, out, seq_lens, window_left, config)
        return out
    # The split count and size are runtime arguments: one compiled decode variant serves every batch size
    # (the merge kernel has one per power-of-two bucket of the split count: its tile).
    rope_kw = {}
    if rope is not None:
        rope_kw = dict(K_NEW=rope.k, V_NEW=rope.v, COS_SIN=rope.cos_sin, LOC=rope.loc,
                       stride_knt=rope.k.stride(0), stride_knh=rope.k.stride(1), stride_vnt=rope.v.stride(0),
                       stride_vnh=rope.v.stride(1), stride_cs=rope.cos_sin.stride(0), ROPE=True,
                       ROUND_BF16=interpreted() and torch.bfloat16 in (q.dtype, k_buffer.dtype))
    _sink_decode_kernel[(batch, hkv, splits)](
        q, k_buffer, v_buffer, out, part_o, part_lse, counters if counters is not None else seq_lens, sinks_arg,
        req_to_token, slot_map if slot_map is not None else req_to_token, req_pool_indices, seq_lens,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0),
        int(window_left), float(scale) * LOG2E, splits, config.min_split_blocks,
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_H=max(16, triton.next_power_of_2(group)), D=d,
        BLOCK_N=config.block_n, SPLIT=splits > 1,
        MERGE_S=_merge_tile(config, group, d, config.num_warps, fused=True)[1], FUSED_MERGE=counters is not None,
        PREFETCH=config.prefetch, HAS_SINKS=sinks is not None,
        HAS_SLOT_MAP=slot_map is not None, DOTS_16BIT=_use_16bit_dots(q.dtype, k_buffer.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages, **rope_kw,
        **pdl_launch_kwargs(q.device, batch, "attention"),
    )
    if splits > 1 and counters is None:
        launch_merge(part_o, part_lse, sinks, out, seq_lens, window_left, config)
    return out


def paged_attention(
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
    rope: Optional[RopeKV] = None,
    no_prefix: bool = False,
) -> torch.Tensor:
    """Extend or decode, chosen from shapes alone. Contract (SGLang's): every request has at least one
    query row, so T == B means one row per request, i.e. decode, with rows in request order. ``rope``:
    q unrotated and this forward's k / v still to be rotated and stored (RopeKV; the decode may fuse it).
    ``no_prefix`` (the caller knows no request has cached keys before its rows): with ``rope``, the extend
    reads its keys from this forward's rows (``sink_attention_prefill``) instead of the cache."""
    if q.shape[0] == req_pool_indices.shape[0]:
        return sink_attention_decode(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sinks,
                                     window_left, scale, slot_map=slot_map, out=out, rope=rope)
    if rope is not None:
        # (the cache's own dtype: the key loop would read the keys as stored, e.g. quantised)
        if (no_prefix and k_buffer.dtype == rope.k.dtype and v_buffer.dtype == rope.v.dtype
                and prefill_applies(q, rope.k, rope.v)):
            k_roped = torch.empty(rope.k.shape, dtype=rope.k.dtype, device=rope.k.device)
            q = rope_store_kv(q, rope.k, rope.v, rope.cos_sin, k_buffer, v_buffer, rope.loc, k_out=k_roped)
            return sink_attention_prefill(q, k_roped, rope.v, q_start, q_len, sinks, scale,
                                          window_left=window_left, out=out)
        q = rope_store_kv(q, rope.k, rope.v, rope.cos_sin, k_buffer, v_buffer, rope.loc)
    return sink_attention_extend(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, q_start, q_len,
                                 sinks, window_left, scale, slot_map=slot_map, out=out)


# ---------------------------------------------------------------------------------------------------------
# reference
# ---------------------------------------------------------------------------------------------------------


def sink_attention_ref(
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
    max_elems: int = 1 << 26,
) -> torch.Tensor:
    """The launchers' contract in plain torch, fp32 maths, out in q's dtype (decode: q_len all ones).

    Per request: gather the visible keys through req_to_token (and slot_map), mask causal + window,
    softmax with the sink as one extra logit column. Query rows go in chunks so that scores stay under
    ``max_elems`` (long full-causal prompts at 64 heads would not fit otherwise)."""
    hq, hkv, d = _check_common(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sinks, slot_map)
    group = hq // hkv
    out = torch.zeros_like(q)
    if q_start is None:
        q_start = torch.cumsum(q_len, 0) - q_len
    for rpi, seq_len, start, n in zip(req_pool_indices.tolist(), seq_lens.tolist(), q_start.tolist(),
                                      q_len.tolist()):
        first = seq_len - n
        rows_per_chunk = max(1, max_elems // (hq * max(seq_len, 1)))
        for c0 in range(0, n, rows_per_chunk):
            c1 = min(n, c0 + rows_per_chunk)
            lo = max(0, first + c0 - window_left) if window_left >= 0 else 0
            hi = first + c1  # keys lo .. hi-1
            slots = req_to_token[rpi, lo:hi].long()
            if slot_map is not None:
                slots = slot_map[slots].long()
            k = k_buffer[slots].float()  # [L, Hkv, D]
            v = v_buffer[slots].float()
            qf = q[start + c0:start + c1].float().view(c1 - c0, hkv, group, d)
            scores = torch.einsum("qhgd,khd->hgqk", qf, k) * scale
            q_pos = torch.arange(first + c0, first + c1, device=q.device).view(-1, 1)
            k_pos = torch.arange(lo, hi, device=q.device).view(1, -1)
            visible = k_pos <= q_pos
            if window_left >= 0:
                visible &= k_pos >= q_pos - window_left
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                sink_col = sinks.float().view(hkv, group, 1, 1).expand(hkv, group, c1 - c0, 1)
                scores = torch.cat([scores, sink_col], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., : hi - lo]
            ctx = torch.einsum("hgqk,khd->qhgd", probs, v)
            out[start + c0:start + c1] = ctx.reshape(c1 - c0, hq, d).to(q.dtype)
    return out
