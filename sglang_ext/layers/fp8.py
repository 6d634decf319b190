"""FP8 e4m3 with 128x128 block scales (weights) and 1x128 group scales (activations), torch path.

SGLang-free. Conventions (SPEC §2; the `quantization_config` {quant_method: fp8, fmt: e4m3,
weight_block_size: [128, 128]} of DeepSeek-style checkpoints):
  - a weight [N, K] is stored as e4m3 values plus `weight_scale_inv` fp32
    [ceil(N/128), ceil(K/128)]: w ≈ w_fp8 * scale_inv of its block;
  - 2880 = 22.5 x 128: blocks cover a ragged edge with a *ragged last block* (64 wide),
    not padding. The stored tensor keeps its true shape, so checkpoints and shards need
    no padded copies; the GEMM masks the edge (Triton) or the torch path slices it.
    Padding would add 2.2% bytes to every 2880-wide weight for no accuracy gain (the
    ragged block has its own scale either way);
  - activations are quantised per token in groups of 128 along K (same ragged edge),
    scale = amax / 448 per group.
The torch path computes exactly what an FP8 GEMM with fp32 accumulation computes: the
products of dequantised e4m3 operands summed in fp32, then the bias, one rounding.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
BLOCK = 128


def _div_448(amax: torch.Tensor) -> torch.Tensor:
    # A tensor divisor, not a Python number: on CUDA torch turns division by a host scalar into
    # multiplication by its rounded reciprocal, which differs from amax / 448 in the last bit for
    # some amax, so the GPU reference would disagree with the kernels' IEEE division (and the CPU).
    return amax / torch.full_like(amax, E4M3_MAX)


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


def quantize_weight_block128(w: torch.Tensor, pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (e4m3 [..., N, K], scale_inv fp32 [..., ceil(N/128), ceil(K/128)]).

    `pow2_scales` rounds each block's scale up to a power of two: then values that are
    already a few mantissa bits times a power of two (MXFP4's) survive bit-exactly when the
    block's exponent spread fits e4m3; amax/448 scales use the range fully but round them."""
    *lead, n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    wf = w.float()
    padded = torch.zeros(*lead, nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=w.device)
    padded[..., :n, :k] = wf
    tiles = padded.unflatten(-2, (nb, BLOCK)).unflatten(-1, (kb, BLOCK))  # [..., nb, 128, kb, 128]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale_inv = torch.where(amax > 0, _div_448(amax), torch.ones_like(amax))
    if pow2_scales:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    # In place on the padded copy (its own storage): a stack of experts needs one fp32 copy of scratch, not three.
    q = tiles.div_(scale_inv[..., :, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = q.flatten(-4, -3).flatten(-2, -1)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), scale_inv


def dequantize_weight_block128(q: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    *lead, n, k = q.shape
    expand = scale_inv.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (q.float() * expand).to(dtype)


def quantize_activation_group128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], scale fp32 [T, ceil(K/128)]), one scale per token per 128 columns."""
    t, k = x.shape
    kb = _blocks(k)
    padded = torch.zeros(t, kb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(t, kb, BLOCK)
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, _div_448(amax), torch.ones_like(amax))
    q = (groups / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(t, kb * BLOCK)[:, :k]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_activation_group128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(BLOCK, dim=-1)[..., :k]


def fp8_linear_torch(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                     bias: torch.Tensor | None, quantize_activations: bool = True) -> torch.Tensor:
    """y = x W^T + b with W in e4m3 block-128; x quantised per 1x128 group unless told not to."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    xf = dequantize_activation_group128(*quantize_activation_group128(x2)) if quantize_activations else x2.float()
    y = xf @ dequantize_weight_block128(w_fp8, w_scale_inv).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, -1)


# -- conversion to FP8 block-128, with its report ------------------------------------------------
# One function for the offline converter (launch/convert.py) and the model's loader (an MXFP4 or
# bf16 checkpoint served on the FP8 path), so a checkpoint served directly and its converted copy
# hold the same bytes, and their reports the same numbers.


def block128_stats(w: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> dict:
    """How e4m3 codes `q` with block scales `scale_inv` hold one matrix `w` [N, K]: the 128x128
    blocks whose every value dequantises to w's exactly, and the largest / mean absolute error
    relative to the largest / mean |w|."""
    w = w.float().contiguous()  # one layout, so the reductions sum in one order wherever w came from
    deq = dequantize_weight_block128(q, scale_inv)
    n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    diff = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.bool, device=w.device)
    diff[:n, :k] = w != deq
    inexact = diff.unflatten(0, (nb, BLOCK)).unflatten(-1, (kb, BLOCK)).any(dim=(1, 3))
    err = (deq - w).abs()
    return {"blocks_exact": int((~inexact).sum()), "blocks": inexact.numel(),
            "max_rel_err": float(err.max() / w.abs().max().clamp(min=1e-30)),
            "mean_rel_err": float(err.mean() / w.abs().mean().clamp(min=1e-30))}


def convert_block128(w: torch.Tensor, exact_source: bool) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """w [..., N, K] -> (e4m3 [..., N, K], scale_inv [..., N/128, K/128], one `block128_stats` per matrix).

    `exact_source` (values with few mantissa bits, MXFP4's): power-of-two block scales, under which
    every block whose exponent spread fits e4m3 converts bit-exactly; otherwise amax/448 scales.
    Each block is quantised on its own, so a stack of matrices gives each matrix's own codes."""
    q, s = quantize_weight_block128(w, pow2_scales=exact_source)
    n, k = w.shape[-2:]
    flat_w, flat_q, flat_s = w.reshape(-1, n, k), q.reshape(-1, n, k), s.reshape(-1, *s.shape[-2:])
    return q, s, [block128_stats(flat_w[i], flat_q[i], flat_s[i]) for i in range(flat_w.shape[0])]


class Block128Report:
    """One tensor's report row (`launch/convert.py`'s convert_report.json) over its `matrices`
    matrices (experts): blocks summed, the largest max_rel_err, mean_rel_err averaged."""

    def __init__(self, matrices: int = 1):
        self.matrices = matrices
        self.row = {"blocks_exact": 0, "blocks": 0, "max_rel_err": 0.0, "mean_rel_err": 0.0}

    def add(self, stats: dict) -> None:
        self.row["blocks_exact"] += stats["blocks_exact"]
        self.row["blocks"] += stats["blocks"]
        self.row["max_rel_err"] = max(self.row["max_rel_err"], stats["max_rel_err"])
        self.row["mean_rel_err"] += stats["mean_rel_err"] / self.matrices


def summarize_block128_report(report: dict) -> dict:
    """A whole checkpoint's rows (name -> row) in three numbers: blocks exact, blocks, worst max_rel_err."""
    return {"blocks_exact": sum(r["blocks_exact"] for r in report.values()),
            "blocks": sum(r["blocks"] for r in report.values()),
            "max_rel_err": max((r["max_rel_err"] for r in report.values()), default=0.0)}
