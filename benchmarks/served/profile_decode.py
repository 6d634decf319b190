"""Where a served decode step's time goes: one server, one batch-1 request, SGLang's own profiler.

The served batch-1 decode ran at 0.69 x the harness on the same card (served_gpu.md); the harness times the
forward alone in a CUDA graph, the server adds its scheduler, sampling, the probe's host work and whatever runs
outside the graph. This starts the real `launch_server` once and, for the same request:
  itl       the client's inter-token intervals of a streamed /generate (the step time a user sees)
  stacks    the server processes' Python stacks over a longer streamed request (benchmarks/served/stack_sampler,
            wall-clock weighted): which host code a decode step waits on, per process and thread
  profile   SGLang's /start_profile over a window of decode steps (torch profiler, CPU + GPU), read back as:
            GPU busy time per step (the union of kernel intervals), the idle gaps between kernels, the top
            kernels by time and how many ran outside a CUDA graph, and the top CPU ops of the scheduler
So a step's time splits into the graph's kernels, kernels launched around it and the GPU waiting on the host.

    eval "$(python3 benchmarks/served/gpu_env.py .carry)"; cd /tmp
    python3 $R/benchmarks/served/profile_decode.py --model-path M --context 8192 --out $OUT/profile -- <server args>

Runs on a CPU too (CPU activities only), which checks the driver before GPU time.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import requests

from sglang_ext.launch.server import SGLangServer


def stream_itl(url: str, ids: list, new_tokens: int) -> dict:
    """Inter-token intervals (ms) of one streamed greedy /generate, first token excluded."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    stamps = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for raw in r.iter_lines():
            if raw.startswith(b"data: ") and raw != b"data: [DONE]":
                stamps.append(time.perf_counter())
    gaps = [1e3 * (b - a) for a, b in zip(stamps[1:], stamps[2:])]
    if not gaps:
        return {"events": len(stamps)}
    return {"events": len(stamps), "itl_median_ms": statistics.median(gaps),
            "itl_p10_ms": sorted(gaps)[len(gaps) // 10], "itl_p90_ms": sorted(gaps)[9 * len(gaps) // 10],
            "tok_s": 1e3 / statistics.median(gaps)}


SAMPLER = Path(__file__).resolve().parent / "stack_sampler"


def sample_stacks(url: str, ids: list, new_tokens: int, folder: Path) -> dict:
    """A streamed request with the sampler on (the server was started with SGLANG_EXT_STACKS=folder)."""
    (folder / "on").touch()
    try:
        itl = stream_itl(url, ids, new_tokens)
    finally:
        (folder / "on").unlink()
    time.sleep(1.0)  # each process writes its file once it sees the switch off
    return {"itl_with_sampler": itl, "processes": summarize_stacks(folder)}


def summarize_stacks(folder: Path, top: int = 25) -> list:
    """Per process and thread: wall time sampled, the functions it spent it in (inclusive) and the leaves."""
    out = []
    for path in sorted(folder.glob("*.folded")):
        threads: dict = defaultdict(lambda: {"us": 0, "incl": defaultdict(int), "leaf": defaultdict(int)})
        for line in path.read_text().splitlines():
            stack, _, us = line.rpartition(" ")
            thread, *frames = stack.split(";")
            row, us = threads[thread], int(us)
            row["us"] += us
            for f in set(frames):
                row["incl"][f] += us
            if frames:
                row["leaf"][frames[-1]] += us
        for thread, row in sorted(threads.items(), key=lambda kv: -kv[1]["us"]):
            total = max(row["us"], 1)
            out.append({"process": path.stem, "thread": thread, "sampled_ms": round(row["us"] / 1e3, 1),
                        # frames on every stack (the process's entry and event loop) say nothing
                        "inclusive": [{"frame": f, "pct": round(100 * us / total, 1)} for f, us in
                                      sorted(row["incl"].items(), key=lambda kv: -kv[1]) if us < 0.995 * total][:top],
                        "leaf": [{"frame": f, "pct": round(100 * us / total, 1)} for f, us in
                                 sorted(row["leaf"].items(), key=lambda kv: -kv[1])[:top]]})
    return out


def profile(url: str, ids: list, new_tokens: int, steps: int, out_dir: Path, activities: list) -> Path | None:
    """SGLang's profiler over `steps` forwards starting with this request's prefill; the trace it wrote."""
    out_dir.mkdir(parents=True, exist_ok=True)
    before = set(glob.glob(str(out_dir / "**" / "*.json*"), recursive=True))
    r = requests.post(url + "/start_profile", json={"output_dir": str(out_dir), "num_steps": steps,
                                                     "activities": activities}, timeout=60)
    r.raise_for_status()
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                  "ignore_eos": True}}
    requests.post(url + "/generate", json=body, timeout=600).raise_for_status()
    deadline = time.time() + 120  # the trace is written after the last profiled step
    while time.time() < deadline:
        new = sorted(set(glob.glob(str(out_dir / "**" / "*.json*"), recursive=True)) - before, key=os.path.getmtime)
        if new:
            time.sleep(2.0)  # let the writer finish
            return Path(new[-1])
        time.sleep(1.0)
    return None


