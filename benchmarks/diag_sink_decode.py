"""Where the batch-1 decode attention's time goes: the one-shot kernel with and without RoPE + the KV
write in its launch (kernels/sink_attention.py RopeKV), its compiled resources, and an ncu mode.

    python benchmarks/diag_sink_decode.py --out benchmarks/results [--contexts 8192,32768] [--batches 1,4]
    ncu --profile-from-start off ... python benchmarks/diag_sink_decode.py --ncu   (one call of each mode)

gpt-oss shapes (64 q / 8 kv heads, head_dim 64, bf16 KV, window 127 for sliding layers), random slots,
req_to_token as wide as the context. Each row times a CUDA graph of back-to-back calls on distinct
requests (more KV than L2 holds for full layers; the sliding rows' 64 windows, 16.8 MB, stay in L2),
PDL on where the launcher takes it: "unfused" is rope_store_kv then the decode (the chain before
RopeKV), "fused" the decode with RopeKV, and "attention only" the decode on a
cache that already holds the new key (no RoPE at all: the floor of the fused chain). Configs: the
table's pick, then (batch 1, 8k, full layers) one-shot variants: chunk, warps, V after the scores, a
register cap (rN: ptxas maxnreg).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

HQ, HKV, D = 64, 8, 64
WINDOW_LEFT = 127
KV_BYTES_PER_KEY = 2 * HKV * D * 2
L2_DEFEAT_BYTES = 256 << 20
# one-shot (chunk, warps, v_late, max_regs): the batch-1 pick (c128 V late) with and without a register cap
# that lets 4 programs of 4 warps share an SM (the 8k grid is 512 programs: one wave at 4 an SM)
VARIANTS = ((128, 4, True, 0), (128, 4, True, 128), (128, 4, False, 0), (128, 4, False, 128), (64, 4, False, 0),
            (64, 4, True, 0), (256, 8, False, 0))


def build(ctx: int, batch: int, window_left: int, g: torch.Generator, width: int = 0):
    """`width` > ctx: req_to_token as wide as that (a server's is the model's context), requests ctx long
    (the columns past ctx point at slot 0, never read)."""
    keys = ctx if window_left < 0 else min(ctx, window_left + 1)
    n_sets = max(2, min(64, math.ceil(L2_DEFEAT_BYTES / (batch * keys * KV_BYTES_PER_KEY))))
    n_rows = n_sets * batch
    num_slots = n_rows * ctx + 1
    k_buffer = torch.randn(num_slots, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    v_buffer = torch.randn(num_slots, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    req_to_token = torch.zeros(n_rows, max(width, ctx), device="cuda", dtype=torch.int32)
    req_to_token[:, :ctx] = (torch.randperm(num_slots - 1, device="cuda", generator=g) + 1).view(n_rows, ctx)
    qkv = torch.randn(n_sets, batch, (HQ + 2 * HKV) * D, device="cuda", generator=g).to(torch.bfloat16)
    ang = torch.rand(batch, D // 2, device="cuda", generator=g) * 6.0
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).float()
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int64)
    sinks = torch.randn(HQ, device="cuda", generator=g)
    sets = [torch.arange(s * batch, (s + 1) * batch, device="cuda") for s in range(n_sets)]
    locs = [req_to_token[s * batch:(s + 1) * batch, ctx - 1].long() for s in range(n_sets)]
    return dict(k_buffer=k_buffer, v_buffer=v_buffer, req_to_token=req_to_token, qkv=qkv, cos_sin=cos_sin,
                seq_lens=seq_lens, sinks=sinks, sets=sets, locs=locs, n_sets=n_sets, keys=keys)


def calls(sa, case, batch, window_left, mode, config=None):
    from sglang_ext.kernels.rope_kv import rope_store_kv

    c = case
    out = torch.empty(c["n_sets"], batch, HQ, D, device="cuda", dtype=torch.bfloat16)

    def one(s):
        row = c["qkv"][s]
        q = row[:, : HQ * D].view(batch, HQ, D)
        k = row[:, HQ * D:(HQ + HKV) * D].view(batch, HKV, D)
        v = row[:, (HQ + HKV) * D:].view(batch, HKV, D)
        args = (c["k_buffer"], c["v_buffer"], c["req_to_token"], c["sets"][s], c["seq_lens"], c["sinks"],
                window_left, 0.125)
        if mode == "unfused":
            def f():
                q2 = rope_store_kv(q, k, v, c["cos_sin"], c["k_buffer"], c["v_buffer"], c["locs"][s])
                sa.sink_attention_decode(q2, *args, out=out[s], config=config)
        elif mode == "fused":
            def f():
                sa.sink_attention_decode(q, *args, out=out[s], config=config,
                                         rope=sa.RopeKV(k, v, c["cos_sin"], c["locs"][s]))
        else:
            qc = q.contiguous()

            def f():
                sa.sink_attention_decode(qc, *args, out=out[s], config=config)
        return f

    return [one(s) for s in range(c["n_sets"])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--ncu", action="store_true", help="profile one call of each mode (batch 1, 8k, full)")
    ap.add_argument("--table-width", type=int, default=0, help="req_to_token this wide (131072: a server's); "
                    "the one-shot variants then run at every context (what a '>8k' pick would be)")
    ap.add_argument("--stem", default="diag_sink_decode")
    args = ap.parse_args()
    bc.import_project()
    from sglang_ext.kernels import sink_attention as sa

    sa.set_rope_fusion(True)  # "fused" rows whatever SGLANG_EXT_ROPE_FUSION says
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.ncu:
        case = build(8192, 1, -1, g)
        for mode in ("unfused", "fused"):
            bc.profile_one_call(calls(sa, case, 1, -1, mode)[0])
        return
    meta = bc.run_meta("python benchmarks/diag_sink_decode.py " + " ".join(sys.argv[1:]))
    copy_bw = bc.copy_bandwidth() if hasattr(bc, "copy_bandwidth") else None
    rows = []
    for ctx in (int(x) for x in args.contexts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            for window_left in (-1, WINDOW_LEFT):
                width = max(args.table_width, ctx)
                case = build(ctx, batch, window_left, g, width)
                kv_bytes = batch * case["keys"] * KV_BYTES_PER_KEY
                layer = "full" if window_left < 0 else "sliding"
                table = sa.decode_config(batch, HKV, window_left, width, torch.device("cuda"))
                runs = [("unfused", None, "table"), ("fused", None, "table"), ("attention only", None, "table")]
                if window_left < 0 and batch == 1 and (ctx <= 8192 or width > ctx):
                    for mode in ("fused", "unfused"):
                        runs += [(mode, sa.oneshot_config(batch, HKV, window_left, width, chunk=c, num_warps=w,
                                                          v_late=vl, max_regs=r),
                                  f"oneshot c{c} w{w}" + (" v_late" if vl else "") + (f" r{r}" if r else ""))
                                 for c, w, vl, r in VARIANTS if mode == "fused" or vl]
                for mode, cfg, label in runs:
                    t = bc.graph_time_calls(calls(sa, case, batch, window_left, mode, cfg))
                    rows.append({"context": ctx, "table_width": width, "batch": batch, "layer": layer, "mode": mode,
                                 "config": label,
                                 "oneshot": (cfg or table).oneshot, "splits": (cfg or table).num_splits,
                                 "time_us": t * 1e6, "kv_MB": kv_bytes / 1e6, "achieved_TBps": kv_bytes / t / 1e12})
                    print(rows[-1], flush=True)
                del case
                torch.cuda.empty_cache()
    resources = bc.compiled_info(sa._sink_decode_oneshot_kernel, with_key=True)
    md = [f"# Decode attention with RoPE + KV write in its launch ({meta.get('gpu', 'GPU')})", "",
          f"`{meta['command']}` — {meta.get('date', '')}", "", __doc__.split("\n\n", 2)[2].strip(), "",
          bc.md_table(rows, [("context", "context", None), ("KV table width", "table_width", None),
                             ("batch", "batch", None), ("layer", "layer", None),
                             ("mode", "mode", None), ("config", "config", None), ("splits", "splits", None),
                             ("time us", "time_us", "{:.2f}"), ("KV MB", "kv_MB", "{:.1f}"),
                             ("TB/s", "achieved_TBps", "{:.2f}")]), "",
          "## Compiled one-shot variants (registers, spills, shared memory)", "",
          bc.md_table(resources, [("regs", "regs", None), ("spills", "spills", None), ("shared KB", "shared_KB", None),
                                  ("warps", "warps", None), ("key", "key", None)])]
    bc.write_results(args.out, args.stem, {**meta, "copy_bw": copy_bw}, rows, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
