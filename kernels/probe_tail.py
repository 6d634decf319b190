"""The SingProbe tail in one Triton kernel: o_proj, residual, RMSNorm, classifier, sigmoid.

Per query row: h = q + ctx @ Wo^T (512), logits = Wc @ (h * rsqrt(mean(h^2) + eps) * norm_w) + bc,
probs = sigmoid(logits). Everything after the loads is fp32 (the serving contract: the
tail runs in fp32 because scores are thresholded near 0.5). Two launches: o_proj spread
over HD/32 programs per row (at batch 1 a single program per row left the GEMV on one
SM: 18 us), then norm + classifier per row; h passes through an fp32 scratch row.
Replaces ~10 small torch launches per decode step (`SingProbeHead.tail` + sigmoid), which
dominated the probe's step on the H200 (benchmarks/results/probe_decode_h200.md).

`probe_tail_ref` is the plain-torch reference (the same maths as `SingProbeHead.tail`).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


@triton.jit
def _probe_oproj_kernel(Q, CTX, WO, H_OUT, HD: tl.constexpr, BLOCK_N: tl.constexpr):
    """h[row, n-block] = q + Wo[n-block] @ ctx: grid (rows, HD / BLOCK_N), so one decode row
    still spreads its 512x512 GEMV over HD / BLOCK_N programs."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, HD)
    ctx = tl.load(CTX + row * HD + offs_k).to(tl.float32)
    wo = tl.load(WO + offs_n[:, None] * HD + offs_k[None, :]).to(tl.float32)
    h = tl.load(Q + row * HD + offs_n).to(tl.float32) + tl.sum(wo * ctx[None, :], axis=1)
    tl.store(H_OUT + row * HD + offs_n, h)


@triton.jit
def _norm_classify_store(h, NORM_W, WC, BC, OUT, row, offs_k, eps, HD: tl.constexpr, L: tl.constexpr,
                         BLOCK_L: tl.constexpr):
    """probs[row] = sigmoid(Wc @ rmsnorm(h) + bc) of the fp32 row h [HD], stored, all fp32: the tail's last stage,
    here and in the decode step's _tail_kernel (probe_step.py), so that the two give the same bits."""
    hn = h / tl.sqrt(tl.sum(h * h, axis=0) / HD + eps) * tl.load(NORM_W + offs_k).to(tl.float32)
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < L
    wc = tl.load(WC + offs_l[:, None] * HD + offs_k[None, :], mask=l_ok[:, None], other=0.0).to(tl.float32)
    logits = tl.sum(wc * hn[None, :], axis=1) + tl.load(BC + offs_l, mask=l_ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * L + offs_l, 1.0 / (1.0 + tl.exp(-logits)), mask=l_ok)


@triton.jit
def _probe_head_kernel(H_IN, NORM_W, WC, BC, OUT, eps, HD: tl.constexpr, L: tl.constexpr, BLOCK_L: tl.constexpr):
    """probs[row] = sigmoid(Wc @ rmsnorm(h[row]) + bc), all fp32."""
    row = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, HD)
    h = tl.load(H_IN + row * HD + offs_k)
    _norm_classify_store(h, NORM_W, WC, BC, OUT, row, offs_k, eps, HD, L, BLOCK_L)


def probe_tail(q: torch.Tensor, ctx: torch.Tensor, wo: torch.Tensor, norm_w: torch.Tensor, wc: torch.Tensor,
               bc: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H*D] (or [T, H, D]), ctx [T, H, D] fp32 -> probabilities [T, L] fp32. No host reads."""
    t = q.shape[0]
    q2, ctx2 = q.reshape(t, -1).contiguous(), ctx.reshape(t, -1).contiguous()
    hd, num_labels = q2.shape[1], wc.shape[0]
    assert wo.shape == (hd, hd) and wc.shape[1] == hd and hd & (hd - 1) == 0, (wo.shape, wc.shape)
    out = out if out is not None else torch.empty(t, num_labels, dtype=torch.float32, device=q.device)
    scratch = scratch if scratch is not None else torch.empty(t, hd, dtype=torch.float32, device=q.device)
    if t:
        block_n = min(32, hd)
        _probe_oproj_kernel[(t, hd // block_n)](q2, ctx2, wo.contiguous(), scratch, HD=hd, BLOCK_N=block_n)
        _probe_head_kernel[(t,)](scratch, norm_w, wc.contiguous(), bc, out, eps, HD=hd, L=num_labels,
                                 BLOCK_L=triton.next_power_of_2(num_labels))
    return out


def probe_tail_ref(q, ctx, wo, norm_w, wc, bc, eps: float = 1e-6) -> torch.Tensor:
    t = q.shape[0]
    h = q.reshape(t, -1).float() + ctx.reshape(t, -1).float() @ wo.float().t()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()
    return torch.sigmoid(h @ wc.float().t() + bc.float())
