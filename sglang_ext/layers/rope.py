"""gpt-oss RoPE: YaRN-scaled inverse frequencies, half-split (non-interleaved) rotation.

SPEC §1: theta 150000, factor 32, beta_fast 32, beta_slow 1, original context 4096,
and cos/sin multiplied by the concentration 0.1*ln(factor)+1. The correction range is
truncated (floor/ceil) only when the config says `truncate: true` (gpt-oss: false).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang_ext.kernel_select import compiled_on_cuda


@dataclass(frozen=True)
class YarnRope:
    head_dim: int = 64
    theta: float = 150000.0
    factor: float = 32.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_positions: int = 4096
    truncate: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "YarnRope":
        # transformers < 5 writes `rope_scaling` + `rope_theta`; 5.x writes `rope_parameters`.
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.update(getattr(config, "rope_parameters", None) or {})
        theta = params.get("rope_theta", getattr(config, "rope_theta", 150000.0))
        rope_type = params.get("rope_type", params.get("type", "yarn"))
        if rope_type != "yarn":
            raise ValueError(f"gpt-oss uses YaRN RoPE, config has rope_type={rope_type!r}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            head_dim=head_dim,
            theta=float(theta),
            factor=float(params.get("factor", 32.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            original_max_positions=int(params.get("original_max_position_embeddings", 4096)),
            truncate=bool(params.get("truncate", True)),
        )

    @property
    def concentration(self) -> float:
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def inv_freq(self) -> torch.Tensor:
        dim, base = self.head_dim, self.theta

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        extrapolation = 1.0 / pos_freqs
        interpolation = 1.0 / (self.factor * pos_freqs)
        keep_extrapolation = 1 - ramp
        return interpolation * (1 - keep_extrapolation) + extrapolation * keep_extrapolation

    def cos_sin_cache(self, max_positions: int, device=None) -> torch.Tensor:
        """[max_positions, head_dim]: cos in the first half, sin in the second, fp32."""
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * self.inv_freq()[None, :]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.concentration
        return cache.to(device) if device is not None else cache


@compiled_on_cuda
def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos_sin: [tokens, head_dim] rows of the cache. Maths in fp32
    (or x's dtype if wider), one rounding back to x's dtype."""
    half = x.shape[-1] // 2
    compute = torch.promote_types(x.dtype, torch.float32)
    cos = cos_sin[:, None, :half].to(compute)
    sin = cos_sin[:, None, half:].to(compute)
    xf = x.to(compute)
    first, second = xf[..., :half], xf[..., half:]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).to(x.dtype)
