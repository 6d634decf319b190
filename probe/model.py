"""Plain-torch reference of the SingProbe attention head and of its input features.

This is the ground truth the serving path (Triton attention over a paged KV pool, fused tail) is tested
against, and the fallback it can run on CPU. It keeps the serving path's precision choices so the two can
be compared tightly: projections in the weight dtype (bf16 when served), attention softmax/accumulation
in fp32, and the residual + RMSNorm + classifier tail in fp32. The runtime reuses ``project`` (to fill
its K/V pool) and ``tail`` (after its own attention), so the three pieces are public.

Parameter names equal the checkpoint keys, so ``load_state_dict(strict=True)`` is the whole loader.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import torch
from torch import nn

from .checkpoint import load_probe_checkpoint
from .config import ProbeConfig

RMS_EPS = 1e-6  # both the feature normalisation and the head's norm (the release's value)

# The reference builds a [B, H, rows, keys] score tensor; chunking rows bounds it for long prompts.
_QUERY_CHUNK = 1024


def rms_normalize(x: torch.Tensor, eps: float = RMS_EPS) -> torch.Tensor:
    """Weight-less RMS normalisation in fp32 (the feature transform the probe was trained on)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def tap_features(hidden_states_list: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Feature rows from the tapped residual streams, in config order: ``[..., hidden * n_taps]``.

    Each tap is normalised separately in fp32 before the cast, since the layers' residual streams differ
    in scale by orders of magnitude and a shared cast before normalising would lose the small ones."""
    if len(hidden_states_list) == 0:
        raise ValueError("tap_features: no tapped hidden states")
    return torch.cat([rms_normalize(h).to(dtype) for h in hidden_states_list], dim=-1)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Optional[int],
                     scale: float) -> torch.Tensor:
    """Causal sliding-window MQA over a dense sequence, fp32.

    q [B, S, H, D]; k, v [B, S, D] (one head shared by all query heads). Key j is visible to query i iff
    i - W < j <= i (W=None or 0: j <= i). No positional encoding: positions only shape the mask."""
    q, k, v = q.float(), k.float(), v.float()
    s_len = q.shape[1]
    out = torch.empty_like(q)
    key_pos = torch.arange(s_len, device=q.device)
    for r0 in range(0, s_len, _QUERY_CHUNK):
        r1 = min(s_len, r0 + _QUERY_CHUNK)
        lo = 0 if not window else max(0, r0 - window + 1)  # keys outside [lo, r1) are masked for all rows
        qpos = torch.arange(r0, r1, device=q.device)[:, None]
        kpos = key_pos[lo:r1][None, :]
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        scores = torch.einsum("bihd,bjd->bhij", q[:, r0:r1], k[:, lo:r1]) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[:, r0:r1] = torch.einsum("bhij,bjd->bihd", probs, v[:, lo:r1])
    return out


class SingProbeHead(nn.Module):
    """The attention probe: MQA over the feature rows, query residual, RMSNorm, 10 sigmoid scores."""

    def __init__(self, cfg: ProbeConfig):
        super().__init__()
        self.config = cfg
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.window = cfg.sliding_window
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        hd = cfg.q_size
        self.proj_q = nn.Linear(cfg.input_size, hd, bias=False)
        self.proj_k = nn.Linear(cfg.input_size, cfg.head_dim, bias=False)
        self.proj_v = nn.Linear(cfg.input_size, cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(hd, hd, bias=False)
        self.norm = nn.RMSNorm(hd, eps=RMS_EPS)
        self.classifier = nn.Linear(hd, cfg.num_labels, bias=True)

    @classmethod
    def from_checkpoint(cls, folder: "str | os.PathLike", dtype: Optional[torch.dtype] = torch.bfloat16,
                        device: "torch.device | str" = "cpu") -> "SingProbeHead":
        """Build from a probe folder (validated, no remote code). ``dtype=None`` keeps the stored dtype."""
        cfg, tensors = load_probe_checkpoint(folder)
        with torch.device("meta"):
            head = cls(cfg)
        head.load_state_dict(tensors, strict=True, assign=True)
        head = head.to(device=device)
        if dtype is not None:
            head = head.to(dtype)
        return head.eval()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feature rows [..., input] -> (q [..., H, D], kv [..., 2D] = K then V) in the weight dtype.

        kv is exactly what the runtime stores per token in its paged pool (128 values for 64-dim heads)."""
        x = x.to(self.proj_q.weight.dtype)
        q = self.proj_q(x).unflatten(-1, (self.num_heads, self.head_dim))
        kv = torch.cat([self.proj_k(x), self.proj_v(x)], dim=-1)
        return q, kv

    def tail(self, q: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """(q [..., H, D], attention output ctx [..., H, D]) -> fp32 logits [..., L].

        o_proj runs in the weight dtype like the served matmul; the residual add, RMSNorm and classifier run
        in fp32 since the served tail is one fused fp32 kernel and the scores are thresholded near 0.5."""
        wdt = self.o_proj.weight.dtype
        o = self.o_proj(ctx.flatten(-2).to(wdt))
        h = q.flatten(-2).float() + o.float()
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + RMS_EPS) * self.norm.weight.float()
        return torch.nn.functional.linear(h, self.classifier.weight.float(), self.classifier.bias.float())

    @staticmethod
    def probs(logits: torch.Tensor) -> torch.Tensor:
        """Independent per-label probabilities (the labels are not mutually exclusive: no softmax)."""
        return torch.sigmoid(logits.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Feature rows x [B, S, input] of whole sequences (position 0 first) -> logits [B, S, L], fp32."""
        if x.dim() != 3:
            raise ValueError(f"SingProbeHead expects [B, S, {self.config.input_size}] features, got {tuple(x.shape)}")
        q, kv = self.project(x)
        k, v = kv[..., : self.head_dim], kv[..., self.head_dim:]
        ctx = window_attention(q, k, v, self.window, self.scale)
        return self.tail(q, ctx)
