"""Sink attention, prefill without a cached prefix: keys are this forward's own rows, read by TMA, no slot
ids; full-causal and sliding layers. ``prefill_applies`` says whether the operands suit it (else the extend
key loop over the cache runs).

Invariant: the extend contract on a cache holding those rows (same visible keys, sink once, fp32 softmax);
blocks before a tile's diagonal unmasked, the diagonal and the window's far edge masked."""

from __future__ import annotations

from typing import Optional

import torch

import triton
import triton.language as tl

from .common import LOG2E, _check_scale, _extend_tile_request, _use_16bit_dots


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
