"""The MoE front at decode batches above the decode front's 16 tokens: one program routing every token and
sorting every pair by pair comparisons vs the routing programs followed by the chunked count + align sort
(what prefill runs), each forced whatever kernels/moe.py's rule (`FUSED_SORT_MAX_TOKENS`,
`FUSED_SORT_MIN_EXPERTS`, set from this script's results) would pick.

Why: the 20b decode step at batch 128, ctx 8192, spends 2108 us of 17086 in `_front_kernel` (24 calls, 88 us
each: benchmarks/results/bench_decode_tp1_b128_profile.md), the single program's [512, 16]-tile comparisons
over 512 pairs; the chunked sort is two more launches but spreads the work.

    python benchmarks/diag_front_sort.py --out benchmarks/results

Per (experts, tokens): both paths in CUDA graphs of back-to-back calls on 8 distinct logit / x sets (the
router's output and the layer input, bf16), us per call, and whether both paths give the same routing, x
groups and pair sort (they must: the sort is stable, token order kept).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
from sglang_ext.kernels import moe  # noqa: E402

TOP_K, HIDDEN, BLOCK_M, CHUNK = 4, 2880, 16, 128  # the table's rows of 17..128 tokens: block_m 16


def front(logits, x, num_experts, fused: bool):
    """route_and_align with the sort forced either way, whatever kernels/moe.py's rule would pick."""
    keep = moe.FUSED_SORT_MAX_TOKENS, moe.FUSED_SORT_MIN_EXPERTS
    moe.FUSED_SORT_MAX_TOKENS, moe.FUSED_SORT_MIN_EXPERTS = (128, 1) if fused else (0, 1 << 30)
    try:
        return moe.route_and_align(logits, x, TOP_K, num_experts, 0, BLOCK_M, CHUNK)
    finally:
        moe.FUSED_SORT_MAX_TOKENS, moe.FUSED_SORT_MIN_EXPERTS = keep


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def row(num_experts: int, tokens: int, device: str) -> dict:
    sets = [(torch.randn(tokens, num_experts, device=device).to(torch.bfloat16),
             torch.randn(tokens, HIDDEN, device=device).to(torch.bfloat16)) for _ in range(8 if device == "cuda" else 1)]
    out = {"experts": num_experts, "tokens": tokens}
    results = {}
    for fused in (True, False):
        name = "fused" if fused else "chunked"
        results[name] = front(*sets[0], num_experts, fused)
        out[f"{name}_us"] = 1e6 * bc.graph_time_calls(
            [lambda s=s, f=fused: front(*s, num_experts, f) for s in sets], device=device)
    a, b = results["fused"], results["chunked"]
    used = a["block_expert"] >= 0  # blocks past the last segment hold whatever each path left there
    out["same"] = (all(torch.equal(_bits(a[k]), _bits(b[k]))
                       for k in ("topk_weights", "topk_ids", "x_fp8", "x_scale", "block_expert"))
                   and torch.equal(a["sorted_pairs"].view(-1, BLOCK_M)[used], b["sorted_pairs"].view(-1, BLOCK_M)[used]))
    out["speedup_chunked"] = out["fused_us"] / out["chunked_us"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--tokens", default="17,32,48,64,96,128")
    ap.add_argument("--experts", default="32,128")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: interpreted smoke runs
    args = ap.parse_args()
    meta = bc.run_meta("python benchmarks/diag_front_sort.py " + " ".join(sys.argv[1:]))
    rows = []
    for e in (int(v) for v in args.experts.split(",")):
        for t in (int(v) for v in args.tokens.split(",")):
            rows.append(row(e, t, args.device))
            print(rows[-1], flush=True)
    md = ["# MoE front above 16 tokens: one-program pair sort vs the chunked sort "
          f"({meta.get('gpu', 'GPU')})", "", f"`{meta['command']}` — {meta.get('date', '')}", "",
          "Routing + x's e4m3 groups + the pair sort (block_m 16, chunks of 128), from bf16 router logits: "
          "`fused` = one program routes every token and sorts by pair comparisons (kernels/moe.py "
          "FUSED_SORT_MAX_TOKENS), `chunked` = routing programs, then the count + align launches. CUDA graphs "
          "of 8 back-to-back calls on distinct inputs; same = identical routing, groups and sort (its used blocks).", "",
          bc.md_table(rows, [("experts", "experts", None), ("tokens", "tokens", None), ("fused us", "fused_us", "{:.1f}"),
                             ("chunked us", "chunked_us", "{:.1f}"), ("fused / chunked", "speedup_chunked", "{:.2f}"),
                             ("same", "same", None)]), ""]
    bc.write_results(args.out, "diag_front_sort", meta, rows, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
