"""MXFP4 -> FP8 block-128 conversion of one full-width gpt-oss-120b layer, checked in float64.

Builds a one-layer MXFP4 checkpoint at the real widths (hidden 2880, intermediate 2880,
128 experts; small vocab: embedding and LM head are copied, not converted) in the official
layout (`*_blocks` / `*_scales`, groups of 32 along K), with per-group scale exponents
spread like trained weights (a few groups per block far below the others, so some
128x128 blocks cannot be exact in e4m3). Runs the real converter
(`python -m sglang_ext.launch.convert`) on it, then recomputes every number of its report
independently: the MXFP4 source dequantised by transformers' `convert_moe_packed_tensors`
(the oracle for the official layout), the FP8 output dequantised in float64, exact blocks
counted and errors taken in float64. Writes results/convert_full_layer.{json,md}.

    python benchmarks/convert_full_layer.py --out benchmarks/results   # ~5 min, ~6 GB disk in --work
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time

import torch

HIDDEN = INTER = 2880
EXPERTS = 128
BLOCK = 128


def write_mxfp4_layer(path: str, seed: int = 0):
    from safetensors.torch import save_file

    from sglang_ext.launch.make_tiny import mxfp4_quantize, tiny_config_dict

    g = torch.Generator().manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, (rows, cols) in (("gate_up_proj", (2 * INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
        blocks, scales = [], []
        for _ in range(EXPERTS):
            w = torch.randn(rows, cols, generator=g) * 0.02
            # Trained weights' 32-groups differ in scale; a few per block sit far lower.
            spread = torch.randn(rows, cols // 32, 1, generator=g) * 1.5
            spread -= 10.0 * (torch.rand(rows, cols // 32, 1, generator=g) < 0.002)
            w = (w.view(rows, cols // 32, 32) * torch.exp2(spread)).view(rows, cols)
            b, s = mxfp4_quantize(w)
            blocks.append(b)
            scales.append(s)
        tensors[f"model.layers.0.mlp.experts.{name}_blocks"] = torch.stack(blocks)
        tensors[f"model.layers.0.mlp.experts.{name}_scales"] = torch.stack(scales)
        tensors[f"model.layers.0.mlp.experts.{name}_bias"] = (torch.randn(EXPERTS, rows, generator=g) * 0.02).bfloat16()
    r = lambda *s: (torch.randn(*s, generator=g) * 0.02).bfloat16()  # noqa: E731
    for proj, rows in (("q", 4096), ("k", 512), ("v", 512)):
        tensors[f"model.layers.0.self_attn.{proj}_proj.weight"] = r(rows, HIDDEN)
        tensors[f"model.layers.0.self_attn.{proj}_proj.bias"] = r(rows)
    tensors["model.layers.0.self_attn.o_proj.weight"] = r(HIDDEN, 4096)
    tensors["model.layers.0.self_attn.o_proj.bias"] = r(HIDDEN)
    tensors["model.layers.0.self_attn.sinks"] = r(64)
    tensors["model.layers.0.mlp.router.weight"] = r(EXPERTS, HIDDEN)
    tensors["model.layers.0.mlp.router.bias"] = r(EXPERTS)
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(HIDDEN).bfloat16()
    tensors["model.layers.0.post_attention_layernorm.weight"] = torch.ones(HIDDEN).bfloat16()
    tensors["model.norm.weight"] = torch.ones(HIDDEN).bfloat16()
    tensors["model.embed_tokens.weight"] = r(1024, HIDDEN)
    tensors["lm_head.weight"] = r(1024, HIDDEN)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg = tiny_config_dict("mxfp4", {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_local_experts": EXPERTS,
                                      "num_hidden_layers": 1, "num_attention_heads": 64, "num_key_value_heads": 8,
                                      "head_dim": 64, "vocab_size": 1024, "experts_per_token": 4,
                                      "num_experts_per_tok": 4})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def float64_check(src: str, dst: str) -> dict:
    """Every converted tensor's exact-block count and errors, recomputed in float64."""
    from safetensors import safe_open
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out_files = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    out = {}
    for f in out_files:
        with safe_open(os.path.join(dst, f), "pt") as h:
            for k in h.keys():
                out[k] = (f, k)

    def read(folder, file, key):
        with safe_open(os.path.join(folder, file), "pt") as h:
            return h.get_tensor(key)

    results = {}
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as s:
        for base in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
            blocks, scales = s.get_tensor(base + "_blocks"), s.get_tensor(base + "_scales")
            q = read(dst, *out[base])
            sc = read(dst, *out[base + "_scale_inv"])
            # The report's definitions, per expert: max |err| / max |w|, and mean |err| / mean |w|
            # averaged over experts; exact = 128x128 blocks with every value equal.
            exact = total = 0
            max_rel = mean_rel = 0.0
            for e in range(EXPERTS):
                # transformers returns [in, out] per expert (the bf16 layout): transpose back to [out, in].
                want = convert_moe_packed_tensors(blocks[e:e + 1], scales[e:e + 1], dtype=torch.float32)[0]
                want = want.transpose(0, 1).double()
                n, k = want.shape
                scale = sc[e].double().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
                got = q[e].double() * scale
                nb, kb = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
                diff = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.bool)
                diff[:n, :k] = got != want
                bad = diff.view(nb, BLOCK, kb, BLOCK).any(dim=(1, 3))
                exact += int((~bad).sum())
                total += bad.numel()
                err = (got - want).abs()
                max_rel = max(max_rel, float(err.max() / want.abs().max()))
                mean_rel += float(err.mean() / want.abs().mean()) / EXPERTS
            results[base] = {"blocks_exact": exact, "blocks": total, "max_rel_err": max_rel, "mean_rel_err": mean_rel}
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/sglang_ext_full_layer")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--keep", action="store_true", help="keep --work (source and output) afterwards")
    ap.add_argument("--reuse", action="store_true", help="reuse a source already in --work")
    args = ap.parse_args()
    src, dst = os.path.join(args.work, "mxfp4"), os.path.join(args.work, "fp8")
    reuse = args.reuse and os.path.exists(os.path.join(src, "config.json"))
    if not reuse:
        shutil.rmtree(args.work, ignore_errors=True)
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.time()
    if not reuse:
        write_mxfp4_layer(src)
    t_gen = time.time() - t0
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "sglang_ext.launch.convert", src, dst], capture_output=True, text=True)
    t_conv = time.time() - t0
    if proc.returncode:
        raise SystemExit(f"convert failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    report = json.load(open(os.path.join(dst, "convert_report.json")))
    check = float64_check(src, dst)
    rows = []
    for name, want in check.items():
        got = report[name]
        rows.append({
            "tensor": name.rsplit(".", 1)[-1], "blocks": got["blocks"],
            "blocks_exact_report": got["blocks_exact"], "blocks_exact_float64": want["blocks_exact"],
            "exact_share": got["blocks_exact"] / got["blocks"],
            "max_rel_err_report": got["max_rel_err"], "max_rel_err_float64": want["max_rel_err"],
            "mean_rel_err_report": got["mean_rel_err"], "mean_rel_err_float64": want["mean_rel_err"],
            "agree": got["blocks_exact"] == want["blocks_exact"] and want["blocks"] == got["blocks"]
            and math.isclose(got["max_rel_err"], want["max_rel_err"], rel_tol=1e-5, abs_tol=1e-12)
            and math.isclose(got["mean_rel_err"], want["mean_rel_err"], rel_tol=1e-4, abs_tol=1e-12),
        })
    meta = {"command": "python benchmarks/convert_full_layer.py --out benchmarks/results",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "generate_s": t_gen, "convert_s": t_conv,
            "converter_peak_rss_GB": child_rss / 1e9, "cpu_count": os.cpu_count(),
            "shape": f"1 layer, hidden {HIDDEN}, intermediate {INTER}, {EXPERTS} experts"}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "convert_full_layer.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = ["# MXFP4 -> FP8 block-128, one full-width gpt-oss-120b layer", "",
             f"`{meta['command']}` — {meta['date']}. {meta['shape']}; synthetic MXFP4 weights whose 32-group "
             "scales spread like trained ones (0.2% of groups 2^10 lower). Converter: "
             f"{t_conv:.0f} s, peak RSS {child_rss / 1e9:.2f} GB on {os.cpu_count()} cores. Every report number "
             "recomputed in float64 from transformers' `convert_moe_packed_tensors` dequantisation.", "",
             "| tensor | blocks | exact (report) | exact (float64) | exact share | max rel err (report / float64) | "
             "mean rel err (report / float64) | agree |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tensor']} | {r['blocks']} | {r['blocks_exact_report']} | {r['blocks_exact_float64']} | "
                     f"{100 * r['exact_share']:.2f}% | {r['max_rel_err_report']:.3e} / {r['max_rel_err_float64']:.3e} | "
                     f"{r['mean_rel_err_report']:.3e} / {r['mean_rel_err_float64']:.3e} | {r['agree']} |")
    with open(os.path.join(args.out, "convert_full_layer.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    if not all(r["agree"] for r in rows):
        raise SystemExit("the converter's report disagrees with the float64 recomputation")


if __name__ == "__main__":
    main()
