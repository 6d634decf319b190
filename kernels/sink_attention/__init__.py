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

Layout (one module per size regime; this package's names are the public API, re-exported here):
  - ``common``: the key loop, the extend/prefill tile numbering, the launchers' checks (every regime);
  - ``extend``: extend over the paged cache, the key loop and the one-shot window kernel;
  - ``prefill``: a prefill with no cached prefix, keys from this forward's rows by TMA;
  - ``decode``: one query row per request, split loop, one-shot and merge kernels, RoPE + KV write fused
    (``set_rope_fusion``'s flag lives there);
  - ``config``: the decode launch tables (``decode_config``, ``ONESHOT_PICKS``, the merge tile);
  - ``reference``: ``sink_attention_ref``;
  - here: ``paged_attention``, the dispatch between them.
Kernels and the names they and their launchers use are looked up in the module that defines or imports them:
patch them there (e.g. ``config.ONESHOT_PICKS``, ``extend._sink_extend_kernel``, ``decode.rope_store_kv``), not
on this package.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_ext.kernels._util import num_sms  # noqa: F401  (read through this package by the benchmarks)
from sglang_ext.kernels.rope_kv import rope_store_kv

from .common import LOG2E, MAX_SPLITS  # noqa: F401
from .config import (LONG_KEYS, MERGE_LOAD_PER_THREAD, MERGE_PROGRAM_ELEMS, ONESHOT_MAX_BATCH,  # noqa: F401
                     ONESHOT_PICKS, SHORT_KEYS, DecodeConfig, OneshotPick, _keys_kind, _merge_tile, decode_config,
                     oneshot_config)
from .decode import (COUNTERS_OWNER, MAX_COUNTERS, RopeKV, launch_merge, rope_fusion_enabled,  # noqa: F401
                     set_rope_fusion, sink_attention_decode)
from .extend import EXTEND_TILE, WINDOW_ONESHOT_MAX_KEYS, WINDOW_TILE, sink_attention_extend  # noqa: F401
from .prefill import (PREFILL_HEAD_DIMS, PREFILL_TILE, PREFILL_WINDOW_TILE, prefill_applies,  # noqa: F401
                      sink_attention_prefill)
from .reference import sink_attention_ref  # noqa: F401


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
