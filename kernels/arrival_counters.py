"""Arrival counters for the kernels' last-arriver reductions (FP8 split-K sums, MoE mlp1 split-K,
sink-attention split merges): int32 zeros per (owner, device), reused by every launch because the
last program of each group resets its own counter, so no memset per call.

Made only outside CUDA-graph capture (a buffer made during capture would be zeroed only by the
graph): inside a capture a missing or too small buffer gives None and the caller falls back.
A buffer replaced by a larger one stays referenced: a captured graph may still write it.
Launches of one owner on one device share the buffer, so they must not run concurrently on two
streams.
"""

from __future__ import annotations

from typing import Optional

import torch

_BUFFERS: dict = {}
_SUPERSEDED: list = []  # smaller buffers graphs may hold: never freed


def _key(owner: str, device: torch.device):
    return owner, device.type, device.index


def arrival_counters(owner: str, device: torch.device, size: int) -> Optional[torch.Tensor]:
    """At least `size` zeroed counters of `owner` on `device`, or None inside a capture that
    would need a new buffer."""
    key = _key(owner, device)
    buf = _BUFFERS.get(key)
    if buf is not None and buf.numel() >= size:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if buf is not None:
        _SUPERSEDED.append(buf)
    buf = torch.zeros(size, dtype=torch.int32, device=device)
    _BUFFERS[key] = buf
    return buf


def current(owner: str, device: torch.device) -> Optional[torch.Tensor]:
    """The buffer `owner` uses on `device` now (tests check it is all zero between launches)."""
    return _BUFFERS.get(_key(owner, device))


def all_current(owner: str) -> list:
    return [buf for (name, *_), buf in _BUFFERS.items() if name == owner]
