"""How often the dense FP8 GEMM's bf16 outputs are the correctly rounded result, by launch config.

    python benchmarks/diag_gemm_rounding.py --out benchmarks/results

For gpt-oss's qkv (5120 x 2880) and o (2880 x 4096) on random e4m3 weights and activations quantised as the
decode step does (1x128 groups), each config's `fp8_gemm` output is compared with the float64 product of the
same dequantised operands (+ bias) rounded once to bf16: the fraction of elements equal to it, and the
relative (Frobenius) error before that rounding's share. Why: Hopper's FP8 wgmma keeps about 14 bits while it
accumulates inside an instruction chain (DeepSeek-V3 report, 3.3.2), so tiles that run on wgmma (64+ rows)
round a few % of outputs to the neighbouring bf16 value, where mma.sync tiles (32 rows) and the GEMV's FMA
blocks are exact before the one rounding. Session 12 measured this when a 64 x 128 wgmma tile for 17..64 rows
(faster: qkv M = 64 16.3 -> 12.1 us) moved a one-layer decode step twice as far from the torch path (reverted).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--m", default="1,16,32,64,128,1024")
    args = ap.parse_args()
    bc.import_project()
    from sglang_ext.kernels import fp8_gemm as mod
    from sglang_ext.layers import fp8

    meta = bc.run_meta("python benchmarks/diag_gemm_rounding.py " + " ".join(sys.argv[1:]))
    C = mod.Fp8GemmConfig
    extra = {"m32n64 s1 (mma.sync)": C(32, 64, num_warps=4, num_stages=4),
             "m64n128 s1 tma (wgmma)": C(64, 128, num_warps=4, num_stages=4, tma=True),
             "m64n128 s1 (wgmma, pointer)": C(64, 128, num_warps=4, num_stages=4)}
    rows = []
    torch.manual_seed(0)
    for shape, (n, k) in (("qkv", (5120, 2880)), ("o", (2880, 4096))):
        w, ws = fp8.quantize_weight_block128(torch.randn(n, k, device="cuda") * 0.05)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        w64 = fp8.dequantize_weight_block128(w, ws).double()
        for m in (int(v) for v in args.m.split(",")):
            xq, xs = mod.quantize_activation_group128(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            exact = fp8.dequantize_activation_group128(xq, xs).double() @ w64.t() + bias.double()
            rounded = exact.to(torch.bfloat16)
            configs = {"table": mod.gemm_config(m, n, k, xq.device, x_prequantized=True)}
            if m > 16:
                configs.update(extra)
            for label, cfg in configs.items():
                y = mod.fp8_gemm(xq, xs, w, ws, bias, config=cfg)
                rows.append({"shape": shape, "M": m, "config": f"{label}: {cfg.short()}",
                             "correctly_rounded": (y == rounded).float().mean().item(),
                             "rel_err": ((y.double() - exact).norm() / exact.norm()).item(),
                             "rounding_rel_err": ((rounded.double() - exact).norm() / exact.norm()).item()})
                print(rows[-1], flush=True)
    md = [f"# Dense FP8 GEMM: correctly rounded bf16 outputs by config ({meta.get('gpu', 'GPU')})", "",
          f"`{meta['command']}` — {meta.get('date', '')}", "",
          "x pre-quantised (1x128 e4m3 groups), random e4m3 weights (block-128 scales), bf16 bias. Correctly "
          "rounded: fraction of outputs equal to the float64 product of the same dequantised operands rounded "
          "once to bf16. rel err: Frobenius, against float64; the rounding's own share beside it.", "",
          bc.md_table(rows, [("shape", "shape", None), ("M", "M", None), ("config", "config", None),
                             ("correctly rounded", "correctly_rounded", "{:.4f}"), ("rel err", "rel_err", "{:.3e}"),
                             ("rounding alone", "rounding_rel_err", "{:.3e}")]), ""]
    bc.write_results(args.out, "diag_gemm_rounding", meta, rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
