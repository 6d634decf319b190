"""A stand-in for `sglang-kernel` on the GPU test machine, where the real one cannot travel.

The real package is 373 MB and built for torch 2.14; the GPU machine has torch 2.11 and no registry.
SGLang imports `sgl_kernel` (and submodules such as `sgl_kernel.kvcacheio`) in many modules behind
`is_cuda()`, mostly for kernels that gpt-oss served by sglang-ext never runs. Every import here
succeeds; every name but the functions defined here (a host-side query, also reachable as `REAL`'s
submodule name, and two norms the upstream peer needs, delegated to SGLang's own kernels) is a
`Stub` that raises a `RuntimeError` naming itself when called, and appends that name to
`$KERNEL_STUB_LOG` (one line a call), so a run can prove that no stubbed function was on its path.
Never installed for users: `benchmarks/served/carry.py` puts it in the carry.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

__version__ = "0.0.0+stub"
STUB = True


def _log(name: str) -> None:
    path = os.environ.get("KERNEL_STUB_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {name}\n")


class Stub:
    """Any attribute of a stubbed module: attributes are stubs too; calling one raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Stub(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        _log(self._name)
        raise RuntimeError(f"{self._name} is a stub: the real sglang-kernel is not installed on this machine")

    def __repr__(self):
        return f"<sgl_kernel stub {self._name}>"


def is_arch_support_pdl() -> bool:
    """As sglang-kernel's `sgl_kernel.utils.is_arch_support_pdl` (a host-side query, no kernel): CUDA sm_90+.
    SGLang's own triton attention backend (the upstream peer's) asks it at init."""
    import torch

    if getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9


def fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6, enable_pdl=None) -> None:
    """sglang-kernel's in-place `residual += input; input = rmsnorm(residual) * weight`, as one CUDA kernel:
    SGLang's own JIT one (compiled with nvcc on first use). The upstream peer's RMSNorm calls it twice a layer."""
    from sglang.kernels.ops.layernorm.norm import fused_add_rmsnorm as jit_fused_add_rmsnorm

    jit_fused_add_rmsnorm(input, residual, weight, eps)


def rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl=None):
    """sglang-kernel's `rmsnorm` (out-of-place): SGLang's JIT kernel where it takes the hidden size, else in torch
    (gpt-oss's 2880 is not a JIT size; the peer calls it once a forward, for the final norm)."""
    import torch

    from sglang.kernels.ops.layernorm.norm import _is_supported_rmsnorm_hidden_size
    from sglang.kernels.ops.layernorm.norm import rmsnorm as jit_rmsnorm

    out = torch.empty_like(input) if out is None else out
    if _is_supported_rmsnorm_hidden_size(input.shape[-1]):
        jit_rmsnorm(input, weight, out, eps)
    else:
        x = input.float()
        out.copy_((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype))
    return out


# Real names of submodules (the functions above are real in this top-level module as they stand): the two norms
# are the ones the upstream peer's gpt-oss calls each step (sglang-kernel's are FlashInfer's, one kernel each).
REAL = {"sgl_kernel.utils.is_arch_support_pdl": is_arch_support_pdl}


def _module_getattr(module_name: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return REAL.get(f"{module_name}.{attr}") or Stub(f"{module_name}.{attr}")

    return __getattr__


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every `sgl_kernel.<sub>` module exists, as a package of stubs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


__getattr__ = _module_getattr(__name__)
sys.meta_path.insert(0, _StubFinder())
