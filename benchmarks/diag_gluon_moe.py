"""The MoE prefill's grouped FP8 GEMMs in Gluon (kernels/moe_gluon.py: `MoeConfig.mlp1_gluon` / `mlp2_gluon`,
one wgmma in flight while the previous K block's scales are applied) beside the table's Triton row, on the same
tokens and routing: output bits, error against moe_ref, whole-layer and per-kernel times.

Why: the 120b prefill of 8192 tokens is 12.3 ms over its 150 ms target; mlp1 / mlp2 take ~1780 / ~805 us a layer
(36 layers) at 599-746 TFLOP/s, where DeepGEMM's grouped GEMM runs 1.24-1.63x faster on the same shapes but needs
128-row expert blocks (diag_moe_deepgemm_padded.md).

    python benchmarks/diag_gluon_moe.py --compile-only     # any machine: waits, registers, spills (PTX, SASS)
    python benchmarks/diag_gluon_moe.py --out DIR          # an H200: bits vs the Triton row, moe_ref, times
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
from sglang_ext.kernels import moe as mk  # noqa: E402

TABLE = mk.select_config(8192)
GLUON = replace(TABLE, mlp1_gluon=True, mlp2_gluon=True)
VARIANTS = {  # name -> MoeConfig, beside the table's row
    "gluon": GLUON,
    "gluon_mlp1": replace(TABLE, mlp1_gluon=True),
    "gluon_mlp2": replace(TABLE, mlp2_gluon=True),
    # 8 warps: mlp1's 256 W1 rows in one pass, a warpgroup each half, sharing the x tile; mlp2 256 wide likewise
    "gluon_w8": replace(GLUON, mlp1_warps=8, mlp2_warps=8, mlp2_block_n=256),
    "gluon_mlp1w8": replace(GLUON, mlp1_warps=8),
    "gluon_mlp2n64w8": replace(GLUON, mlp2_warps=8),  # mlp2 n128 tiles split: a warpgroup m64 x n64
    # persistent: a program per SM slot, each next tile's first copies requested before the current epilogue
    "gluon_p": replace(GLUON, gluon_persistent=True),
    "gluon_w8p": replace(GLUON, mlp1_warps=8, mlp2_warps=8, mlp2_block_n=256, gluon_persistent=True),
    "gluon_s3": replace(GLUON, mlp1_stages=3),
    "gluon_mlp2s4": replace(GLUON, mlp2_stages=4),
    "gluon_g8": replace(GLUON, group_m=8),
}


# the kernels' distinct compiled forms
COMPILE_VARIANTS = ("gluon", "gluon_w8", "gluon_mlp2n64w8", "gluon_s3", "gluon_mlp2s4", "gluon_p", "gluon_w8p")


def compile_only(names=COMPILE_VARIANTS) -> list:
    """Compile both kernels for sm_90 on this machine (no launch: a routing of 256 tokens over 8 experts at the
    real hidden / intermediate sizes) and read their waits, registers and spills."""
    from compile_only import install_compile_only_h200, pretend_torch_has_h200, wgmma_facts

    from sglang_ext.kernels import moe_gluon

    pretend_torch_has_h200()
    compiled = []
    install_compile_only_h200(lambda fn, kernel, kwargs: compiled.append((fn, kernel)))
    experts, dim, tokens, block_m = 8, 2880, 256, TABLE.block_m
    kb = triton.cdiv(dim, 128)
    max_blocks = mk._max_blocks(tokens * 4, experts, block_m)
    rows = max_blocks * block_m
    w1 = torch.zeros(experts, 2 * dim, dim, dtype=mk.FP8)
    w2 = torch.zeros(experts, dim, dim, dtype=mk.FP8)
    routing = (torch.zeros(rows, dtype=torch.int32), torch.zeros(max_blocks, dtype=torch.int32))
    hq, hs = torch.zeros(rows, dim, dtype=mk.FP8), torch.ones(rows, kb)
    out = []
    for name in names:
        c = VARIANTS[name]
        compiled.clear()
        moe_gluon.mlp1_gluon(torch.zeros(rows, dim, dtype=mk.FP8), torch.ones(tokens, kb), w1,
                             torch.ones(experts, 2 * dim // 128, kb),
                             torch.zeros(experts, 2 * dim, dtype=torch.bfloat16), *routing, hq, hs, tokens * 4,
                             max_blocks, 7.0, mk.SWIGLU_ALPHA, 4, block_m, c.mlp1_warps, c.mlp1_stages, c.group_m,
                             persistent=c.gluon_persistent)
        moe_gluon.mlp2_gluon(hq, hs, w2, torch.ones(experts, kb, kb), torch.zeros(experts, dim, dtype=torch.bfloat16),
                             *routing, torch.zeros(tokens * 4, dim, dtype=torch.bfloat16), tokens * 4, max_blocks,
                             block_m, c.mlp2_block_n, c.mlp2_warps, c.mlp2_stages, c.group_m,
                             persistent=c.gluon_persistent)
        for fn, kernel in compiled:
            out.append({"variant": name, "config": c.short(), "kernel": fn.__name__, **wgmma_facts(kernel)})
            print(out[-1], flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--stem", default=None, help="results file stem (default: diag_gluon_moe, + _compile)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--variants", default=None, help="names of VARIANTS (default: all; compiled: COMPILE_VARIANTS)")
    args = ap.parse_args()
    from compile_only import command_line

    command = command_line("diag_gluon_moe.py")
    if args.compile_only:
        from compile_only import write_wgmma_report

        rows = compile_only(args.variants.split(",") if args.variants else COMPILE_VARIANTS)
        print(write_wgmma_report(args.out, args.stem or "diag_gluon_moe_compile", "Gluon MoE prefill GEMMs", command,
                                 rows, [("variant", "variant", None), ("kernel", "kernel", None)]))
        return

    import bench_moe as bm

    rows = []
    for model in args.models.split(","):
        layer = bm.make_layer(bm.MODELS[model], 2880, 2880, seed=1)
        x = torch.randn(args.tokens, 2880, device="cuda").to(torch.bfloat16)
        x_small = x[:512].contiguous()  # moe_ref at full size takes minutes: its error on 512 of the tokens
        ref_small = mk.moe_ref(x_small, *bm.layer_args(layer), top_k=4, limit=7.0, pair_out_bf16=True)
        table_out = None
        names = (args.variants or ",".join(VARIANTS)).split(",")
        for name, config in [("table", TABLE)] + [(v, VARIANTS[v]) for v in names]:
            row = {"model": model, "tokens": args.tokens, "variant": name, "config": config.short()}
            try:
                out = torch.empty_like(x)
                call = lambda: mk.fused_moe_fp8(x, *bm.layer_args(layer), top_k=4, limit=7.0,  # noqa: E731
                                                config=config, out=out)
                call()
                torch.cuda.synchronize()
                if table_out is None:
                    table_out = out
                row["bits_equal_table"] = bool(torch.equal(out, table_out))
                row["max_rel_vs_table"] = ((out.float() - table_out.float()).abs().max()
                                           / table_out.float().abs().max()).item()
                small = mk.fused_moe_fp8(x_small, *bm.layer_args(layer), top_k=4, limit=7.0, config=config)
                row["max_rel_vs_ref"] = ((small.float() - ref_small.float()).abs().max()
                                         / ref_small.float().abs().max()).item()
                first = out.clone()
                row["layer_us"] = bc.graph_time_calls([call]) * 1e6
                row["bit_reproducible"] = bool(torch.equal(out, first))
                times = bm.kernel_times(call, calls=5)
                row["mlp1_us"] = next((v for k, v in times.items() if "_mlp1_" in k), None)
                row["mlp2_us"] = next((v for k, v in times.items() if "_mlp2_" in k), None)
                row["mlp1_kernel"] = next((k for k in times if "_mlp1_" in k), None)
            except Exception as exc:  # noqa: BLE001 - a prototype: report, keep going
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(row, flush=True)
            save(args, command, rows)  # after every row: a stage cut by its time limit keeps what ran
        layer = None  # its 3 GB (120b) freed before the next model's
        torch.cuda.empty_cache()
    print(save(args, command, rows))


def save(args, command, rows) -> str:
    for r in rows:
        flops = 2 * r["tokens"] * 4 * 2880 * 2880  # mlp2's; mlp1's is twice it
        if r.get("mlp1_us"):
            r["mlp1_TFLOPs"] = 2 * flops / r["mlp1_us"] / 1e6
        if r.get("mlp2_us"):
            r["mlp2_TFLOPs"] = flops / r["mlp2_us"] / 1e6
    meta = bc.run_meta(command)
    md = "\n".join([
        "# Gluon MoE prefill GEMMs beside the table's Triton row (H200)", "",
        f"`{command}`. Random FP8 experts (bench_moe.make_layer), random bf16 tokens, `fused_moe_fp8` with each "
        "config: the whole layer (router, front, gather, mlp1, mlp2, combine) as one CUDA graph; mlp1 / mlp2 per "
        "launch from the profiler. `bits = table`: the layer's output equal to the table row's on the same tokens; "
        "`max rel vs ref`: against moe_ref (bf16 pairs) on the first 512 tokens; `bit-repro`: the graph's replays "
        "left the first call's output.", "",
        bc.md_table(rows, [("model", "model", None), ("variant", "variant", None), ("config", "config", None),
                           ("layer us", "layer_us", "{:.0f}"), ("mlp1 us", "mlp1_us", "{:.0f}"),
                           ("mlp1 TFLOP/s", "mlp1_TFLOPs", "{:.0f}"), ("mlp2 us", "mlp2_us", "{:.0f}"),
                           ("mlp2 TFLOP/s", "mlp2_TFLOPs", "{:.0f}"), ("bits = table", "bits_equal_table", None),
                           ("max rel vs table", "max_rel_vs_table", "{:.1e}"),
                           ("max rel vs ref", "max_rel_vs_ref", "{:.1e}"), ("bit-repro", "bit_reproducible", None),
                           ("error", "error", None)])]) + "\n"
    bc.write_results(args.out, args.stem or "diag_gluon_moe", meta, rows, md)
    return md


if __name__ == "__main__":
    main()
