"""DeepGEMM's Hopper FP8 block-scaled GEMM as a benchmark peer of `kernels/fp8_gemm/`.

The peer is deepseek-ai/DeepGEMM at 03d0be3 (2025-07-02), the last pure-Python release: its
kernels are JIT-compiled at run time by nvcc into sm_90a cubins and launched through
cuda-bindings, so nothing is built at install time. `.peers/deepgemm/` (ignored; made by
`bash benchmarks/fetch_deepgemm_peer.sh`, see its SOURCE.txt) holds that package plus the CUTLASS
v3.8 headers it includes.
`benchmarks/build_deepgemm_peer.sh` checks it on the GPU machine.

  load_deepgemm(root)      puts `root` on sys.path and imports `deep_gemm` (compiles nothing;
                           the first GEMM of each shape JIT-compiles, ~3 s, cached on disk under
                           $DG_JIT_CACHE_DIR, default `<root>/jit_cache`). Raises
                           `DeepGemmUnavailable` with the reason when it can't.
  deepgemm_version()       "DeepGEMM 03d0be3 ... CUTLASS ... nvcc X.Y" (loads it).
  deepgemm_scale_buffer(m, k)   DeepGEMM's TMA-aligned MN-major scale layout ([M, KB], strides
                           (1, align4(M))), as the project's backend (sglang_ext/layers/fp8_backend.py) makes
                           it, so DeepGEMM's `get_col_major_tma_aligned_tensor` is a no-op.
  deepgemm_gemm(a, a_s, w, w_s, out)   DeepGEMM's `gemm_fp8_fp8_bf16_nt` only (pre-quantised A).
  deepgemm_linear(x, w, w_s, bias)     the project's backend on this peer: quantise x + DeepGEMM GEMM
                           into bf16 [M, N] + bias added after (DeepGEMM has no bias epilogue):
                           y = bf16(bf16(x_q W^T) + b).

Weights: our layout as is: W [N, K] e4m3, weight_scale_inv fp32 [ceil(N/128), ceil(K/128)]
(row-major, ragged last blocks allowed: DeepGEMM rounds K up to 128 and TMA zero-fills past K).
Numerics differ from ours only by the bias: ours adds it to the fp32 accumulator and rounds once;
here the GEMM rounds to bf16 and the bias add rounds again (<= 1 bf16 ulp apart).

This module imports only the standard library and torch at import time.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Optional

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROOT = ".peers/deepgemm"
GROUP = 128

# Files the JIT needs (the kernel header and the CUTLASS/CuTe headers it includes directly).
_REQUIRED = (
    "deep_gemm/__init__.py",
    "deep_gemm/jit_kernels/gemm.py",
    "deep_gemm/include/deep_gemm/fp8_gemm.cuh",
    "deep_gemm/include/cute/arch/copy_sm90_tma.hpp",
    "deep_gemm/include/cute/arch/mma_sm90_gmma.hpp",
    "deep_gemm/include/cutlass/arch/barrier.h",
    "deep_gemm/include/cutlass/arch/reg_reconfig.h",
)


class DeepGemmUnavailable(RuntimeError):
    """DeepGEMM can't be loaded here; the message says why and what to do."""


_state: dict = {"module": None, "root": None}


def _resolve_root(root: str | os.PathLike | None) -> Path:
    root = os.environ.get("DEEPGEMM_PEER_ROOT") or root or DEFAULT_ROOT
    p = Path(root).expanduser()
    if not p.is_absolute():
        p = p if p.exists() else REPO_ROOT / p
    return p.resolve()


def _cuda_home() -> Optional[str]:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        return home
    return "/usr/local/cuda" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def load_deepgemm(root: str | os.PathLike | None = DEFAULT_ROOT):
    """Import DeepGEMM from `root` (relative paths: to the cwd, else to the repo root;
    $DEEPGEMM_PEER_ROOT overrides). Returns the `deep_gemm` module. Builds nothing."""
    if _state["module"] is not None:
        return _state["module"]
    path = _resolve_root(root)
    missing = [f for f in _REQUIRED if not (path / f).is_file()]
    if missing:
        raise DeepGemmUnavailable(
            f"DeepGEMM peer tree incomplete at {path} (missing {missing[0]}"
            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}); carry .peers/deepgemm "
            "to this machine (see .peers/deepgemm/SOURCE.txt)")
    try:
        import cuda.bindings.driver  # noqa: F401  (DeepGEMM launches through cuda-bindings)
    except ImportError as e:
        raise DeepGemmUnavailable(f"DeepGEMM needs the cuda-bindings package (import cuda.bindings.driver: {e})") from e
    cuda_home = _cuda_home()
    if cuda_home is None or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        raise DeepGemmUnavailable(f"DeepGEMM's JIT needs nvcc: set CUDA_HOME (got {cuda_home!r})")
    if not os.path.exists(os.path.join(cuda_home, "bin", "cuobjdump")):
        raise DeepGemmUnavailable(f"DeepGEMM's loader runs {cuda_home}/bin/cuobjdump, which is missing")
    os.environ.setdefault("CUDA_HOME", cuda_home)  # read by torch.utils.cpp_extension at import
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(path / "jit_cache"))

    loaded = sys.modules.get("deep_gemm")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(path)):
        raise DeepGemmUnavailable(f"another deep_gemm is already imported: {loaded.__file__}")
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    try:
        import deep_gemm
    except Exception as e:  # ImportError, or an error inside its imports
        raise DeepGemmUnavailable(f"import deep_gemm from {path} failed: {type(e).__name__}: {e}") from e
    if not str(deep_gemm.__file__).startswith(str(path)):
        raise DeepGemmUnavailable(f"imported the wrong deep_gemm: {deep_gemm.__file__} (wanted {path})")
    if not hasattr(deep_gemm, "gemm_fp8_fp8_bf16_nt"):
        raise DeepGemmUnavailable(f"{deep_gemm.__file__} has no gemm_fp8_fp8_bf16_nt")
    _state.update(module=deep_gemm, root=path)
    return deep_gemm


