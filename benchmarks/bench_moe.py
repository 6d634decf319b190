"""Fused FP8 MoE (kernels/moe/) on one H200 at gpt-oss shapes: hidden = intermediate = 2880, top-4,
128 experts (120b) and 32 experts (20b), FP8 e4m3 block-128 experts with biases, bf16 router. Random
weights and tokens (fresh per run), so routing is random too.

Decode, batch 1..128 tokens: per-call time is the median over replays of a CUDA graph that runs the
layer on R different token batches back to back, so the experts one replay reads exceed the 50 MB L2
(a real decode step visits 35 other layers between two visits of this one). Bytes = the experts each
call actually touches (distinct routed experts: W1, W2, their scales and biases) + router weight +
tokens in/out. Achieved bandwidth = bytes / time, against the device copy bandwidth measured in the
same run (target: >= 70%).

Prefill, 8192 tokens: time of the whole layer (router GEMM, routing, sort, both expert GEMMs, combine)
and TFLOP/s on the expert GEMMs' 2 * T * k * (2I*H + H*I) FLOPs, against the FP8 matmul rate measured
in the same run, and against a bf16 `torch._grouped_mm` pipeline doing the same work on the same
routing (gather, mlp1, bias, swiglu, mlp2, bias, weighted scatter-add; target >= 1.5x), and that
peer's two GEMMs alone.

Kernel times per launch (profiler, eager) for batch 1 / 128 and prefill, and a sweep of launch
configurations while the time budget lasts (--budget-s; the next tuning step: winners go into
`H200_HIDDEN_2880_CONFIGS`): decode batches --sweep-batches (1..32) of both models and prefill,
the table's config beside each candidate (split-K decode configs, prefill tiles), each row with
its error vs `moe_ref` and a bit-reproducibility check; a summary lists the fastest per shape. Peers: ``peers(kind, ctx)`` returns name -> callable; errors are caught
and recorded. SGLang 0.5.23's own Triton fused MoE runs as a peer where `.peers/sglang_src` was
carried (benchmarks/fetch_sglang_peers.sh), timed without its routing and alignment.

    python -m benchmarks.bench_moe --out benchmarks/results   # < 200 s: no sweep candidate starts after --budget-s 165
    python -m benchmarks.bench_moe --out /tmp/moe --sweep-only   # the sweep alone
    # prefill candidates only (mlp1's one-dot variant among them), 120b, more time
    python -m benchmarks.bench_moe --out /tmp/moe --sweep-only --sweep-kinds prefill --models 120b --budget-s 400
    # decode GEMV variants vs the table's pick at batch 1, 2, 4, 8, both models, kernels compiled in
    # 12 processes first (< 150 s)
    python -m benchmarks.bench_moe --out /tmp/moe --gemv-sweep --compile-workers 12
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import replace

import torch

from benchmarks import bench_common as bc  # noqa: E402

bc.import_project()
from benchmarks.bench_common import md_table, run_meta, write_results  # noqa: E402
from sglang_ext.kernels import moe as moe_kernels  # noqa: E402
from sglang_ext.layers.fp8 import dequantize_weight_block128  # noqa: E402
from sglang_ext.layers.moe import experts_torch, route, swiglu_oai  # noqa: E402

MODELS = {"120b": 128, "20b": 32}
TOP_K, LIMIT = 4, 7.0
L2_DEFEAT_BYTES = 300e6  # distinct expert bytes per graph replay we aim for (H200 L2: 50 MB)
# "cpu" only for a smoke run of this script under TRITON_INTERPRET=1 (--device cpu, small dims:
# wall-clock timing, no graphs); every number in results/ comes from "cuda".
DEVICE = "cuda"


# ---------------------------------------------------------------------------------------------
# timing and ceilings
# ---------------------------------------------------------------------------------------------


def event_time(fn, iters=10, warmup=3) -> float:
    return bc.event_time(fn, iters, warmup, device=DEVICE)


def ceilings() -> dict:
    """Copy bandwidth and dense matmul rates, measured now."""
    if DEVICE != "cuda":
        return {"copy_bandwidth_Bps": 1e9, "bf16_matmul_flops": 1e9, "fp8_matmul_flops": 1e9}
    return bc.measure_ceilings()


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------


def make_layer(num_experts, hidden, inter, seed) -> dict:
    """Random FP8 block-128 experts (e4m3 values ~N(0, 16), block scales so W ~ N(0, 1/H)), biases,
    a bf16 router. Generated per expert on the device (the 120b experts are 3.2 GB)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    nb = lambda n: -(-n // 128)  # noqa: E731

    def experts(out_dim, in_dim):
        q = torch.empty(num_experts, out_dim, in_dim, dtype=torch.float8_e4m3fn, device=DEVICE)
        for e in range(num_experts):
            q[e] = (torch.randn(out_dim, in_dim, generator=g, device=DEVICE) * 16).clamp(-448, 448).to(q.dtype)
        scale = (0.5 + torch.rand(num_experts, nb(out_dim), nb(in_dim), generator=g, device=DEVICE)) / (16 * in_dim ** 0.5)
        return q, scale

    w1, s1 = experts(2 * inter, hidden)
    w2, s2 = experts(hidden, inter)
    bias = lambda *shape: (torch.randn(*shape, generator=g, device=DEVICE) * 0.1).to(torch.bfloat16)  # noqa: E731
    router_w = (torch.randn(num_experts, hidden, generator=g, device=DEVICE) / hidden ** 0.5).to(torch.bfloat16)
    return {"router_weight": router_w, "router_bias": bias(num_experts), "w1": w1, "w1_scale_inv": s1,
            "b1": bias(num_experts, 2 * inter), "w2": w2, "w2_scale_inv": s2, "b2": bias(num_experts, hidden)}


def layer_args(layer):
    return (layer["router_weight"], layer["router_bias"], layer["w1"], layer["w1_scale_inv"], layer["b1"],
            layer["w2"], layer["w2_scale_inv"], layer["b2"])


def expert_bytes(layer) -> float:
    """Bytes of one expert: W1, W2 (e4m3), their fp32 block scales, both bf16 biases."""
    e = layer["w1"].shape[0]
    keys = ("w1", "w1_scale_inv", "b1", "w2", "w2_scale_inv", "b2")
    return sum(layer[k].numel() * layer[k].element_size() for k in keys) / e


def bf16_experts(layer) -> dict:
    """Dequantised bf16 copies for the bf16 peers (made once per model, on demand)."""
    if "w1_bf16" not in layer:
        for name in ("w1", "w2"):
            q, s = layer[name], layer[name + "_scale_inv"]
            w = torch.empty(q.shape, dtype=torch.bfloat16, device=DEVICE)
            for e in range(q.shape[0]):
                w[e] = dequantize_weight_block128(q[e], s[e], torch.bfloat16)
            layer[name + "_bf16"] = w
    return layer


# ---------------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------------


def _experts_torch_bf16(ctx):
    layer = bf16_experts(ctx["layer"])
    x = ctx["x"]

    def run():
        weights, ids = route(x, layer["router_weight"], layer["router_bias"], TOP_K)
        return experts_torch(x, weights, ids, layer["w1_bf16"], layer["b1"], layer["w2_bf16"], layer["b2"], LIMIT)

    return run


def _grouped_mm_pipeline(ctx, gemms_only=False):
    """bf16 torch._grouped_mm doing the layer's expert work on the kernel's routing: pairs sorted by
    expert (metadata made outside the timing, as our sort is inside ours), gather, mlp1 + bias,
    swiglu, mlp2 + bias, weighted scatter-add in fp32."""
    layer = bf16_experts(ctx["layer"])
    x, weights, ids = ctx["x"], ctx["topk_weights"], ctx["topk_ids"]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    expert_of_row = flat[order]
    token_of_row = order // TOP_K
    offs = torch.cumsum(torch.bincount(flat, minlength=layer["w1"].shape[0]), 0).to(torch.int32)
    w1t = layer["w1_bf16"].transpose(1, 2)  # [E, H, 2I], K-major as _grouped_mm wants
    w2t = layer["w2_bf16"].transpose(1, 2)
    row_weight = weights.reshape(-1)[order].float()[:, None]
    xs = x[token_of_row]
    act = swiglu_oai(torch._grouped_mm(xs, w1t, offs=offs), LIMIT)

    if gemms_only:
        return lambda: (torch._grouped_mm(xs, w1t, offs=offs), torch._grouped_mm(act, w2t, offs=offs))[1]

    def run():
        h = torch._grouped_mm(x[token_of_row], w1t, offs=offs) + layer["b1"][expert_of_row]
        y = torch._grouped_mm(swiglu_oai(h, LIMIT), w2t, offs=offs) + layer["b2"][expert_of_row]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, token_of_row, y.float() * row_weight).to(x.dtype)

    return run


