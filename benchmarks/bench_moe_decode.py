"""One-shot decode MoE (kernels/moe/oneshot.py) vs the shipped `fused_moe_fp8` on one H200, gpt-oss-120b
shapes: 128 experts, hidden = intermediate = 2880, top-4, FP8 e4m3 block-128 experts with biases,
bf16 router; random weights and router (fresh per run), so routing is random.

Per batch T (default 1, 2, 4): per-call times are the median over replays of a CUDA graph that runs
the call on CALLS distinct token batches back to back (each routes to its own experts: 4T of 128,
~25 MB each, so one replay reads ~0.8-3 GB and L2's 50 MB holds nothing from call to call).

- the whole layer: the shipped `fused_moe_fp8` (the table's config for T: the split-K GEMV path)
  and `fused_moe_fp8_oneshot` (the same decode front, then mlp1 / h quantisation / mlp2 +
  combine one-shot) for every `oneshot_variants()` config: us, % of copy bandwidth on the bytes
  the call must read (distinct routed experts' W1, W2, scales, biases + router + tokens), speedup
  vs shipped, max relative error vs `moe_ref` on the kernel's own routing, bit reproducibility;
- the parts on their own, on the decode front's outputs of the same token batches: the front,
  mlp1 per tile (bytes: touched experts' W1 + scales + b1; streaming 66 MB takes 16.7 us at T=1),
  the h quantisation, mlp2 + combine per tile (W2 + scales + b2).

Kernels are compiled first in --compile-workers processes (Triton's on-disk cache), so the sweep
itself (< 120 s in all) only times. A failing variant is an error row, never a stop; no new timing
starts after --budget-s.

    python -m benchmarks.bench_moe_decode --out benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
from benchmarks import bench_common as bc  # noqa: E402

bc.import_project()
from benchmarks.bench_common import md_table, run_meta, write_results  # noqa: E402
from benchmarks import bench_moe  # noqa: E402
from benchmarks.bench_moe import expert_bytes, layer_args, make_layer  # noqa: E402
from sglang_ext.kernels import moe as moe_kernels  # noqa: E402
from sglang_ext.kernels.moe import oneshot as md  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K, LIMIT = 128, 2880, 2880, 4, 7.0
CALLS = 8  # distinct token batches per graph replay
FP8 = torch.float8_e4m3fn
# "cpu" only for a smoke run of this script under TRITON_INTERPRET=1 (--device cpu, small dims,
# wall-clock times, no graphs); every number in results/ comes from "cuda".
DEVICE = "cuda"


def graph_us(calls, iters=20) -> float:
    return bc.graph_time_calls(calls, iters, device=DEVICE) * 1e6


def part_bytes(layer, keys) -> float:
    e = layer["w1"].shape[0]
    return sum(layer[k].numel() * layer[k].element_size() for k in keys) / e


# ---------------------------------------------------------------------------------------------
# compile first, in parallel (Triton compiles one kernel at a time per process)
# ---------------------------------------------------------------------------------------------


def _precompile_worker(tasks) -> int:
    """Spawned: the full layer's shapes, dtypes and alignment (so the timed calls' specialisations),
    a zero router (routing to experts 0..3), unset experts; each task's call run once."""
    from benchmarks import bench_common as common

    common.import_project()
    from sglang_ext.kernels import moe as mod
    from sglang_ext.kernels.moe import oneshot as mdd

    dev = "cuda"
    nh, ni, n2i = (-(-n // 128) for n in (HIDDEN, INTER, 2 * INTER))  # scale blocks (2I = 5760: 45, not 2 x 23)
    args = (torch.zeros(EXPERTS, HIDDEN, dtype=torch.bfloat16, device=dev),
            torch.zeros(EXPERTS, dtype=torch.bfloat16, device=dev),
            torch.empty(EXPERTS, 2 * INTER, HIDDEN, dtype=FP8, device=dev),
            torch.empty(EXPERTS, n2i, nh, device=dev),
            torch.empty(EXPERTS, 2 * INTER, dtype=torch.bfloat16, device=dev),
            torch.empty(EXPERTS, HIDDEN, INTER, dtype=FP8, device=dev),
            torch.empty(EXPERTS, nh, ni, device=dev), torch.empty(EXPERTS, HIDDEN, dtype=torch.bfloat16, device=dev))
    for kind, tokens, config in tasks:
        x = torch.randn(tokens, HIDDEN, device=dev).to(torch.bfloat16)
        if kind == "shipped":
            mod.fused_moe_fp8(x, *args, top_k=TOP_K, limit=LIMIT)
        else:
            mdd.fused_moe_fp8_oneshot(x, *args, top_k=TOP_K, limit=LIMIT, config=config)
    torch.cuda.synchronize()
    return len(tasks)


def _mlp2_tiles() -> list:
    """(block_n, warps, quant_in_mlp2, per_pair) of every mlp2 tile the sweep times."""
    return ([(n, w, False, False) for n, w in md.ONESHOT_MLP2_TILES]
            + [(n, w, True, False) for n, w in md.ONESHOT_MLP2_QUANT_TILES]
            + [(n, w, False, True) for n, w in md.ONESHOT_MLP2_PAIR_TILES])


def precompile(tokens, workers) -> float:
    """Every distinct kernel once: each mlp2 tile beside an mlp1 tile (all six covered), the decode
    front per token tile (T = 1; 2..4 share one), the shipped path per token bucket."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    mlp1 = md.ONESHOT_MLP1_TILES
    tasks = [[("oneshot", tokens[0], md.OneshotConfig(*mlp1[i % len(mlp1)], n, w, q, pp))]
             for i, (n, w, q, pp) in enumerate(_mlp2_tiles())]
    buckets = sorted({moe_kernels._decode_token_pad(t) for t in tokens})  # the front's token tiles
    tasks[0] += [("oneshot", b, md.DEFAULT_ONESHOT) for b in buckets]
    tasks.append([("shipped", b, None) for b in buckets])
    workers = max(1, min(workers, len(tasks)))
    per_worker = [sum(tasks[i::workers], []) for i in range(workers)]
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for f in [pool.submit(_precompile_worker, b) for b in per_worker if b]:
            f.result()
    return time.time() - t0


# ---------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------


def sweep_batch(layer, tokens, bw, rows, deadline, variants):
    args = layer_args(layer)
    rw, rb, w1, s1, b1, w2, s2, b2 = args
    calls = CALLS if DEVICE == "cuda" else 1
    xs = [torch.randn(tokens, HIDDEN, device=DEVICE).to(torch.bfloat16) for _ in range(calls)]
    outs = [torch.empty_like(x) for x in xs]
    fronts = [moe_kernels.decode_front(x, rw, rb, TOP_K, EXPERTS, 0, block_m=1) for x in xs]
    touched = [torch.unique(f["topk_ids"]).numel() for f in fronts]
    mean_touched = sum(touched) / len(touched)
    layer_bytes = mean_touched * expert_bytes(layer) + rw.numel() * 2 + 2 * xs[0].numel() * 2
    mlp1_bytes = mean_touched * part_bytes(layer, ("w1", "w1_scale_inv", "b1"))
    mlp2_bytes = mean_touched * part_bytes(layer, ("w2", "w2_scale_inv", "b2"))
    base = {"tokens": tokens, "experts_touched": mean_touched}

    def timed(row, nbytes, calls, check=None):
        """Time `calls`, fill the row (an exception: an error row), append it."""
        if time.time() > deadline:
            row["error"] = "--budget-s reached: not timed"
        else:
            try:
                if check is not None:
                    row.update(check())
                us = graph_us(calls)
                row.update(us=us, MB=nbytes / 1e6, floor_us=nbytes / bw * 1e6,
                           pct_copy_bw=100 * nbytes / (us * 1e-6) / bw)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc()
        rows.append(row)
        print(row, flush=True)
        return row

    # moe_ref on the first batch's routing (the shipped path and the one-shot share the front)
    w0, ids0 = fronts[0]["topk_weights"], fronts[0]["topk_ids"]
    ref = moe_kernels.moe_ref(xs[0], None, None, w1, s1, b1, w2, s2, b2, top_k=TOP_K, limit=LIMIT, routing=(w0, ids0))
    ref_max = ref.float().abs().max().item()

    def accuracy(run):
        out, weights, ids = run()
        assert torch.equal(ids, ids0) and torch.equal(weights, w0), "routing differs from the decode front's"
        again = run()[0]
        return {"max_rel_err_vs_ref": ((out.float() - ref.float()).abs().max() / ref_max).item(),
                "bit_reproducible": bool(torch.equal(out, again))}

    # the whole layer: shipped, then every one-shot variant
    shipped_row = moe_kernels.select_config(tokens, rw.shape[0], TOP_K)
    shipped = timed({**base, "part": "layer", "variant": "shipped " + shipped_row.short()},
                    layer_bytes,
                    [lambda x=x, o=o: moe_kernels.fused_moe_fp8(x, *args, top_k=TOP_K, limit=LIMIT, out=o)
                     for x, o in zip(xs, outs)],
                    lambda: accuracy(lambda: moe_kernels.fused_moe_fp8(xs[0], *args, top_k=TOP_K, limit=LIMIT,
                                                                       return_routing=True)))
    shipped_us = shipped.get("us")
    for config in variants:
        row = timed({**base, "part": "layer", "variant": config.short()}, layer_bytes,
                    [lambda x=x, o=o, c=config: md.fused_moe_fp8_oneshot(x, *args, top_k=TOP_K, limit=LIMIT, out=o,
                                                                         config=c)
                     for x, o in zip(xs, outs)],
                    lambda c=config: accuracy(lambda: md.fused_moe_fp8_oneshot(xs[0], *args, top_k=TOP_K, limit=LIMIT,
                                                                               config=c, return_routing=True)))
        if shipped_us and row.get("us"):
            row["speedup_vs_shipped"] = shipped_us / row["us"]

    # the parts, on the fronts' outputs
    timed({**base, "part": "front", "variant": "decode_front (router, top-4, x quant, sort)"}, rw.numel() * 2,
          [lambda x=x: moe_kernels.decode_front(x, rw, rb, TOP_K, EXPERTS, 0, block_m=1) for x in xs])
    num_pairs = tokens * TOP_K
    hfs = [torch.empty(num_pairs, INTER, device=DEVICE) for _ in xs]
    hqs = [torch.empty(num_pairs, INTER, dtype=FP8, device=DEVICE) for _ in xs]
    hss = [torch.empty(num_pairs, -(-INTER // 128), device=DEVICE) for _ in xs]
    for n, w in md.ONESHOT_MLP1_TILES:
        config = md.OneshotConfig(mlp1_block_n=n, mlp1_warps=w)
        timed({**base, "part": "mlp1", "variant": f"mlp1 n{n}/w{w}"}, mlp1_bytes,
              [lambda f=f, h=h, c=config: md.launch_mlp1(f["x_fp8"], f["x_scale"], f["topk_ids"], w1, s1, b1, h, LIMIT,
                                                         0, c) for f, h in zip(fronts, hfs)])
    for f, h, hq, hs in zip(fronts, hfs, hqs, hss):  # h and its groups as mlp2 will see them
        md.launch_mlp1(f["x_fp8"], f["x_scale"], f["topk_ids"], w1, s1, b1, h, LIMIT, 0, md.DEFAULT_ONESHOT)
        md.quantize_h(h, f["topk_ids"], hq=hq, hs=hs)
    timed({**base, "part": "quant", "variant": "quantize_h"}, 5 * num_pairs * INTER,
          [lambda f=f, h=h, hq=hq, hs=hs: md.quantize_h(h, f["topk_ids"], hq=hq, hs=hs)
           for f, h, hq, hs in zip(fronts, hfs, hqs, hss)])
    for n, w, q, pp in _mlp2_tiles():
        config = md.OneshotConfig(mlp2_block_n=n, mlp2_warps=w, quant_in_mlp2=q, mlp2_per_pair=pp)
        timed({**base, "part": "mlp2+combine",
               "variant": f"mlp2 n{n}/w{w}" + (" hq-in-mlp2" if q else "") + (" per-pair" if pp else "")},
              mlp2_bytes,
              [lambda f=f, h=h, hq=hq, hs=hs, o=o, c=config, q=q: md.launch_mlp2_combine(
                  None if q else hq, None if q else hs, h, f["topk_weights"], f["topk_ids"], w2, s2, b2, o, 0, c)
               for f, h, hq, hs, o in zip(fronts, hfs, hqs, hss, outs)])


def summary(rows) -> list:
    out = []
    for tokens in dict.fromkeys(r["tokens"] for r in rows):
        rs = [r for r in rows if r["tokens"] == tokens and "us" in r]
        layer = [r for r in rs if r["part"] == "layer"]
        shipped = next((r for r in layer if r["variant"].startswith("shipped")), None)
        ok = [r for r in layer if not r["variant"].startswith("shipped") and r.get("bit_reproducible")]
        best = min(ok, key=lambda r: r["us"]) if ok else None
        parts = {p: min((r for r in rs if r["part"] == p), key=lambda r: r["us"], default=None)
                 for p in ("front", "mlp1", "quant", "mlp2+combine")}
        out.append({"tokens": tokens, "shipped_us": shipped and shipped["us"],
                    "shipped_pct": shipped and shipped["pct_copy_bw"], "best_us": best and best["us"],
                    "best_pct": best and best["pct_copy_bw"], "speedup": best and best.get("speedup_vs_shipped"),
                    "best_variant": best and best["variant"], "best_err": best and best["max_rel_err_vs_ref"],
                    **{f"{p}_us": r and r["us"] for p, r in parts.items()},
                    "best_mlp1": parts["mlp1"] and parts["mlp1"]["variant"],
                    "best_mlp2": parts["mlp2+combine"] and parts["mlp2+combine"]["variant"]})
    return out


def markdown(meta, rows) -> str:
    bw = meta["copy_bandwidth_Bps"]
    model = {128: "gpt-oss-120b", 32: "gpt-oss-20b"}.get(EXPERTS, f"{EXPERTS}-expert")
    lines = [f"# One-shot decode MoE vs the shipped path, {model} layer ({meta.get('gpu')})", "",
             f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}, triton {meta.get('triton')}, "
             f"{meta['elapsed_s']} s (kernels precompiled in {meta.get('precompile_s') or 0:.0f} s). Copy bandwidth "
             f"{bw / 1e12:.2f} TB/s measured now. {EXPERTS} experts, H = {HIDDEN}, I = {INTER}, top-4, random FP8 weights "
             "and router; "
             f"per-call times from CUDA-graph replays over {CALLS} distinct token batches (distinct experts: > L2). "
             "% copy BW: bytes that must be read (touched experts, router, tokens) / time / copy bandwidth.", "",
             "## Summary: fastest bit-reproducible one-shot config per batch vs the shipped table's", "",
             md_table(summary(rows), [
                 ("T", "tokens", None), ("shipped us", "shipped_us", "{:.1f}"), ("% BW", "shipped_pct", "{:.0f}"),
                 ("one-shot us", "best_us", "{:.1f}"), ("% BW", "best_pct", "{:.0f}"), ("speedup", "speedup", "{:.2f}"),
                 ("config", "best_variant", None), ("max rel err", "best_err", "{:.1e}"),
                 ("front us", "front_us", "{:.1f}"), ("best mlp1 us", "mlp1_us", "{:.1f}"),
                 ("quant us", "quant_us", "{:.1f}"), ("best mlp2+comb. us", "mlp2+combine_us", "{:.1f}"),
                 ("mlp1 tile", "best_mlp1", None), ("mlp2 tile", "best_mlp2", None)]), ""]
    cols = [("T", "tokens", None), ("variant", "variant", None), ("us", "us", "{:.2f}"), ("MB", "MB", "{:.1f}"),
            ("floor us", "floor_us", "{:.1f}"), ("% copy BW", "pct_copy_bw", "{:.0f}")]
    parts = [r for r in rows if r["part"] != "layer" and "us" in r]
    lines += ["## Parts on their own (the fronts' outputs of the same batches)", "",
              md_table(parts, [("part", "part", None)] + cols), ""]
    layer = sorted((r for r in rows if r["part"] == "layer" and "us" in r), key=lambda r: (r["tokens"], r["us"]))
    lines += ["## Whole layer, every variant (fastest first)", "",
              md_table(layer, cols + [("experts", "experts_touched", "{:.1f}"),
                                      ("speedup", "speedup_vs_shipped", "{:.2f}"),
                                      ("max rel err", "max_rel_err_vs_ref", "{:.1e}"),
                                      ("bit-repro", "bit_reproducible", None)]), ""]
    errors = [r for r in rows if "error" in r]
    if errors:
        lines += ["## Rows with errors", ""] + [f"- T={r['tokens']} {r['part']} {r['variant']}: {r['error']}"
                                                  for r in errors]
    if meta.get("errors"):
        lines += ["", "## Sections that failed", ""] + [f"```\n{e}\n```" for e in meta["errors"]]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--tokens", default="1,2,4")
    ap.add_argument("--compile-workers", type=int, default=8, help="0: compile as the calls come")
    ap.add_argument("--budget-s", type=float, default=105.0, help="no timing starts after this many seconds")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu smoke runs only:
    ap.add_argument("--dims", default="128,2880,2880", help=argparse.SUPPRESS)  # experts,hidden,inter
    ap.add_argument("--variants", type=int, default=0, help=argparse.SUPPRESS)  # only the first N
    ap.add_argument("--filter", default="", help="time only the one-shot variants whose label contains this")
    ap.add_argument("--ncu", action="store_true", help="instead: one call of the served MoE layer at the first "
                    "--tokens count (120b), for `ncu --profile-from-start off`")
    args = ap.parse_args()
    global DEVICE, EXPERTS, HIDDEN, INTER
    DEVICE = bench_moe.DEVICE = args.device
    EXPERTS, HIDDEN, INTER = (int(v) for v in args.dims.split(","))
    if args.ncu:
        layer = make_layer(EXPERTS, HIDDEN, INTER, seed=0)
        x = (torch.randn(int(args.tokens.split(",")[0]), HIDDEN, device=DEVICE) * 0.5).to(torch.bfloat16)
        bc.profile_one_call(lambda: moe_kernels.fused_moe_fp8(x, *layer_args(layer)))
        return
    variants = [v for v in md.oneshot_variants() if args.filter in v.short()][:args.variants or None]
    t0 = time.time()
    tokens = [int(t) for t in args.tokens.split(",")]
    errors, rows = [], []
    meta = {"copy_bandwidth_Bps": None, "precompile_s": None}

    def save():
        full = run_meta("python -m benchmarks.bench_moe_decode " + " ".join(sys.argv[1:]),
                        {**meta, "elapsed_s": round(time.time() - t0, 1), "errors": errors,
                         "table": moe_kernels.select_config(1).short()})
        write_results(args.out, "bench_moe_decode", full, rows, markdown(full, rows))
        return full

    if args.compile_workers > 0 and DEVICE == "cuda":
        try:
            meta["precompile_s"] = precompile(tokens, args.compile_workers)
        except Exception:  # then the timed calls compile as they come
            errors.append(traceback.format_exc())
            print(errors[-1], flush=True)
        print({"precompile_s": meta["precompile_s"]}, flush=True)
    meta["copy_bandwidth_Bps"] = bc.copy_bandwidth(DEVICE)
    torch.manual_seed(int(time.time()))  # fresh random inputs every run
    layer = make_layer(EXPERTS, HIDDEN, INTER, seed=int(time.time() * 1000) % (1 << 31))
    for t in tokens:
        try:
            sweep_batch(layer, t, meta["copy_bandwidth_Bps"], rows, t0 + args.budget_s, variants)
        except Exception:
            errors.append(traceback.format_exc())
            print(errors[-1], flush=True)
        save()
    print(markdown(save(), rows))


if __name__ == "__main__":
    main()
