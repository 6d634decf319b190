"""The flash-attention step that attention kernels weigh a block of keys with: scores, then the online softmax's
running max and sum and the block's weights, as @triton.jit helpers that Triton inlines. The probe's attention
(``probe_attention``, natural-log units) and the sink decode (``sink_attention.decode``, log2 units) both take
their weights here, so the two cannot drift apart. P.V stays with each: both feed it p as a hi + lo pair of
16-bit values, but order those instructions differently (the same bits), and each keeps its own compiled code.

Precision: with DOTS_16BIT (q and K of one 16-bit type) the scores come from tensor cores, the 16-bit products
exact in the fp32 accumulator; otherwise from IEEE fp32 dots. The softmax state is fp32."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_scores(q, k, DOTS_16BIT: tl.constexpr):
    """Raw scores q.k^T [rows, keys] of q [rows, D] and k [keys, D] in fp32."""
    if DOTS_16BIT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    return s


@triton.jit
def online_softmax_step(m_i, l_i, s, LOG2: tl.constexpr):
    """The running max m_i and sum l_i [rows] after the scaled scores s [rows, keys] (log2 units with LOG2:
    exp2), with alpha, the rescale of what came before, and the block's weights p [rows, keys]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if LOG2:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    else:
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def block_weights(m_i, l_i, q, k, start, offs_n, key_hi, scale, LOG2: tl.constexpr, DOTS_16BIT: tl.constexpr):
    """online_softmax_step over the block of keys start + offs_n (K [keys, D]; those at or past key_hi score
    -inf) for q [rows, D], its scores times ``scale``: (m_new, alpha, p, l_i)."""
    s = block_scores(q, k, DOTS_16BIT)
    s = tl.where((start + offs_n < key_hi)[None, :], s * scale, float("-inf"))
    return online_softmax_step(m_i, l_i, s, LOG2)
