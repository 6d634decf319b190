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


# Seconds each of the long test files takes in `launch/test.sh` on a 2-core machine (two xdist
# workers, both busy; measured, junit times); every other file takes under ~20 s and counts 0.
# With `--dist loadfile` a worker asks for the next file when its current one is nearly done, in
# collection order: the longest go first so that the short ones fill the end and both workers
# finish together (in xdist's own order, most tests first, a 490 s file with five tests went
# last). A new long file belongs here.
FILE_SECONDS = {  # summed durations of a full run (pytest --durations=0)
    "test_faults.py": 421,
    "test_kernel_sink_attention.py": 363,
    "test_served_parity.py": 240,
    "test_probe_serving.py": 223,
    "test_tenants.py": 210,
    "test_fp8.py": 192,
    "test_kernel_moe.py": 160,
    "test_compile_sm90.py": 151,
    "test_playground.py": 131,  # one CPU server with the probe and a headless Chromium
    "test_served_parallel.py": 99,
    "test_kernel_fp8_gemm.py": 82,
    "test_probe_serving_bf16.py": 79,
    "test_cli.py": 75,
    "test_sglang_server_grid.py": 40,
    "test_probe_kernel.py": 35,
    "test_kernel_moe_decode.py": 30,
    "test_probe_step.py": 27,
    "test_mxfp4_load.py": 26,
}


_FILE_TOTALS: dict = {}


def pytest_runtest_logreport(report):
    # On the xdist controller too: every phase's duration, summed by file for the summary below.
    name = report.nodeid.split("::")[0].rsplit("/", 1)[-1]
    _FILE_TOTALS[name] = _FILE_TOTALS.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    # A long file missing from FILE_SECONDS runs wherever collection order puts it (once: last, 126 s).
    # The table orders the CPU suite; a GPU run's times say nothing about it.
    import torch

    if torch.cuda.is_available():
        return
    missing = {f: t for f, t in _FILE_TOTALS.items() if t >= 20 and f not in FILE_SECONDS}
    if missing:
        terminalreporter.write_line("tests/conftest.py FILE_SECONDS lacks these long files (seconds this run): "
                                    + ", ".join(f"{f} {t:.0f}" for f, t in sorted(missing.items())))


def pytest_configure(config):
    # xdist >= 3.8 re-sorts files by their number of tests (most first) unless told not to, which
    # would undo the order below; older xdist has no such option and keeps collection order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    import torch

    # Longest files first; a stable sort keeps each file's tests together and in their order.
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; GPU results live in benchmarks/results/")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seeded_rng(request):
    """Each test draws from torch's, numpy's and Python's global generators seeded by its own name, so
    what it draws does not depend on which tests ran before it on its xdist worker."""
    import random
    import zlib

    import numpy
    import torch

    seed = zlib.crc32(request.node.nodeid.encode())
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


@pytest.fixture()
def ext_env(monkeypatch):
    """`ext_env(name, value)` sets an SGLANG_EXT_* switch for this test (None unsets it) and makes the
    modules that read theirs once per process read it again; after the test they read the restored
    environment again too."""
    from sglang_ext.kernel_select import reload_settings as reload

    def set_env(name, value):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        reload()

    yield set_env
    # Runs before monkeypatch restores the variables (it was set up first): the caches are empty
    # until the next read, which then sees the restored environment.
    reload()


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
