"""The decode/prefill grid against real SGLang servers, for users with GPUs and SGLang.

For each --tp/--ep/--dp configuration: launch `python -m sglang.launch_server` (with this
package installed, so the plugin, our kernels and --probe-ckpt are active; started, waited for
and stopped as the demo and the tests do, `sglang_ext.launch.server`), drive SGLang's own
`sglang.benchmark.one_batch_server` over the batch sizes and input lengths, stop the server, and
write rows in the schema of bench_decode.py / bench_prefill.py (kind "sglang-server"), so the same
tables and plots apply:

  decode : tok/s per user = (output_len - 1) / (latency - last_ttft), the batch's tokens after its
           first (SGLang's output_throughput counts the prefill's time too); $/M output tokens at
           $3.00/GPU-hour
  prefill: latency = last_ttft at batch 1; $/M input tokens

Prompts are SGLang's "random-ids" dataset (token ids of exactly the asked length, no download: the
"random" one fetches ShareGPT from the Hugging Face hub). Without a GPU the server runs on the CPU
(the demo's recipe): that is how the tests run this script, on the tiny checkpoint.

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
from bench_decode import parse_configs  # noqa: E402


def server_args(args, tp: int, ep: int, dp: int) -> list[str]:
    """launch_server's arguments for one configuration, after --model-path / --host / --port."""
    cmd = ["--tp", str(tp)]
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
           "--dataset-name", "random-ids", "--result-filename", result]
    return cmd + (["--skip-warmup"] if args.skip_warmup else [])


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def decode_row(base: dict, r: dict, context: int, output_len: int, gpus: int) -> dict:
    """One batch of one_batch_server's results as a decode row: every request's tokens after its first."""
    batch = r["batch_size"]
    decode_s = r["latency"] - r["last_ttft"]
    if output_len < 2 or decode_s <= 0:
        raise ValueError(f"no decode time to measure: output_len {output_len}, latency {r['latency']} s, "
                         f"last_ttft {r['last_ttft']} s")
    per_user = (output_len - 1) / decode_s
    return {**base, "bench": "decode", "batch": batch, "context": context, "tok_s_per_user": per_user,
            "tok_s_total": per_user * batch, "tok_s_per_gpu": per_user * batch / gpus,
            "dollars_per_M_output": bc.dollars_per_million_output(per_user * batch, gpus),
            "step_ms": 1e3 / per_user, "ttft_s": r["last_ttft"], "latency_s": r["latency"],
            "sglang_output_throughput": r.get("output_throughput")}


def prefill_row(base: dict, r: dict, length: int, gpus: int) -> dict:
    latency = r["last_ttft"]
    return {**base, "bench": "prefill", "length": length, "latency_ms": latency * 1e3, "tok_s": length / latency,
            "dollars_per_M_input": bc.dollars_per_million_input(latency, length, gpus)}


def run_config(args, tp: int, ep: int, dp: int) -> list[dict]:
    from sglang_ext.launch.cpu_shims import cpu_server_env
    from sglang_ext.launch.server import SGLangServer

    label = f"EP{ep} DP{dp} TP{tp}"
    batches = [int(b) for b in args.batches.split(",")]
    server = SGLangServer(args.model_path, server_args(args, tp, ep, dp), port=args.port,
                          log_path=os.path.join(args.out, f"server_{tp}_{ep}_{dp}.log"), vocab_dir=args.vocab_dir,
                          startup_timeout=args.startup_timeout)
    if args.dry_run:
        print(" ".join(server.command()))
        for ctx in args.contexts.split(","):
            print("  " + " ".join(bench_command(args, server.url, batches, int(ctx), args.output_len, "decode.jsonl")))
        for n in args.lengths.split(","):
            print("  " + " ".join(bench_command(args, server.url, [1], int(n), 1, "prefill.jsonl")))
        return []
    # the benchmark client loads the server's tokenizer: on a CPU it needs the server's environment (vocab)
    env = cpu_server_env(vocab_dir=args.vocab_dir) if server.cpu else dict(os.environ)
    base = {"model": os.path.basename(args.model_path.rstrip("/")), "config": label, "gpus": tp,
            "kind": "sglang-server"}
    rows = []
    try:
        server.start()
        with tempfile.TemporaryDirectory() as tmp:
            runs = [("decode", ctx, batches, args.output_len) for ctx in map(int, args.contexts.split(","))]
            runs += [("prefill", n, [1], 1) for n in map(int, args.lengths.split(","))]
            for bench, tokens, run_batches, output_len in runs:
                result = os.path.join(tmp, f"{bench}_{tokens}.jsonl")
                done = subprocess.run(bench_command(args, server.url, run_batches, tokens, output_len, result),
                                      env=env, capture_output=True, text=True)
                got = read_jsonl(result)
                if done.returncode != 0 or not got:
                    rows.append({**base, "bench": bench, "tokens": tokens,
                                 "error": f"one_batch_server exited {done.returncode}: {done.stderr[-300:]}"})
                for r in got:
                    rows.append(decode_row(base, r, tokens, output_len, tp) if bench == "decode"
                                else prefill_row(base, r, tokens, tp))
    except Exception as exc:  # noqa: BLE001  (a configuration that fails is a row; the grid goes on)
        rows.append({**base, "error": repr(exc)[:300]})
    finally:
        server.stop()
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
    ap.add_argument("--vocab-dir", default=None, help="tiktoken vocab folder for an offline server's tokenizer "
                    "(sglang_ext.launch.tokenizer.ensure_o200k_vocab; the CPU tests pass theirs)")
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
    decode = [r for r in rows if r.get("bench") == "decode" and "error" not in r]
    prefill = [r for r in rows if r.get("bench") == "prefill" and "error" not in r]
    md = ["# SGLang servers: decode and prefill by configuration", "", f"`{meta['command']}` — {meta['date']}", "",
          "decode tok/s per user: (output_len - 1) / (latency - last_ttft) of SGLang's one_batch_server.", "",
          bc.md_table(decode, [("config", "config", None), ("context", "context", None), ("batch", "batch", None),
                               ("tok/s/user", "tok_s_per_user", "{:.1f}"), ("tok/s/GPU", "tok_s_per_gpu", "{:.0f}"),
                               ("$/M out", "dollars_per_M_output", "{:.3f}")]), "",
          bc.md_table(prefill, [("config", "config", None), ("input tokens", "length", None),
                                ("latency ms", "latency_ms", "{:.1f}"), ("$/M input", "dollars_per_M_input", "{:.4f}")])]
    errors = [r for r in rows if "error" in r]
    md += [""] + [f"- {r['config']}" + (f" {r['bench']} {r['tokens']} tokens" if "tokens" in r else "")
                  + f": {r['error']}" for r in errors]
    bc.write_results(args.out, args.stem, meta, rows, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