def deepgemm_version(root: str | os.PathLike | None = DEFAULT_ROOT) -> str:
    """One line naming the loaded DeepGEMM: source commit, CUTLASS pin, JIT header hash, nvcc."""
    dg = load_deepgemm(root)
    path = _state["root"]
    try:
        commits = re.findall(r"^\s*commit:\s+([0-9a-f]{7})[0-9a-f]*\s+\(([^,;)]+)", (path / "SOURCE.txt").read_text(), re.M)
    except OSError:
        commits = []
    commit, cutlass = (f"{c[0]} {c[1].split()[0]}" for c in (commits + [("?", "?")] * 2)[:2])
    from deep_gemm.jit.compiler import get_deep_gemm_version, get_nvcc_compiler
    try:
        nvcc = get_nvcc_compiler()[1]
    except Exception as e:  # noqa: BLE001  (reported, not fatal here)
        nvcc = f"unavailable ({e})"
    return (f"DeepGEMM {commit} (pure-Python JIT, {os.path.dirname(dg.__file__)}), CUTLASS {cutlass}, "
            f"headers {get_deep_gemm_version()}, nvcc {nvcc}")


def _backend():
    """The project's DeepGEMM adapter (`sglang_ext/layers/fp8_backend.py`: the scale layout, our quantiser,
    the bias after), imported lazily: the same code path the served layers take with
    SGLANG_EXT_FP8_GEMM=deepgemm."""
    from benchmarks import bench_common

    bench_common.import_project()
    from sglang_ext.layers import fp8_backend

    return fp8_backend


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def deepgemm_scale_buffer(m: int, k: int, device) -> torch.Tensor:
    """fp32 [m, ceil(k/128)] with strides (1, align4(m)): DeepGEMM's TMA-aligned MN-major layout."""
    return _backend().deepgemm_scale_buffer(m, k, device)


def _check_weight(w_fp8: torch.Tensor, w_scale_inv: torch.Tensor, k: int) -> int:
    if w_fp8.dim() != 2 or w_fp8.dtype != torch.float8_e4m3fn or w_fp8.shape[1] != k:
        raise ValueError(f"deepgemm: weight must be e4m3 [N, {k}], got {w_fp8.dtype} {tuple(w_fp8.shape)}")
    n = w_fp8.shape[0]
    want = (_cdiv(n, GROUP), _cdiv(k, GROUP))
    if tuple(w_scale_inv.shape) != want or w_scale_inv.dtype != torch.float32:
        raise ValueError(f"deepgemm: weight_scale_inv must be fp32 {want}, got "
                         f"{w_scale_inv.dtype} {tuple(w_scale_inv.shape)}")
    if not (w_fp8.is_contiguous() and w_scale_inv.is_contiguous()):
        raise ValueError("deepgemm: weight and weight_scale_inv must be contiguous (row-major)")
    if (k * w_fp8.element_size()) % 16:
        raise ValueError(f"deepgemm: K={k} bytes per row must be a multiple of 16 (TMA)")
    return n


def deepgemm_gemm(a_fp8: torch.Tensor, a_scale: torch.Tensor, w_fp8: torch.Tensor,
                  w_scale_inv: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 [M, N] = dequant(a) dequant(w)^T by DeepGEMM alone. a_scale in any layout (DeepGEMM
    copies it into its layout if needed: `deepgemm_scale_buffer` gives that layout)."""
    dg = load_deepgemm()
    m, k = a_fp8.shape
    n = _check_weight(w_fp8, w_scale_inv, k)
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a_fp8.device)
    if m > 0:
        dg.gemm_fp8_fp8_bf16_nt((a_fp8, a_scale), (w_fp8, w_scale_inv), out)
    return out


def deepgemm_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale_inv: torch.Tensor,
                    bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y [..., N] bf16 = x W^T + b: the backend's `deepgemm_linear` on this peer (x quantised by our Triton
    quantiser into DeepGEMM's scale layout, DeepGEMM's GEMM into bf16, the bias added after)."""
    _check_weight(w_fp8, w_scale_inv, x.shape[-1])
    return _backend().deepgemm_linear(x, w_fp8, w_scale_inv, bias, module=load_deepgemm(), api="v1")


__all__ = [
    "DEFAULT_ROOT", "DeepGemmUnavailable", "load_deepgemm", "deepgemm_version",
    "deepgemm_scale_buffer", "deepgemm_gemm", "deepgemm_linear",
]
