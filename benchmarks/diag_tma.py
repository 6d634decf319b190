"""Tensor-memory-accelerator (TMA) tiles against pointer tiles for the FP8 GEMMs, on one H200.

Why: the 120b prefill of 8192 tokens spent 131 of its 187 ms (session 7) in FP8 GEMMs whose operand
tiles came in through pointer loads (cp.async: one 16-byte copy a thread per instruction, address
tensors held in registers); at 255 registers a warpgroup the MoE's mlp1 issued from 2 warps per
scheduler and idled 57 % of cycles (ncu). A Hopper TMA copy moves a whole tile on one instruction
from a descriptor (kernels/tma.py), frees the address registers and the issue slots, and zero-fills
past the tensor's edge (no K masks).

    python benchmarks/diag_tma.py --out benchmarks/results                 # prefill M: pointer vs TMA tiles
    python benchmarks/diag_tma.py --shipped-dense 32,64,128,256 --out ...  # decode M, weights from HBM
    TRITON_INTERPRET=1 python benchmarks/diag_tma.py --smoke               # CPU: outputs only

The default mode times the shipped `fp8_gemm` with the table's tile on pointers against TMA tiles of
a few shapes (same operands, bits compared) and cuBLAS block-scaled `scaled_mm` + bias. The MoE's
A/B is `diag_moe_prefill.py --configs table,pointer` (and `--decode-tma`). results/diag_tma.md came
from this script's first form at commit f80169d, whose prototype kernels (dense, mlp1 on gathered
x, mlp2) became `_fp8_gemm_tma_kernel` and `MoeConfig.tma`; its m128n256 dense rows were wrong (one
weight scale per 256-column tile; the shipped kernel loads a vector there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
from bench_common import event_time, md_table, run_meta, write_results  # noqa: E402
from sglang_ext.kernels import fp8_gemm as fg  # noqa: E402

FP8 = torch.float8_e4m3fn


def dense_rows(dev, m_list, iters):
    """The shipped `fp8_gemm` on pre-quantised x at prefill sizes: pointer tiles (the table's row
    with tma=False) against TMA tiles of a few shapes, the same operands, bits compared; cuBLAS
    block-scaled `scaled_mm` + bias beside them."""
    from dataclasses import replace

    rows = []
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        for m in m_list:
            g = torch.Generator(device=dev).manual_seed(m + n)
            x = torch.randn(m, k, device=dev, generator=g)
            a, a_s = fg.quantize_activation_group128_ref(x)
            w = (torch.randn(n, k, device=dev, generator=g) * 0.5).to(FP8)
            ws = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev, generator=g) * 0.01 + 0.001
            bias = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
            out1 = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            out2 = torch.empty_like(out1)
            table = fg.gemm_config(m, n, k, dev, x_prequantized=True)
            pointer = replace(table, tma=False)
            shipped = lambda: fg.fp8_gemm(a, a_s, w, ws, bias, out=out1, config=pointer)  # noqa: E731
            row = {"shape": name, "M": m, "N": n, "K": k, "flop": 2.0 * m * n * k, "pointer_config": pointer.short()}
            row["shipped_us"] = event_time(shipped, iters=iters, device=dev) * 1e6
            for bm_, bn_, wp, st in ((128, 128, 8, 4), (128, 128, 8, 3), (128, 256, 8, 3), (64, 128, 4, 4)):
                key = f"tma_m{bm_}n{bn_}w{wp}s{st}"
                cfg = fg.Fp8GemmConfig(block_m=bm_, block_n=bn_, num_warps=wp, num_stages=st, tma=True)
                try:
                    fn = lambda: fg.fp8_gemm(a, a_s, w, ws, bias, out=out2, config=cfg)  # noqa: E731
                    fn()
                    row[key + "_us"] = event_time(fn, iters=iters, device=dev) * 1e6
                    row[key + "_max_abs_diff"] = float((out1.float() - out2.float()).abs().max())
                except Exception as exc:  # noqa: BLE001
                    row[key + "_error"] = f"{type(exc).__name__}: {exc}"[:300]
                if dev.type == "cpu":
                    break
            if dev.type == "cuda":
                try:
                    import bench_fp8_gemm as bfg
                    cub, _ = bfg.cublas_blockwise_fn(a, a_s, w, ws, bias)
                    row["cublas_us"] = event_time(cub, iters=iters, device=dev) * 1e6
                except Exception as exc:  # noqa: BLE001
                    row["cublas_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def shipped_dense_rows(dev, m_list, copies: int = 8):
    """The shipped `_fp8_gemm_kernel` tiles of gemm_config at decode-sized M (no split-K) against the
    same tiles with `tma=True`: CUDA graphs of back-to-back calls over `copies` weight copies (> L2,
    so the weights stream from HBM, as in a decode step); bits compared."""
    from dataclasses import replace

    rows = []
    for name, n, k in (("qkv", 5120, 2880), ("o", 2880, 4096)):
        g = torch.Generator(device=dev).manual_seed(n)
        ws = [(torch.randn(n, k, device=dev, generator=g) * 0.5).to(FP8) for _ in range(copies)]
        wsc = torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=dev, generator=g) * 0.01 + 0.001
        bias = torch.randn(n, device=dev, generator=g).to(torch.bfloat16)
        for m in m_list:
            a, a_s = fg.quantize_activation_group128_ref(torch.randn(m, k, device=dev, generator=g))
            cfg = fg.gemm_config(m, n, k, dev, x_prequantized=True)
            if not isinstance(cfg, fg.Fp8GemmConfig) or cfg.split_k != 1:
                continue
            row = {"shape": name, "M": m, "config": cfg.short(), "weight_MB": n * k / 1e6}
            outs = {}
            for label, c in (("pointer", replace(cfg, tma=False)), ("tma", replace(cfg, tma=True))):
                out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
                calls = [lambda w=w, c=c, out=out: fg.fp8_gemm(a, a_s, w, wsc, bias, out=out, config=c) for w in ws]
                row[label + "_us"] = bc.graph_time_calls(calls, device=dev) * 1e6
                row[label + "_TBps"] = n * k / (row[label + "_us"] * 1e-6) / 1e12
                fg.fp8_gemm(a, a_s, ws[0], wsc, bias, out=out, config=c)
                outs[label] = out
            row["bits_equal"] = bool(torch.equal(outs["pointer"], outs["tma"]))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def markdown(meta, dense) -> str:
    lines = [f"# TMA tiles for the dense FP8 GEMM at prefill sizes ({meta.get('gpu', 'CPU')})", "",
             f"`{meta['command']}` — {meta.get('date', '')}", "",
             "Times in us, medians of CUDA-event timed calls on the same operands (pre-quantised x). `shipped`: "
             "the table's tile on pointer loads; `diff`: max abs difference of a TMA tile's output from it.", ""]
    for r in dense:
        ks = [k[:-3] for k in r if k.startswith("tma_") and k.endswith("_us")]
        best = min(ks, key=lambda k: r[k + "_us"]) if ks else None
        cub = r.get("cublas_us")
        lines.append(f"- {r['shape']} M={r['M']}: shipped {r['pointer_config']} {r['shipped_us']:.1f}"
                     + (f", cuBLAS {cub:.1f}" if cub else "")
                     + "".join(f", {k} {r[k + '_us']:.1f} (diff {r.get(k + '_max_abs_diff', float('nan')):.1e})"
                               for k in ks)
                     + (f"; best TMA vs shipped {r['shipped_us'] / r[best + '_us']:.2f}x" if best else "")
                     + (f", vs cuBLAS {cub / r[best + '_us']:.2f}x" if best and cub else ""))
        lines += [f"  - {k}: {v}" for k, v in r.items() if k.endswith("_error")]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: tiny shapes, outputs compared only")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--shipped-dense", default=None, metavar="M,M,...",
                    help="only the shipped dense tiles with / without TMA at these M (decode sizes), "
                         "written to diag_tma_dense_decode.{json,md}")
    args = ap.parse_args(argv)
    if args.shipped_dense:
        dev = torch.device("cpu" if args.smoke else "cuda")
        rows = shipped_dense_rows(dev, [int(m) for m in args.shipped_dense.split(",")], copies=1 if args.smoke else 8)
        meta = run_meta("python benchmarks/diag_tma.py " + " ".join(sys.argv[1:]))
        md = "\n".join([f"# Shipped dense FP8 GEMM tiles with / without TMA at decode sizes ({meta.get('gpu', 'CPU')})",
                        "", f"`{meta['command']}` — {meta.get('date', '')}", "",
                        "CUDA graphs of back-to-back calls over 8 weight copies (beyond L2); us per call.", "",
                        md_table(rows, [("shape", "shape", None), ("M", "M", None), ("config", "config", None),
                                        ("pointer us", "pointer_us", "{:.1f}"), ("TMA us", "tma_us", "{:.1f}"),
                                        ("pointer TB/s", "pointer_TBps", "{:.2f}"), ("TMA TB/s", "tma_TBps", "{:.2f}"),
                                        ("bits equal", "bits_equal", None)])]) + "\n"
        if args.out:
            write_results(args.out, "diag_tma_dense_decode", meta, rows, md)
        print(md)
        return
    dev = torch.device("cpu" if args.smoke else "cuda")
    dense = dense_rows(dev, [160] if args.smoke else [2048, 8192], 1 if args.smoke else args.iters)
    meta = run_meta("python benchmarks/diag_tma.py" + (" --smoke" if args.smoke else ""))
    if args.out:
        write_results(args.out, "diag_tma", meta, {"dense": dense}, markdown(meta, dense))
    else:
        print(markdown(meta, dense))


if __name__ == "__main__":
    main()