def _sglang_fused_experts(ctx):
    """SGLang 0.5.23's Triton fused MoE on our routing (benchmarks/sglang_peers.py: the carried
    wheel source; H and I zero-padded to 2944 once, alignment and config untimed)."""
    from benchmarks import sglang_peers

    make = sglang_peers.load_sglang_kernels().get("make_fused_experts")
    if not callable(make):
        raise RuntimeError(str(make))
    layer = ctx["layer"]
    run = make(ctx["x"], ctx["topk_weights"], ctx["topk_ids"], layer["w1"], layer["w1_scale_inv"], layer["b1"],
               layer["w2"], layer["w2_scale_inv"], layer["b2"], LIMIT)
    return run


SGLANG_PEER_DECODE_BATCHES = (1, 32)  # each batch size compiles SGLang's kernels (and its torch.compile swiglu) anew


def peers(kind: str, ctx: dict) -> dict:
    """Peers on the same inputs: name -> factory(ctx) returning a zero-argument callable that gives
    [T, H]. ``kind`` is "decode" or "prefill"; ``ctx`` holds x, layer (the dict of make_layer),
    topk_weights / topk_ids (the kernel's routing, int32)."""
    found = {}
    if kind == "decode":
        if ctx["x"].shape[0] * TOP_K <= 32:  # experts_torch's graph-capturable (gathered) path
            found["torch_experts_bf16"] = _experts_torch_bf16
        if ctx["x"].shape[0] in SGLANG_PEER_DECODE_BATCHES:
            found["sglang_triton_fused_experts"] = _sglang_fused_experts
        return found
    return {"grouped_mm_bf16_pipeline": _grouped_mm_pipeline,
            "grouped_mm_bf16_gemms_only": lambda c: _grouped_mm_pipeline(c, gemms_only=True),
            "sglang_triton_fused_experts": _sglang_fused_experts}


def run_peers(kind, ctx, ours_s, ours_out) -> dict:
    results = {}
    for name, factory in peers(kind, ctx).items():
        try:
            fn = factory(ctx)
            out = fn()
            t = bc.graph_time_calls([fn], device=DEVICE) if kind == "decode" else event_time(fn)
            results[name] = {"time_us": t * 1e6, "ours_speedup": t / ours_s}
            if getattr(fn, "api", None):
                results[name]["api"] = fn.api
            if "gemms_only" not in name:
                results[name]["rel_fro_vs_ours"] = ((out.float() - ours_out.float()).norm()
                                                    / ours_out.float().norm()).item()
        except Exception as exc:  # a peer's failure is a result, not a crash
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    return results


# ---------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------


