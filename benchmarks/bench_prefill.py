"""Prefill latency and $ per million input tokens of gpt-oss by TP degree and input length.

Batch 1, DP 1 (SPEC §4). One forward of `length` new tokens through the model-step
harness (model_step.py: the project's own layers and Triton kernels, random FP8 weights,
paged KV), timed with CUDA events (median of a few runs after warm-up; a prefill is
long enough that launch overhead does not need a graph). FLOP rate against the FP8 and
bf16 matmul rates measured in the same run. TP degrees beyond this run's GPUs are
modelled as in bench_decode.py (rank 0's shard timed + modelled collectives).

    python -m benchmarks.bench_prefill --models 120b,20b --configs 1:1:1,2:1:1,4:1:1,8:1:1
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a file (benchmarks/served/run_full_size.sh does): the checkout root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_common as bc  # noqa: E402
from benchmarks import perf_model  # noqa: E402
from benchmarks.bench_decode import MEMORY_MARGIN, parse_configs  # noqa: E402
from benchmarks.model_step import MODELS, ModelStep, layout_label, parallel_layout, prefill_flops  # noqa: E402


def run(rank: int, world: int, args):
    cuda, device, group = bc.start_rank(rank, world, args.cpu, args.port)
    ceilings = bc.measure_ceilings() if cuda else {}
    comm = perf_model.CollectiveModel.load(args.nccl)
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    for model_name in args.models.split(","):
        dims = MODELS[model_name]
        if args.layers:
            dims = type(dims)(**{**dims.__dict__, "num_layers": args.layers})
        for tp, ep, dp in parse_configs(args.configs):
            emulate = tp != world
            layout = parallel_layout(tp=tp, ep=ep, dp=dp, rank=rank if not emulate else 0)
            base = {"model": dims.name, "config": layout_label(layout), "gpus": tp,
                    "kind": "modelled" if emulate else "measured"}
            need = ModelStep.bytes_needed(dims, layout, 1, max(lengths), swa_slots=max(lengths))
            free = torch.cuda.mem_get_info()[0] if cuda else 1 << 40
            if need["total"] + MEMORY_MARGIN > free:
                rows.append({**base, "does_not_fit": f"{need['total'] / 1e9:.1f} GB per GPU > free {free / 1e9:.1f} GB"})
                continue
            try:
                model = ModelStep(dims, layout, batch=1, context=max(lengths), swa_slots=max(lengths), device=device,
                                  group=group, emulate=emulate, dtype=torch.bfloat16 if cuda else torch.float32)
            except Exception as exc:
                rows.append({**base, "error": repr(exc)[:300]})
                continue
            for length in lengths:
                row = {**base, "length": length}
                inputs = model.prefill_inputs(length)
                try:
                    t = bc.event_time(lambda: model.forward(**inputs), iters=args.iters, warmup=args.warmup,
                                      device=device)
                except Exception as exc:
                    traceback.print_exc()
                    rows.append({**row, "error": repr(exc)[:300]})
                    continue
                comm_s = comm.prefill_seconds(dims, layout, length) if emulate else 0.0
                latency = t + comm_s
                flops = prefill_flops(dims, length) / tp
                row.update({
                    "latency_ms": latency * 1e3, "compute_ms": t * 1e3,
                    "modelled_collectives_ms": comm_s * 1e3 if emulate else None,
                    "tok_s": length / latency,
                    "dollars_per_M_input": bc.dollars_per_million_input(latency, length, tp),
                    "tflops_per_gpu": flops / t / 1e12,
                    "pct_fp8_peak": 100 * flops / t / ceilings["fp8_matmul_flops"] if "fp8_matmul_flops" in ceilings else None,
                })
                if args.graph and cuda and not emulate:
                    # the same forward captured whole: what launch gaps cost the eager call (SGLang's breakable
                    # prefill graphs capture all but attention)
                    try:
                        row["graph_ms"] = bc.graph_time_calls([lambda: model.forward(**inputs)], iters=args.iters) * 1e3
                    except Exception as exc:  # noqa: BLE001  (a capture failure is reported, the row stays)
                        row["graph_error"] = repr(exc)[:300]
                rows.append(row)
                if rank == 0:
                    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                if args.profile == length and rank == 0 and cuda and not emulate:
                    rows.append({**base, "profile_length": length,
                                 "kernel_breakdown": perf_model.kernel_breakdown(model, length, inputs=inputs)})
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
    meta = bc.run_meta(" ".join(["python", "-m", "benchmarks.bench_prefill"] + sys.argv[1:]),
                       {"ceilings": ceilings, "world": world, "collective_model": comm.describe()})
    bc.write_results(args.out, args.stem, meta, rows, markdown(meta, rows))


def markdown(meta: dict, rows: list) -> str:
    c = meta["ceilings"]
    rate = c.get("fp8_matmul_flops")
    lines = [f"# Prefill: gpt-oss, batch 1, DP 1, by TP degree and input length ({meta.get('gpu', 'cpu')})", "",
             f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}, triton {meta.get('triton')}.",
             (f"FP8 matmul rate measured in this run: {rate / 1e12:.0f} TFLOP/s; " if rate else "") +
             f"cost at ${meta['dollars_per_gpu_hour']:.2f} per GPU-hour; 'modelled' rows time rank 0's shard and add "
             f"modelled collectives ({meta['collective_model']}).", ""]
    cols = [("model", "model", None), ("config", "config", None), ("kind", "kind", None),
            ("input tokens", "length", None), ("latency ms", "latency_ms", "{:.1f}"), ("tok/s", "tok_s", "{:.0f}"),
            ("$/M input", "dollars_per_M_input", "{:.4f}"), ("TFLOP/s/GPU", "tflops_per_gpu", "{:.0f}"),
            ("% FP8 rate", "pct_fp8_peak", "{:.0f}")]
    timed = [r for r in rows if "latency_ms" in r]
    if any("graph_ms" in r or "graph_error" in r for r in timed):
        cols += [("one CUDA graph ms", "graph_ms", "{:.1f}"), ("graph error", "graph_error", None)]
    lines.append(bc.md_table(timed, cols))
    for r in rows:
        if "kernel_breakdown" in r:
            lines += ["", f"Kernel breakdown, {r['model']} {r['config']} prefill of {r['profile_length']} tokens "
                          "(profiler, one call):", "",
                      bc.md_table(r["kernel_breakdown"], [("kernel", "name", None), ("calls", "calls", None),
                                                          ("total us", "us", "{:.0f}"), ("share %", "pct", "{:.1f}")])]
    other = [r for r in rows if "latency_ms" not in r and "kernel_breakdown" not in r]
    if other:
        lines += ["", "Not timed:", ""]
        lines += [f"- {r['model']} {r['config']} length {r.get('length', '—')}: "
                  f"{r.get('does_not_fit') or r.get('error')}" for r in other]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--configs", default="1:1:1")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--iters", type=int, default=5)
    # 3 untimed calls (was 1) did not steady the short lengths: 120b TP1 1024 tokens read 38.2 ms
    # with 1 (final7b) and 68.1 with 3 (prefill7c), the same kernels; see the README on those rows
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per length before the timed ones")
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--nccl", default=os.path.join(os.path.dirname(__file__), "results", "nccl_collectives.json"))
    ap.add_argument("--graph", action="store_true", help="also time each measured prefill captured in one CUDA graph")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--port", type=int, default=29537)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--stem", default="bench_prefill")
    ap.add_argument("--profile", type=int, default=0, help="per-kernel breakdown at this input length (rank 0)")
    args = ap.parse_args()
    bc.launch(run, args)


if __name__ == "__main__":
    main()
