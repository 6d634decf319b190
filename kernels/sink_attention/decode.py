"""Sink attention, decode (one query row per request): the flash-decoding split loop, the one-shot decode for
small batches, the split merge (last arriver or a second launch), and RoPE + the KV write fused into the launch
(RopeKV; ``set_rope_fusion``'s flag lives here and only here).

Invariant: the sink joins the softmax denominator exactly once, whatever the splits (in the split that owns a
single-split request, else in the merge); split boundaries are recomputed identically on the device by every
split and by the merge (``_split_range``); no host read of tensor values (CUDA-graph safe)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import torch

import triton
import triton.language as tl

from sglang_ext.kernels._util import interpreted
from sglang_ext.kernels.arrival_counters import arrival_counters
from sglang_ext.kernels.fp8_gemm import _round_to_bf16_grid
from sglang_ext.kernels.online_softmax import block_scores, block_weights, online_softmax_step
from sglang_ext.kernels.pdl import pdl_launch_kwargs, pdl_wait_then_release
from sglang_ext.kernels.rope_kv import check_rope_kv, rope_first_half, rope_second_half, rope_store_kv

from .common import LOG2E, _attend_key_range, _check_common, _check_scale, _use_16bit_dots
from .config import DecodeConfig, _merge_tile, decode_config


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
def _pv(p, v, DOTS_16BIT: tl.constexpr):
    """P.V [rows, D] of the fp32 weights p [rows, keys]: with 16-bit V on tensor cores, p entering as a hi + lo
    pair of 16-bit values (~16 mantissa bits: a decode is bound by memory, not by these dots)."""
    if DOTS_16BIT:
        p_hi = p.to(v.dtype)
        pv = tl.dot(p_hi, v) + tl.dot((p - p_hi.to(tl.float32)).to(v.dtype), v)
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return pv


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
        m_new, alpha, p, l_i = block_weights(m_i, l_i, q, k, start, offs_n, key_hi, qk_scale_log2, True, DOTS_16BIT)
        pv = _pv(p, v, DOTS_16BIT)
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
def _sinks_log2(SINKS, q_head, head_ok, HAS_SINKS: tl.constexpr):
    """The q heads' sinks in log2 units (without sinks a 0 that nothing reads)."""
    if HAS_SINKS:
        sink = tl.load(SINKS + q_head, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    else:
        sink = 0.0
    return sink


@triton.jit
def _split_start(sink, single, BLOCK_H: tl.constexpr, D: tl.constexpr, HAS_SINKS: tl.constexpr):
    """(max, denominator, output) of a split's q heads before any key. The sink enters only where the split is
    its request's single one (else the merge adds it, once), as the max with weight exp2(sink - sink) = 1."""
    if HAS_SINKS:
        m_i = tl.where(single, sink, -1.0e30)
        l_i = tl.where(single, 1.0, 0.0) + tl.zeros([BLOCK_H], dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    return m_i, l_i, tl.zeros([BLOCK_H, D], dtype=tl.float32)


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
    m_i, l_i, acc = _split_start(_sinks_log2(SINKS, q_head, head_ok, HAS_SINKS), single, BLOCK_H, D, HAS_SINKS)
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
    s = block_scores(q, k, DOTS_16BIT)
    s = tl.where(key_ok[None, :], s * qk_scale_log2, float("-inf"))
    # m_i is finite (sink or -1e30): no -inf - -inf
    m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, s, True)
    if V_LATE:
        if ROPE:
            v = tl.load(v_ptr, mask=(key_ok & ~is_new)[:, None], other=0.0)
            v = tl.where(is_new[:, None], v_new[None, :], v)
        else:
            v = tl.load(v_ptr, mask=key_ok[:, None], other=0.0)
    pv = _pv(p, v, DOTS_16BIT)
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
    sink = _sinks_log2(SINKS, q_head, head_ok, HAS_SINKS)
    q = tl.where(head_ok[:, None], q, 0.0)
    if not DOTS_16BIT:
        q = q.to(tl.float32)
    m_i, l_i, acc = _split_start(sink, single, BLOCK_H, D, HAS_SINKS)  # the chunk loop's state, in its order
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


_rope_fusion_override: Optional[bool] = None  # set_rope_fusion(): tests compile and compare both in one process


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
