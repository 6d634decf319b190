"""The decode/prefill grid against real SGLang servers, for users with GPUs and SGLang.

For each --tp/--ep/--dp configuration: launch `python -m sglang.launch_server` (with this
package installed, so the plugin, our kernels and --probe-ckpt are active), wait for
/health, drive SGLang's own `sglang.benchmark.one_batch_server` over the batch sizes and
input lengths, stop the server, and write rows in the schema of bench_decode.py /
bench_prefill.py (kind "sglang-server"), so the same tables and plots apply:

  decode : tok/s per user = output_throughput / batch; $/M output tokens at $3.00/GPU-hour
  prefill: latency = last_ttft at batch 1; $/M input tokens

    python benchmarks/sglang_server_grid.py --model-path /models/gpt-oss-120b-fp8 \
        --configs 1:1:1,4:4:1,8:8:8 --probe-ckpt /models/gpt-oss-120b-singprobe --out results/
    python benchmarks/sglang_server_grid.py --model-path X --dry-run      # print the commands
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from bench_decode import parse_configs  # noqa: E402


def server_command(args, tp: int, ep: int, dp: int, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model_path,
           "--host", "127.0.0.1", "--port", str(port), "--tp", str(tp)]
    if ep > 1:
        cmd += ["--ep-size", str(ep)]
    if dp > 1:
        cmd += ["--dp", str(dp), "--enable-dp-attention"]
    if args.probe_ckpt:
        cmd += ["--probe-ckpt", args.probe_ckpt]
    return cmd + args.server_args


def bench_command(args, url: str, batches: list[int], input_len: int, output_len: int, result: str) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.benchmark.one_batch_server", "--model", "None", "--base-url", url,
           "--batch-size", *map(str, batches), "--input-len", str(input_len), "--output-len", str(output_len),
           "--result-filename", result]
    return cmd + (["--skip-warmup"] if args.skip_warmup else [])


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before /health answered")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(5)
    raise TimeoutError(f"server at {url} not healthy after {timeout:.0f} s")


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_config(args, tp: int, ep: int, dp: int) -> list[dict]:
    label = f"EP{ep} DP{dp} TP{tp}"
    port = args.port
    url = f"http://127.0.0.1:{port}"
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    cmd = server_command(args, tp, ep, dp, port)
    if args.dry_run:
        print(" ".join(cmd))
        for ctx in args.contexts.split(","):
            print("  " + " ".join(bench_command(args, url, batches, int(ctx), args.output_len, "decode.jsonl")))
        for n in args.lengths.split(","):
            print("  " + " ".join(bench_command(args, url, [1], int(n), 1, "prefill.jsonl")))
        return rows
    log = open(os.path.join(args.out, f"server_{tp}_{ep}_{dp}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = {"model": os.path.basename(args.model_path.rstrip("/")), "config": label, "gpus": tp,
            "kind": "sglang-server"}
    try:
        wait_healthy(url, proc, args.startup_timeout)
        with tempfile.TemporaryDirectory() as tmp:
            for ctx in [int(c) for c in args.contexts.split(",")]:
                result = os.path.join(tmp, f"decode_{ctx}.jsonl")
                subprocess.run(bench_command(args, url, batches, ctx, args.output_len, result), check=False)
                for r in read_jsonl(result):
                    total = r["output_throughput"]
                    rows.append({**base, "bench": "decode", "batch": r["batch_size"], "context": ctx,
                                 "tok_s_per_user": total / r["batch_size"], "tok_s_total": total,
                                 "tok_s_per_gpu": total / tp,
                                 "dollars_per_M_output": bc.dollars_per_million_output(total, tp),
                                 "ttft_s": r.get("last_ttft"), "latency_s": r.get("latency")})
            for n in [int(v) for v in args.lengths.split(",")]:
                result = os.path.join(tmp, f"prefill_{n}.jsonl")
                subprocess.run(bench_command(args, url, [1], n, 1, result), check=False)
                for r in read_jsonl(result):
                    latency = r["last_ttft"]
                    rows.append({**base, "bench": "prefill", "length": n, "latency_ms": latency * 1e3,
                                 "tok_s": n / latency,
                                 "dollars_per_M_input": bc.dollars_per_million_input(latency, n, tp)})
    except Exception as exc:
        rows.append({**base, "error": repr(exc)[:300]})
    finally:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
        except Exception:
            os.killpg(proc.pid, 9)
        log.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--probe-ckpt", default="")
    ap.add_argument("--configs", default="1:1:1")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--port", type=int, default=30111)
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--skip-warmup", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--stem", default="sglang_server_grid")
    ap.add_argument("server_args", nargs="*", help="extra arguments for launch_server (after --)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for tp, ep, dp in parse_configs(args.configs):
        rows += run_config(args, tp, ep, dp)
    if args.dry_run:
        return
    meta = bc.run_meta(" ".join(["python", "benchmarks/sglang_server_grid.py"] + sys.argv[1:]))
    decode = [r for r in rows if r.get("bench") == "decode"]
    prefill = [r for r in rows if r.get("bench") == "prefill"]
    md = [f"# SGLang servers: decode and prefill by configuration", "", f"`{meta['command']}` — {meta['date']}", "",
          bc.md_table(decode, [("config", "config", None), ("context", "context", None), ("batch", "batch", None),
                               ("tok/s/user", "tok_s_per_user", "{:.1f}"), ("tok/s/GPU", "tok_s_per_gpu", "{:.0f}"),
                               ("$/M out", "dollars_per_M_output", "{:.3f}")]), "",
          bc.md_table(prefill, [("config", "config", None), ("input tokens", "length", None),
                                ("latency ms", "latency_ms", "{:.1f}"), ("$/M input", "dollars_per_M_input", "{:.4f}")])]
    errors = [r for r in rows if "error" in r]
    md += [""] + [f"- {r['config']}: {r['error']}" for r in errors]
    bc.write_results(args.out, args.stem, meta, rows, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