def accuracy(out, x, layer) -> dict:
    ref = moe_kernels.moe_ref(x, *layer_args(layer), top_k=TOP_K, limit=LIMIT)
    diff = (out.float() - ref.float()).abs()
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
    return {"max_rel_err_vs_ref": (diff.max() / ref.float().abs().max()).item(),
            "within_ulp_vs_ref": (diff <= ulp + 1e-6).float().mean().item()}


def kernel_times(fn, calls=5) -> dict:
    """Device time per call of each kernel in `fn` (bench_common.kernel_times), in us; none off CUDA."""
    return bc.kernel_times(fn, calls) if DEVICE == "cuda" else {}


def decode_inputs(layer, batch) -> list:
    """Distinct token batches for one graph replay: enough that the experts they touch exceed L2."""
    per_call = expert_bytes(layer) * min(layer["w1"].shape[0], batch * TOP_K)
    reps = max(2, min(16, round(L2_DEFEAT_BYTES / per_call))) if DEVICE == "cuda" else 1
    return [torch.randn(batch, layer["w1"].shape[2], device=DEVICE).to(torch.bfloat16) for _ in range(reps)]


def bench_decode(model, layer, batch, bw, check, config=None, xs=None) -> dict:
    """`xs`: the token batches (`decode_inputs`), so configs can be compared on the same routing."""
    args = layer_args(layer)
    xs = xs or decode_inputs(layer, batch)
    reps = len(xs)
    outs = [torch.empty_like(x) for x in xs]
    touched, nbytes = [], []
    for x, out in zip(xs, outs):
        _, _, ids = moe_kernels.fused_moe_fp8(x, *args, top_k=TOP_K, limit=LIMIT, out=out, config=config,
                                              return_routing=True)
        n = torch.unique(ids).numel()
        touched.append(n)
        nbytes.append(n * expert_bytes(layer) + layer["router_weight"].numel() * 2 + 2 * x.numel() * 2)
    calls = [lambda x=x, out=out: moe_kernels.fused_moe_fp8(x, *args, top_k=TOP_K, limit=LIMIT, out=out,
                                                            config=config) for x, out in zip(xs, outs)]
    t = bc.graph_time_calls(calls, device=DEVICE)
    mean_bytes = sum(nbytes) / len(nbytes)
    row = {"model": model, "batch": batch, "time_us": t * 1e6, "experts_touched": sum(touched) / len(touched),
           "MB_per_call": mean_bytes / 1e6, "graph_reps": reps, "floor_us": mean_bytes / bw * 1e6,
           "achieved_TBps": mean_bytes / t / 1e12, "pct_of_copy_bw": 100 * mean_bytes / t / bw}
    if check:
        moe_kernels.fused_moe_fp8(xs[0], *args, top_k=TOP_K, limit=LIMIT, out=outs[0], config=config)
        row.update(accuracy(outs[0], xs[0], layer))
        _, weights, ids = moe_kernels.fused_moe_fp8(xs[0], *args, top_k=TOP_K, limit=LIMIT, config=config,
                                                    return_routing=True)
        row["peers"] = run_peers("decode", {"x": xs[0], "layer": layer, "topk_weights": weights,
                                            "topk_ids": ids}, t, outs[0])
    return row


def accuracy_on_own_routing(x, layer, config) -> dict:
    """Error vs `moe_ref` on the kernel's own routing (the decode front's logits may sit an ulp from
    torch's GEMM, which can swap an expert: that is the router's contract, not the experts'), and
    whether three calls agree bit for bit."""
    run = lambda: moe_kernels.fused_moe_fp8(x, *layer_args(layer), top_k=TOP_K, limit=LIMIT, config=config,  # noqa: E731
                                            return_routing=True)
    out, weights, ids = run()
    ref = moe_kernels.moe_ref(x, None, None, *layer_args(layer)[2:], top_k=TOP_K, limit=LIMIT, routing=(weights, ids))
    diff = (out.float() - ref.float()).abs()
    return {"max_rel_err_vs_ref": (diff.max() / ref.float().abs().max()).item(),
            "rel_fro_vs_ref": (diff.norm() / ref.float().norm()).item(),
            "bit_reproducible": bool(torch.equal(out, run()[0]) and torch.equal(out, run()[0]))}


def table_config(layer, tokens: int):
    """The row fused_moe_fp8 takes for this layer without a config (its router's expert count decides
    the many-pairs rows)."""
    return moe_kernels.select_config(tokens, layer["router_weight"].shape[0], TOP_K)


def gemv_sweep(layers, bw, rows, kernel_rows, save, batches, deadline=float("inf")):
    """Decode GEMV variants (`moe_kernels.decode_gemv_variants`) beside the table's pick, per model
    and batch, all on the same token batches (so the same routing and bytes); `x_vs_table` > 1:
    the variant is faster. Device time per kernel (profiler) for the table, the first variant and the
    PDL one at batch 1. No (model, batch) starts after `deadline` (an error row says so)."""
    for model in sorted(layers, key=lambda m: m != "120b"):
        layer = layers[model]
        for batch in batches:
            if time.time() > deadline:
                rows.append({"model": model, "tokens": batch, "is_table": False,
                             "error": "--budget-s reached: this and later batches skipped"})
                save()
                return
            xs = decode_inputs(layer, batch)
            table_us = None
            for config in [None] + moe_kernels.decode_gemv_variants(batch):
                chosen = config or table_config(layer, batch)
                row = {"model": model, "tokens": batch, "config": chosen.short(), "is_table": config is None}
                try:
                    r = bench_decode(model, layer, batch, bw, check=False, config=config, xs=xs)
                    row.update(time_us=r["time_us"], pct_of_copy_bw=r["pct_of_copy_bw"], MB_per_call=r["MB_per_call"])
                    if config is None:
                        table_us = r["time_us"]
                    if table_us:
                        row["x_vs_table"] = table_us / r["time_us"]
                    row.update(accuracy_on_own_routing(xs[0], layer, config))
                except Exception as exc:  # a variant's failure is a result, not a crash
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                print(row, flush=True)
            save()
    if DEVICE != "cuda":
        return
    model = sorted(layers, key=lambda m: m != "120b")[0]
    x = torch.randn(1, layers[model]["w1"].shape[2], device=DEVICE).to(torch.bfloat16)
    variants = moe_kernels.decode_gemv_variants(1)
    for config in (None, variants[0], variants[-1]):
        label = f"{model}_decode_1 " + (config.short() if config else "table")
        kernel_rows[label] = kernel_times(lambda: moe_kernels.fused_moe_fp8(x, *layer_args(layers[model]), top_k=TOP_K,
                                                                           limit=LIMIT, config=config))


