"""What the opt-in FP8 LM head (sglang_ext/layers/lm_head.py) changes, at gpt-oss's full head shape on
the GPU: logits error, argmax / top-5 agreement against the bf16 head, and both heads' time.

    python benchmarks/diag_lm_head.py --out benchmarks/results

Random weights (N(0, 0.02), the harness's) and random hidden states (N(0, 1) rows, bf16): the size of
the quantisation's effect on logits of this spread, not a statement about the real checkpoint's
tokens (real weights cannot be downloaded here). Times: CUDA graphs of back-to-back calls
(bench_common.graph_time_calls), beside the copy bandwidth measured in the same run."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
from sglang_ext.layers.lm_head import fp8_lm_head_error, fp8_lm_head_logits, quantize_head_weight  # noqa: E402

VOCAB, HIDDEN = 201088, 2880


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--rows", default="1,8,32")
    args = ap.parse_args()
    meta = bc.run_meta("python benchmarks/diag_lm_head.py " + " ".join(sys.argv[1:]))
    copy_bw = bc.copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    codes, scales = quantize_head_weight(weight)
    rows = []
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
        err = fp8_lm_head_error(x, weight, (codes, scales))
        xs = [torch.randn(m, HIDDEN, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
        t_bf16 = bc.graph_time_calls([lambda x=x: x @ weight.t() for x in xs])
        t_fp8 = bc.graph_time_calls([lambda x=x: fp8_lm_head_logits(x, codes, scales) for x in xs])
        bytes_bf16, bytes_fp8 = weight.numel() * 2, codes.numel() + scales.numel() * 4
        rows.append({"rows": m, **err, "bf16_us": t_bf16 * 1e6, "fp8_us": t_fp8 * 1e6,
                     "bf16_pct_copy_bw": 100 * bytes_bf16 / t_bf16 / copy_bw,
                     "fp8_pct_copy_bw": 100 * bytes_fp8 / t_fp8 / copy_bw, "saved_us": (t_bf16 - t_fp8) * 1e6})
        print(rows[-1], flush=True)
    md = "\n".join([f"# The LM head in FP8 e4m3 blocks vs bf16, gpt-oss shape {VOCAB} x {HIDDEN} ({meta.get('gpu', 'GPU')})", "",
                    f"`{meta['command']}` — {meta.get('date', '')}. Copy bandwidth {copy_bw / 1e12:.2f} TB/s. "
                    "Random weights and hidden states (module docstring): the logits' quantisation error at this "
                    "spread, not the real checkpoint's token agreement. bf16: torch's matmul (cuBLAS), the "
                    "served default; FP8: fp8_linear (SGLANG_EXT_FP8_LM_HEAD=1).", "",
                    bc.md_table(rows, [("rows", "rows", None), ("max rel err", "max_rel_err", "{:.3g}"),
                                       ("rel Frobenius", "rel_fro", "{:.3g}"),
                                       ("argmax agree", "argmax_agree", "{:.3f}"),
                                       ("top-5 set agree", "top5_agree", "{:.3f}"), ("bf16 us", "bf16_us", "{:.1f}"),
                                       ("bf16 % copy BW", "bf16_pct_copy_bw", "{:.0f}"), ("FP8 us", "fp8_us", "{:.1f}"),
                                       ("FP8 % copy BW", "fp8_pct_copy_bw", "{:.0f}"),
                                       ("saved us", "saved_us", "{:.1f}")])]) + "\n"
    bc.write_results(args.out, "diag_lm_head", meta, rows, md)
    print(md)


if __name__ == "__main__":
    main()
