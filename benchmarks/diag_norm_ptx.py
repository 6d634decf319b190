"""Why `residual_rms_norm` compiled with QUANTIZE returns other bf16 bits than the plain launch (session 14's
gpu test, logs/h200_session14_gpu_test_x_quant_REVERTED.log): compile both variants for sm_90 on this CPU (no
GPU needed: benchmarks/compile_only.py, as tests/test_sglang_peers.py's SGLANG_PEERS_SM90 check) and compare
how each thread's elements of the row are laid out, which sets the order of the mean-square reduction.

    python benchmarks/diag_norm_ptx.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_only import install_compile_only_h200, pretend_torch_has_h200  # noqa: E402


def _compile_only_h200() -> dict:
    """{(kernel name, QUANTIZE): compiled kernel} of every launch from now on, none of them run; torch told it
    has an H200 where the launchers ask."""
    pretend_torch_has_h200()
    compiled = {}
    install_compile_only_h200(lambda fn, kernel, kwargs: compiled.__setitem__(
        (fn.fn.__name__, bool(kwargs.get("QUANTIZE"))), kernel))
    return compiled


def _summary(ptx: str) -> dict:
    """The first lines that map the thread index to row elements, and the reduction's instruction counts."""
    lines = ptx.splitlines()
    tid = next(i for i, line in enumerate(lines) if "%tid.x" in line)
    mapping = [line.strip() for line in lines[tid: tid + 6] if re.search(r"\b(and|shl|mul|mad)\.", line)]
    return {"thread_to_element": mapping, "fma_f32": ptx.count("fma.rn.f32"), "add_f32": ptx.count("add.f32"),
            "shfl": ptx.count("shfl.sync"), "loads_v4": ptx.count("ld.global.v4")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    compiled = _compile_only_h200()
    import bench_common as bc

    bc.import_project()
    from sglang_ext.kernels import residual_norm

    residual_norm._interpreted = lambda: False  # compile as on the GPU (HW rounding, no bf16 emulation)
    residual_norm.pdl_launch_kwargs = lambda *a, **k: {"USE_PDL": False}
    t, c = 256, 2880  # prefill rows of gpt-oss's hidden size: one program a row
    h, d = torch.randn(t, c).to(torch.bfloat16), torch.randn(t, c).to(torch.bfloat16)
    w = torch.rand(c).to(torch.bfloat16)
    for quantize in (False, True):
        try:
            residual_norm.residual_rms_norm(h, d, w, 1e-5, quantize=quantize)
        except Exception:  # noqa: BLE001  (compiled; the launch itself cannot run here)
            pass
    meta = bc.run_meta("python benchmarks/diag_norm_ptx.py " + " ".join(sys.argv[1:]))
    rows = [{"variant": f"QUANTIZE={q}", **_summary(k.asm["ptx"])} for (_, q), k in sorted(compiled.items())]
    md = ["# residual_rms_norm's layout with and without QUANTIZE (sm_90 PTX, compiled on a CPU)", "",
          f"`{meta['command']}` — {meta.get('date', '')}, triton {meta.get('triton')}", "",
          f"[{t}, {c}] bf16, one program a row (BLOCK 4096, 8 warps). The mean square sums each thread's own "
          "elements first (mul + fma), then a tree across its registers, the warp (shfl) and the warps: which "
          "elements a thread holds sets the order of the fp32 sums, so two layouts may round mean(h^2) apart.", ""]
    for r in rows:
        md += [f"## {r['variant']}", "", "```", *r["thread_to_element"], "```", "",
               f"fma.rn.f32 {r['fma_f32']}, add.f32 {r['add_f32']}, shfl.sync {r['shfl']}, 16-byte loads "
               f"{r['loads_v4']}", ""]
    bc.write_results(args.out, "diag_norm_ptx", meta, rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
