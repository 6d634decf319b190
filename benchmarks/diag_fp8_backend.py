"""The dense FP8 layers' two backends side by side: our `fp8_linear` vs DeepGEMM through
`sglang_ext.layers.fp8_backend.deepgemm_linear`, as the served layers call them.

    python benchmarks/diag_fp8_backend.py --out benchmarks/results

gpt-oss's qkv (5120 x 2880, x pre-quantised by the input norm: `x_quant`) and o (2880 x 4096, bf16 x
quantised inside the call), random e4m3 weights with block-128 scales, bf16 bias; times are medians of
CUDA-graph replays of back-to-back calls over enough distinct weight copies (> 2x L2) that weights come
from HBM. Each row also says how many bf16 outputs are the correctly rounded float64 result (same codes and
scales, + bias, rounded once). The shapes and rows where DeepGEMM is faster set
`fp8_backend.DEEPGEMM_AUTO_ROWS` (SGLANG_EXT_FP8_GEMM=auto; per weight shape). DeepGEMM: whatever
`import deep_gemm` finds, else the 1.x JIT release in .peers/deepgemm (benchmarks/deepgemm_peer.py).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from diag_gemm_rounding import dequantize_float64, round_to_bf16  # noqa: E402


def load_backend():
    """(fp8_backend module, (deep_gemm module, api), a line naming it)."""
    from sglang_ext.layers import fp8_backend

    try:
        dg = fp8_backend.load_deep_gemm()
        return fp8_backend, dg, f"deep_gemm {dg[1]} from {getattr(dg[0], '__file__', '?')}"
    except fp8_backend.DeepGemmUnavailable:
        import deepgemm_peer

        deepgemm_peer.load_deepgemm()
        fp8_backend.reset()
        return fp8_backend, fp8_backend.load_deep_gemm(), deepgemm_peer.deepgemm_version()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--m", default="1,4,8,16,24,32,48,64,96,128,192,256,512,1024,4096,8192")
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    bc.import_project()
    from sglang_ext.kernels import fp8_gemm as mod
    from sglang_ext.layers import fp8

    backend, (dg, api), dg_name = load_backend()
    meta = bc.run_meta("python benchmarks/diag_fp8_backend.py " + " ".join(sys.argv[1:]),
                       {"deepgemm": dg_name, "copy_bw_TBps": round(bc.copy_bandwidth() / 1e12, 3)})
    l2 = int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20) or (50 << 20))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for shape, n, k, prequantised in (("qkv", 5120, 2880, True), ("o", 2880, 4096, False)):
        w, ws = fp8.quantize_weight_block128(torch.randn(n, k, device=dev) * 0.05)
        bias = (torch.randn(n, device=dev) * 0.1).to(torch.bfloat16)
        copies = int(max(1, min(16, math.ceil(2 * l2 / w.numel()))))
        weights = [(w, ws)] + [(w.clone(), ws.clone()) for _ in range(copies - 1)]
        w64 = dequantize_float64(w, ws)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            xq = mod.quantize_activation_group128(x) if prequantised else None
            y_ours = torch.empty(m, n, device=dev, dtype=torch.bfloat16)

            def ours(w_, s_, x=x, xq=xq, y=y_ours):
                return mod.fp8_linear(x, w_, s_, bias, out=y, x_quant=xq)

            def deep(w_, s_, x=x, xq=xq):
                return backend.deepgemm_linear(x, w_, s_, bias, x_quant=xq, module=dg, api=api)

            codes, scales = xq if xq is not None else mod.quantize_activation_group128(x)
            exact = dequantize_float64(codes, scales) @ w64.t() + bias.double()
            rounded = round_to_bf16(exact)
            row = {"shape": shape, "M": m, "N": n, "K": k, "x": "pre-quantised" if prequantised else "bf16",
                   "weight_copies": copies}
            for name, fn in (("ours", ours), ("deepgemm", deep)):
                y = fn(w, ws)
                torch.cuda.synchronize()
                row[f"{name}_correctly_rounded"] = (y == rounded).double().mean().item()
                row[f"{name}_rel_err"] = ((y.double() - exact).norm() / exact.norm()).item()
                t = bc.graph_time_calls([lambda w_=w_, s_=s_, fn=fn: fn(w_, s_) for w_, s_ in weights], iters=args.iters)
                row[f"{name}_us"] = t * 1e6
            # DeepGEMM's time over ours (> 1: ours faster); the key's name is the committed results' own
            row["ours_over_deepgemm"] = row["deepgemm_us"] / row["ours_us"]
            row["weight_TBps_ours"] = w.numel() / row["ours_us"] / 1e6
            rows.append(row)
            print(row, flush=True)
    faster = sorted({r["M"] for r in rows} - {r["M"] for r in rows if r["ours_over_deepgemm"] >= 1})
    md = [f"# Dense FP8 layers: our kernel vs DeepGEMM as the backend ({meta.get('gpu', 'GPU')})", "",
          f"`{meta['command']}` — {meta.get('date', '')}; {dg_name}", "",
          "As the served layers call them: `fp8_linear` (ours; qkv reads the norm's FP8 codes, o quantises bf16 x "
          "in its launch) vs `fp8_backend.deepgemm_linear` (our quantiser into DeepGEMM's scale layout where x is "
          "bf16, DeepGEMM's GEMM into bf16, the bias added after). us: per call, median of CUDA-graph replays over "
          f"distinct weight copies (> 2x L2). ratio > 1: ours faster. Copy bandwidth now {meta['copy_bw_TBps']} TB/s. "
          "Correctly rounded: outputs equal to the float64 result (same codes and scales, + bias) rounded once to "
          "bf16.", "",
          bc.md_table(rows, [("shape", "shape", None), ("M", "M", None), ("x", "x", None),
                             ("ours us", "ours_us", "{:.1f}"), ("DeepGEMM us", "deepgemm_us", "{:.1f}"),
                             ("DeepGEMM / ours", "ours_over_deepgemm", "{:.2f}"),
                             ("ours correctly rounded", "ours_correctly_rounded", "{:.4f}"),
                             ("DeepGEMM correctly rounded", "deepgemm_correctly_rounded", "{:.4f}"),
                             ("ours rel err", "ours_rel_err", "{:.2e}"),
                             ("DeepGEMM rel err", "deepgemm_rel_err", "{:.2e}")]), "",
          f"DeepGEMM faster at both shapes for M in {faster or 'none'}.", ""]
    bc.write_results(args.out, "diag_fp8_backend", meta, rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
