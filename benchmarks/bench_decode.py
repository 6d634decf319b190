"""Decode speed and cost of gpt-oss-120b/20b by TP/EP/DP configuration, probe off and on.

Runs the model-step harness (model_step.py: the project's own layers and Triton kernels,
random FP8 weights, paged KV) at full size. Each row: one decode step for `batch` users
at `context` tokens, timed as the median replay of a CUDA graph of the whole step
(embedding .. LM head, NCCL collectives inside the graph), then tok/s per user
(1 / step), tok/s per GPU, $ per million output tokens at $3.00 per H200-hour, and the
achieved bandwidth on the bytes the step must read (weights touched + KV) against the
copy bandwidth measured in the same run. The probe (SingProbe, window 2048; the serving
runtime's own code, its decode step on a side stream from the last tap) runs in the same
step for the "probe on" time; its overhead is the median of paired differences between the
probe-off and probe-on graphs replayed alternately, over the probe-off step.

Configurations that need more GPUs than this run has are *modelled*: one process builds
rank 0's shard (its heads, experts, intermediate slice), times its step without
collectives, and adds the collectives' time from perf_model.py (calibrated on measured
NCCL times of 2 GPUs when benchmarks/results/nccl_collectives.json exists). Rows say
"measured" or "modelled". A batch whose KV does not fit next to the weights is reported
as such, with the bytes, never dropped.

    python -m benchmarks.bench_decode --models 120b,20b --out benchmarks/results          # 1 GPU
    python -m benchmarks.bench_decode --nproc 2 --configs 2:1:1,2:2:1,2:2:2 --stem bench_decode_x2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a file (benchmarks/served/run_full_size.sh does): the checkout root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_common as bc  # noqa: E402
from benchmarks import perf_model  # noqa: E402
from benchmarks.model_step import MODELS, HarnessProbe, ModelStep, layout_label, parallel_layout, decode_step_bytes  # noqa: E402

MEMORY_MARGIN = 6 << 30  # activations, graphs, allocator slack


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        tp, ep, dp = (int(v) for v in item.split(":"))
        out.append((tp, ep, dp))
    return out


def time_decode(model: ModelStep, context: int, probe: bool, eager: bool) -> float:
    inputs = model.decode_inputs(context)
    model.probe = HarnessProbe(model) if probe else None
    try:
        if eager:
            return bc.event_time(lambda: model.forward(**inputs), device="cpu")
        graph = bc.capture_graph(lambda: model.forward(**inputs))
        return bc.graph_time(graph)
    finally:
        model.probe = None


def capture_probe_pair(model: ModelStep, inputs: dict):
    """(graph without the probe, graph with it, the probe): the step captured twice from the same inputs.
    The caller keeps the probe while it replays the second graph (it uses the probe's buffers)."""
    model.probe = None
    graph_off = bc.capture_graph(lambda: model.forward(**inputs))
    model.probe = HarnessProbe(model)
    try:
        graph_on = bc.capture_graph(lambda: model.forward(**inputs))
    finally:
        probe, model.probe = model.probe, None
    return graph_off, graph_on, probe


def time_decode_probe_pair(model: ModelStep, context: int, rounds: int = 40, reps: int = 3,
                           spread: dict | None = None):
    """(off seconds, on seconds, overhead seconds): the step captured without and with the probe,
    replayed alternately (`reps` replays each per round), so clock and thermal drift hit both
    alike; the overhead is the median of the per-round differences (a 0.25 % target is below
    the ~1 % spread of two separately timed captures). `spread`, if given, receives the
    differences' quartiles and their count: a median near the target says little without them."""
    graph_off, graph_on, probe = capture_probe_pair(model, model.decode_inputs(context))
    offs, ons = [], []
    for graph in (graph_off, graph_on, graph_off, graph_on):
        graph.replay()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for graph, times in ((graph_off, offs), (graph_on, ons)):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
    del probe
    diffs = [b - a for a, b in zip(offs, ons)]
    if spread is not None:
        q1, _, q3 = statistics.quantiles(diffs, n=4)
        spread.update({"q1_s": q1, "q3_s": q3, "rounds": len(diffs)})
    return statistics.median(offs), statistics.median(ons), statistics.median(diffs)


def run(rank: int, world: int, args):
    cuda, device, group = bc.start_rank(rank, world, args.cpu, args.port)
    ceilings = bc.measure_ceilings() if cuda else {"copy_bandwidth_Bps": float("nan")}
    comm = perf_model.CollectiveModel.load(args.nccl)
    rows = []
    for model_name in args.models.split(","):
        dims = MODELS[model_name]
        if args.layers:
            dims = type(dims)(**{**dims.__dict__, "num_layers": args.layers})
        for tp, ep, dp in parse_configs(args.configs):
            emulate = tp != world
            probe_here = args.probe_configs == "all" or (
                args.probe_configs != "none" and (tp, ep, dp) in parse_configs(args.probe_configs))
            layout = parallel_layout(tp=tp, ep=ep, dp=dp, rank=rank if not emulate else 0)
            base = {"model": dims.name, "config": layout_label(layout) + (" FP8 LM head" if args.fp8_lm_head else ""),
                    "gpus": tp, "kind": "modelled" if emulate else "measured",
                    "lm_head": "fp8" if args.fp8_lm_head else "bf16"}
            need_w = ModelStep.bytes_needed(dims, layout, 1, 1)["weights"]
            free = torch.cuda.mem_get_info()[0] if cuda else 1 << 40
            if need_w + MEMORY_MARGIN > free:
                rows.append({**base, "does_not_fit": f"weights {need_w / 1e9:.1f} GB per GPU > free "
                                                     f"{free / 1e9:.1f} GB"})
                continue
            try:
                model = ModelStep(dims, layout, batch=1, context=args.context_probe_min, device=device,
                                  group=group, emulate=emulate, dtype=torch.bfloat16 if cuda else torch.float32,
                                  fp8_lm_head=args.fp8_lm_head)
            except Exception as exc:
                rows.append({**base, "error": repr(exc)[:300]})
                continue
            for context in [int(c) for c in args.contexts.split(",")]:
                for batch in [int(b) for b in args.batches.split(",")]:
                    row = {**base, "batch": batch, "context": context}
                    if dp > 1 and batch < dp:
                        rows.append({**row, "skipped": f"batch {batch} < dp {dp}"})
                        continue
                    kv = ModelStep.bytes_needed(dims, layout, batch, context)["kv"]
                    probe_kv = batch * context * 128 * 2 if args.probe and probe_here else 0
                    free = torch.cuda.mem_get_info()[0] if cuda else 1 << 40
                    if cuda:
                        free += sum(t.numel() * t.element_size() for pair in model.kv_full + model.kv_swa
                                    if pair is not None for t in pair)
                    if kv + probe_kv + MEMORY_MARGIN > free:
                        rows.append({**row, "does_not_fit": f"KV {kv / 1e9:.1f} GB (+ probe {probe_kv / 1e9:.1f}) "
                                                            f"per GPU > {free / 1e9:.1f} GB free next to the weights"})
                        continue
                    try:
                        model.allocate_cache(batch, context)
                        overhead_s = None
                        spread: dict = {}
                        if args.probe and probe_here and cuda:
                            t_off, t_on, overhead_s = time_decode_probe_pair(model, context, rounds=args.probe_rounds,
                                                                             spread=spread)
                        else:
                            t_off = time_decode(model, context, probe=False, eager=not cuda)
                            t_on = (time_decode(model, context, probe=True, eager=not cuda)
                                    if args.probe and probe_here else None)
                    except Exception as exc:
                        traceback.print_exc()
                        rows.append({**row, "error": repr(exc)[:300]})
                        continue
                    comm_s = comm.decode_step_seconds(dims, layout, batch) if emulate else 0.0
                    step = t_off + comm_s
                    bytes_floor = decode_step_bytes(dims, layout, batch, context, args.fp8_lm_head)
                    total_tps = batch / step
                    row.update({
                        "step_ms": step * 1e3,
                        "compute_ms": t_off * 1e3,
                        "modelled_collectives_ms": comm_s * 1e3 if emulate else None,
                        "tok_s_per_user": 1 / step,
                        "tok_s_total": total_tps,
                        "tok_s_per_gpu": total_tps / tp,
                        "dollars_per_M_output": bc.dollars_per_million_output(total_tps, tp),
                        "bytes_per_gpu_step": bytes_floor,
                        "achieved_TBps": bytes_floor / t_off / 1e12,
                        "pct_copy_bw": 100 * bytes_floor / t_off / ceilings["copy_bandwidth_Bps"],
                    })
                    if t_on is not None:
                        row["probe_on_step_ms"] = (t_on + comm_s) * 1e3
                        row["probe_overhead_pct"] = 100 * (overhead_s if overhead_s is not None else t_on - t_off) / step
                        if spread:
                            row["probe_overhead_iqr_pct"] = [100 * spread["q1_s"] / step, 100 * spread["q3_s"] / step]
                            row["probe_rounds"] = spread["rounds"]
                    rows.append(row)
                    if rank == 0:
                        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            if args.profile and rank == 0 and cuda and not emulate:
                profile_rows = perf_model.kernel_breakdown(model, min(int(args.contexts.split(",")[0]), model.context))
                rows.append({**base, "profile_batch": model.batch, "kernel_breakdown": profile_rows})
            del model
            if cuda:
                torch.cuda.empty_cache()
            if rank == 0:
                _write(args, rows, ceilings, world, comm)
    if rank == 0:
        _write(args, rows, ceilings, world, comm)
    if world > 1:
        dist.destroy_process_group()


def _write(args, rows, ceilings, world, comm):
    meta = bc.run_meta(" ".join(["python", "-m", "benchmarks.bench_decode"] + sys.argv[1:]),
                       {"ceilings": ceilings, "world": world, "collective_model": comm.describe()})
    bc.write_results(args.out, args.stem, meta, rows, markdown(meta, rows))


def markdown(meta: dict, rows: list) -> str:
    c = meta["ceilings"]
    lines = [f"# Decode: gpt-oss by TP/EP/DP configuration ({meta.get('gpu', 'cpu')})", "",
             f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}, triton {meta.get('triton')}.",
             f"Copy bandwidth measured in this run: {c.get('copy_bandwidth_Bps', float('nan')) / 1e12:.2f} TB/s. "
             f"Cost at ${meta['dollars_per_gpu_hour']:.2f} per GPU-hour. Step = median CUDA-graph replay of one "
             "whole decode step; 'modelled' rows time rank 0's shard and add modelled collectives "
             f"({meta['collective_model']}).", ""]
    cols = [("model", "model", None), ("config", "config", None), ("kind", "kind", None),
            ("context", "context", None), ("batch", "batch", None), ("step ms", "step_ms", "{:.3f}"),
            ("tok/s/user", "tok_s_per_user", "{:.1f}"), ("tok/s/GPU", "tok_s_per_gpu", "{:.0f}"),
            ("$/M out", "dollars_per_M_output", "{:.3f}"), ("GB read/GPU", "bytes_per_gpu_step", None),
            ("% copy BW", "pct_copy_bw", "{:.0f}"), ("probe on ms", "probe_on_step_ms", "{:.3f}"),
            ("probe %", "probe_overhead_pct", "{:.2f}"), ("probe % IQR", "probe_iqr", None)]
    timed = [dict(r, bytes_per_gpu_step=f"{r['bytes_per_gpu_step'] / 1e9:.2f}",
                  probe_iqr=("{:.2f}..{:.2f}".format(*r["probe_overhead_iqr_pct"]) if "probe_overhead_iqr_pct" in r
                             else None))
             for r in rows if "step_ms" in r]
    lines.append(bc.md_table(timed, cols))
    other = [r for r in rows if "step_ms" not in r and "kernel_breakdown" not in r]
    if other:
        lines += ["", "Not timed:", ""]
        for r in other:
            why = r.get("does_not_fit") or r.get("skipped") or r.get("error")
            lines.append(f"- {r['model']} {r['config']} batch {r.get('batch', '—')} context {r.get('context', '—')}: {why}")
    for r in rows:
        if "kernel_breakdown" in r:
            lines += ["", f"Kernel breakdown, {r['model']} {r['config']} batch {r['profile_batch']} (profiler, "
                          "one eager step):", "", bc.md_table(r["kernel_breakdown"],
                                                                [("kernel", "name", None), ("calls", "calls", None),
                                                                 ("total us", "us", "{:.1f}"), ("share %", "pct", "{:.1f}")])]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--configs", default="1:1:1", help="tp:ep:dp,...; tp != --nproc rows are modelled")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--no-probe", dest="probe", action="store_false")
    ap.add_argument("--probe-configs", default="all",
                    help="tp:ep:dp,... whose rows also time the probe (all | none | a list)")
    ap.add_argument("--profile", action="store_true", help="per-kernel breakdown of one step (rank 0)")
    ap.add_argument("--layers", type=int, default=0, help="override the layer count (smoke tests)")
    ap.add_argument("--nccl", default=os.path.join(os.path.dirname(__file__), "results", "nccl_collectives.json"))
    ap.add_argument("--cpu", action="store_true", help="tiny smoke run on CPU (torch path, eager)")
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--stem", default="bench_decode")
    ap.add_argument("--fp8-lm-head", action="store_true", help="the LM head in e4m3 blocks (a server's opt-in "
                    "SGLANG_EXT_FP8_LM_HEAD=1); rows labelled 'FP8 LM head'")
    ap.add_argument("--context-probe-min", type=int, default=256)
    ap.add_argument("--probe-rounds", type=int, default=40,
                    help="paired probe-off/on rounds per row (the overhead is their median difference)")
    args = ap.parse_args()
    bc.launch(run, args)


if __name__ == "__main__":
    main()