def gemv_winners(rows) -> list:
    """Per (model, batch): the table's time and the fastest bit-reproducible variant."""
    out = []
    for key in dict.fromkeys((r["model"], r["tokens"]) for r in rows):
        rs = [r for r in rows if (r["model"], r["tokens"]) == key and "time_us" in r]
        table = next((r for r in rs if r["is_table"]), None)
        ok = [r for r in rs if not r["is_table"] and r.get("bit_reproducible")]
        if not ok:
            continue
        best = min(ok, key=lambda r: r["time_us"])
        out.append({"model": key[0], "tokens": key[1], "table_us": table["time_us"] if table else None,
                    "table_pct": table.get("pct_of_copy_bw") if table else None, "best_us": best["time_us"],
                    "best_pct": best["pct_of_copy_bw"], "x_vs_table": best.get("x_vs_table"),
                    "best_config": best["config"]})
    return out


class _Warmup:
    """Stands in for a jit kernel in a precompile worker: `kernel[grid](...)` compiles (into Triton's
    on-disk cache) without launching."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn.warmup(*args, grid=grid, **kwargs)


JIT_KERNELS = ("_decode_front_kernel", "_front_kernel", "_count_kernel", "_align_kernel", "_mlp1_kernel",
               "_mlp2_kernel", "_mlp1_gemv_kernel", "_mlp2_gemv_kernel", "_combine_kernel")


def _precompile_worker(tasks, device="cuda") -> int:
    """Spawned worker: the GEMV sweep's launches with empty full-size tensors (the specialisations
    the timed calls get), compiled, none run: ("front", experts, tokens, block_m) runs the decode
    front's launcher, ("experts", experts, tokens, config) mlp1/mlp2/combine's on a stand-in front."""
    from benchmarks import bench_common as common

    common.import_project()
    from sglang_ext.kernels import moe as mod

    package = [m for n, m in list(sys.modules.items()) if n == mod.__name__ or n.startswith(mod.__name__ + ".")]
    for name in JIT_KERNELS:  # every binding: each launcher looks its kernels up in its own module of the package
        real = getattr(mod, name)
        warm = _Warmup(real)
        for sub in package:
            if getattr(sub, name, None) is real:
                setattr(sub, name, warm)
    dev = torch.device(device)
    hidden = inter = 2880
    nb = -(-hidden // 128)
    for kind, num_experts, tokens, what in tasks:
        x = torch.empty(tokens, hidden, dtype=torch.bfloat16, device=dev)
        if kind == "front":
            rw = torch.empty(num_experts, hidden, dtype=torch.bfloat16, device=dev)
            mod._decode_front(x, rw, rw[:, 0].contiguous(), TOP_K, (num_experts, 0, what, 0))
            continue
        config = what or mod.select_config(tokens)
        w1 = torch.empty(num_experts, 2 * inter, hidden, dtype=torch.float8_e4m3fn, device=dev)
        w2 = torch.empty(num_experts, hidden, inter, dtype=torch.float8_e4m3fn, device=dev)
        s1 = torch.empty(num_experts, 2 * nb, nb, device=dev)
        s2 = torch.empty(num_experts, nb, nb, device=dev)
        b1 = torch.empty(num_experts, 2 * inter, dtype=torch.bfloat16, device=dev)
        b2 = torch.empty(num_experts, hidden, dtype=torch.bfloat16, device=dev)
        mb = mod._max_blocks(tokens * TOP_K, num_experts, config.block_m)
        front = (torch.empty(tokens, TOP_K, dtype=torch.bfloat16, device=dev),
                 torch.empty(tokens, TOP_K, dtype=torch.int32, device=dev),
                 torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=dev),
                 torch.empty(tokens, nb, device=dev), torch.empty(mb * config.block_m, dtype=torch.int32, device=dev),
                 torch.empty(mb, dtype=torch.int32, device=dev), mb)
        mod._experts(x, front, front[0], w1, s1, b1, w2, s2, b2, LIMIT, 0, num_experts, inter, config,
                     torch.empty_like(x))
        del w1, w2
    return len(tasks)


def precompile_gemv(models, batches, workers) -> float:
    """Compile the GEMV sweep's kernels in `workers` spawned processes (Triton compiles one kernel
    at a time per process); the timed calls then load them from Triton's cache. The expert kernels
    do not specialise on the expert or token count, so each config compiles once; the decode
    front does, per (experts, token tile, block_m). Returns the seconds taken."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    fronts, experts = {}, {}
    for model in models:
        e = MODELS[model]
        for batch in batches:
            for config in [moe_kernels.select_config(batch, e, TOP_K)] + moe_kernels.decode_gemv_variants(batch):
                fronts.setdefault((e, moe_kernels._decode_token_pad(batch), config.block_m),
                                  ("front", e, batch, config.block_m))
                experts.setdefault(config, ("experts", 32, batch, config))
    tasks = list(experts.values()) + list(fronts.values())
    buckets = [tasks[i::max(1, workers)] for i in range(max(1, workers))]
    with cf.ProcessPoolExecutor(len(buckets), mp_context=mp.get_context("spawn")) as pool:
        for f in [pool.submit(_precompile_worker, b) for b in buckets if b]:
            f.result()
    return time.time() - t0


