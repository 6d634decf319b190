"""FP8 e4m3 with 128x128 block scales (weights) and 1x128 group scales (activations), torch path.

SGLang-free. The maths (quantise, dequantise, the reference linear) lives with the kernels that reproduce
it (`sglang_ext.kernels.reference`, conventions there) and is re-exported here for the layers; this module
adds the conversion of whole checkpoints to FP8 block-128 and its report.
"""

from __future__ import annotations

import torch

from sglang_ext.kernels.reference import (  # noqa: F401  (re-exported: the layers' FP8 maths)
    BLOCK,
    E4M3_MAX,
    _blocks,
    _div_448,
    dequantize_activation_group128,
    dequantize_weight_block128,
    fp8_linear_torch,
    quantize_activation_group128,
    quantize_weight_block128,
)


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
