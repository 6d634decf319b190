"""Where a prefill MoE layer's time goes, per launch configuration (H200, gpt-oss shapes, random FP8
experts): whole-layer time (CUDA events), device time per kernel (profiler), the compiled mlp1 /
mlp2 kernels' registers, spills and shared memory, max relative difference from the table's
config on the same tokens and from `moe_ref` (512 tokens), and bit reproducibility.

Why: the 120b prefill of 8192 tokens spends 65 % of its time in the MoE's two grouped GEMMs at
~28-31 % of the FP8 matmul rate, where the dense FP8 GEMM (`_fp8_gemm_kernel`, the same
per-K-step block-scale promotion) reaches ~41 % on 128 x 128 tiles of 8 warps. The candidates
here test whether mlp1 in two passes of 128 W1 rows (`MoeConfig.mlp1_passes`: the dense GEMM's
m64n128 warpgroup tile, a scalar weight scale per K step) closes that gap.

    python benchmarks/diag_moe_prefill.py --out benchmarks/results              # 120b and 20b, 8192 tokens
    python benchmarks/diag_moe_prefill.py --configs table,p2w4s3 --ncu          # one call each, for `ncu`
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
import bench_moe as bm  # noqa: E402
from bench_common import md_table, run_meta, write_results  # noqa: E402
from sglang_ext.kernels import moe as moe_kernels  # noqa: E402

TABLE = moe_kernels.select_config(8192)
BEFORE = moe_kernels.TWO_DOT_PREFILL_CONFIG  # the prefill row before session 7 (two dots on 8 warps)
_TWO_PASS = replace(BEFORE, mlp1_warps=4, mlp1_one_dot=True, mlp1_passes=2)
CANDIDATES = {
    "table": TABLE,
    "before": BEFORE,
    # mlp1 in 2 passes of 128 W1 rows: one warpgroup m64n128 per pass
    "p2w4s3": _TWO_PASS,
    "p2w4s4": replace(_TWO_PASS, mlp1_stages=4),
    "p2w4s3g8": replace(_TWO_PASS, group_m=8),
    "p2w4s2": replace(_TWO_PASS, mlp1_stages=2),
    # two warpgroups split each pass's 128 rows (m64n64 each)
    "p2w8s3": replace(_TWO_PASS, mlp1_warps=8),
    # 128-row sort blocks: two warpgroups of m64n128 a pass, mlp2 likewise on 8 warps
    "p2m128w8s3": replace(_TWO_PASS, block_m=128, mlp1_warps=8, mlp2_warps=8),
    "p2m128w8s4": replace(_TWO_PASS, block_m=128, mlp1_warps=8, mlp1_stages=4, mlp2_warps=8, mlp2_stages=4),
    # mlp2 alone (the old mlp1)
    "mlp2s4": replace(BEFORE, mlp2_stages=4),
    "mlp2w8s3": replace(BEFORE, mlp2_warps=8),
    # register caps: three 4-warp programs an SM instead of two
    "p2w4s3r1": replace(_TWO_PASS, mlp1_maxnreg=168),
    "p2w4s3r2": replace(_TWO_PASS, mlp2_maxnreg=168),
    "p2w4s3r12": replace(_TWO_PASS, mlp1_maxnreg=168, mlp2_maxnreg=168),
    "p2w4s2r12": replace(_TWO_PASS, mlp1_stages=2, mlp2_stages=2, mlp1_maxnreg=168, mlp2_maxnreg=168),
    "p2w4s3r12g8": replace(_TWO_PASS, group_m=8, mlp1_maxnreg=168, mlp2_maxnreg=168),
    "p2w4s3r2s4": replace(_TWO_PASS, mlp2_maxnreg=168, mlp2_stages=4),
    # TMA tiles (session 8's table row: mlp1 s4, mlp2 s3): the same tiles on pointers, and its neighbours
    "pointer": replace(TABLE, tma=False),
    "tma_m128w8": replace(TABLE, block_m=128, mlp1_warps=8, mlp2_warps=8),
    "tma_m128w8s3": replace(TABLE, block_m=128, mlp1_warps=8, mlp1_stages=3, mlp2_warps=8),
    "tma_s5": replace(TABLE, mlp1_stages=5),
    "tma_g8": replace(TABLE, group_m=8),
    "tma_g1": replace(TABLE, group_m=1),
    "tma_mlp2s2": replace(TABLE, mlp2_stages=2),
    # session 20: x's rows by pointers in mlp1 (no gather launch), as the 5..128-token rows since session 18
    "tma_xptr": replace(TABLE, tma_x=False),
    # the prefill row before session 20: each pair's mlp2 output as fp32 for the combine (the table's is bf16,
    # MoeConfig.pair_out_bf16; diag_moe_prefill_y16.md ran before, its "table" is this row and its "y16" today's)
    "y32": replace(TABLE, pair_out_bf16=False),
    # session 21: mlp1 / mlp2 as the Gluon kernels (kernels/moe_gluon.py: one wgmma in flight through the scaling)
    "gluon": replace(TABLE, mlp1_gluon=True, mlp2_gluon=True),
    # the same on 8 warps (mlp1's 256 W1 rows in one pass, 256-wide mlp2), persistent programs
    "gluon_w8p": replace(TABLE, mlp1_gluon=True, mlp2_gluon=True, mlp1_warps=8, mlp2_warps=8, mlp2_block_n=256,
                         gluon_persistent=True),
}


def use_prefill_row(name: str):
    """The MoE table's prefill row (T > 128) replaced by CANDIDATES[name] for the rest of the process (the
    whole-model A/Bs: prefill_moe_ab.py, diag_prefill_host.py --moe-row); returns that config."""
    config = CANDIDATES[name]
    moe_kernels.H200_HIDDEN_2880_CONFIGS = tuple(
        (bound, config if bound > 128 else old) for bound, old in moe_kernels.H200_HIDDEN_2880_CONFIGS)
    return config


def decode_tma_candidates(tokens: int) -> dict:
    """--decode-tma: at `tokens` (a decode batch, 17..128) the table's row (two one-dot passes, TMA
    tiles since session 8), its tiles on pointer loads, and the row before (two dots, pointers).
    The committed sweeps/diag_moe_decode_tma_*.md ran before the table took TMA, so their "table" is
    this "two_dot", their "tma" this "table" and their "two_pass" this "pointer"."""
    row = moe_kernels.select_config(tokens)
    return {"table": row, "pointer": replace(row, tma=False),
            "two_dot": replace(row, mlp1_one_dot=False, mlp1_passes=1, tma=False)}


def clear_caches():
    for k in (moe_kernels._mlp1_kernel, moe_kernels._mlp2_kernel):
        try:
            for caches in k.device_caches.values():
                (caches[0] if isinstance(caches, tuple) else caches).clear()
        except Exception:  # noqa: BLE001
            pass


def run_config(name, config, layer, x, ref_out, x_small, ceil):
    args = bm.layer_args(layer)
    hidden, inter = layer["w1"].shape[2], layer["w2"].shape[2]
    out = torch.empty_like(x)
    row = {"config_name": name, "config": config.short()}
    try:
        clear_caches()
        call = lambda: moe_kernels.fused_moe_fp8(x, *args, top_k=bm.TOP_K, limit=bm.LIMIT, out=out,  # noqa: E731
                                                 config=config)
        call()
        if x.is_cuda:
            torch.cuda.synchronize()
        row["mlp1_compiled"] = bc.compiled_info(moe_kernels._mlp1_kernel)
        row["mlp2_compiled"] = bc.compiled_info(moe_kernels._mlp2_kernel)
        t = bm.event_time(call, iters=20)
        if x.is_cuda:
            row["enqueue_us"] = bc.enqueue_time(call) * 1e6
        flops = 2 * x.shape[0] * bm.TOP_K * (2 * inter * hidden + hidden * inter)
        row.update(time_us=t * 1e6, TFLOPs=flops / t / 1e12,
                   pct_fp8=100 * flops / t / ceil["fp8_matmul_flops"])
        times = bm.kernel_times(call, calls=5)
        row["kernels_us"] = times
        row["mlp1_us"] = next((v for k, v in times.items() if "_mlp1_kernel" in k), None)
        row["mlp2_us"] = next((v for k, v in times.items() if "_mlp2_kernel" in k), None)
        # TFLOP/s of each GEMM alone
        if row["mlp1_us"]:
            row["mlp1_TFLOPs"] = 2 * x.shape[0] * bm.TOP_K * 2 * inter * hidden / row["mlp1_us"] / 1e6
        if row["mlp2_us"]:
            row["mlp2_TFLOPs"] = 2 * x.shape[0] * bm.TOP_K * hidden * inter / row["mlp2_us"] / 1e6
        if ref_out is not None:
            row["max_rel_vs_table"] = ((out.float() - ref_out.float()).abs().max()
                                       / ref_out.float().abs().max()).item()
        small = lambda: moe_kernels.fused_moe_fp8(x_small, *args, top_k=bm.TOP_K, limit=bm.LIMIT,  # noqa: E731
                                                  config=config)
        o = small()
        row["bit_reproducible"] = bool(torch.equal(o, small()) and torch.equal(out.clone(), call()))
        row["max_rel_err_vs_ref"] = bm.accuracy(o, x_small, layer)["max_rel_err_vs_ref"]
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {exc}"[:400]
    print(row, flush=True)
    return row, out


def markdown(meta, rows) -> str:
    lines = ["# MoE prefill: time per kernel and compiled resources by launch configuration (H200)", "",
             f"{meta.get('gpu', 'cpu')}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}. FP8 matmul rate "
             f"measured in this run: {meta['fp8_matmul_TFLOPs']:.0f} TFLOP/s. Random FP8 experts, random tokens; "
             "`x table`: whole-layer speed-up over the table's config on the same tokens.", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        rs = [r for r in rows if r["model"] == model]
        base = next((r for r in rs if r["config_name"] == "table" and "time_us" in r), None)
        for r in rs:
            if base and "time_us" in r:
                r["x_table"] = base["time_us"] / r["time_us"]
            for k in ("mlp1", "mlp2"):
                info = (r.get(f"{k}_compiled") or [{}])[-1]
                r[f"{k}_res"] = (f"{info['regs']} / {info['spills']} / {info['shared_KB']}" if "regs" in info
                                 else info.get("error", "—"))
        lines += [f"## {model}, {rs[0]['tokens']} tokens", "", md_table(rs, [
            ("name", "config_name", None), ("config", "config", None), ("layer us", "time_us", "{:.0f}"),
            ("host enqueue us", "enqueue_us", "{:.0f}"),
            ("x table", "x_table", "{:.3f}"), ("TFLOP/s", "TFLOPs", "{:.0f}"), ("% FP8", "pct_fp8", "{:.0f}"),
            ("mlp1 us", "mlp1_us", "{:.0f}"), ("mlp1 TFLOP/s", "mlp1_TFLOPs", "{:.0f}"),
            ("mlp2 us", "mlp2_us", "{:.0f}"), ("mlp2 TFLOP/s", "mlp2_TFLOPs", "{:.0f}"),
            ("mlp1 regs / spills / smem KB", "mlp1_res", None), ("mlp2 regs / spills / smem KB", "mlp2_res", None),
            ("max rel vs table", "max_rel_vs_table", "{:.1e}"), ("max rel vs ref", "max_rel_err_vs_ref", "{:.1e}"),
            ("bit-repro", "bit_reproducible", None), ("error", "error", None)]), ""]
    lines += [f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--configs", default=",".join(CANDIDATES))
    ap.add_argument("--ncu", action="store_true", help="one call per config between cudaProfilerStart/Stop")
    ap.add_argument("--stem", default="diag_moe_prefill")
    ap.add_argument("--decode-tma", action="store_true",
                    help="at --tokens (a decode batch): the table's row vs its tiles with TMA (decode_tma_candidates)")
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # CPU, TRITON_INTERPRET=1, tiny dims
    args = ap.parse_args()
    dim, dev = 2880, "cuda"
    if args.smoke:
        dim, dev = 256, "cpu"
        bm.DEVICE = "cpu"
    cands = decode_tma_candidates(args.tokens) if args.decode_tma else CANDIDATES
    names = list(cands) if args.decode_tma else args.configs.split(",")
    t0 = time.time()
    if args.ncu:
        layer = bm.make_layer(bm.MODELS[args.models.split(",")[0]], 2880, 2880, seed=1)
        x = torch.randn(args.tokens, 2880, device="cuda").to(torch.bfloat16)
        for name in names:
            call = lambda: moe_kernels.fused_moe_fp8(x, *bm.layer_args(layer), top_k=bm.TOP_K,  # noqa: E731
                                                     limit=bm.LIMIT, config=cands[name])
            bc.profile_one_call(call)
            print(f"ncu: {name} = {cands[name].short()}", flush=True)
        return
    ceil = bm.ceilings()
    meta = run_meta(" ".join(["python", "benchmarks/diag_moe_prefill.py"] + sys.argv[1:]),
                    {"fp8_matmul_TFLOPs": ceil["fp8_matmul_flops"] / 1e12})
    rows = []
    for model in args.models.split(","):
        layer = bm.make_layer(8 if args.smoke else bm.MODELS[model], dim, dim, seed=1)
        x = torch.randn(args.tokens, dim, device=dev).to(torch.bfloat16)
        x_small = torch.randn(min(512, args.tokens), dim, device=dev).to(torch.bfloat16)
        ref_out = None
        for name in names:
            row, out = run_config(name, cands[name], layer, x, ref_out, x_small, ceil)
            if name == "table" and "error" not in row:
                ref_out = out
            rows.append({"model": model, "tokens": args.tokens, **row})
            write_results(args.out, args.stem, meta, rows, markdown(meta, rows))
        del layer
        if dev == "cuda":
            torch.cuda.empty_cache()
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