def load_trace(path: Path) -> list:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(events: list, decode_steps: int, top: int = 20) -> dict:
    """Kernel and CPU-op statistics of a torch-profiler trace (chrome format)."""
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                   "gpu_memset")),
                     key=lambda e: e["ts"])
    out: dict = {"kernels": len(kernels)}
    if kernels:
        start, end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
        busy, cur_s, cur_e, gaps = 0.0, kernels[0]["ts"], kernels[0]["ts"] + kernels[0]["dur"], []
        for e in kernels[1:]:
            s, t = e["ts"], e["ts"] + e["dur"]
            if s > cur_e:
                busy += cur_e - cur_s
                gaps.append(s - cur_e)
                cur_s, cur_e = s, t
            else:
                cur_e = max(cur_e, t)
        busy += cur_e - cur_s
        by_name = defaultdict(lambda: [0, 0.0, 0])
        for e in kernels:
            row = by_name[e.get("name", "?")]
            row[0] += 1
            row[1] += e["dur"]
            args = e.get("args") or {}
            row[2] += not any(k.lower().startswith("graph") for k in args)
        span = end - start
        out.update(span_ms=span / 1e3, busy_ms=busy / 1e3, idle_ms=(span - busy) / 1e3,
                   per_step_span_ms=span / 1e3 / max(decode_steps, 1), per_step_busy_ms=busy / 1e3 / max(decode_steps, 1),
                   gaps_over_20us=sum(g > 20 for g in gaps), gap_ms_over_20us=sum(g for g in gaps if g > 20) / 1e3,
                   outside_graph=sum(r[2] for r in by_name.values()),
                   top_kernels=[{"name": n[:120], "count": c, "total_ms": round(t / 1e3, 3), "outside_graph": o}
                                for n, (c, t, o) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]])
    cpu = defaultdict(lambda: [0, 0.0])
    for e in events:
        # aten ops and SGLang's own annotations (python_function frames are inclusive stacks: noise here)
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            row = cpu[e.get("name", "?")]
            row[0] += 1
            row[1] += e.get("dur", 0)
    out["top_cpu"] = [{"name": n[:120], "count": c, "total_ms": round(t / 1e3, 3)}
                      for n, (c, t) in sorted(cpu.items(), key=lambda kv: -kv[1][1])[:top]]
    return out