def bench_prefill(model, layer, tokens, ceil, config=None, with_peers=True) -> dict:
    hidden, inter = layer["w1"].shape[2], layer["w2"].shape[2]
    args = layer_args(layer)
    x = torch.randn(tokens, hidden, device=DEVICE).to(torch.bfloat16)
    out = torch.empty_like(x)
    t = event_time(lambda: moe_kernels.fused_moe_fp8(x, *args, top_k=TOP_K, limit=LIMIT, out=out, config=config))
    _, weights, ids = moe_kernels.fused_moe_fp8(x, *args, top_k=TOP_K, limit=LIMIT, out=out, config=config,
                                                return_routing=True)
    flops = 2 * tokens * TOP_K * (2 * inter * hidden + hidden * inter)
    row = {"model": model, "tokens": tokens, "time_ms": t * 1e3, "TFLOPs": flops / t / 1e12,
           "pct_of_fp8_matmul": 100 * flops / t / ceil["fp8_matmul_flops"] if "fp8_matmul_flops" in ceil else None}
    if with_peers:
        row.update(accuracy(out, x, layer))
        row["peers"] = run_peers("prefill", {"x": x, "layer": layer, "topk_weights": weights, "topk_ids": ids}, t, out)
        pipe = row["peers"].get("grouped_mm_bf16_pipeline", {})
        row["speedup_vs_grouped_mm_pipeline"] = pipe.get("ours_speedup")
        row["speedup_vs_grouped_mm_gemms"] = row["peers"].get("grouped_mm_bf16_gemms_only", {}).get("ours_speedup")
    return row


def sweep_candidates():
    """Alternatives to the table's configs: (decode, prefill) lists of MoeConfig. Decode: mlp1 /
    mlp2 split-K (k<mlp1>/<mlp2> in the labels) so 4..32 touched experts x 23 tiles fill 132
    SMs, with fewer stages (shared memory) for 2-3 programs per SM. Prefill: mlp1's one-dot
    variant (`mlp1_one_dot`) first, then stages, warps, grouping, mlp2 tile width and the sort's
    chunk."""
    C = moe_kernels.MoeConfig
    decode = [C(16, 128, 4, 3, 32, 4, 4, mlp1_split_k=2),
              C(16, 128, 4, 3, 32, 4, 4, mlp1_split_k=2, mlp2_split_k=2),
              C(16, 128, 4, 3, 32, 4, 4, mlp1_split_k=3, mlp2_split_k=2),
              C(16, 128, 4, 2, 32, 4, 4, mlp1_split_k=4, mlp2_split_k=2),
              C(16, 128, 4, 2, 64, 4, 3, mlp1_split_k=4, mlp2_split_k=4),
              C(16, 128, 8, 3, 32, 4, 4, mlp1_split_k=2, mlp2_split_k=2),
              C(16, 128, 8, 2, 32, 2, 4, mlp1_split_k=4, mlp2_split_k=2),
              C(16, 128, 4, 2, 32, 4, 3, mlp1_split_k=8, mlp2_split_k=4)]
    # mlp1_one_dot (one dot over 256 contiguous W1 rows, one [block_m, 256] accumulator, "/1dot" in
    # the labels) first: at 8 warps and block_m 64 the (then) table's two dots run as m64n64 wgmmas per
    # warpgroup, one dot as m64n128. Beside the table's tile: 4 stages (160 KB of shared memory),
    # group 8, one warpgroup (m64n256: 128 accumulator registers a thread), 64 columns (128 W1 rows,
    # fp32 h: mlp2 quantises it on load). block_m 128 is also mlp2's (the sort's block), so mlp2 at 8
    # warps there: two warpgroups of m64 x 256 W1 rows (128 accumulator registers a thread; stages 3:
    # 144 KB, 4: 192 KB). Then mlp2's tiles: 256 wide on 8 warps at block_m 64 (m64n128 per
    # warpgroup, as one-dot mlp1) and 128 (128 registers a thread), 4 stages. A candidate that does
    # not compile or fit (shared memory) is an error row: run_sweep catches it per row.
    one = dict(mlp1_one_dot=True)
    prefill = [C(64, 128, 8, 3, 128, 4, 3, group_m=4, **one), C(64, 128, 8, 4, 128, 4, 3, group_m=4, **one),
               C(64, 128, 8, 3, 128, 4, 3, group_m=8, **one), C(64, 128, 4, 3, 128, 4, 3, group_m=4, **one),
               C(64, 64, 4, 4, 128, 4, 3, group_m=4, **one), C(128, 128, 8, 3, 128, 8, 3, group_m=4, **one),
               C(128, 128, 8, 4, 128, 8, 3, group_m=4, **one), C(128, 128, 8, 3, 128, 8, 3, group_m=8, **one),
               C(64, 128, 8, 3, 256, 8, 3, group_m=4, **one), C(128, 128, 8, 3, 256, 8, 3, group_m=4, **one),
               C(128, 128, 8, 3, 128, 8, 4, group_m=4, **one)]
    # two dots: block_m 128 needs 16 warps for mlp1's two 128x128 accumulators, which caps registers
    # at 128: spills
    prefill += [C(64, 128, 8, 4, 128, 8, 4, group_m=8), C(64, 128, 8, 3, 128, 8, 4, group_m=8, align_chunk=64),
               C(64, 128, 8, 3, 128, 8, 4, group_m=8, align_chunk=256), C(64, 128, 8, 3, 128, 4, 3, group_m=4),
               C(64, 128, 8, 3, 64, 4, 4, group_m=8), C(64, 128, 8, 3, 128, 8, 3, group_m=16),
               C(64, 128, 8, 4, 128, 8, 4, group_m=4)]
    return decode, prefill


