"""Where a batch-1 decode step's time goes on one GPU: launch floor, fixed cost per GEMV, and the
per-kernel device time of the whole gpt-oss step replayed as a CUDA graph.

    python -m benchmarks.diagnostics.diag_decode_b1                  # all parts, into benchmarks/results
    python -m benchmarks.diagnostics.diag_decode_b1 --ncu-kernels    # for `ncu`: one launch each

Parts (JSON + Markdown `diag_decode_b1.*`):
  floor   an empty Triton kernel and a 2880-element torch add, 200 back to back in one graph:
          the per-launch cost every extra kernel in the step pays;
  fork    a side-stream fork/join inside a graph (how the probe's step runs), empty and with one
          kernel, against the same chain without it: the branch's structural cost;
  gemv    `fp8_linear` at M = 1, K = 2880 over N = 256 .. 11520 (weight copies rotated past L2):
          a straight-line fit time = fixed + bytes / rate splits each call into a fixed part and
          a streaming part;
  step    gpt-oss-120b and -20b decode, batch 1, context 8192 (the model-step harness): the graph's
          median replay and the profiler's per-kernel device times inside that replay, summed by
          kernel name and by layer part; the sum against the replay time is the launch gaps; and the
          probe's overhead (paired graphs) with its side stream started after the deepest tap
          ("tap") or after the last layer, beside the LM head ("head").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from benchmarks import bench_common as bc


@triton.jit
def _empty_kernel(X):
    pid = tl.program_id(0)
    if pid < 0:  # never: keeps X an argument without touching memory
        tl.store(X, 0.0)


def _per_call_graph(fn, n: int = 200) -> float:
    graph = bc.capture_graph(lambda: [fn() for _ in range(n)])
    return statistics.median(bc.graph_time(graph) for _ in range(3)) / n


def part_floor() -> list[dict]:
    x = torch.randn(2880, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rows = [
        {"what": "empty Triton kernel (1 program)", "us": _per_call_graph(lambda: _empty_kernel[(1,)](x)) * 1e6},
        {"what": "empty Triton kernel (132 programs)", "us": _per_call_graph(lambda: _empty_kernel[(132,)](x)) * 1e6},
        {"what": "torch add, 2880 bf16", "us": _per_call_graph(lambda: torch.add(x, x, out=y)) * 1e6},
    ]
    return rows


def part_fork_join() -> list[dict]:
    """What a side-stream branch (the probe's) costs a graph by its structure alone: a chain of
    600 small kernels captured plain, with an empty fork/join at launch 500, and with one small
    kernel on the side branch; the paired median difference, as bench_decode times the probe."""
    x = torch.randn(2880, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    side = torch.cuda.Stream()

    def chain(fork: bool, side_work: bool):
        for i in range(600):
            if fork and i == 500:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    if side_work:
                        _empty_kernel[(132,)](x)
            torch.add(x, x, out=y)
        if fork:
            torch.cuda.current_stream().wait_stream(side)

    graphs = {name: bc.capture_graph(lambda f=f, w=w: chain(f, w))
              for name, f, w in (("plain", False, False), ("fork", True, False), ("fork+kernel", True, True))}
    times = {name: [] for name in graphs}
    for _ in range(30):
        for name, g in graphs.items():
            times[name].append(bc.graph_time(g, iters=3))
    base = times["plain"]
    rows = []
    for name, ts in times.items():
        diff = statistics.median(b - a for a, b in zip(base, ts))
        rows.append({"what": name, "step_us": statistics.median(ts) * 1e6, "vs_plain_us": diff * 1e6})
    return rows


def part_gemv() -> list[dict]:
    from sglang_ext.kernels.fp8_gemm import fp8_linear, gemv_config

    k = 2880
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    rows = []
    for n in (256, 1024, 2048, 5120, 11520):
        copies = max(2, (400 << 20) // (n * k))
        ws = [(torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn) for _ in range(copies)]
        ss = [torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device="cuda") * 1e-2 + 1e-3
              for _ in range(copies)]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        calls = [lambda w=w, s=s: fp8_linear(x, w, s, bias, out=y) for w, s in zip(ws, ss)]
        t = bc.graph_time_calls(calls * max(1, 200 // len(calls)))
        rows.append({"n": n, "k": k, "weight_MB": n * k / 1e6, "us": t * 1e6,
                     "config": gemv_config(1, n, k, "cuda").short(), "TBps": n * k / t / 1e12})
        del ws, ss
    # time = fixed + bytes / rate, least squares
    xs = [r["weight_MB"] for r in rows]
    ys = [r["us"] for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
    fixed = my - slope * mx
    for r in rows:
        r["fit_fixed_us"] = fixed
        r["fit_stream_TBps"] = 1e6 / slope / 1e12 * 1e6 if slope > 0 else None
    return rows


LAYER_PARTS = [
    ("_residual_rms_norm", "residual add + RMSNorm"), ("_rope_kv", "RoPE + KV write"),
    ("_fp8_gemv", "qkv/o GEMV"), ("_fp8_gemm_kernel", "qkv/o GEMM"),
    ("_sink_decode", "attention"), ("_mlp1", "MoE mlp1"), ("_mlp2", "MoE mlp2"), ("_quantize_h", "MoE h quantisation"),
    ("_front", "MoE routing"), ("_combine", "MoE combine"), ("splitK", "MoE router GEMM"),
    ("nvjet", "router/LM head GEMM"), ("rsqrt", "RMSNorm"), ("cat_mul_slice", "RoPE"),
    ("index", "KV write / gather"), ("add", "residual add"), ("copy", "copies"),
]


def _part(name: str) -> str:
    for key, part in LAYER_PARTS:
        if key in name:
            return part
    return "other"


def _parts(kernels: list[dict]) -> dict[str, float]:
    """us per step by layer part (`LAYER_PARTS`), largest first; labels each kernel row too."""
    parts: dict[str, float] = {}
    for r in kernels:
        r["part"] = _part(r["name"])
        parts[r["part"]] = parts.get(r["part"], 0.0) + r["us_per_step"]
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


def part_step(model_name: str, context: int = 8192) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.model_step import MODELS, ModelStep, parallel_layout

    model = ModelStep(MODELS[model_name], parallel_layout(1, 1, 1, 0), batch=1, context=context)
    inputs = model.decode_inputs(context)
    graph = bc.capture_graph(lambda: model.forward(**inputs))
    step = statistics.median(bc.graph_time(graph, iters=50) for _ in range(3))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    by_name: dict[str, list] = {}
    for evt in prof.events():
        us = getattr(evt, "device_time", None) or getattr(evt, "cuda_time", 0)
        if us <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        key = evt.name[:90]
        by_name.setdefault(key, []).append(us)
    kernels = []
    for name, times in by_name.items():
        kernels.append({"name": name, "calls_per_step": len(times) / 5, "us_per_step": sum(times) / 5,
                        "us_per_call": statistics.median(times)})
    kernels.sort(key=lambda r: -r["us_per_step"])
    kernel_sum = sum(r["us_per_step"] for r in kernels)
    graph = None
    # The probe's side-stream launch point, paired probe-off/on graphs as bench_decode times it.
    from benchmarks.bench_decode import time_decode_probe_pair

    probe = {}
    for point in ("tap", "head"):
        for priority in ("high", "normal"):
            os.environ["SGLANG_EXT_PROBE_LAUNCH"] = point
            os.environ["SGLANG_EXT_PROBE_PRIORITY"] = priority
            spread: dict = {}
            off, on, diff = time_decode_probe_pair(model, context, rounds=100, spread=spread)
            probe[f"{point}, {priority} priority"] = {
                "off_us": off * 1e6, "on_us": on * 1e6, "overhead_us": diff * 1e6, "overhead_pct": 100 * diff / off,
                "iqr_us": [spread["q1_s"] * 1e6, spread["q3_s"] * 1e6]}
    os.environ.pop("SGLANG_EXT_PROBE_LAUNCH", None)
    os.environ.pop("SGLANG_EXT_PROBE_PRIORITY", None)
    model = None
    torch.cuda.empty_cache()
    return {"model": model_name, "context": context, "batch": 1, "step_us": step * 1e6, "probe": probe,
            "kernel_sum_us": kernel_sum, "launches_per_step": sum(r["calls_per_step"] for r in kernels),
            "kernels": kernels}


def ncu_kernels():
    """One launch each of the batch-1 kernels, after warm-up, between cudaProfilerStart/Stop."""
    from sglang_ext.kernels.fp8_gemm import fp8_linear
    from sglang_ext.kernels.moe import fused_moe_fp8
    from sglang_ext.layers.sink_attention import paged_sink_attention

    dev = "cuda"
    x = torch.randn(1, 2880, device=dev, dtype=torch.bfloat16)
    w = (torch.randn(5120, 2880, device=dev) * 0.05).to(torch.float8_e4m3fn)
    s = torch.rand(40, 23, device=dev) * 1e-2 + 1e-3
    b = torch.randn(5120, device=dev, dtype=torch.bfloat16)
    e, i = 128, 2880
    rw = (torch.randn(e, 2880, device=dev) * 0.02).to(torch.bfloat16)
    rb = torch.zeros(e, device=dev, dtype=torch.bfloat16)
    w1 = (torch.randn(e, 2 * i, 2880, device=dev, dtype=torch.bfloat16) * 0.05).to(torch.float8_e4m3fn)
    s1 = torch.rand(e, 45, 23, device=dev) * 1e-2 + 1e-3
    b1 = torch.zeros(e, 2 * i, device=dev, dtype=torch.bfloat16)
    w2 = (torch.randn(e, 2880, i, device=dev, dtype=torch.bfloat16) * 0.05).to(torch.float8_e4m3fn)
    s2 = torch.rand(e, 23, 23, device=dev) * 1e-2 + 1e-3
    b2 = torch.zeros(e, 2880, device=dev, dtype=torch.bfloat16)
    ctx = 8192
    kbuf = torch.randn(1 + ctx, 8, 64, device=dev, dtype=torch.bfloat16)
    vbuf = torch.randn_like(kbuf)
    r2t = (1 + torch.arange(ctx, device=dev, dtype=torch.int32))[None, :]
    q = torch.randn(1, 64, 64, device=dev, dtype=torch.bfloat16)
    sinks = torch.randn(64, device=dev)
    one = torch.ones(1, device=dev, dtype=torch.int32)
    zero = torch.zeros(1, device=dev, dtype=torch.int32)
    seq = torch.full((1,), ctx, device=dev, dtype=torch.int32)

    def run():
        fp8_linear(x, w, s, b)
        fused_moe_fp8(x, rw, rb, w1, s1, b1, w2, s2, b2)
        paged_sink_attention(q, kbuf, vbuf, r2t, zero, seq, zero, one, sinks, -1, 0.125)

    bc.profile_one_call(run, warmup=3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results"))
    ap.add_argument("--models", default="120b,20b")
    ap.add_argument("--ncu-kernels", action="store_true")
    ap.add_argument("--rebuild", action="store_true",
                    help="rewrite the Markdown (and the kernels' part labels) from --out's diag_decode_b1.json")
    args = ap.parse_args()
    if args.rebuild:
        with open(os.path.join(args.out, "diag_decode_b1.json")) as f:
            saved = json.load(f)
        for st in saved["rows"]["steps"]:
            st.pop("parts", None)  # derived: recomputed from the kernels in markdown()
        bc.write_results(args.out, "diag_decode_b1", saved["meta"], saved["rows"], markdown(saved["meta"], saved["rows"]))
        return
    bc.import_project()
    if args.ncu_kernels:
        ncu_kernels()
        return
    meta = bc.run_meta("python -m benchmarks.diagnostics.diag_decode_b1 " + " ".join(sys.argv[1:]),
                       {"ceilings": bc.measure_ceilings()})
    floor = part_floor()
    print(floor, flush=True)
    fork = part_fork_join()
    print(fork, flush=True)
    gemv = part_gemv()
    print(gemv, flush=True)
    steps = []
    for m in args.models.split(","):
        steps.append(part_step(m))
        print({k: v for k, v in steps[-1].items() if k != "kernels"}, flush=True)
    data = {"floor": floor, "fork_join": fork, "gemv": gemv, "steps": steps}
    bc.write_results(args.out, "diag_decode_b1", meta, data, markdown(meta, data))


def markdown(meta: dict, data: dict) -> str:
    floor, fork, gemv, steps = data["floor"], data["fork_join"], data["gemv"], data["steps"]
    lines = [f"# Batch-1 decode: where the time goes ({meta.get('gpu', 'GPU')})", "",
             f"`{meta['command']}` — {meta.get('date', '')}", "", "## Launch floor (200 launches in one graph)", "",
             bc.md_table(floor, [("what", "what", None), ("us per launch", "us", "{:.2f}")]), "",
             "## A side-stream branch in a graph (600 small kernels, fork at 500; paired medians)", "",
             bc.md_table(fork, [("graph", "what", None), ("us per replay", "step_us", "{:.1f}"),
                                ("vs plain, us", "vs_plain_us", "{:.2f}")]), "",
             "## FP8 GEMV at M = 1, K = 2880 (fit: time = fixed + bytes / rate)", "",
             bc.md_table(gemv, [("N", "n", None), ("weight MB", "weight_MB", "{:.1f}"), ("config", "config", None),
                                ("us", "us", "{:.2f}"), ("TB/s", "TBps", "{:.2f}")]), "",
             f"Fit: fixed {gemv[0]['fit_fixed_us']:.2f} us per call + streaming at "
             f"{gemv[0]['fit_stream_TBps'] or float('nan'):.2f} TB/s.", ""]
    for st in steps:
        lines += [f"## {st['model']} decode step, batch 1, context {st['context']} (graph replay)", "",
                  f"Step {st['step_us']:.1f} us; kernels {st['kernel_sum_us']:.1f} us summed over "
                  f"{st['launches_per_step']:.0f} launches; gaps {st['step_us'] - st['kernel_sum_us']:.1f} us. "
                  "Probe (window 2048) overhead by where its side stream starts and its priority, paired "
                  "graphs (median of the per-round differences, IQR in brackets): "
                  + "; ".join(f"{k}: {v['overhead_us']:.1f} us = {v['overhead_pct']:.2f} %"
                              + (" [{:.1f}..{:.1f} us]".format(*v["iqr_us"]) if "iqr_us" in v else "")
                              for k, v in st["probe"].items()), "",
                  bc.md_table([{"part": k, "us": v, "pct": 100 * v / st["step_us"]}
                               for k, v in _parts(st["kernels"]).items()],
                              [("part", "part", None), ("us per step", "us", "{:.1f}"), ("% of step", "pct", "{:.1f}")]),
                  "", bc.md_table(st["kernels"][:25], [("kernel", "name", None), ("calls", "calls_per_step", "{:.0f}"),
                                                       ("us per call", "us_per_call", "{:.2f}"),
                                                       ("us per step", "us_per_step", "{:.1f}"), ("part", "part", None)]),
                  ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
