"""What SGLang 0.5.23 needs to run on a CPU without a GPU, applied for the user.

- `SGLANG_USE_CPU_ENGINE=1`: SGLang's CPU platform is opt-in.
- a stub `libcuda.so.1` on `LD_LIBRARY_PATH`: with the CPU engine on, SGLang imports
  the CUDA build of `sgl_kernel` (`cache_move.py`), whose library links libcuda.
- `TRITON_INTERPRET=1` is *not* set: our CPU paths are torch, not Triton.

`cpu_server_env()` returns the environment for a server process; the demo and the
tests start SGLang with it, so nobody sets these by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

STUB_SOURCE = Path(__file__).with_name("libcuda_stub.c")


def default_cache_dir() -> Path:
    from sglang_ext.launch.tokenizer import default_cache_dir as tokenizer_cache_dir

    return Path(tokenizer_cache_dir())


def build_libcuda_stub(cache_dir: Path | None = None) -> Path:
    """Compile the stub once; returns the folder that holds `libcuda.so.1`."""
    out_dir = (cache_dir or default_cache_dir()) / "cudastub"
    lib = out_dir / "libcuda.so.1"
    if lib.exists() and lib.stat().st_mtime >= STUB_SOURCE.stat().st_mtime:
        return out_dir
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("building the libcuda stub needs a C compiler (gcc or cc) on PATH")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"libcuda.so.1.{os.getpid()}.tmp"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(STUB_SOURCE)],
        check=True,
    )
    os.replace(tmp, lib)
    return out_dir


def has_cuda_driver() -> bool:
    """A real driver with at least one device (our stub, once loaded, answers no device)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


SERVED_MODEL_MODULES = ("gpt_oss",)  # sglang.srt.models modules the CPU servers load


def other_model_modules() -> list[str]:
    """The module names of sglang.srt.models other than SERVED_MODEL_MODULES, found on disk (no import)."""
    import importlib.util
    import pkgutil

    spec = importlib.util.find_spec("sglang.srt.models")
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(name for _, name, ispkg in pkgutil.iter_modules(spec.submodule_search_locations)
                  if not ispkg and name not in SERVED_MODEL_MODULES and name != "registry")


def cpu_server_env(base: dict | None = None, vocab_dir: str | None = None) -> dict:
    """Environment for an SGLang process on this CPU."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if env.get("SGLANG_EXT_KERNELS", "").strip().lower() != "triton":
        # An interpreter flag left in a test's environment would slow SGLang's own Triton code
        # paths; only a server asked to run our kernels on this CPU keeps it.
        env.pop("TRITON_INTERPRET", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not has_cuda_driver():
        stub_dir = str(build_libcuda_stub())
        paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        if stub_dir not in paths:
            env["LD_LIBRARY_PATH"] = os.pathsep.join([stub_dir] + paths)
    # SGLang imports all ~250 model modules in every process it starts (its model registry), ~2 s each time
    # on a small CPU; these servers only ever load gpt-oss, so the others are skipped through SGLang's own
    # switch. A value already in the environment is kept.
    skipped = other_model_modules()
    if skipped:
        env.setdefault("SGLANG_DISABLED_MODEL_ARCHS", ",".join(skipped))
    # One intra-op thread: these servers run the tiny model, whose forward is hundreds of small ops, each a
    # parallel region whose barrier waits for every thread. Beside another busy process (a second test
    # worker, the client) a descheduled thread stalls each of them: eight 12-token requests took 26.9 s
    # next to a torch loop with torch's default 2 threads here, 4.0 s with one (3.8 / 3.6 s with the
    # machine idle; benchmarks/bench_cpu_threads.py). A value already in the environment is kept.
    env.setdefault("OMP_NUM_THREADS", "1")
    if vocab_dir:
        from sglang_ext.launch.tokenizer import harmony_env

        env.update(harmony_env(vocab_dir))
    return env
