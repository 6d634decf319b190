"""On the GPU test machine: unpack `.carry/` (benchmarks/served/carry.py) and print the environment under which
`python -m sglang.launch_server` runs there with this checkout as the installed `sglang-ext`.

    eval "$(python3 benchmarks/served/gpu_env.py)" && cd /tmp && python3 -m sglang.launch_server ...

Run from outside the checkout: in its root, `sglang_ext/` (the glue folder alone) would shadow the linked package.

Standard library only: it runs before anything of the carry is importable. This checkout is linked in as the
package `sglang_ext` (the layout pyproject's package-dir maps) beside a dist-info that declares the plugin entry
point, so SGLang's `load_plugins()` finds it in every process, as after `pip install sglang-ext`.

What the stand-in `sgl_kernel` cannot do is switched off by SGLang's own settings, each exported below:
  SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1        the stand-in has no real version
  SGLANG_FORCE_FUSED_OP_BACKEND=torch            positions and other fused ops in torch, not sgl_kernel's JIT
  SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python  the Rust radix core is built for torch 2.14 (inserts fail on 2.11)
and by launch flags (`SERVER_FLAGS`): sampling in torch (sgl_kernel's top-k/top-p kernels otherwise), and no
prefill CUDA graphs (SGLang's breakable prefill graphs, its default without `--probe-ckpt`, hold their
intermediates through `sgl_kernel.weak_ref_tensor`; with the probe they are off anyway).
"""

from __future__ import annotations

import os
import shlex
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEST = Path(os.environ.get("SGLANG_EXT_CARRY_DEST", "/tmp/sglang_ext_carry"))
# The package's import layout (pyproject.toml [tool.setuptools.package-dir]).
SUBPACKAGES = {"kernels": "kernels", "probe": "probe", "patches": "patches", "launch": "launch"}
VERSION = "0.1.0"
SERVER_FLAGS = ("--sampling-backend", "pytorch", "--disable-prefill-cuda-graph")
ENV = {
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
    "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",
    "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def unpack(carry: Path = ROOT / ".carry", dest: Path = DEST) -> dict[str, str]:
    site = dest / "site"
    if not (site / "sglang").is_dir():
        with tarfile.open(carry / "site.tar.gz") as tar:
            tar.extractall(dest, filter="data")
    ext = dest / "ext"
    pkg = ext / "sglang_ext"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "sglang_ext").iterdir():
        if entry.name != "__pycache__":
            _link(pkg / entry.name, entry)
    for name, folder in SUBPACKAGES.items():
        _link(pkg / name, ROOT / folder)
    info = ext / f"sglang_ext-{VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang-ext\nVersion: {VERSION}\n")
    # sglang_ext_weightless_routing: patches/dummy_routing.py alone, for upstream's gpt-oss timed as the peer
    # (SGLANG_PLUGINS=sglang_ext_weightless_routing): its dummy routers otherwise send every token to 4 experts
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nsglang_ext = sglang_ext.plugin:load\n"
                                           "sglang_ext_weightless_routing = sglang_ext.patches.dummy_routing:register\n")
    (info / "top_level.txt").write_text("sglang_ext\n")
    env = dict(ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ext), str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(site / "bin"), os.environ.get("PATH", "")])  # the carried wheels' scripts (ninja)
    env["TIKTOKEN_ENCODINGS_BASE"] = str((carry / "vocab").resolve())
    env["TIKTOKEN_RS_CACHE_DIR"] = str(dest / "tiktoken-rs")
    env["KERNEL_STUB_LOG"] = str(dest / "sgl_kernel_calls.log")
    return env


def _link(link: Path, target: Path) -> None:
    if link.is_symlink() or link.exists():
        if link.is_symlink() and Path(os.readlink(link)) == target:
            return
        link.unlink()
    link.symlink_to(target)


def describe() -> dict:
    """The machine and versions a served result was measured with (run under the exported environment)."""
    import sglang
    import torch
    import transformers
    import triton

    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "sglang": sglang.__version__,
            "transformers": transformers.__version__, "flags": list(SERVER_FLAGS),
            "env": {k: v for k, v in ENV.items() if k.startswith("SGLANG")}, "sgl_kernel": "stand-in (carry)",
            "host": host()}


def host() -> dict:
    """The host the scheduler's Python runs on: the served batch-1 step waits on its loop, and two machines with
    the same card ran that loop 2x apart. CPU model, cores, load average, and a fixed pure-Python loop's time (the
    median of 5), which compares hosts directly."""
    import statistics
    import time

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += i % 7
        runs.append((time.perf_counter() - t0) * 1e3)
    return {"cpu": model, "cores": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
            "python_loop_ms": round(statistics.median(runs), 2)}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--describe"]:
        import json

        print(json.dumps(describe()))
    else:
        carry = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".carry"
        for key, value in unpack(carry).items():
            print(f"export {key}={shlex.quote(value)}")
