"""The dense block-scaled FP8 GEMM in Gluon (kernels/fp8_gluon.py: one wgmma in flight while the previous K
block's scales are applied) against float64 and beside our Triton GEMM (`fp8_gemm.fp8_gemm`) on the prefill's
shapes; `--compile-only` reads its wgmma waits in the PTX and the machine code on any machine.

    python benchmarks/diag_gluon_fp8_gemm.py --compile-only     # any machine: the wgmma waits, PTX and SASS
    python benchmarks/diag_gluon_fp8_gemm.py --out DIR          # an H200: check against float64, time
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
from sglang_ext.kernels.fp8_gluon import fp8_gemm_gluon, fp8_gemm_gluon_ref  # noqa: E402


def compile_only() -> list:
    """Compile the kernel for sm_90 on this machine (no launch) and read its pipeline from its code
    (`compile_only.wgmma_facts`)."""
    from compile_only import install_compile_only_h200, pretend_torch_has_h200, wgmma_facts

    pretend_torch_has_h200()
    compiled = []
    install_compile_only_h200(lambda fn, kernel, kwargs: compiled.append(kernel))
    rows = []
    for block_m, warps, persistent in ((64, 4, False), (128, 8, False), (128, 8, True)):
        a = torch.zeros(256, 2880, dtype=torch.float8_e4m3fn)
        w = torch.zeros(256, 2880, dtype=torch.float8_e4m3fn)
        fp8_gemm_gluon(a, torch.ones(256, 23), w, torch.ones(2, 23), block_m=block_m, num_warps=warps,
                       persistent=persistent)
        rows.append({"tile": f"m{block_m} n128 w{warps} s4" + (" persistent" if persistent else ""),
                     **wgmma_facts(compiled[-1])})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--stem", default=None, help="results file stem (default: diag_gluon_fp8_gemm, + _compile)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    from compile_only import command_line

    command = command_line("diag_gluon_fp8_gemm.py")

    if args.compile_only:
        from compile_only import write_wgmma_report

        print(write_wgmma_report(args.out, args.stem or "diag_gluon_fp8_gemm_compile", "Gluon FP8 GEMM", command,
                                 compile_only(), [("tile", "tile", None)]))
        return

    from sglang_ext.kernels import fp8_gemm

    ceil = bc.measure_ceilings()
    torch.manual_seed(0)
    rows = []
    for m, n, k in ((8192, 5120, 2880), (8192, 2880, 4096), (1000, 640, 2880)):
        a = (torch.randn(m, k, device="cuda") * 64).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, device="cuda") * 64).to(torch.float8_e4m3fn)
        a_s = torch.rand(m, triton.cdiv(k, 128), device="cuda") * 1e-3 + 1e-4
        a_s_mn = a_s.t().contiguous().t()  # MN-major, as fp8_gemm's quantiser writes it
        w_s = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device="cuda") * 1e-3 + 1e-4
        want = fp8_gemm_gluon_ref(a, a_s, w, w_s)
        # ours as served (the bias-free form of the dense layers' GEMM), and its bits to compare with
        ours_out = fp8_gemm.fp8_gemm(a, a_s_mn, w, w_s)
        candidates = [("ours (fp8_gemm)", lambda o: fp8_gemm.fp8_gemm(a, a_s_mn, w, w_s, out=o))]
        gluon = lambda scales, block_m, warps, stages=4, persistent=False: lambda o: fp8_gemm_gluon(  # noqa: E731
            a, scales, w, w_s, out=o, block_m=block_m, num_warps=warps, stages=stages, persistent=persistent)
        candidates += [("gluon m128 w8, a_s row-major", gluon(a_s, 128, 8)), ("gluon m128 w8", gluon(a_s_mn, 128, 8)),
                       ("gluon m64 w4", gluon(a_s_mn, 64, 4)), ("gluon m64 w4 s3", gluon(a_s_mn, 64, 4, 3)),
                       ("gluon m64 w8 (n64 a warpgroup)", gluon(a_s_mn, 64, 8)),
                       ("gluon m128 w8 persistent", gluon(a_s_mn, 128, 8, persistent=True)),
                       ("gluon m64 w4 persistent", gluon(a_s_mn, 64, 4, persistent=True))]
        ours_us = None
        for name, fn in candidates:
            row = {"M": m, "N": n, "K": k, "kernel": name}
            try:
                got = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                fn(got)
                torch.cuda.synchronize()
                row["max_rel_err"] = ((got.double() - want).abs().max() / want.abs().max()).item()
                row["bits_equal_ours"] = bool(torch.equal(got, ours_out))
                row["us"] = bc.graph_time_calls([lambda: fn(got)]) * 1e6
                row["TFLOPs"] = 2 * m * n * k / row["us"] / 1e6
                if "fp8_matmul_flops" in ceil:
                    row["pct_fp8"] = 100 * row["TFLOPs"] * 1e12 / ceil["fp8_matmul_flops"]
                ours_us = ours_us or row["us"]
                row["x_ours"] = ours_us / row["us"]
            except Exception as e:  # noqa: BLE001 - report, keep going
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(row, flush=True)
    meta = bc.run_meta(command, {"fp8_matmul_TFLOPs": ceil.get("fp8_matmul_flops", float("nan")) / 1e12})
    md = "\n".join([
        "# Gluon FP8 GEMM (the promotion behind the MMA) beside ours (H200)", "",
        f"`{command}`. Random e4m3 operands and block scales, bf16 out, no bias; CUDA-graph times. FP8 matmul rate "
        f"measured in this run: {meta['fp8_matmul_TFLOPs']:.0f} TFLOP/s. `max rel err` against float64 of the "
        "dequantised operands; `bits = ours`: equal to `fp8_gemm.fp8_gemm` (same block sums in K order); `x ours`: "
        "speed-up over it.", "",
        bc.md_table(rows, [("M", "M", None), ("N", "N", None), ("K", "K", None), ("kernel", "kernel", None),
                           ("us", "us", "{:.1f}"), ("TFLOP/s", "TFLOPs", "{:.0f}"), ("% FP8", "pct_fp8", "{:.0f}"),
                           ("x ours", "x_ours", "{:.3f}"), ("max rel err", "max_rel_err", "{:.1e}"),
                           ("bits = ours", "bits_equal_ours", None), ("error", "error", None)])]) + "\n"
    bc.write_results(args.out, args.stem or "diag_gluon_fp8_gemm", meta, rows, md)
    print(md)


if __name__ == "__main__":
    main()
