"""Is a short prefill bound by the host? Host enqueue time vs device time of one model-step prefill.

Why: the prefill grid's 1024-token rows move by ~2x between runs of the same kernels (120b TP1
38.2 vs 68.1 ms; 20b 58.5 ms at 1024 tokens against 54.6 at 4096). A prefill is ~650 eager
launches; if Python takes longer to issue them than the GPU takes to run them, the latency is the
host's, and it varies with the host. Per model and length, after warm-up calls:
  - enqueue ms: wall time of `forward()` returning (no synchronise): the host's share;
  - call ms: wall time of `forward()` + synchronise;
  - CUDA-event ms: as bench_prefill times it;
  - kernel ms: the sum of the profiler's device kernel times (the GPU's busy time);
  - the host's top functions by own time (cProfile, one call).

    python benchmarks/diag_prefill_host.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

bc.import_project()
from model_step import MODELS, ModelStep, Sharding  # noqa: E402


# CUDA runtime / driver calls that can hold the host: a synchronisation or a copy to the host in the middle of a
# forward stops its enqueueing until the GPU has caught up (the overlap of host and device is lost)
HOST_BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc", "cudaFree",
                 "cudaMemcpy", "cudaMemcpyAsync", "cudaHostAlloc", "cudaStreamIsCapturing")


def kernel_ms(fn) -> tuple[float, str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    blocking = ", ".join(f"{e.key} {e.count} / {e.cpu_time_total / 1e3:.1f} ms" for e in events
                         if e.key.startswith(HOST_BLOCKING))
    return sum(e.device_time_total for e in events) / 1e3, blocking or "none"


def measure(model, length: int, iters: int) -> dict:
    inputs = model.prefill_inputs(length)
    call = lambda: model.forward(**inputs)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    wall = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
    row = {"length": length, "enqueue_ms": bc.enqueue_time(call, iters) * 1e3, "call_ms": statistics.median(wall),
           "event_ms": bc.event_time(call, iters=iters, warmup=1) * 1e3,
           "graph_ms": bc.graph_time_calls([call], iters=iters) * 1e3}
    row["kernel_ms"], row["host_blocking"] = kernel_ms(call)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    call()
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(35)
        row[f"host_profile_{key}"] = text.getvalue()[:9000]
    print({k: v for k, v in row.items() if not k.startswith("host_profile")}, flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default="20b,120b")
    ap.add_argument("--lengths", default="1024,8192")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--moe-row", default=None, help="the MoE prefill row by diag_moe_prefill.CANDIDATES name")
    ap.add_argument("--stem", default="diag_prefill_host")
    args = ap.parse_args()
    if args.moe_row:  # the MoE prefill row by its diag_moe_prefill.CANDIDATES name
        import diag_moe_prefill

        diag_moe_prefill.use_prefill_row(args.moe_row)
    rows = []
    for name in args.models.split(","):
        dims = MODELS[name]
        lengths = [int(n) for n in args.lengths.split(",")]
        model = ModelStep(dims, Sharding(tp=1, ep=1, dp=1, rank=0), batch=1, context=max(lengths),
                          swa_slots=max(lengths), device="cuda")
        for length in lengths:
            rows.append({"model": dims.name, "moe_row": args.moe_row or "table", **measure(model, length, args.iters)})
        del model
        torch.cuda.empty_cache()
    meta = bc.run_meta("python benchmarks/diag_prefill_host.py " + " ".join(sys.argv[1:]))
    lines = ["# Prefill: host enqueue time vs device time (TP1, batch 1)", "",
             f"`{meta['command']}` — {meta['date']}, {meta.get('gpu', '')}, torch {meta['torch']}, "
             f"triton {meta.get('triton', '')}", "",
             "enqueue: `forward()` returning, no synchronise (the host's share); call: with synchronise; "
             "event: CUDA events as bench_prefill; graph: the call as one CUDA graph; kernels: the profiler's summed "
             "device kernel time; host-blocking: runtime calls that can stop the enqueueing (count / host time).", "",
             bc.md_table(rows, [("model", "model", None), ("MoE row", "moe_row", None), ("tokens", "length", None),
                                ("enqueue ms", "enqueue_ms", "{:.1f}"), ("call ms", "call_ms", "{:.1f}"),
                                ("event ms", "event_ms", "{:.1f}"), ("graph ms", "graph_ms", "{:.1f}"),
                                ("kernels ms", "kernel_ms", "{:.1f}"), ("host-blocking", "host_blocking", None)]), ""]
    for r in rows:
        for key, what in (("tottime", "own time"), ("cumulative", "cumulative")):
            lines += [f"## Host profile, {r['model']} {r['length']} tokens ({what})", "", "```",
                      r[f"host_profile_{key}"].strip(), "```", ""]
    md = "\n".join(lines) + "\n"
    if args.out:
        bc.write_results(args.out, args.stem, meta, rows, md)
    print(md)


if __name__ == "__main__":
    main()
