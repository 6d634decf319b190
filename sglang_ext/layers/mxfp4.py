"""The official gpt-oss MXFP4 expert layout: its dequantisation, and expert tensors' conversion to FP8
e4m3 block-128 (SGLang-free).

`*_blocks` [..., G, 16] uint8 hold 32 FP4 (e2m1) values per group, low nibble first;
`*_scales` [..., G] uint8 are e8m0 exponents with bias 127. The result is [..., G*32].

`experts_to_fp8_block128` converts a stack of experts a few at a time: the offline converter
(launch/convert.py) and the model's loader (an MXFP4 or bf16 checkpoint served on the FP8 path) both
run it, so the two give the same bytes and the same report.
"""

from __future__ import annotations

from typing import Iterator

import torch

from sglang_ext.layers.fp8 import convert_block128

FP4_VALUES = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16,
                     rows_per_chunk: int = 1 << 16) -> torch.Tensor:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 shapes do not match: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    *prefix, groups, _ = blocks.shape
    flat_blocks = blocks.reshape(-1, 16)
    flat_exp = scales.reshape(-1).to(torch.int32) - 127
    out = torch.empty(flat_blocks.shape[0], 32, dtype=dtype, device=blocks.device)
    for lo in range(0, flat_blocks.shape[0], rows_per_chunk):
        b = flat_blocks[lo : lo + rows_per_chunk]
        vals = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).reshape(b.shape[0], 32)
        out[lo : lo + rows_per_chunk] = torch.ldexp(vals, flat_exp[lo : lo + rows_per_chunk, None]).to(dtype)
    return out.reshape(*prefix, groups * 32)


class Mxfp4Experts:
    """An MXFP4 expert tensor (`*_blocks` [E, N, K/32, 16] u8 + `*_scales` [E, N, K/32] u8), read as
    [E, N, K] fp32 a range of experts at a time."""

    exact_source = True  # few mantissa bits: power-of-two block scales keep them exactly where they fit

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor):
        if blocks.dim() != 4 or scales.shape != blocks.shape[:3]:
            raise ValueError(f"MXFP4 expert shapes do not match: blocks {tuple(blocks.shape)}, scales "
                             f"{tuple(scales.shape)}")
        self.blocks, self.scales = blocks, scales
        self.num, self.rows, self.cols = blocks.shape[0], blocks.shape[1], blocks.shape[2] * 32

    def matrices(self, lo: int, hi: int, device) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks[lo:hi].to(device), self.scales[lo:hi].to(device), dtype=torch.float32)


class DenseExperts:
    """A bf16/fp32 expert tensor as transformers saves it, [E, in, out], read as [E, out, in] (a view)."""

    exact_source = False  # amax/448 block scales

    def __init__(self, tensor: torch.Tensor):
        if tensor.dim() != 3 or not tensor.is_floating_point():
            raise ValueError(f"expected a floating-point [E, in, out] expert tensor, got {tuple(tensor.shape)} "
                             f"{tensor.dtype}")
        self.tensor = tensor
        self.num, self.cols, self.rows = tensor.shape

    def matrices(self, lo: int, hi: int, device) -> torch.Tensor:
        return self.tensor[lo:hi].to(device).transpose(-1, -2)


# Elements of fp32 experts dequantised at once (256 MiB; with the quantiser's temporaries the scratch is about
# three times that): a 120b expert matrix is 16.6 M, so four experts a step, never a whole layer.
CONVERT_CHUNK_ELEMENTS = 1 << 26


def experts_to_fp8_block128(source, lo: int, hi: int, device,
                            chunk_elements: int = CONVERT_CHUNK_ELEMENTS) -> Iterator[tuple]:
    """Experts [lo, hi) of `source` (Mxfp4Experts / DenseExperts) as FP8 block-128 on `device`, a few at a
    time: yields (first, last, e4m3 [last-first, N, K], scale_inv [last-first, N/128, K/128], one
    `block128_stats` per expert). Only the chunk in flight is ever dequantised."""
    step = max(1, chunk_elements // (source.rows * source.cols))
    for first in range(lo, hi, step):
        last = min(hi, first + step)
        q, s, stats = convert_block128(source.matrices(first, last, device), source.exact_source)
        yield first, last, q, s, stats