def decode_tma_candidates() -> dict:
    """The grouped TMA rows (two one-dot mlp1 passes, h requantised by mlp1, operand tiles by TMA) at
    decode's 5..16 tokens, where the table ran the GEMV path (5..8: one pair a program, so an expert is
    read once per pair) and pointer-loaded split-K rows (9..16) before. Why: the TMA rows were tuned at
    17..128 tokens; at 8 tokens 20b's 32 pairs fall on ~20-22 of its 32 experts, and a block of 16 rows reads
    each of them once. The table took two of them (the many-pairs row at 5..8 tokens, the 64-wide mlp2 at
    9..32), then the same rows without their x gather launch (`_xptr`); also here the rows with the gather,
    and the 33..128 row with and without it, for A/Bs. Labels name the rows for --decode-candidates tma."""
    t32 = moe_kernels.TMA_DECODE_ROW
    return {
        "tma32": t32,                      # the many-pairs row with x gathered
        # the 33..128 row (mlp1 3 stages, mlp2 n64) with its x gather launch; and without it, the table's row
        "tma128": replace(moe_kernels.select_config(128), tma_x=True),
        "tma128_xptr": moe_kernels.select_config(128),
        "tma32_s3": replace(t32, mlp1_stages=3),  # 54 KB a program: 4 an SM, one wave at ~20 experts
        "tma32_n64": moe_kernels.TMA_DECODE_ROW_WIDE_MLP2,     # the 9..32 rows with x gathered
        "tma32_n16": replace(t32, mlp2_block_n=16),
        "tma32_s3_n64": replace(t32, mlp1_stages=3, mlp2_block_n=64, mlp2_stages=3),
        # x's rows by pointers in mlp1, no gather launch (MoeConfig.tma_x off): the table's 5..8 (many pairs)
        # and 9..32 rows
        "tma32_xptr": moe_kernels.TMA_DECODE_ROW_XPTR,
        "tma32_n64_xptr": moe_kernels.TMA_DECODE_ROW_WIDE_MLP2_XPTR,
        "gemv8": moe_kernels.select_config(8),
    }


def sweep_plan(models, batches, prefill_tokens, kinds=("decode", "prefill"), decode_candidates="split"):
    """(kind, model, tokens, config or None = the table's) in priority order, so a budget cut
    drops the least wanted: 120b decode, 120b prefill, then 20b (`kinds`: which of the two).
    The table's own config is measured beside the candidates in the same run."""
    decode, prefill = sweep_candidates()
    tma = list(decode_tma_candidates().values())
    decode = {"split": decode, "tma": tma, "all": decode + tma}[decode_candidates]
    plan = []
    for model in sorted(models, key=lambda m: m != "120b"):
        if "decode" in kinds:
            plan += [("decode", model, b, c) for b in batches for c in [None] + decode]
        if "prefill" in kinds:
            plan += [("prefill", model, prefill_tokens, c) for c in [None] + prefill]
    return plan


def run_sweep(layers, bw, ceil, deadline, rows, save, batches=(1, 2, 4, 8, 16, 32), prefill_tokens=8192,
              kinds=("decode", "prefill"), decode_candidates="split"):
    """Launch configurations vs the table's, while time lasts (each new config compiles first).
    Each row also records the error vs `moe_ref` and whether two calls agree bit for bit. A
    config that fails (compile error, out of shared memory) is an error row; the sweep goes on.
    Decode candidates of one (model, tokens) run on the same token batches, so on the same experts."""
    batches_of = {}
    for kind, model, tokens, config in sweep_plan(list(layers), batches, prefill_tokens, kinds, decode_candidates):
        if time.time() > deadline:
            rows.append({"error": "--budget-s reached: the remaining candidates skipped"})
            break
        chosen = config or table_config(layers[model], tokens)
        row = {"kind": kind, "model": model, "tokens": tokens, "config": chosen.short(), "is_table": config is None}
        try:
            layer = layers[model]
            if kind == "decode":
                xs = batches_of.setdefault((model, tokens), decode_inputs(layer, tokens))
                r = bench_decode(model, layer, tokens, bw, check=False, config=config, xs=xs)
                row.update(time_us=r["time_us"], pct_of_copy_bw=r["pct_of_copy_bw"],
                           experts_touched=r["experts_touched"])
            else:
                r = bench_prefill(model, layer, tokens, ceil, config=config, with_peers=False)
                row.update(time_us=r["time_ms"] * 1e3, TFLOPs=r["TFLOPs"])
            if kind == "decode" or config is not None:
                x = torch.randn(tokens if kind == "decode" else 512, layer["w1"].shape[2],
                                device=DEVICE).to(torch.bfloat16)
                run = lambda: moe_kernels.fused_moe_fp8(x, *layer_args(layer), top_k=TOP_K, limit=LIMIT,  # noqa: E731
                                                        config=chosen)
                out = run()
                row["bit_reproducible"] = bool(torch.equal(out, run()) and torch.equal(out, run()))
                row["max_rel_err_vs_ref"] = accuracy(out, x, layer)["max_rel_err_vs_ref"]
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(row, flush=True)
        save()


