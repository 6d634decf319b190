"""Attention with per-head sinks and an inclusive sliding window: the torch path.

SGLang-free. The SGLang backend (`sglang_ext.attention_backend`) gathers each
request's keys/values out of the paged KV pool and calls `sink_attention_torch`;
the Triton path for H200 (kernels issue) replaces this call, not the backend.

Conventions (gpt-oss, SPEC §1):
  - `window_left` is the number of *earlier* keys a query may see, SGLang's
    `sliding_window_size` (= config.sliding_window - 1 = 127): key j is visible to
    query i iff i - window_left <= j <= i, i.e. 128 keys including itself.
    A negative value means full causal attention.
  - the sink is one extra logit column per query head that joins the softmax
    denominator once and contributes no value.
"""

from __future__ import annotations

import torch

from sglang_ext.kernel_select import use_triton


def sink_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    q_positions: torch.Tensor,
    k_start: int,
    window_left: int,
    scale: float,
) -> torch.Tensor:
    """Attention of queries at absolute `q_positions` over keys at k_start..k_start+L-1.

    q: [Q, Hq, D]; k, v: [L, Hkv, D] with Hq a multiple of Hkv (GQA); sinks: [Hq].
    Scores, softmax and the weighted sum run in fp32; the result is cast to q's dtype.
    """
    num_q, num_q_heads, head_dim = q.shape
    num_k, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    assert group * num_kv_heads == num_q_heads, (num_q_heads, num_kv_heads)

    qf = q.float().view(num_q, num_kv_heads, group, head_dim)
    kf = k.float()
    vf = v.float()
    scores = torch.einsum("qhgd,khd->hgqk", qf, kf) * scale  # [Hkv, G, Q, L]

    k_positions = torch.arange(k_start, k_start + num_k, device=q.device)
    qp = q_positions.to(q.device).view(-1, 1)
    visible = k_positions.view(1, -1) <= qp
    if window_left >= 0:
        visible &= k_positions.view(1, -1) >= qp - window_left
    scores = scores.masked_fill(~visible, float("-inf"))

    row_max = scores.amax(dim=-1)  # [Hkv, G, Q]
    if sinks is not None:
        sink = sinks.float().view(num_kv_heads, group, 1)
        row_max = torch.maximum(row_max, sink)
    # A query always sees itself, so row_max is finite.
    probs = torch.exp(scores - row_max.unsqueeze(-1))
    denom = probs.sum(dim=-1)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    out = torch.einsum("hgqk,khd->qhgd", probs, vf) / denom.permute(2, 0, 1).unsqueeze(-1)
    return out.reshape(num_q, num_q_heads, head_dim).to(q.dtype)


def paged_sink_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_start: torch.Tensor,
    q_len: torch.Tensor,
    sinks: torch.Tensor | None,
    window_left: int,
    scale: float,
    rope=None,
    no_prefix: bool = False,
) -> torch.Tensor:
    """Attention of flattened query rows over SGLang's paged KV layout, [T, Hq, D].

    ``rope`` (kernels/sink_attention/decode.py's RopeKV: this forward's unrotated k / v rows, their cos_sin rows
    and cache slots): q is unrotated and k / v are rotated and written to the cache first (at decode the
    one-shot kernel does that in its own launch); without it, q is rotated and the cache already written.
    ``no_prefix``: the caller knows no request has cached keys before its rows (the kernel path then
    reads this forward's keys as rows, sliding layers too: ``sink_attention_prefill``; the same contract).

    Request b owns rows q_start[b] .. q_start[b]+q_len[b]-1, at the last q_len[b] of its
    seq_lens[b] positions; position p of request b lives in slot req_to_token[req_pool_indices[b], p]
    of k_buffer/v_buffer [slots, Hkv, D]. The Triton kernels run where
    `sglang_ext.kernel_select.use_triton` says so (graph-safe, no host reads); the torch path
    reads the lengths on the host and is for CPUs and tests.
    """
    if use_triton(q.device):
        from sglang_ext.kernels.sink_attention import paged_attention  # @triton.jit reads TRITON_INTERPRET at import

        return paged_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, q_start, q_len,
                               sinks, window_left, scale, rope=rope, no_prefix=no_prefix)
    if rope is not None:
        from sglang_ext.kernels.rope_kv import rope_store_kv_ref  # @triton.jit reads TRITON_INTERPRET at import

        q = rope_store_kv_ref(q, rope.k, rope.v, rope.cos_sin, k_buffer, v_buffer, rope.loc)
    out = torch.empty_like(q)
    for b, (rpi, seq_len, start, n) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist(),
                                                       q_start.tolist(), q_len.tolist())):
        if n == 0:
            continue
        first = seq_len - n
        k_lo = max(0, first - window_left) if window_left >= 0 else 0
        slots = req_to_token[rpi, k_lo:seq_len].long()
        positions = torch.arange(first, seq_len, device=q.device)
        out[start:start + n] = sink_attention_torch(q[start:start + n], k_buffer[slots], v_buffer[slots], sinks,
                                                    positions, k_lo, window_left, scale)
    return out
