"""The maths-path switches (`sglang_ext/kernel_select.py`): parsed and checked once per process."""

import pytest
import torch

from sglang_ext import kernel_select


def test_kernel_mode_is_parsed_once(ext_env, monkeypatch):
    ext_env(kernel_select.ENV_VAR, None)
    assert kernel_select.kernel_mode() == "auto"
    assert kernel_select.use_triton("cpu") is False
    ext_env(kernel_select.ENV_VAR, " Torch ")
    assert kernel_select.kernel_mode() == "torch"
    monkeypatch.setenv(kernel_select.ENV_VAR, "auto")
    assert kernel_select.kernel_mode() == "torch"  # read once: a change without reload_settings is not seen
    ext_env(kernel_select.ENV_VAR, "cuda")
    for _ in range(2):  # a bad value is not kept: each call raises
        with pytest.raises(ValueError, match="SGLANG_EXT_KERNELS='cuda': expected one of auto, triton, torch"):
            kernel_select.kernel_mode()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only rule")
def test_triton_off_cuda_needs_the_interpreter(ext_env, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ext_env(kernel_select.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="SGLANG_EXT_KERNELS=triton on a machine without CUDA needs TRITON_INTERP"):
        kernel_select.use_triton("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel_select.reload_settings()
    assert kernel_select.use_triton("cpu") is True


def test_compile_switch_is_read_once(ext_env, monkeypatch):
    ext_env(kernel_select.COMPILE_ENV_VAR, None)
    assert kernel_select.compile_enabled() is True
    ext_env(kernel_select.COMPILE_ENV_VAR, "0")
    assert kernel_select.compile_enabled() is False
    monkeypatch.setenv(kernel_select.COMPILE_ENV_VAR, "1")
    assert kernel_select.compile_enabled() is False
    kernel_select.reload_settings()
    assert kernel_select.compile_enabled() is True