def sweep_winners(sweep_rows) -> list:
    """Per (kind, model, tokens): the table's time, the fastest candidate and its speed-up."""
    groups = {}
    for r in sweep_rows:
        if "time_us" in r and r.get("bit_reproducible", True):
            groups.setdefault((r["kind"], r["model"], r["tokens"]), []).append(r)
    out = []
    for (kind, model, tokens), rs in groups.items():
        table = next((r for r in rs if r.get("is_table")), None)
        best = min(rs, key=lambda r: r["time_us"])
        out.append({"kind": kind, "model": model, "tokens": tokens,
                    "table_us": table["time_us"] if table else None, "best_us": best["time_us"],
                    "speedup": table["time_us"] / best["time_us"] if table else None,
                    "best_pct_copy": best.get("pct_of_copy_bw"), "best_TFLOPs": best.get("TFLOPs"),
                    "best_config": best["config"]})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--budget-s", type=float, default=165.0,
                    help="no new sweep candidate (--gemv-sweep: model and batch) starts after this many "
                         "seconds from the start")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="skip the main tables, peers and profile")
    ap.add_argument("--sweep-batches", default="1,2,4,8,16,32")
    ap.add_argument("--sweep-kinds", default="decode,prefill",
                    help="which shapes the config sweep times: decode, prefill or both")
    ap.add_argument("--decode-candidates", default="split", choices=("split", "tma", "all"),
                    help="the sweep's decode candidates: split-K rows, the TMA rows at 5..16 tokens "
                         "(decode_tma_candidates), or both")
    ap.add_argument("--stem", default="bench_moe", help="results file stem")
    ap.add_argument("--gemv-sweep", action="store_true",
                    help="only the decode GEMV variants beside the table's pick (no main tables, no config sweep)")
    ap.add_argument("--gemv-batches", default="1,2,4,8")
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="--gemv-sweep: compile its kernels first in this many processes (0: as they come)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=2880, help=argparse.SUPPRESS)  # cpu smoke runs only
    ap.add_argument("--experts-override", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    t_start = time.time()
    torch.manual_seed(int(time.time()))  # fresh random inputs every run
    ceil = ceilings()
    bw = ceil["copy_bandwidth_Bps"]
    print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in ceil.items()}, flush=True)
    models = args.models.split(",")
    seed = int(time.time() * 1000) % (1 << 31)
    layers = {m: make_layer(args.experts_override or MODELS[m], args.hidden, args.hidden, seed=seed + i)
              for i, m in enumerate(models)}
    rows = {"decode": [], "prefill": [], "kernel_us": {}, "sweep": [], "gemv": []}
    errors = []

    def save():  # after every section: a run cut short by a timeout still leaves its numbers
        meta = run_meta("python -m benchmarks.bench_moe " + " ".join(sys.argv[1:]), {
            "ceilings": ceil, "elapsed_s": round(time.time() - t_start, 1), "errors": errors, "device": DEVICE,
            "table": {str(b): c.short() for b, c in moe_kernels.H200_HIDDEN_2880_CONFIGS},
            "many_pairs_rows": {f"{lo}..{hi}": c.short() for lo, hi, c in moe_kernels.H200_MANY_PAIRS_CONFIGS}})
        write_results(args.out, args.stem, meta, rows, markdown(meta, rows, ceil))
        return meta

    def attempt(fn):
        try:
            fn()
        except Exception:
            errors.append(traceback.format_exc())
            print(errors[-1], flush=True)

    if args.gemv_sweep:
        batches = [int(b) for b in args.gemv_batches.split(",")]
        if args.compile_workers > 0 and DEVICE == "cuda":
            try:
                ceil["precompile_s"] = precompile_gemv(models, batches, args.compile_workers)
            except Exception:  # the sweep then compiles as it goes
                errors.append(traceback.format_exc())
            print({"precompile_s": ceil.get("precompile_s")}, flush=True)
        attempt(lambda: gemv_sweep(layers, bw, rows["gemv"], rows["kernel_us"], save, batches,
                                   t_start + args.budget_s))
        meta = save()
        print(markdown(meta, rows, ceil))
        return

    for model in models if not args.sweep_only else []:
        for batch in [int(b) for b in args.batches.split(",")]:
            attempt(lambda: rows["decode"].append(bench_decode(model, layers[model], batch, bw, check=True)))
            print(rows["decode"][-1:], flush=True)
        attempt(lambda: rows["prefill"].append(bench_prefill(model, layers[model], args.prefill_tokens, ceil)))
        print(rows["prefill"][-1:], flush=True)
        for name in ("w1_bf16", "w2_bf16"):  # the peers' copies: free them before the next model
            layers[model].pop(name, None)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        save()

    def profile_kernels():
        # every model at batch 1 and at the decode front's bound (router in Triton up to there);
        # the first model also above it and in prefill
        bound = moe_kernels.DECODE_FRONT_MAX_TOKENS
        for i, model in enumerate(models):
            shapes = [("decode_1", 1), (f"decode_{bound}", bound)]
            if i == 0:
                shapes += [("decode_128", 128), ("prefill", args.prefill_tokens)]
            for label, tokens in shapes:
                x = torch.randn(tokens, args.hidden, device=DEVICE).to(torch.bfloat16)
                times = kernel_times(lambda: moe_kernels.fused_moe_fp8(x, *layer_args(layers[model]), top_k=TOP_K,
                                                                       limit=LIMIT))
                if times:
                    rows["kernel_us"][f"{model}_{label}"] = times

    if not args.sweep_only:
        attempt(profile_kernels)
        save()
    if not args.no_sweep:
        attempt(lambda: run_sweep(layers, bw, ceil, t_start + args.budget_s, rows["sweep"], save,
                                  [int(b) for b in args.sweep_batches.split(",")], args.prefill_tokens,
                                  tuple(args.sweep_kinds.split(",")), args.decode_candidates))
    meta = save()
    print(markdown(meta, rows, ceil))


