"""Dequantisation of the official gpt-oss MXFP4 expert layout (SGLang-free).

`*_blocks` [..., G, 16] uint8 hold 32 FP4 (e2m1) values per group, low nibble first;
`*_scales` [..., G] uint8 are e8m0 exponents with bias 127. The result is [..., G*32].
"""

from __future__ import annotations

import torch

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
