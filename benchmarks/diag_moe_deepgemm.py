"""Would DeepGEMM's grouped GEMM make the MoE prefill faster? (a measurement, not a backend)

    python benchmarks/diag_moe_deepgemm.py --out benchmarks/results [--models 120b,20b] [--tokens 8192]

The 120b prefill of 8192 tokens spends 64.8 of its 164.3 ms in our mlp1 and 28.9 in mlp2
(benchmarks/results/bench_prefill_tp1.md), ~43 % of the FP8 matmul rate. DeepGEMM
(`m_grouped_gemm_fp8_fp8_bf16_nt_contiguous`, the 1.x peer in .peers/deepgemm, benchmarks/deepgemm_peer.py)
runs the same block-scaled FP8 products over experts laid out in 128-row segments, which our pair sort
already produces (`align_pairs(block_m=128)`). It has no bias, SwiGLU or h quantisation epilogue and writes
bf16, so a backend built on it needs a gather of x's codes into the sorted rows, one elementwise launch after
mlp1 (bias, activation, e4m3 groups of h) and the combine after mlp2 (bias, weights). This times, per layer,
on the same random FP8 experts and routing, in CUDA graphs:

  ours        `fused_experts_fp8` with the table's prefill row (mlp1, mlp2, combine; the front too)
              and its kernels one by one (profiler)
  dg mlp1     DeepGEMM over x's gathered codes: [rows, 2I] bf16
  dg mlp2     DeepGEMM over h's codes: [rows, H] bf16
  gather      x's codes and scales into the sorted rows (torch indexing; a backend would fuse it)

and checks DeepGEMM's mlp1 against our dequantised float reference on the same gathered rows (with `--pad-k`:
DeepGEMM 1.x's grouped kernel needs K padded to 128, see `pad_k`). The
elementwise launches are not built: the column "dg GEMMs" is the two GEMMs only, a lower bound of such a
backend; the bytes its extra launches move are listed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

MODELS = {"120b": 128, "20b": 32}  # experts; both: hidden = intermediate = 2880, top-4
HIDDEN = INTER = 2880
TOP_K = 4
ALIGN = 128  # DeepGEMM's contiguous-layout row alignment


def random_fp8(shape, device, g: torch.Generator):
    return (torch.randn(shape, device=device, generator=g) * 0.5).to(torch.float8_e4m3fn)


def pad_k(t: torch.Tensor, k: int) -> torch.Tensor:
    """t [..., K] with zero columns up to k (DeepGEMM 1.x's grouped kernel drops a ragged last K block: its host
    code passes K unaligned, and the kernel's last stage count is (K % (stages * 128)) / 128, rounded down; the
    dense entry rounds K up to 128 itself)."""
    if t.shape[-1] == k:
        return t
    out = torch.zeros((*t.shape[:-1], k), dtype=t.dtype, device=t.device)
    out[..., : t.shape[-1]] = t
    return out


def measure(model: str, tokens: int, dg, padded: bool = False) -> dict:
    from sglang_ext.kernels import moe
    from sglang_ext.kernels.fp8_gemm import quantize_activation_group128

    dev = torch.device("cuda")
    experts = MODELS[model]
    kb_h = (HIDDEN + 127) // 128
    kb_i = (INTER + 127) // 128
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = random_fp8((experts, 2 * INTER, HIDDEN), dev, g)
    w1s = torch.rand((experts, 2 * INTER // 128, kb_h), device=dev, generator=g) * 1e-2 + 1e-3
    w2 = random_fp8((experts, HIDDEN, INTER), dev, g)
    w2s = torch.rand((experts, kb_h, kb_i), device=dev, generator=g) * 1e-2 + 1e-3
    b1 = torch.randn((experts, 2 * INTER), device=dev, generator=g).to(torch.bfloat16)
    b2 = torch.randn((experts, HIDDEN), device=dev, generator=g).to(torch.bfloat16)
    x = torch.randn((tokens, HIDDEN), device=dev, generator=g).to(torch.bfloat16)
    logits = torch.randn((tokens, experts), device=dev, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    ids = ids.to(torch.int32)
    weights = weights.to(torch.bfloat16)

    config = moe.select_config(tokens, experts, TOP_K)
    ours = lambda: moe.fused_experts_fp8(x, weights, ids, w1, w1s, b1, w2, w2s, b2, config=config)  # noqa: E731
    ours_s = bc.graph_time(bc.capture_graph(ours))
    ours_kernels = bc.kernel_times(ours, calls=3)

    # DeepGEMM's layout: the pair sort in 128-row segments, m_indices the expert of each row (-1: unused block)
    sorted_pairs, block_expert, max_blocks = moe.align_pairs(ids, experts, 0, ALIGN)
    rows = max_blocks * ALIGN
    m_indices = block_expert.repeat_interleave(ALIGN).contiguous()
    pair_ok = sorted_pairs < tokens * TOP_K
    token_of_row = torch.where(pair_ok, sorted_pairs // TOP_K, 0).long()
    xq, xs = quantize_activation_group128(x)
    xg = xq[token_of_row].contiguous()
    xgs = xs[token_of_row].contiguous()
    xgs_tma = dg.get_col_major_tma_aligned_tensor(xgs)  # DeepGEMM's scale layout, made once
    hq = random_fp8((rows, INTER), dev, g)
    dg_x, dg_w1, dg_h, dg_w2 = xg, w1, hq, w2
    if padded:  # K to a multiple of 128, zeros past K (the scales keep their ceil(K / 128) columns)
        dg_x, dg_w1 = pad_k(xg, kb_h * 128), pad_k(w1, kb_h * 128)
        dg_h, dg_w2 = pad_k(hq, kb_i * 128), pad_k(w2, kb_i * 128)
    hs = (torch.rand((rows, kb_i), device=dev, generator=g) * 1e-2 + 1e-3)
    hs_tma = dg.get_col_major_tma_aligned_tensor(hs)
    out1 = torch.empty((rows, 2 * INTER), device=dev, dtype=torch.bfloat16)
    out2 = torch.empty((rows, HIDDEN), device=dev, dtype=torch.bfloat16)
    mlp1 = lambda: dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((dg_x, xgs_tma), (dg_w1, w1s), out1, m_indices)  # noqa
    mlp2 = lambda: dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((dg_h, hs_tma), (dg_w2, w2s), out2, m_indices)  # noqa

    def gather():
        xg.copy_(xq[token_of_row])
        xgs.copy_(xs[token_of_row])

    mlp1()
    torch.cuda.synchronize()
    # DeepGEMM's mlp1 against the dequantised float product, on the used rows (bias not included: it has none)
    used = (m_indices >= 0) & pair_ok
    idx = used.nonzero().squeeze(1)[:4096]
    xf = xg[idx].float() * xgs[idx].repeat_interleave(128, dim=1)[:, :HIDDEN]
    err = 0.0
    for e in m_indices[idx].unique().tolist()[:8]:
        sel = m_indices[idx] == e
        w_scale = w1s[e].repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)[:, :HIDDEN]
        ref = xf[sel] @ (w1[e].float() * w_scale).t()
        got = out1[idx][sel].float()
        err = max(err, ((got - ref).norm() / ref.norm()).item())
    mlp1_s = bc.graph_time(bc.capture_graph(mlp1))
    mlp2_s = bc.graph_time(bc.capture_graph(mlp2))
    gather_s = bc.graph_time(bc.capture_graph(gather))
    valid = int(used.sum().item())
    flop1 = 2 * valid * 2 * INTER * HIDDEN
    flop2 = 2 * valid * HIDDEN * INTER
    ours_mlp1 = sum(v for k, v in ours_kernels.items() if k.startswith("_mlp1")) / 1e6
    ours_mlp2 = sum(v for k, v in ours_kernels.items() if k.startswith("_mlp2")) / 1e6
    row = {
        "model": model, "tokens": tokens, "k_padded": padded, "experts": experts, "rows": rows, "pairs": tokens * TOP_K,
        "ours_layer_us": ours_s * 1e6, "ours_mlp1_us": ours_mlp1 * 1e6, "ours_mlp2_us": ours_mlp2 * 1e6,
        "ours_kernels_us": ours_kernels, "ours_config": config.short() if hasattr(config, "short") else str(config),
        "dg_mlp1_us": mlp1_s * 1e6, "dg_mlp2_us": mlp2_s * 1e6, "dg_gemms_us": (mlp1_s + mlp2_s) * 1e6,
        "gather_us": gather_s * 1e6,
        "dg_mlp1_tflops": flop1 / mlp1_s / 1e12, "dg_mlp2_tflops": flop2 / mlp2_s / 1e12,
        "ours_mlp1_tflops": flop1 / ours_mlp1 / 1e12 if ours_mlp1 else None,
        "ours_mlp2_tflops": flop2 / ours_mlp2 / 1e12 if ours_mlp2 else None,
        "dg_mlp1_rel_err": err,
        # what the launches a backend would add must move (bytes, one pass each)
        "extra_bytes_after_mlp1": rows * 2 * INTER * 2 + rows * INTER + rows * kb_i * 4,
        "extra_bytes_after_mlp2": rows * HIDDEN * 2 + tokens * HIDDEN * 2,
    }
    return row


def markdown(meta: dict, rows: list) -> str:
    lines = [f"# MoE prefill: our grouped kernels vs DeepGEMM's grouped GEMM ({meta.get('gpu', 'GPU')})", "",
             f"`{meta['command']}` — {meta.get('date', '')}", "", (__doc__ or "").split("\n\n")[2].replace("\n", " "),
             "", "CUDA-graph device time per MoE layer call, random FP8 experts and routing; TFLOP/s on the used rows.",
             "",
             bc.md_table(rows, [("model", "model", None), ("tokens", "tokens", None),
                                ("K padded", "k_padded", None), ("rows", "rows", None),
                                ("ours layer us", "ours_layer_us", "{:.0f}"), ("ours mlp1 us", "ours_mlp1_us", "{:.0f}"),
                                ("ours mlp2 us", "ours_mlp2_us", "{:.0f}"), ("dg mlp1 us", "dg_mlp1_us", "{:.0f}"),
                                ("dg mlp2 us", "dg_mlp2_us", "{:.0f}"), ("dg GEMMs us", "dg_gemms_us", "{:.0f}"),
                                ("gather us", "gather_us", "{:.0f}"),
                                ("ours mlp1 TFLOP/s", "ours_mlp1_tflops", "{:.0f}"),
                                ("dg mlp1 TFLOP/s", "dg_mlp1_tflops", "{:.0f}"),
                                ("ours mlp2 TFLOP/s", "ours_mlp2_tflops", "{:.0f}"),
                                ("dg mlp2 TFLOP/s", "dg_mlp2_tflops", "{:.0f}"),
                                ("dg mlp1 rel err", "dg_mlp1_rel_err", "{:.1e}")]), ""]
    if any(r["dg_mlp1_rel_err"] > 1e-2 for r in rows):
        lines += ["**DeepGEMM's mlp1 does not match the dequantised float product (rel err above 1e-2).** Where K is "
                  "not padded that is DeepGEMM 1.x's grouped entry dropping the last 64 of K = 2880 (`pad_k`; "
                  "`--pad-k` gives 1.7e-3, diag_moe_deepgemm_padded.md); otherwise unexplained.", ""]
    for r in rows:
        lines += [f"- {r['model']} {r['tokens']} tokens, ours ({r['ours_config']}) by kernel, us a call: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in list(r["ours_kernels_us"].items())[:8])]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--tokens", default="8192")
    ap.add_argument("--pad-k", action="store_true", help="DeepGEMM's operands zero-padded to K = 2944 (see pad_k)")
    ap.add_argument("--stem", default="diag_moe_deepgemm")
    args = ap.parse_args()
    from deepgemm_peer import deepgemm_version, load_deepgemm

    dg = load_deepgemm()
    meta = bc.run_meta("python benchmarks/diag_moe_deepgemm.py " + " ".join(sys.argv[1:]))
    meta["deepgemm"] = deepgemm_version()
    rows = []
    for m in args.models.split(","):
        for t in (int(v) for v in args.tokens.split(",")):
            rows.append(measure(m, t, dg, args.pad_k))
            print({k: v for k, v in rows[-1].items() if k != "ours_kernels_us"}, flush=True)
            torch.cuda.empty_cache()
            bc.write_results(args.out, args.stem, meta, rows, markdown(meta, rows))
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