def markdown(meta, rows, ceil) -> str:
    fp8 = ceil.get("fp8_matmul_flops")
    lines = [
        "# Fused FP8 MoE on one H200 (gpt-oss: hidden 2880, intermediate 2880, top-4, random weights)", "",
        f"{meta.get('gpu', meta['device'])}, torch {meta['torch']}, triton {meta.get('triton')}, {meta['date']}, "
        f"{meta['elapsed_s']} s. Measured now: copy bandwidth {ceil['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s"
        + (f", FP8 matmul {fp8 / 1e12:.0f} TFLOP/s" if fp8 else "")
        + (f"; kernels precompiled in {ceil['precompile_s']:.0f} s" if ceil.get("precompile_s") else "") + ".", "",
    ]
    if rows["decode"]:
        lines += ["## Decode (CUDA-graph replays over distinct token batches; bytes = experts touched)", "",
                  md_table(rows["decode"], [
                      ("model", "model", None), ("batch", "batch", None), ("us", "time_us", "{:.1f}"),
                      ("experts touched", "experts_touched", "{:.1f}"), ("MB", "MB_per_call", "{:.0f}"),
                      ("floor us", "floor_us", "{:.1f}"), ("TB/s", "achieved_TBps", "{:.2f}"),
                      ("% of copy", "pct_of_copy_bw", "{:.0f}"), ("max rel err vs ref", "max_rel_err_vs_ref", "{:.1e}")]),
                  ""]
    if rows["prefill"]:
        lines += ["## Prefill (whole layer vs bf16 torch._grouped_mm on the same routing)", "",
                  md_table(rows["prefill"], [
                      ("model", "model", None), ("tokens", "tokens", None), ("ms", "time_ms", "{:.2f}"),
                      ("TFLOP/s", "TFLOPs", "{:.0f}"), ("% of FP8 matmul", "pct_of_fp8_matmul", "{:.0f}"),
                      ("x vs grouped_mm pipeline", "speedup_vs_grouped_mm_pipeline", "{:.2f}"),
                      ("x vs its 2 GEMMs only", "speedup_vs_grouped_mm_gemms", "{:.2f}"),
                      ("max rel err vs ref", "max_rel_err_vs_ref", "{:.1e}")]),
                  ""]
    peer_lines = []
    for r in rows["decode"] + rows["prefill"]:
        for name, p in (r.get("peers") or {}).items():
            what = p.get("error") or f"{p['time_us']:.1f} us ({p['ours_speedup']:.2f}x ours)"
            peer_lines.append(f"- {r['model']} {r.get('batch', r.get('tokens'))}: {name}: {what}")
    if peer_lines:
        lines += ["## Peers", ""] + peer_lines + [""]
    if rows["kernel_us"]:
        lines += ["## Device time per launch (us, profiler)", ""]
        for label, times in rows["kernel_us"].items():
            lines.append(f"- {label}: " + ", ".join(f"{k} {v}" for k, v in list(times.items())[:8]))
        lines.append("")
    if rows.get("gemv"):
        lines += ["## Decode GEMV variants: fastest bit-reproducible per shape vs the table's pick", "", md_table(
            gemv_winners(rows["gemv"]), [
                ("model", "model", None), ("batch", "tokens", None), ("table us", "table_us", "{:.1f}"),
                ("table % copy", "table_pct", "{:.0f}"), ("best us", "best_us", "{:.1f}"),
                ("best % copy", "best_pct", "{:.0f}"), ("x vs table", "x_vs_table", "{:.2f}"),
                ("config", "best_config", None)]), ""]
        lines += ["## Decode GEMV variants (same token batches per model and batch; x vs table > 1: faster; "
                  "error on the kernel's own routing)", "", md_table(rows["gemv"], [
                      ("model", "model", None), ("batch", "tokens", None), ("config", "config", None),
                      ("table", "is_table", None), ("us", "time_us", "{:.1f}"), ("% copy", "pct_of_copy_bw", "{:.0f}"),
                      ("x vs table", "x_vs_table", "{:.2f}"), ("max rel err", "max_rel_err_vs_ref", "{:.1e}"),
                      ("rel fro", "rel_fro_vs_ref", "{:.1e}"), ("bit-repro", "bit_reproducible", None),
                      ("error", "error", None)]), ""]
    if rows["sweep"]:
        lines += ["## Sweep: fastest bit-reproducible config per shape vs the table's", "", md_table(
            sweep_winners(rows["sweep"]), [
                ("kind", "kind", None), ("model", "model", None), ("tokens", "tokens", None),
                ("table us", "table_us", "{:.1f}"), ("best us", "best_us", "{:.1f}"), ("x", "speedup", "{:.2f}"),
                ("% copy", "best_pct_copy", "{:.0f}"), ("TFLOP/s", "best_TFLOPs", "{:.0f}"),
                ("config", "best_config", None)]), ""]
        lines += ["## Launch-configuration sweep (table = the config `select_config` picks now)", "",
                  md_table(rows["sweep"], [
                      ("kind", "kind", None), ("model", "model", None), ("tokens", "tokens", None),
                      ("config", "config", None), ("table", "is_table", None), ("us", "time_us", "{:.1f}"),
                      ("% copy", "pct_of_copy_bw", "{:.0f}"), ("TFLOP/s", "TFLOPs", "{:.0f}"),
                      ("rel err", "max_rel_err_vs_ref", "{:.1e}"), ("bit-repro", "bit_reproducible", None),
                      ("error", "error", None)]), ""]
    if meta["errors"]:
        lines += ["## Errors", ""] + ["```\n" + e[-1500:] + "\n```" for e in meta["errors"]] + [""]
    lines.append(f"Command: `{meta['command']}`")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
