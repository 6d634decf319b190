"""SGLang's own online benchmark against one server: `python -m sglang.benchmark.serving --backend sglang
--dataset-name random-ids` (token ids of the asked lengths, no dataset download) at each concurrency, one row per
concurrency with SGLang's numbers (output tok/s, median TPOT and ITL, TTFT) and tok/s per user = 1000 / median
TPOT. The server is started and stopped as the tests and the grid do (sglang_ext.launch.server).

    python benchmarks/served/serving_grid.py --model-path M [--probe-ckpt P] --concurrency 1,8,32,128 \
        --input-len 1024 --output-len 256 --out results/serving.json -- --load-format dummy ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

KEEP = ("completed", "duration", "output_throughput", "input_throughput", "mean_ttft_ms", "median_ttft_ms",
        "mean_tpot_ms", "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "max_concurrency")


def bench_command(url: str, concurrency: int, prompts: int, input_len: int, output_len: int, result: str) -> list[str]:
    return [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--base-url", url,
            "--dataset-name", "random-ids", "--random-input-len", str(input_len), "--random-output-len",
            str(output_len), "--random-range-ratio", "1.0", "--num-prompts", str(prompts), "--max-concurrency",
            str(concurrency), "--output-file", result, "--disable-tqdm"]


def row_of(result: dict, concurrency: int, input_len: int, output_len: int) -> dict:
    row = {k: result.get(k) for k in KEEP}
    tpot = result.get("median_tpot_ms")
    row.update(concurrency=concurrency, input_len=input_len, output_len=output_len,
               tok_s_per_user=(1e3 / tpot) if tpot else None)
    return row


def main(argv=None):
    from sglang_ext.launch.server import SGLangServer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model-name", default="")
    ap.add_argument("--probe-ckpt", default="")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--prompts-per-concurrency", type=int, default=2, help="num-prompts = this x concurrency (min 4)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--bench-timeout", type=float, default=600)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--cpu", action="store_true", help="a CPU server (the tests' recipe), for a dry check")
    ap.add_argument("--out", required=True)
    ap.add_argument("server_args", nargs="*")
    args = ap.parse_args(argv)
    extra = list(args.server_args) + (["--probe-ckpt", args.probe_ckpt] if args.probe_ckpt else [])
    rows = []
    meta = {"command": " ".join(["python", "benchmarks/served/serving_grid.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "probe": bool(args.probe_ckpt),
            "model": args.model_name or os.path.basename(args.model_path.rstrip("/"))}
    with SGLangServer(args.model_path, extra, cpu=True if args.cpu else None,
                      startup_timeout=args.startup_timeout) as srv, tempfile.TemporaryDirectory() as tmp:
        for c in (int(x) for x in args.concurrency.split(",")):
            result = os.path.join(tmp, f"c{c}.jsonl")
            cmd = bench_command(srv.url, c, max(4, args.prompts_per_concurrency * c), args.input_len,
                                args.output_len, result)
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.bench_timeout)
                error = None if done.returncode == 0 else done.stderr[-500:]
            except subprocess.TimeoutExpired:
                error = f"still running after {args.bench_timeout:.0f} s"
            lines = open(result).read().splitlines() if os.path.exists(result) else []
            rows.append(row_of(json.loads(lines[-1]), c, args.input_len, args.output_len) if lines and not error
                        else {"concurrency": c, "error": error or "no result"})
            print(json.dumps(rows[-1]), flush=True)
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
