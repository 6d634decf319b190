"""The LM head in FP8 e4m3 with 128x128 block scales: opt-in (SGLANG_EXT_FP8_LM_HEAD=1), off by default.

gpt-oss ships its LM head in bf16 ([201088, 2880], 1.16 GB), and at decode batch 1 reading it is
~10 % of a 120b step and ~15 % of a 20b step on an H200 (265 us at copy bandwidth,
benchmarks/results/diag_rope_fusion.md's critical path). In e4m3 it is half the bytes. The logits
then carry the weights' block quantisation (and x's 1x128 activation groups), like the projections
this package already serves in FP8, so greedy tokens can differ from the bf16 head's where two
logits are close: the default stays bf16, and `fp8_lm_head_error` measures the difference.

SGLang's LogitsProcessor computes logits with `lm_head.quant_method.apply(lm_head, hidden, bias)`
for a quant method it does not know as unquantised, so `quantize_lm_head` swaps the loaded bf16
weight of a ParallelLMHead (or any module with a `weight`) for its codes, adds
`weight_scale_inv` and sets `Fp8BlockLMHeadMethod`: no SGLang code changes.

SGLANG_EXT_FP8_LM_HEAD is read once per process, at its first use (the model's load_weights);
`kernel_select.reload_settings()` reads it again, for code that changes it in-process (tests).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from sglang_ext.kernel_select import read_once, use_triton
from sglang_ext.layers.fp8 import BLOCK, fp8_linear_torch, quantize_weight_block128

FP8_LM_HEAD_ENV = "SGLANG_EXT_FP8_LM_HEAD"


def _read_fp8_lm_head() -> bool:
    value = os.environ.get(FP8_LM_HEAD_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{FP8_LM_HEAD_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def fp8_lm_head_enabled() -> bool:
    """SGLANG_EXT_FP8_LM_HEAD == "1", validated, read once per process (kernel_select.read_once)."""
    return read_once(FP8_LM_HEAD_ENV, _read_fp8_lm_head)


def fp8_lm_head_logits(x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., H] against the e4m3 head: the FP8 GEMM kernels where they run, else the torch path."""
    if use_triton(x.device):
        from sglang_ext.kernels.fp8_gemm import fp8_linear  # @triton.jit reads TRITON_INTERPRET at import

        return fp8_linear(x, codes, scale_inv, bias)
    return fp8_linear_torch(x, codes, scale_inv, bias)


class Fp8BlockLMHeadMethod:
    """The quant method SGLang's LogitsProcessor calls: logits = x W^T (+ bias) with W the head's
    e4m3 codes (`layer.weight`) and fp32 block scales (`layer.weight_scale_inv`), in x's dtype."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_lm_head_logits(x, layer.weight, layer.weight_scale_inv, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """SGLang's loader calls this on every module's quant method after load_weights: the head is
        already quantised (quantize_lm_head ran at the end of load_weights)."""


def quantize_head_weight(weight: torch.Tensor, rows_per_chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 [V, H] -> (e4m3 [V, H], fp32 [ceil(V/128), ceil(H/128)]), as quantize_weight_block128, a
    chunk of 128-row blocks at a time (the whole head in fp32 would be 2.3 GB)."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.dtype == torch.float8_e4m3fn:
        raise ValueError(f"LM head: expected a [vocab, hidden] float weight, got {weight.dtype} {tuple(weight.shape)}")
    step = max(BLOCK, rows_per_chunk // BLOCK * BLOCK)
    codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scales = torch.empty((-(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK)), dtype=torch.float32,
                         device=weight.device)
    for r0 in range(0, weight.shape[0], step):
        q, s = quantize_weight_block128(weight[r0:r0 + step])
        codes[r0:r0 + q.shape[0]] = q
        scales[r0 // BLOCK:r0 // BLOCK + s.shape[0]] = s
    return codes, scales


def quantize_lm_head(lm_head: nn.Module) -> nn.Module:
    """In place, after the checkpoint is loaded: the head's bf16 `weight` becomes its e4m3 codes,
    `weight_scale_inv` its block scales, and `quant_method` Fp8BlockLMHeadMethod. What loading needs
    (the weight's dtype and attributes, e.g. the vocab-parallel `weight_loader`, and the old quant
    method) is kept for `restore_bf16_lm_head`. Returns lm_head."""
    old = lm_head.weight
    codes, scales = quantize_head_weight(old.data)
    lm_head._bf16_head = (old.dtype, dict(vars(old)), getattr(lm_head, "quant_method", None))
    lm_head.weight = nn.Parameter(codes, requires_grad=False)
    lm_head.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
    lm_head.quant_method = Fp8BlockLMHeadMethod()
    return lm_head


def restore_bf16_lm_head(lm_head: nn.Module) -> bool:
    """Undo `quantize_lm_head` before the checkpoint is loaded again (SGLang's weight updates call
    load_weights on the live model): an empty weight of the loaded dtype with its attributes back,
    the old quant method, no scales. False if the head was not quantised."""
    state = getattr(lm_head, "_bf16_head", None)
    if state is None:
        return False
    dtype, attrs, method = state
    weight = nn.Parameter(torch.empty(lm_head.weight.shape, dtype=dtype, device=lm_head.weight.device),
                          requires_grad=False)
    for key, value in attrs.items():
        setattr(weight, key, value)
    lm_head.weight = weight
    del lm_head.weight_scale_inv, lm_head._bf16_head
    lm_head.quant_method = method
    return True


def fp8_lm_head_error(x: torch.Tensor, weight: torch.Tensor, quantized: tuple | None = None) -> dict:
    """What the FP8 head changes on hidden states x [M, H] against the bf16 head `weight`: relative
    error of the logits (max over rows of |d|_inf / |ref|_inf, and Frobenius), and how often the
    argmax (greedy token) and the top-5 set agree. `quantized`: `quantize_head_weight(weight)`, if the
    caller has it already."""
    ref = (x @ weight.t()).float()
    codes, scales = quantized if quantized is not None else quantize_head_weight(weight)
    got = fp8_lm_head_logits(x, codes, scales).float()
    diff = got - ref
    top5 = lambda t: torch.topk(t, 5, dim=-1).indices.sort(dim=-1).values  # noqa: E731
    return {"rows": x.shape[0],
            "max_rel_err": (diff.abs().amax(-1) / ref.abs().amax(-1)).max().item(),
            "rel_fro": (diff.norm() / ref.norm()).item(),
            "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "top5_agree": (top5(got) == top5(ref)).all(-1).float().mean().item()}