def markdown(result: dict) -> str:
    lines = [f"# Served decode profile: {result['model']} (batch 1, context {result['context']})", "",
             f"`{result['command']}` on {result['device']}", ""]
    itl = result.get("itl", {})
    if "itl_median_ms" in itl:
        lines.append(f"- streamed ITL median {itl['itl_median_ms']:.3f} ms ({itl['tok_s']:.1f} tok/s), "
                     f"p10 {itl['itl_p10_ms']:.3f}, p90 {itl['itl_p90_ms']:.3f}")
    stacks = result.get("stacks", {})
    if "itl_median_ms" in stacks.get("itl_with_sampler", {}):
        lines.append(f"- with the stack sampler on: ITL median {stacks['itl_with_sampler']['itl_median_ms']:.3f} ms")
    for t in stacks.get("processes", []):
        if "scheduler" not in t["process"] or t["thread"] != "MainThread":
            continue
        lines += ["", f"Python stacks of `{t['process']}` {t['thread']} ({t['sampled_ms']} ms sampled): "
                      "inclusive % of wall time | leaf %", "", "| frame | inclusive % | | leaf frame | % |",
                  "|---|---|---|---|---|"]
        lines += [f"| `{a['frame']}` | {a['pct']} | | `{b['frame']}` | {b['pct']} |"
                  for a, b in zip(t["inclusive"], t["leaf"])]
    prof = result.get("profile", {})
    if prof.get("kernels"):
        lines += [f"- profiled window: {prof['span_ms']:.2f} ms over ~{result['steps']} steps: GPU busy "
                  f"{prof['per_step_busy_ms']:.3f} ms a step, span {prof['per_step_span_ms']:.3f} ms a step; idle "
                  f"gaps over 20 us: {prof['gaps_over_20us']} ({prof['gap_ms_over_20us']:.2f} ms); kernels outside a "
                  f"CUDA graph: {prof['outside_graph']} of {prof['kernels']}", "",
                  "| kernel | count | total ms | outside graph |", "|---|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['count']} | {k['total_ms']} | {k['outside_graph']} |"
                  for k in prof["top_kernels"]]
    if prof.get("top_cpu"):
        lines += ["", "| CPU op | count | total ms |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['count']} | {k['total_ms']} |" for k in prof["top_cpu"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model-name", default="")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64, help="forwards profiled (the first is the prefill)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--stack-tokens", type=int, default=1024, help="streamed tokens sampled for stacks (0: none)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    ids = [random.Random(0).randrange(1000, 100000) for _ in range(args.context)]
    result = {"model": args.model_name or Path(args.model_path).name, "context": args.context, "steps": args.steps,
              "device": device, "server_args": server_args,
              "command": "python benchmarks/served/profile_decode.py " + " ".join(sys.argv[1:] if argv else [])}
    stacks_dir = args.out / "stacks"
    if args.stack_tokens:
        stacks_dir.mkdir(exist_ok=True)
        os.environ["SGLANG_EXT_STACKS"] = str(stacks_dir)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SAMPLER), os.environ.get("PYTHONPATH")]))
    with SGLangServer(args.model_path, server_args, log_path=args.out / "server.log",
                      startup_timeout=args.startup_timeout, cpu=device == "cpu") as srv:
        stream_itl(srv.url, ids[:64], 8)  # warm-up: graphs, allocator, the first prefill's compiles
        result["itl"] = stream_itl(srv.url, ids, args.new_tokens)
        if args.stack_tokens:
            result["stacks"] = sample_stacks(srv.url, ids[:-2] + [ids[-2] ^ 1, ids[-1]], args.stack_tokens, stacks_dir)
        trace = profile(srv.url, ids[:-1] + [ids[-1] ^ 1], max(args.new_tokens, args.steps + 8), args.steps,
                        args.out / "trace", ["CPU", "GPU"] if device != "cpu" else ["CPU"])
        result["trace"] = trace and str(trace)
        if trace is not None:
            result["profile"] = summarize(load_trace(trace), args.steps - 1)
    (args.out / "profile_decode.json").write_text(json.dumps(result, indent=1))
    (args.out / "profile_decode.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
