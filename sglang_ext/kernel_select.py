"""Which maths path runs: the Triton kernels (`sglang_ext.kernels`) or the torch path.

SGLang-free. One switch for the model's layers, the attention backend and the benchmark
harness, so that a test can run the whole served model through the Triton kernels on a
CPU under `TRITON_INTERPRET=1` and compare it with the torch path:

  SGLANG_EXT_KERNELS=auto    (default) Triton on CUDA tensors, torch elsewhere
  SGLANG_EXT_KERNELS=triton  Triton everywhere (on CPU only with TRITON_INTERPRET=1)
  SGLANG_EXT_KERNELS=torch   torch everywhere (a fallback and a peer)

`use_triton` runs many times a forward, so each variable here is read and checked once per process, at
its first use (not at import: a script may set it, or TRITON_INTERPRET, after importing the package).
`reload_settings()` reads them again, for code that changes them in-process (tests).
"""

from __future__ import annotations

import os

import torch

from sglang_ext.kernels._util import interpreted

ENV_VAR = "SGLANG_EXT_KERNELS"
CHOICES = ("auto", "triton", "torch")
COMPILE_ENV_VAR = "SGLANG_EXT_COMPILE"

# Variable name -> its parsed value, for every sglang_ext switch (kernel_select's, layers.fp8_backend's,
# layers.lm_head's). A plain dict rather than lru_cache: the readers may run inside a forward that
# torch.compile traces, where a dict lookup is an ordinary guarded read.
_settings: dict = {}


def read_once(name: str, read):
    """`read()` (parse and check variable `name`) on first use, then its cached value. A bad value is not
    kept: it raises at each call."""
    value = _settings.get(name)
    if value is None:
        value = _settings[name] = read()
    return value


def reload_settings() -> None:
    """Every sglang_ext switch (and TRITON_INTERPRET, for SGLANG_EXT_KERNELS's check) read again at its next use."""
    _settings.clear()


def _read_kernel_mode() -> str:
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in CHOICES:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(CHOICES)}")
    if mode == "triton" and not interpreted() and not torch.cuda.is_available():
        raise ValueError(f"{ENV_VAR}=triton on a machine without CUDA needs TRITON_INTERPRET=1")
    return mode


def kernel_mode() -> str:
    """SGLANG_EXT_KERNELS, validated, read once per process."""
    return read_once(ENV_VAR, _read_kernel_mode)


def compile_enabled() -> bool:
    """SGLANG_EXT_COMPILE != "0", read once per process."""
    return read_once(COMPILE_ENV_VAR, lambda: os.environ.get(COMPILE_ENV_VAR, "1") != "0")


def compiled_on_cuda(fn):
    """`fn` as one torch.compile'd (Inductor -> Triton) kernel on CUDA tensors, eager elsewhere.

    For the small elementwise maths between the big kernels (RMSNorm, RoPE): eager torch issues
    6-8 kernels for each, ~30 per layer, which dominate a batch-1 decode step. Same maths, fused;
    SGLANG_EXT_COMPILE=0 turns it off (eager everywhere; read once per process, `compile_enabled`)."""
    compiled = None

    def wrapper(x, *args, **kwargs):
        nonlocal compiled
        if x.is_cuda and compile_enabled():
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            return compiled(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    wrapper.__wrapped__ = fn
    wrapper.__doc__ = fn.__doc__
    wrapper.__name__ = fn.__name__
    return wrapper


def use_triton(device: torch.device | str) -> bool:
    """True when the Triton kernels should run for tensors on `device`."""
    mode = kernel_mode()
    if mode == "auto":
        return torch.device(device).type == "cuda"
    return mode == "triton"
