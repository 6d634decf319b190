"""The decode/prefill grid against real SGLang servers, for users with GPUs and SGLang.

For each TP:EP:DP configuration: launch `python -m sglang.launch_server` (with this package installed,
so the plugin, our kernels and --probe-ckpt are active; started, waited for and stopped as the demo
and the tests do, `sglang_ext.launch.server`) with `--tp-size T --ep-size E --attn-dp-size D` (DP =
data-parallel attention inside the TP group, as the harness's configurations), drive SGLang's own
`sglang.benchmark.one_batch_server` over the batch sizes and input lengths, stop the server, and
write rows in the schema of bench_decode.py / bench_prefill.py (kind "sglang-server"):

  decode : tok/s per user = (tokens per request - 1) / (latency - last_ttft), the batch's tokens after
           its first (SGLang's output_throughput counts the prefill's time too); $/M output tokens at
           $3.00/GPU-hour
  prefill: latency = last_ttft at batch 1, the median of --prefill-repeats runs (each on a flushed
           cache); $/M input tokens. The server splits prompts longer than its chunked_prefill_size
           (recorded in each row), which bench_prefill.py's one forward does not.

Each row's configuration label and GPU count come from what the server resolved (`/server_info`: SGLang
changes some settings silently, e.g. an all-to-all MoE backend sets ep = tp, DP attention divides the
prefill chunk), with the requested label beside it where they differ. A batch that one_batch_server
skips (above the server's KV capacity or running-request limit) is a `does_not_fit` row, not a gap.
Results are rewritten after every configuration: `<stem>.json/.md` (every row and error) and
`bench_decode_<stem>.json` / `bench_prefill_<stem>.json`, so that
`python -m benchmarks.plot_results --results <out>` draws the same plots and summary for them (keep
--out its own folder: mixed with the harness's files, the two kinds of rows would be deduplicated
against each other).

Keep one probe setting per folder (plot_results does not tell them apart). With DP attention, a group that
finishes its prefill early decodes before last_ttft, so tok/s per user is an upper bound there; SGLang's
steady-state rate is kept beside it (`sglang_steady_state_output_throughput`).

Prompts are SGLang's "random-ids" dataset (token ids of exactly the asked length, no download: the
"random" one fetches ShareGPT from the Hugging Face hub). --device auto runs the server on the CPU where
no CUDA driver loads (the demo's recipe): that is how the tests run this script, on the tiny checkpoint.

    python -m benchmarks.sglang_server_grid --model-path /models/gpt-oss-120b-fp8 --model-name gpt-oss-120b \
        --configs 1:1:1,4:4:1,8:8:8 --probe-ckpt /models/gpt-oss-120b-singprobe --out results/servers
    python -m benchmarks.sglang_server_grid --model-path X --device cuda --dry-run   # print the commands
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import requests

if __package__ in (None, ""):  # run as a file (benchmarks/served/run_full_size.sh does): the checkout root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_common as bc  # noqa: E402
from benchmarks.bench_decode import parse_configs  # noqa: E402


def server_args(args, tp: int, ep: int, dp: int) -> list[str]:
    """launch_server's arguments for one configuration, after --model-path / --host / --port. DP is
    data-parallel attention (SGLang 0.5.23's --attn-dp-size; `--dp D --enable-dp-attention` is its
    deprecated spelling)."""
    cmd = ["--tp-size", str(tp)]
    if ep > 1:
        cmd += ["--ep-size", str(ep)]
    if dp > 1:
        cmd += ["--attn-dp-size", str(dp)]
    if args.probe_ckpt:
        cmd += ["--probe-ckpt", args.probe_ckpt]
    return cmd + args.server_args


def bench_command(args, url: str, batches: list[int], input_len: int, output_len: int, result: str) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.benchmark.one_batch_server", "--model", "None", "--base-url", url,
           "--batch-size", *map(str, batches), "--input-len", str(input_len), "--output-len", str(output_len),
           "--dataset-name", "random-ids", "--result-filename", result]
    if args.temperature:
        cmd += ["--temperature", str(args.temperature)]
    return cmd + (["--skip-warmup"] if args.skip_warmup else [])


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def config_label(tp: int, ep: int, dp: int, replicas: int = 1, pp: int = 1) -> str:
    return f"EP{ep} DP{dp} TP{tp}" + (f" PP{pp}" if pp > 1 else "") + (f" x{replicas} replicas" if replicas > 1 else "")


def resolved_layout(info: dict) -> dict:
    """The configuration a server runs, from its `/server_info` (SGLang's resolved arguments): label, GPUs
    (tp x pp x dp replicas; attention DP groups live inside the TP group), the prefill chunk, the device."""
    # KeyError, not a default, where SGLang names a field otherwise: a wrong label would pass unnoticed
    tp, pp, replicas = int(info["tp_size"]), int(info["pp_size"]), int(info["dp_size"])
    ep, dp = int(info["ep_size"]), int(info["attn_dp_size"])
    return {"config": config_label(tp, ep, dp, replicas, pp), "gpus": tp * pp * replicas,
            "chunked_prefill_size": info.get("chunked_prefill_size"), "device": info.get("device")}


def decode_row(base: dict, r: dict, context: int, output_len: int, gpus: int) -> dict:
    """One batch of one_batch_server's results as a decode row: every request's tokens after its first.
    Tokens per request from the tokens the server generated (a server that clamps max_new_tokens makes
    fewer than output_len: counted as made, and the row says so)."""
    batch = r["batch_size"]
    decode_s = r["latency"] - r["last_ttft"]
    made = r.get("total_output_tokens")
    per_request = made / batch if made else output_len
    if per_request < 2 or decode_s <= 0:
        raise ValueError(f"no decode time to measure: {per_request:g} tokens a request, latency {r['latency']} s, "
                         f"last_ttft {r['last_ttft']} s")
    per_user = (per_request - 1) / decode_s
    row = {**base, "bench": "decode", "batch": batch, "context": context, "tok_s_per_user": per_user,
           "tok_s_total": per_user * batch, "tok_s_per_gpu": per_user * batch / gpus,
           "dollars_per_M_output": bc.dollars_per_million_output(per_user * batch, gpus),
           "step_ms": 1e3 / per_user, "ttft_s": r["last_ttft"], "latency_s": r["latency"],
           "sglang_output_throughput": r.get("output_throughput"),
           "sglang_steady_state_output_throughput": r.get("steady_state_output_throughput")}
    if made is not None and made != batch * output_len:
        row["short_output"] = f"{made} tokens made of {batch * output_len} asked"
    return row


def prefill_row(base: dict, runs: list[dict], length: int, gpus: int) -> dict:
    """Batch-1 prefill: the median last_ttft of the runs (each one_batch_server case flushes the cache first)."""
    latency = statistics.median(r["last_ttft"] for r in runs)
    return {**base, "bench": "prefill", "length": length, "latency_ms": latency * 1e3, "tok_s": length / latency,
            "dollars_per_M_input": bc.dollars_per_million_input(latency, length, gpus),
            "runs_ms": [r["last_ttft"] * 1e3 for r in runs]}


SKIP_LINE = re.compile(r"Skip benchmark batch_size=(\d+).*?(due to [^=]*)")


def missing_rows(base: dict, bench: str, tokens: int, asked: list[int], got: list[dict], stdout: str) -> list[dict]:
    """Batches one_batch_server returned no result for: it skips those above the server's KV capacity or
    running-request limit with a line on stdout and exit 0. Each becomes a row that says so."""
    why = {int(m.group(1)): m.group(0).strip("= ") for m in SKIP_LINE.finditer(stdout)}
    made = {r["batch_size"] for r in got}
    key = "batch" if bench == "decode" else "length"
    rows = []
    for b in sorted(set(asked) - made):
        at = {"batch": b, "context": tokens} if bench == "decode" else {"length": tokens}
        if b in why:
            rows.append({**base, "bench": bench, **at, "does_not_fit": f"one_batch_server: {why[b]}"})
        else:
            rows.append({**base, "bench": bench, **at, "tokens": tokens,
                         "error": f"one_batch_server returned no result for {key} {tokens if key == 'length' else b}"})
    return rows


def run_benchmark(args, env: dict, url: str, batches: list[int], tokens: int, output_len: int, tmp: str, name: str):
    """One one_batch_server invocation: (result rows, stdout, an error text or None)."""
    result = os.path.join(tmp, f"{name}.jsonl")
    env = {**env, "PYTHONUNBUFFERED": "1"}  # a run killed at its timeout keeps its printed lines (skips, errors)
    try:
        done = subprocess.run(bench_command(args, url, batches, tokens, output_len, result), env=env,
                              capture_output=True, text=True, timeout=args.bench_timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return read_jsonl(result), out, f"one_batch_server still running after {args.bench_timeout:.0f} s (killed)"
    error = None if done.returncode == 0 else f"one_batch_server exited {done.returncode}: {done.stderr[-300:]}"
    return read_jsonl(result), done.stdout, error


STOP_FAILED = "stopping the server"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_config(args, tp: int, ep: int, dp: int, progress=lambda rows: None) -> list[dict]:
    """One server's rows; ``progress(rows)`` after each benchmark run, so a grid cut short keeps what ran."""
    from sglang_ext.launch.cpu_shims import cpu_server_env
    from sglang_ext.launch.server import SGLangServer, free_port

    label = config_label(tp, ep, dp)
    batches = _ints(args.batches)
    cpu = {"auto": None, "cpu": True, "cuda": False}[args.device]
    server = SGLangServer(args.model_path, server_args(args, tp, ep, dp), port=args.port or free_port(),
                          log_path=os.path.join(args.out, f"server_{tp}_{ep}_{dp}.log"), vocab_dir=args.vocab_dir,
                          startup_timeout=args.startup_timeout, cpu=cpu)
    if args.dry_run:
        print(f"# {label} on the {'CPU' if server.cpu else 'GPUs'}")
        print(" ".join(server.command()))
        for ctx in _ints(args.contexts):
            print("  " + " ".join(bench_command(args, server.url, batches, int(ctx), args.output_len, "decode.jsonl")))
        for n in _ints(args.lengths):
            print("  " + " ".join(bench_command(args, server.url, [1] * args.prefill_repeats, int(n), 1,
                                                "prefill.jsonl")))
        return []
    # the benchmark client loads the server's tokenizer: on a CPU it needs the server's environment (vocab)
    env = cpu_server_env(vocab_dir=args.vocab_dir) if server.cpu else dict(os.environ)
    base = {"model": args.model_name or os.path.basename(args.model_path.rstrip("/")), "config": label,
            "gpus": tp, "kind": "sglang-server", "probe": bool(args.probe_ckpt),
            "device": "cpu" if server.cpu else "cuda"}
    rows = []
    try:
        server.start()
        info = requests.get(server.url + "/server_info", timeout=60).json()
        layout = resolved_layout(info)
        if layout["config"] != label:
            base["requested_config"] = label
        base.update(layout)
        with tempfile.TemporaryDirectory() as tmp:
            for ctx in _ints(args.contexts):
                got, out, error = run_benchmark(args, env, server.url, batches, ctx, args.output_len, tmp, f"decode_{ctx}")
                for r in got:
                    try:
                        rows.append(decode_row(base, r, ctx, args.output_len, base["gpus"]))
                    except (KeyError, ValueError) as exc:  # one batch's result, not the configuration's
                        rows.append({**base, "bench": "decode", "batch": r.get("batch_size"), "context": ctx,
                                     "error": f"{exc!r}"[:300]})
                rows += missing_rows(base, "decode", ctx, batches, got, out)
                if error:
                    rows.append({**base, "bench": "decode", "tokens": ctx, "error": error})
                progress(rows)
            for n in _ints(args.lengths):
                got, out, error = run_benchmark(args, env, server.url, [1] * args.prefill_repeats, n, 1, tmp,
                                                f"prefill_{n}")
                if got:
                    rows.append(prefill_row(base, got, n, base["gpus"]))
                else:
                    rows += missing_rows(base, "prefill", n, [1], got, out)
                if error:
                    rows.append({**base, "bench": "prefill", "tokens": n, "error": error})
                progress(rows)
    except Exception as exc:  # noqa: BLE001  (a configuration that fails is a row; the grid goes on)
        rows.append({**base, "error": repr(exc)[:300]})
    finally:
        try:
            server.stop()
        except Exception as exc:  # noqa: BLE001  (the grid stops after writing: see main)
            rows.append({**base, "error": f"{STOP_FAILED}: {exc!r}"[:300]})
    return rows


def write_grid(args, meta: dict, rows: list[dict]) -> None:
    decode = [r for r in rows if r.get("bench") == "decode" and "step_ms" in r]
    prefill = [r for r in rows if r.get("bench") == "prefill" and "latency_ms" in r]
    head = ["# SGLang servers: decode and prefill by configuration", "", f"`{meta['command']}` — {meta['date']}", "",
            "decode tok/s per user: (tokens per request - 1) / (latency - last_ttft) of SGLang's one_batch_server; "
            f"prefill: the median last_ttft of {args.prefill_repeats} batch-1 runs. Configurations as the servers "
            "resolved them (`/server_info`).", ""]
    decode_md = bc.md_table(decode, [("config", "config", None), ("context", "context", None), ("batch", "batch", None),
                                     ("tok/s/user", "tok_s_per_user", "{:.1f}"),
                                     ("tok/s/GPU", "tok_s_per_gpu", "{:.0f}"),
                                     ("$/M out", "dollars_per_M_output", "{:.3f}")])
    prefill_md = bc.md_table(prefill, [("config", "config", None), ("input tokens", "length", None),
                                       ("latency ms", "latency_ms", "{:.1f}"),
                                       ("prefill chunk", "chunked_prefill_size", None),
                                       ("$/M input", "dollars_per_M_input", "{:.4f}")])
    # one line per configuration the server resolved otherwise, one per row that did not measure as asked
    notes = [f"- asked {asked}, the server ran {config}"
             for config, asked in dict.fromkeys((r["config"], r["requested_config"]) for r in rows
                                                if "requested_config" in r)]
    for r in rows:
        if not any(k in r for k in ("error", "does_not_fit", "short_output")):
            continue
        where = r["config"] + (f" {r['bench']}" if "bench" in r else "") + "".join(
            f" {k} {r[k]}" for k in ("context", "batch", "length", "tokens") if k in r)
        notes.append(f"- {where}: {r.get('error') or r.get('does_not_fit') or r.get('short_output')}")
    bc.write_results(args.out, args.stem, meta, rows, "\n".join(head + [decode_md, "", prefill_md, ""] + notes) + "\n")
    bc.write_results(args.out, f"bench_decode_{args.stem}", meta, decode, "\n".join(head + [decode_md]) + "\n")
    bc.write_results(args.out, f"bench_prefill_{args.stem}", meta, prefill, "\n".join(head + [prefill_md]) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model-name", default="", help="the rows' model (default: the folder's name); name it as the "
                    "harness does (gpt-oss-120b, gpt-oss-20b) to read both side by side")
    ap.add_argument("--probe-ckpt", default="")
    ap.add_argument("--configs", default="1:1:1", help="TP:EP:DP,... (DP: data-parallel attention)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768", help="prefill lengths ('': none)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: the CPU where no CUDA driver loads (as the demo and the tests)")
    ap.add_argument("--port", type=int, default=0, help="default: a free port for each configuration")
    ap.add_argument("--vocab-dir", default=None, help="tiktoken vocab folder for an offline server's tokenizer "
                    "(sglang_ext.launch.tokenizer.ensure_o200k_vocab; the CPU tests pass theirs)")
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--bench-timeout", type=float, default=3600, help="seconds for one one_batch_server run")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="one_batch_server's sampling temperature (0: greedy, its default). A weightless server "
                    "(--load-format dummy) wants 1: greedy, its requests repeat a few tokens, route alike and read "
                    "fewer experts than a trained model's batch")
    ap.add_argument("--skip-warmup", action="store_true")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sglang_servers"))
    ap.add_argument("--stem", default="sglang_server_grid")
    ap.add_argument("server_args", nargs="*", help="extra arguments for launch_server (after --)")
    args = ap.parse_args()
    if args.prefill_repeats < 1:
        ap.error("--prefill-repeats must be at least 1")
    if not args.dry_run:
        os.makedirs(args.out, exist_ok=True)
    meta = bc.run_meta(" ".join(["python", "benchmarks/sglang_server_grid.py"] + sys.argv[1:]))
    rows = []
    for tp, ep, dp in parse_configs(args.configs):
        got = run_config(args, tp, ep, dp, progress=lambda partial: write_grid(args, meta, rows + partial))
        rows += got
        if args.dry_run:
            continue
        write_grid(args, meta, rows)  # after each configuration: a grid cut short keeps what ran
        if any(r.get("error", "").startswith(STOP_FAILED) for r in got):
            # its processes may still hold the GPUs: the next server would measure less memory, or not start
            sys.exit(f"sglang_server_grid: a server did not stop; the grid ends here ({args.out})")


if __name__ == "__main__":
    main()
