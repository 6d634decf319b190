"""How often the dense FP8 GEMM's bf16 outputs are the correctly rounded result, by launch config.

    python benchmarks/diag_gemm_rounding.py --out benchmarks/results

For gpt-oss's qkv (5120 x 2880) and o (2880 x 4096) on random e4m3 weights and activations quantised as the
decode step does (1x128 groups), each config's `fp8_gemm` output is compared with the product of the same
codes and scales in float64 (+ bias), rounded once to bf16 (nearest, ties to even): the fraction of elements
equal to it, and the relative (Frobenius) error against the float64 product beside the rounding's own share.
Each row also names the matrix instruction its compiled kernels use (from their PTX: wgmma, mma.sync, or none,
i.e. FMA blocks). Why: Hopper's FP8 wgmma keeps about 14 bits while it accumulates inside an instruction chain
(DeepSeek-V3 report, 3.3.2), so tiles on wgmma (64+ rows) can round a few % of outputs to the neighbouring bf16
value. Session 12 measured that for qkv at M = 32 (93.2 % correctly rounded on the 64 x 128 tile against
99.99 % on the table's 32-row tile, logs/h200_session12_wide_tile_rounding.log) and kept the 32-row tile for
17..64 rows although the 64 x 128 tile was faster (qkv M = 64 16.3 -> 12.1 us).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def dequantize_float64(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 codes [R, C] times their 128-blocked fp32 scales ([R, C/128] for activations, [R/128, C/128] for
    weights), in float64: exact (a code has 4 significant bits, a scale 24)."""
    r, c = codes.shape
    s = scale.double()
    if s.shape[0] != r:  # weights: one scale per 128 x 128 block
        s = s.repeat_interleave(128, dim=0)[:r]
    return codes.float().double() * s.repeat_interleave(128, dim=1)[:, :c]


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> bf16, rounded once (nearest, ties to even; a cast may pass through fp32 and round twice)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.full_like(exponent, 8))), exponent - 8).to(torch.bfloat16)


def _variants(kernels) -> dict:
    return {(id(kernel), str(key)): compiled for kernel in kernels for key, compiled in bc.compiled_variants(kernel)}


def _matrix_instructions(compiled) -> str:
    kinds = set()
    for c in compiled:
        ptx = c.asm.get("ptx", "")
        kinds.add("wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none")
    return "+".join(sorted(kinds))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--m", default="1,16,32,64,128,1024")
    ap.add_argument("--shapes", default="qkv:5120x2880,o:2880x4096", help="name:NxK,... (gpt-oss's by default)")
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script under TRITON_INTERPRET=1 "
                    "(small --shapes; no compiled kernels, so no instructions)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    bc.import_project()
    from sglang_ext.kernels import fp8_gemm as mod
    from sglang_ext.layers import fp8

    meta = bc.run_meta("python benchmarks/diag_gemm_rounding.py " + " ".join(sys.argv[1:]))
    C = mod.Fp8GemmConfig
    extra = {"32-row tile": C(32, 64, num_warps=4, num_stages=4),
             "64 x 128 tile, TMA": C(64, 128, num_warps=4, num_stages=4, tma=True),
             "64 x 128 tile, pointer loads": C(64, 128, num_warps=4, num_stages=4)}
    kernels = [v for v in vars(mod).values() if hasattr(v, "device_caches")]
    instructions = {}  # config -> the matrix instructions of the variants its first launch compiled
    rows = []
    torch.manual_seed(0)
    for spec in args.shapes.split(","):
        shape, dims = spec.split(":")
        n, k = (int(v) for v in dims.split("x"))
        w, ws = fp8.quantize_weight_block128(torch.randn(n, k, device=dev) * 0.05)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
        w64 = dequantize_float64(w, ws)
        for m in (int(v) for v in args.m.split(",")):
            xq, xs = mod.quantize_activation_group128(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            exact = dequantize_float64(xq, xs) @ w64.t() + bias.double()
            rounded = round_to_bf16(exact)
            configs = {"table": mod.gemm_config(m, n, k, xq.device, x_prequantized=True)}
            if m > 16:
                configs.update(extra)
            for label, cfg in configs.items():
                before = set(_variants(kernels))
                y = mod.fp8_gemm(xq, xs, w, ws, bias, config=cfg)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                new = [c for k, c in _variants(kernels).items() if k not in before]
                if dev.type != "cuda":
                    instructions[cfg.short()] = "interpreted (no PTX)"
                elif new or cfg.short() not in instructions:
                    instructions[cfg.short()] = _matrix_instructions(new) if new else "compiled earlier"
                rows.append({"shape": shape, "M": m, "config": f"{label}: {cfg.short()}",
                             "instructions": instructions[cfg.short()],
                             "correctly_rounded": (y == rounded).float().mean().item(),
                             "rel_err": ((y.double() - exact).norm() / exact.norm()).item(),
                             "rounding_rel_err": ((rounded.double() - exact).norm() / exact.norm()).item()})
                print(rows[-1], flush=True)
    md = [f"# Dense FP8 GEMM: correctly rounded bf16 outputs by config ({meta.get('gpu', 'GPU')})", "",
          f"`{meta['command']}` — {meta.get('date', '')}", "",
          "x pre-quantised (1x128 e4m3 groups), random e4m3 weights (block-128 scales), bf16 bias. Correctly "
          "rounded: fraction of outputs equal to the float64 product of the same codes and scales rounded once to "
          "bf16 (nearest, ties to even). rel err: Frobenius, against float64; the rounding's own share beside it. "
          "Matrix instructions: in the PTX of the kernel variants the config's first launch compiled.", "",
          bc.md_table(rows, [("shape", "shape", None), ("M", "M", None), ("config", "config", None),
                             ("matrix instructions", "instructions", None),
                             ("correctly rounded", "correctly_rounded", "{:.4f}"), ("rel err", "rel_err", "{:.3e}"),
                             ("rounding alone", "rounding_rel_err", "{:.3e}")]), ""]
    bc.write_results(args.out, "diag_gemm_rounding", meta, rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
