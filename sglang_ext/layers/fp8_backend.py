"""Which GEMM runs the dense FP8 layers (gpt-oss's qkv and o): our Triton kernel or DeepGEMM.

SGLang-free (the model-step harness runs the same layers). DeepGEMM (deepseek-ai; SGLang installs
it as `sgl-deep-gemm`) is the Hopper FP8 block-scaled GEMM upstream SGLang serves with. It has no
bias epilogue, so its path adds the bias to its bf16 output, y = bf16(bf16(x_q W^T) + b), where our
kernel adds the bias to the fp32 accumulator and rounds once: DeepGEMM's outputs carry about √2 of
ours' rounding error (benchmarks/results/diag_fp8_backend.md).

  SGLANG_EXT_FP8_GEMM=triton    (default) our kernel for every dense FP8 GEMM
  SGLANG_EXT_FP8_GEMM=deepgemm  DeepGEMM for every dense FP8 GEMM on CUDA that it takes (bf16 x, its
                                shape rules: `deepgemm_unsupported`), ours for the rest (logged once
                                per shape); the first such GEMM raises `DeepGemmUnavailable` if
                                `deep_gemm` cannot be imported
  SGLANG_EXT_FP8_GEMM=auto      DeepGEMM only for the weight shapes and row counts where it measured
                                faster than ours on an H200 (`DEEPGEMM_AUTO_ROWS`), ours elsewhere
                                and wherever DeepGEMM is missing (logged once)

The variable is read and checked once per process, at the first dense FP8 GEMM (each one asks for the
mode); `kernel_select.reload_settings()` reads it again, for code that changes it in-process (tests).

Two DeepGEMM APIs are known: 1.x `gemm_fp8_fp8_bf16_nt` (its pure-Python JIT line, the one the
project's H200 runs: benchmarks/deepgemm_peer.py) and 2.x `fp8_gemm_nt` (sgl-deep-gemm, a torch
extension; its shape rule here is SGLang 0.5.23's own, `_deepgemm_block_fp8_supported`).
Activations are quantised by our Triton quantiser (the same codes and scales our GEMM reads), their
scales written straight into DeepGEMM's TMA-aligned MN-major layout, so DeepGEMM copies nothing.
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from typing import Optional

import torch

from sglang_ext.kernel_select import read_once

ENV_VAR = "SGLANG_EXT_FP8_GEMM"
CHOICES = ("triton", "deepgemm", "auto")
GROUP = 128
# auto: (N, K) of a weight -> the rows per GEMM where DeepGEMM beat ours on an H200 as the layers call
# them (GEMM + bias, CUDA graphs; benchmarks/results/diag_fp8_backend*.md). gpt-oss's o (x bf16, which ours
# quantises inside its 32-row split-K tiles at 17..64 rows): 0.71-0.89 of ours at 48..128 rows; its qkv (x
# from the norm's codes, the 64 x 128 tile from 17 rows) nowhere by more than the noise (0.96 at 64).
# Other shapes (TP shards included) are unmeasured: ours.
DEEPGEMM_AUTO_ROWS = {(2880, 4096): (48, 128)}

logger = logging.getLogger(__name__)


class DeepGemmUnavailable(RuntimeError):
    """`deep_gemm` cannot be used here; the message says why."""


def _read_backend_mode() -> str:
    mode = os.environ.get(ENV_VAR, "triton").strip().lower() or "triton"
    if mode not in CHOICES:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(CHOICES)}")
    return mode


def backend_mode() -> str:
    """SGLANG_EXT_FP8_GEMM, validated, read once per process (kernel_select.read_once)."""
    return read_once(ENV_VAR, _read_backend_mode)


_loaded: dict = {}


def _import_deep_gemm():
    """(module, api), or the reason (a string) it cannot be used."""
    try:
        import deep_gemm  # noqa: PLC0415  (optional; an import can fail inside its extension)
    except Exception as e:  # ImportError, OSError from a torch extension built for another torch
        return f"import deep_gemm failed: {type(e).__name__}: {e}"
    if hasattr(deep_gemm, "fp8_gemm_nt"):
        return deep_gemm, "v2"
    if hasattr(deep_gemm, "gemm_fp8_fp8_bf16_nt"):
        return deep_gemm, "v1"
    return (f"{getattr(deep_gemm, '__file__', 'deep_gemm')} has neither fp8_gemm_nt (2.x) nor "
            "gemm_fp8_fp8_bf16_nt (1.x)")


def load_deep_gemm():
    """(module, api) of the importable `deep_gemm`, api "v1" (`gemm_fp8_fp8_bf16_nt`) or "v2"
    (`fp8_gemm_nt`). Raises DeepGemmUnavailable with the import's own error; the outcome is cached (as a
    reason string: a cached exception raised again would grow its traceback, and with it the frames and
    tensors of every caller, call after call)."""
    if "result" not in _loaded:
        _loaded["result"] = _import_deep_gemm()
    result = _loaded["result"]
    if isinstance(result, str):
        raise DeepGemmUnavailable(result)
    return result


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _device_capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def reset() -> None:
    """Forget the import outcome and the once-logged fallbacks (tests; a newly installed deep_gemm)."""
    _loaded.clear()
    _logged.clear()
    _capability.cache_clear()


def deepgemm_unsupported(api: str, x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor) -> Optional[str]:
    """Why DeepGEMM (`api`) cannot run this GEMM, or None when it can."""
    n, k = w_fp8.shape
    if not x.is_cuda:
        return "x is not on a CUDA device"
    major = _device_capability(x.device)[0]
    if major not in ((9,) if api == "v1" else (9, 10)):
        return f"DeepGEMM {'1.x' if api == 'v1' else '2.x'} has no kernels for sm{major}x GPUs"
    if x.dtype != torch.bfloat16:
        return f"DeepGEMM writes bf16 only, x is {x.dtype}"
    if not (w_fp8.is_contiguous() and w_scale_inv.is_contiguous()):
        return "the weight or its scales are not contiguous"
    if api == "v2" and (n % 64 or k % GROUP):
        # sgl-deep-gemm's rule as SGLang 0.5.23 applies it (fp8_utils._deepgemm_block_fp8_supported)
        return f"DeepGEMM 2.x takes N % 64 == 0 and K % 128 == 0 (N={n}, K={k})"
    if k % 16:  # 1.x: TMA row strides of 16 bytes; K rounds up to 128 inside, zero-filled past K
        return f"K={k} is not a multiple of 16 bytes (TMA)"
    return None


def deepgemm_scale_buffer(m: int, k: int, device) -> torch.Tensor:
    """fp32 [m, ceil(k/128)] with strides (1, align4(m)): DeepGEMM's TMA-aligned MN-major layout."""
    aligned_m = -(-m // 4) * 4  # TMA wants 16-byte aligned columns of fp32
    return torch.empty((-(-k // GROUP), aligned_m), dtype=torch.float32, device=device).t()[:m]


def _in_deepgemm_layout(scale: torch.Tensor) -> bool:
    m = scale.shape[0]
    return scale.stride(0) == 1 and scale.stride(1) == -(-m // 4) * 4


def deepgemm_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                    bias: Optional[torch.Tensor] = None, x_quant=None, module=None, api: Optional[str] = None
                    ) -> torch.Tensor:
    """y [..., N] bf16 = x W^T + b by DeepGEMM: x quantised per 1x128 group by our quantiser (or
    `x_quant`, its producer's codes and scales: copied into DeepGEMM's scale layout if not in it),
    DeepGEMM's GEMM into bf16, the bias added in place. `module`/`api` default to `load_deep_gemm()`."""
    # @triton.jit reads TRITON_INTERPRET at import
    from sglang_ext.kernels.fp8_gemm import _check_x_quant, quantize_activation_group128

    if module is None:
        module, api = load_deep_gemm()
    lead, k = x.shape[:-1], x.shape[-1]
    n = w_fp8.shape[0]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if x_quant is None:
        codes, scale = quantize_activation_group128(x2, out_scale=deepgemm_scale_buffer(m, k, x.device))
    else:
        codes, scale = _check_x_quant(x_quant, x, m, k)
        codes = codes.contiguous()  # DeepGEMM's A descriptor takes rows of exactly K codes
        if not _in_deepgemm_layout(scale):
            scale = deepgemm_scale_buffer(m, k, x.device).copy_(scale)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m > 0:
        if api == "v2":
            module.fp8_gemm_nt((codes, scale), (w_fp8, w_scale_inv), y)
        else:
            module.gemm_fp8_fp8_bf16_nt((codes, scale), (w_fp8, w_scale_inv), y)
    if bias is not None:
        y.add_(bias)
    return y.view(*lead, n)


_logged: set = set()


def _log_once(key, msg: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(msg)


def choose(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, mode: Optional[str] = None):
    """("deepgemm", (module, api)) or ("triton", None) for this GEMM under `mode` (the env's by default)."""
    mode = mode or backend_mode()
    if mode == "triton":
        return "triton", None
    if mode == "auto":
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        lo, hi = DEEPGEMM_AUTO_ROWS.get(tuple(w_fp8.shape), (1, 0))
        if not lo <= rows <= hi:
            return "triton", None
    try:
        module, api = load_deep_gemm()
    except DeepGemmUnavailable as e:
        if mode == "deepgemm":
            raise DeepGemmUnavailable(f"{ENV_VAR}=deepgemm: {e}") from None
        _log_once("unavailable", f"{ENV_VAR}=auto: DeepGEMM unavailable, our FP8 GEMM runs ({e})")
        return "triton", None
    if mode == "auto" and x.is_cuda and _device_capability(x.device) != (9, 0):
        return "triton", None  # the auto rows were measured on an H200 (sm90) only
    reason = deepgemm_unsupported(api, x, w_fp8, w_scale_inv)
    if reason is not None:
        _log_once((tuple(w_fp8.shape), x.dtype, x.device.type),
                  f"{ENV_VAR}={mode}: our FP8 GEMM runs [{w_fp8.shape[0]} x {w_fp8.shape[1]}]: {reason}")
        return "triton", None
    return "deepgemm", (module, api)


def dense_fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, x_quant=None) -> torch.Tensor:
    """The kernel path of a dense FP8 layer: `fp8_linear` (ours), or DeepGEMM where the
    backend choice sends it (`choose`)."""
    kind, dg = choose(x, w_fp8, w_scale_inv)
    if kind == "deepgemm":
        return deepgemm_linear(x, w_fp8, w_scale_inv, bias, x_quant=x_quant, module=dg[0], api=dg[1])
    from sglang_ext.kernels.fp8_gemm import fp8_linear  # @triton.jit reads TRITON_INTERPRET at import

    return fp8_linear(x, w_fp8, w_scale_inv, bias, x_quant=x_quant)
