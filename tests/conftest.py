"""Test-wide setup: SGLang's CPU engine and the libcuda stub, as the README's commands apply them."""

import ctypes
import os

import pytest

from sglang_ext.launch.cpu_shims import build_libcuda_stub, has_cuda_driver

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not has_cuda_driver():
    # Loaded under its soname before sgl_kernel is imported, the stub satisfies
    # sgl_kernel's NEEDED libcuda.so.1 in this process (LD_LIBRARY_PATH is read at exec).
    ctypes.CDLL(str(build_libcuda_stub() / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; GPU results live in benchmarks/results/")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoints():
    """The tiny gpt-oss checkpoints (bf16, fp32, mxfp4), generated once into the repo's .cache/."""
    from pathlib import Path

    from sglang_ext.launch.make_tiny import generate

    root = Path(__file__).resolve().parents[1] / ".cache" / "tiny"
    return {k: Path(v) for k, v in generate(root, variants=("bf16", "fp32", "mxfp4"), log=lambda *_: None).items()}


@pytest.fixture(scope="session")
def tiny_calm_checkpoints():
    """The tiny gpt-oss with the "calm" init (bf16 rounding not amplified), bf16 and fp32."""
    from pathlib import Path

    from sglang_ext.launch.make_tiny import generate

    root = Path(__file__).resolve().parents[1] / ".cache" / "tiny_calm"
    return {k: Path(v) for k, v in generate(root, variants=("bf16", "fp32"), log=lambda *_: None,
                                            init="calm").items()}


@pytest.fixture(scope="session")
def vocab_dir():
    from sglang_ext.launch.tokenizer import ensure_o200k_vocab

    return ensure_o200k_vocab()
