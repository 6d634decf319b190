"""Host tensor descriptors for Hopper TMA loads: the FP8 GEMMs' operand tiles (prefill, and decode
batches of 17+ rows).

A kernel that takes a `TensorDescriptor` loads its tiles with `desc.load([row, col])`: on sm90 one
bulk tensor copy per tile into shared memory (no per-thread address tensors, no issue slots spent on
16-byte copies), zero-filled past the tensor's edge, so a ragged K block needs no mask. On an H200
the FP8 GEMMs of the 8192-token prefill ran 1.08-1.38x faster this way with the same bits
(benchmarks/results/diag_tma.md). Under TRITON_INTERPRET the interpreter emulates the same loads.

The copy engine's rules (CUDA `cuTensorMapEncodeTiled`): the base address and every stride but the
last a multiple of 16 bytes, a unit last stride. `tma_2d_ok` checks them on the host, so a launcher
falls back to its pointer kernel where they fail (e.g. gpt-oss-120b at TP8: 360-wide h rows).
"""

from __future__ import annotations

import contextlib
from functools import lru_cache

import torch

from ._util import interpreted

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: every launcher keeps its pointer kernel
    TensorDescriptor = None

TMA_ALIGN = 16  # bytes


def tma_supported(device: torch.device) -> bool:
    """Descriptor loads run here: an sm90+ GPU, or the interpreter (which emulates them)."""
    if TensorDescriptor is None:
        return False
    if interpreted():
        return True
    return device.type == "cuda" and sm_major(device.index) >= 9


@lru_cache(maxsize=None)
def sm_major(index: int | None) -> int:
    # cached: a 120b prefill asked ~300 times, ~10 us each under cProfile
    # (benchmarks/results/diag_prefill_host_cumulative.md)
    return torch.cuda.get_device_capability(index)[0]


def tma_2d_layout_ok(t: torch.Tensor) -> bool:
    """A non-empty 2-D tensor laid out as the copy engine tiles: unit last stride, 16-byte aligned base and row
    stride (an empty one, e.g. a rank with no local experts, has no descriptor: pointer loads)."""
    return (t.dim() == 2 and t.numel() > 0 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % TMA_ALIGN == 0
            and t.data_ptr() % TMA_ALIGN == 0)


def tma_2d_ok(t: torch.Tensor) -> bool:
    """`tma_2d_layout_ok`, on a device whose loads take descriptors (`tma_supported`)."""
    return tma_2d_layout_ok(t) and tma_supported(t.device)


_recorders: list[list] = []


def descriptor(t: torch.Tensor, block_shape: list[int]):
    """The descriptor of a 2-D tensor (tma_2d_ok) for tiles of block_shape."""
    for blocks in _recorders:
        blocks.append(list(block_shape))
    return TensorDescriptor.from_tensor(t, block_shape)


@contextlib.contextmanager
def recording_descriptors():
    """The block shapes of every descriptor built inside the block, in order. A TMA kernel gives its
    pointer twin's bits, so this is what shows (tests) that a launch took the TMA path."""
    blocks: list = []
    _recorders.append(blocks)
    try:
        yield blocks
    finally:
        _recorders.remove(blocks)
