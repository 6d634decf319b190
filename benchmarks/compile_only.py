"""Compile Triton kernels for an H200 (sm_90) on a machine without a GPU: Triton's view of a device that never
launches. Every `kernel[grid](...)` call compiles (PTX, then a cubin through Triton's bundled ptxas) and hands the
compiled kernel to a callback; the launch itself never happens. Used by tests/benchmarks/test_sglang_peers.py's opt-in
sm_90 check (SGLANG_PEERS_SM90=1), benchmarks/diag_norm_ptx.py and tests/kernels/test_compile_sm90.py; the caller tells
torch it has a GPU where
the launchers ask (torch.cuda.is_available and the device's properties: `pretend_torch_has_h200`). `ptxas_resources`
and `sass_of` read a compiled kernel's registers, spills and machine code.
"""

from __future__ import annotations

import types

import torch


def pretend_torch_has_h200() -> None:
    """From now on torch answers as on an H200 where launchers ask (availability, capability, properties): for
    compile-only runs, whose kernels never launch."""
    props = types.SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448, gcnArchName="",
                                  name="NVIDIA H200")
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    torch.cuda.get_device_properties = lambda *a: props
    torch.cuda.current_device = lambda: 0


def install_compile_only_h200(on_compile) -> None:
    """From now on, a Triton launch compiles for sm_90 and calls on_compile(jit_function, compiled_kernel,
    launch_kwargs) instead of launching."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import jit as tjit
    from triton.runtime.driver import driver

    class CompileOnlyH200(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_current_device(self):
            return 0

        def get_current_stream(self, idx=None):
            return 0

    driver.set_active(CompileOnlyH200())
    run = tjit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        on_compile(self, kernel, kwargs)
        return kernel

    tjit.JITFunction.run = compile_only


def ptxas_resources(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers, spilled bytes (stores / loads) and static shared memory per thread block of a compiled
    kernel's PTX, from Triton's bundled ptxas (-v). A compile-only run has no loaded kernel whose attributes
    could be asked."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([tool, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    found = lambda pattern: int(m.group(1)) if (m := re.search(pattern, log)) else None  # noqa: E731
    return {"regs": found(r"Used (\d+) registers"), "spill_stores": found(r"(\d+) bytes spill stores"),
            "spill_loads": found(r"(\d+) bytes spill loads"), "smem": found(r"(\d+) bytes smem")}


def sass_of(cubin: bytes) -> str:
    """A cubin's machine code through Triton's bundled cuobjdump."""
    import os
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def copies_behind_barrier(ptx: str) -> tuple[int, int]:
    """(fenced, all) of a kernel's TMA requests (`mbarrier.arrive.expect_tx`, `cp.async.bulk.tensor`): fenced where,
    going back through the PTX text, a CTA barrier (`bar.sync`) comes before any wgmma instruction. With two
    warpgroups, each waits only for its own MMAs: a copy into a ring slot that the other may still read is safe
    only behind such a barrier, which Triton's shared-memory barrier pass inserts (the Gluon source has none)."""
    import re

    lines = ptx.split("\n")
    fenced = total = 0
    for i, line in enumerate(lines):
        if not re.search(r"cp\.async\.bulk\.tensor|mbarrier\.arrive\.expect_tx", line):
            continue
        total += 1
        for prev in reversed(lines[:i]):
            if re.search(r"\bbar\.sync|\bbarrier\.sync", prev):
                fenced += 1
                break
            if "wgmma." in prev:
                break
        else:  # nothing before it: no MMA to race with
            fenced += 1
    return fenced, total


def wgmma_facts(kernel) -> dict:
    """What a compiled Hopper GEMM kernel's code says about its tensor-core pipeline: the PTX's wgmma instructions
    and wait_group levels; the machine code's QGMMA count and scoreboard waits by how many wgmma groups they leave
    in flight (ptxas may still serialise: a DEPBAR ... 0x0 after every QGMMA); registers and spilled bytes (stores
    / loads); TMA requests behind a CTA barrier (`copies_behind_barrier`); shared memory."""
    import re

    ptx = kernel.asm["ptx"]
    sass = sass_of(kernel.asm["cubin"])
    res = ptxas_resources(ptx)
    levels = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+)", ptx)
    return {"wgmma": ptx.count("wgmma.mma_async"),
            "ptx_waits": ", ".join(f"wait_group {n} x{levels.count(n)}" for n in sorted(set(levels))),
            "sass_qgmma": sass.count("QGMMA"),
            "sass_depbar": ", ".join(f"{w} x{sass.count(w)}" for w in sorted(set(re.findall(r"DEPBAR\.LE gsb0, 0x\d",
                                                                                                sass)))),
            "regs": res["regs"], "spills": f"{res['spill_stores']} / {res['spill_loads']}",
            "copies_fenced": "{} / {}".format(*copies_behind_barrier(ptx)), "smem_KB": kernel.metadata.shared / 1024}


def command_line(script: str) -> str:
    """The command that ran `script`, with the PYTHONPATH that put another Triton first, if one did (e.g. the
    device image's 3.6: pip install --target DIR triton==3.6.0)."""
    import os
    import sys

    prefix = "PYTHONPATH=" + os.environ["PYTHONPATH"] + " " if os.environ.get("PYTHONPATH") else ""
    return prefix + f"python benchmarks/{script} " + " ".join(sys.argv[1:])


def write_wgmma_report(out_dir: str, stem: str, title: str, command: str, rows: list, key_columns: list) -> str:
    """The results file of a compile-only run: its rows of `wgmma_facts` (after key_columns, which name each row),
    under a legend of what each column reads; returns the Markdown."""
    import triton

    import bench_common as bc

    meta = {"command": command, "triton": triton.__version__, "target": "cuda sm_90a, compiled only (no GPU)"}
    md = "\n".join([
        f"# {title}, compiled for sm_90 (no GPU)", "", f"`{command}` — Triton {meta['triton']}", "",
        "Per kernel: the wgmma instructions and wait levels in the PTX; in the machine code (cuobjdump) the QGMMA "
        "count and the scoreboard waits by how many wgmma groups they leave in flight (0x1: one MMA runs while the "
        "previous K block is scaled; 0x0: all done, at a loop's end); ptxas's registers and spilled bytes (stores / "
        "loads); TMA requests behind a CTA barrier since the last wgmma, of all (two warpgroups each wait only for "
        "their own MMAs, so a copy into a slot the other may still read needs one); shared memory. Never run here: "
        "no timing, no check of the outputs.", "",
        bc.md_table(rows, key_columns + [
            ("PTX wgmma", "wgmma", None), ("PTX waits", "ptx_waits", None), ("SASS QGMMA", "sass_qgmma", None),
            ("SASS waits", "sass_depbar", None), ("regs", "regs", None), ("spills", "spills", None),
            ("copies behind a barrier", "copies_fenced", None), ("smem KB", "smem_KB", "{:.0f}")])]) + "\n"
    bc.write_results(out_dir, stem, meta, rows, md)
    return md
