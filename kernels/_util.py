"""Host-side helpers the kernel launchers share. Like every module under kernels/, this imports nothing from
sglang_ext.layers or SGLang."""

from __future__ import annotations

import os
from functools import lru_cache

import torch

H200_SMS = 132  # SM count assumed off-GPU, so the interpreter runs the configs an H200 would get


def interpreted() -> bool:
    """Whether kernels run under Triton's interpreter. Read at each call, not once at import: tests and
    benchmarks set or clear TRITON_INTERPRET (or replace this function) after the kernel modules are imported."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=None)
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device | str | None, off_gpu: int = H200_SMS) -> int:
    """SM count of `device` (cached per CUDA device; "cuda" without an index is the current device). Off a CUDA
    device, `off_gpu`: the count a launcher's interpreted configs are chosen for."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda":
        return off_gpu
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
