"""Sink attention in plain torch (fp32 maths), every regime: the launchers' contract, the CPU fallback and the
test oracle. Invariant: independent of the kernels' tiling: keys gathered per request, masked, the sink as one
extra logit column."""

from __future__ import annotations

from typing import Optional

import torch

from .common import _check_common


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
