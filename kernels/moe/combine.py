"""The MoE's weighted combine for the GEMV and grouped regimes (the one-shot decode combines inside
its mlp2): out[t] = sum_j w_j * y_j over token t's top-k pairs.

Invariant: fp32 sums in slot order (mlp2's K splits summed in split order first), pairs of another
rank's experts masked (their rows were never written), one rounding to out's dtype; the one-shot
kernels repeat this expression, so every regime combines the same per-pair outputs to the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .common import _round_to_bf16


COMBINE_BLOCK_T = 4


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_kernel(PAIR_OUT, TOPK_W, TOPK_IDS, OUT, num_tokens, hidden, stride_out, expert_offset, num_local,
                    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT_K: tl.constexpr,
                    USE_PDL: tl.constexpr = False):
    if USE_PDL:  # kernels/pdl.py: mlp2's pairs, then the next layer's kernels may start
        gdc_wait()
        gdc_launch_dependents()
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    tokens = tokens.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = token_ok[:, None] & (cols < hidden)[None, :]
    slab = num_tokens.to(tl.int64) * (TOP_K * hidden)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pairs = tokens * TOP_K + j
        local = tl.load(TOPK_IDS + pairs, mask=token_ok, other=0).to(tl.int32) - expert_offset
        mine = (local >= 0) & (local < num_local)
        weight = tl.load(TOPK_W + pairs, mask=token_ok, other=0.0).to(tl.float32)
        # foreign pairs' rows were never written: mask the load, never multiply garbage by 0
        y_ptrs = PAIR_OUT + pairs[:, None] * hidden + cols[None, :]
        y = tl.load(y_ptrs, mask=ok & mine[:, None], other=0.0).to(tl.float32)  # bf16 y: MoeConfig.pair_out_bf16
        for s in tl.static_range(1, SPLIT_K):  # mlp2's K splits, summed in split order
            y += tl.load(y_ptrs + s * slab, mask=ok & mine[:, None], other=0.0).to(tl.float32)
        acc += weight[:, None] * y
    if OUT.dtype.element_ty == tl.bfloat16:
        acc = _round_to_bf16(acc)
    tl.store(OUT + tokens[:, None] * stride_out + cols[None, :], acc.to(OUT.dtype.element_ty), mask=ok)
