"""benchmarks/results/served_gpu.json (+ .md) from what the GPU machine wrote: the parity run
(benchmarks/served/parity.py), the served grid (benchmarks/sglang_server_grid.py, SGLang's one_batch_server) and
the harness on the same shapes (benchmarks/bench_decode.py / bench_prefill.py), each call's environment
(`env.json`: device, torch, triton, sglang, flags). Sections are merged: a later call replaces the rows of the
same key and keeps the others, so results from several calls (and cards) stand side by side, each row naming
its card.

    python benchmarks/served/collect.py --call /work/.device/N [--call ...] [--note TEXT ...]

A call that ran run_gpu_tests.sh (its gpu_tests.xml) also writes benchmarks/results/gpu_tests.json (+ .md).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "served_gpu"
GPU_TESTS = ROOT / "benchmarks" / "results" / "gpu_tests"
KEYS = {"serving": ("model", "concurrency", "probe", "device"), "parity": ("checkpoint", "cuda_graph"), "decode": ("model", "batch", "context", "probe", "device"),
        "prefill": ("model", "input_tokens", "probe", "device"), "checks": ("name", "device"),
        "profile": ("model", "context", "probe", "device", "call"),
        "scheduler_log": ("model", "batch", "probe", "call")}
# SGLang's scheduler logs its decode rate every `decode_log_interval` (40) steps; run_full_size.sh names each grid's
# folder after its stage.
DECODE_LOG = re.compile(r"Decode batch, #running-req: (\d+), #full token: (\d+).*?gen throughput \(token/s\): ([\d.]+)")
MODEL_PATH = re.compile(r"'model_path': '[^']*?(gpt-oss-\d+b)")
STAGE_PROBE = {"probe": True, "noprobe": False}
# patches/dummy_routing.py's log line from before it redrew the embedding too: with the routers alone redrawn the
# tokens' hidden states converge with depth, so a batch still routes alike.
ROUTERS_ONLY_LOG = "gpt-oss routers redrawn (N(0, 1), no bias) so that"
ROUTERS_ONLY = ("invalid: the server redrew only the routers; under SGLang's dummy weights the tokens' hidden states "
                "converge with depth and the batch reads fewer experts (the embedding redraw fixes it)")


# A batch decoded greedily on --load-format dummy weights: each request repeats a few tokens (on the CPU, 4 distinct
# across 8 requests), so the batch routes alike and reads fewer experts than a trained model's would.
GREEDY_WEIGHTLESS = ("invalid: greedy decoding on dummy weights repeats a few tokens per request, so the batch "
                     "routes alike and reads fewer experts (sglang_server_grid.py --temperature 1 fixes it)")


def _flag_value(command: str, flag: str) -> str | None:
    """The value after `flag` in a command line, or None."""
    words = command.split()
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def load(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def merge(old: list, new: list, key: tuple) -> list:
    index = {tuple(r.get(k) for k in key): r for r in old}
    for r in new:
        index[tuple(r.get(k) for k in key)] = r
    return list(index.values())


def rows_of_call(call: Path) -> dict:
    env = load(call / "env.json") or {}
    device = env.get("device", "unknown")
    host_loop = (env.get("host") or {}).get("python_loop_ms")  # gpu_env.host(): how fast this machine runs Python
    out = {"parity": [], "decode": [], "prefill": [], "serving": [], "checks": [], "profile": [], "scheduler_log": [],
           "env": env}
    for serving_file in sorted(call.rglob("serving_*.json")):
        data = load(serving_file)
        for r in data.get("rows", []):
            out["serving"].append({**r, "model": data["meta"]["model"], "probe": data["meta"]["probe"],
                                   "device": device, "source": serving_file.name})
    for parity_file in sorted(call.glob("parity*.json")):
        parity = load(parity_file)
        for r in parity["parity"]:
            out["parity"].append({**r, "device": device, "stub_calls": parity.get("stub_calls", [])})
    harness, copy_bw = {}, None
    for name in ("harness_decode.json", "harness_prefill.json"):
        data = load(call / name)
        copy_bw = copy_bw or ((data or {}).get("meta", {}).get("ceilings", {}).get("copy_bandwidth_Bps"))
        for r in (data or {}).get("rows", []):
            if r.get("bench") == "decode" or "batch" in r:
                harness[("decode", r.get("batch"), r.get("context"))] = r
            else:
                harness[("prefill", r.get("length"))] = r
    for grid_file in sorted(call.rglob("grid_*.json")):
        grid = load(grid_file)
        probe = "probe" in grid_file.stem and "noprobe" not in grid_file.stem
        command = grid.get("meta", {}).get("command", "")
        greedy_weightless = ("--load-format dummy" in command
                             and float(_flag_value(command, "--temperature") or 0) == 0)
        for r in grid.get("rows", []):
            model = r.get("model", "gpt-oss-20b")
            if r.get("bench") == "decode" and "tok_s_per_user" in r:
                h = harness.get(("decode", r["batch"], r["context"]))
                out["decode"].append({"model": model, "batch": r["batch"], "context": r["context"], "probe": probe,
                                      "served_tok_s_per_user": round(r["tok_s_per_user"], 1),
                                      **beside_harness(h, probe, r["tok_s_per_user"]),
                                      "harness_pct_copy_bw": h and h.get("pct_copy_bw") and round(h["pct_copy_bw"], 1),
                                      "harness_probe_overhead_pct": h and h.get("probe_overhead_pct"),
                                      # bytes a step reads, the harness's count: the same at batch 1 (four experts a
                                      # token either way); at larger batches dummy weights route differently
                                      "served_pct_copy_bw": (h and r["batch"] == 1 and copy_bw and round(
                                          100 * h["bytes_per_gpu_step"] * r["tok_s_per_user"] / copy_bw, 1)) or None,
                                      "device": device, "host_python_loop_ms": host_loop, "config": r.get("config"),
                                      "source": grid_file.name})
                if greedy_weightless and r["batch"] > 1:
                    out["decode"][-1]["note"] = GREEDY_WEIGHTLESS
            elif r.get("bench") == "prefill" and "latency_ms" in r:
                h = harness.get(("prefill", r["length"]))
                out["prefill"].append({"model": model, "input_tokens": r["length"], "probe": probe,
                                       "served_ttft_ms": round(r["latency_ms"], 1),
                                       "harness_ms": h and h.get("latency_ms") and round(h["latency_ms"], 1),
                                       "device": device, "source": grid_file.name})
            elif "does_not_fit" in r or "error" in r:
                out["checks"].append({"name": f"{grid_file.stem} {r.get('bench')} {r.get('batch', r.get('length'))}",
                                      "device": device, "result": r.get("does_not_fit") or r.get("error")})
    for prof_file in sorted(call.rglob("profile_decode.json")):  # benchmarks/served/profile_decode.py
        p = load(prof_file)
        itl, prof = p.get("itl", {}), p.get("profile", {})
        if "itl_median_ms" not in itl:
            continue
        h = harness.get(("decode", 1, p["context"]))
        probe = "--probe-ckpt" in p.get("server_args", [])
        out["profile"].append({"model": p["model"], "context": p["context"], "batch": 1, "probe": probe,
                               "call": call.name,
                               "itl_median_ms": round(itl["itl_median_ms"], 3), "itl_p10_ms": round(itl["itl_p10_ms"], 3),
                               "itl_p90_ms": round(itl["itl_p90_ms"], 3), "served_tok_s_per_user": round(itl["tok_s"], 1),
                               **beside_harness(h, probe, itl["tok_s"]),
                               "gpu_busy_ms_per_step": prof.get("per_step_busy_ms") and round(prof["per_step_busy_ms"], 3),
                               "device": device, "host_python_loop_ms": host_loop,
                               "source": str(prof_file.relative_to(call))})
    measured = {(r["model"], r["batch"], r["probe"]) for r in out["decode"]}
    for stage, probe in STAGE_PROBE.items():
        for log in sorted((call / stage).glob("server_*.log")):
            text = log.read_text(errors="replace")
            for r in scheduler_log_rates(text):
                if r["batch"] > 1 and ROUTERS_ONLY_LOG in text:
                    r["note"] = ROUTERS_ONLY
                if (r["model"], r["batch"], probe) in measured:
                    continue  # one_batch_server's row stands; the log is the cross-check where that was lost
                # the log's context runs a few tokens past the grid's: the harness row at the grid's context
                h = next((h for (kind, *shape), h in harness.items() if kind == "decode" and shape[0] == r["batch"]
                          and 0 <= r["context"] - shape[1] < 0.05 * shape[1]), None)
                out["scheduler_log"].append({**r, "probe": probe, "call": call.name, "device": device,
                                             "host_python_loop_ms": host_loop,
                                             **beside_harness(h, probe, r["tok_s_per_user"]),
                                             "source": str(log.relative_to(call))})
    for check in (load(call / "checks.json") or []):
        out["checks"].append({**check, "device": device})
    return out


def beside_harness(h: dict | None, probe: bool, served: float) -> dict:
    """The harness's rate for a served row (its probe-on step where the server ran the probe) and their ratio."""
    rate = h and ((1e3 / h["probe_on_step_ms"] if h.get("probe_on_step_ms") else None) if probe
                  else h.get("tok_s_per_user"))
    return {"harness_tok_s_per_user": rate and round(rate, 1), "served_over_harness": rate and round(served / rate, 3)}


def scheduler_log_rates(text: str) -> list[dict]:
    """A server log's decode rates by running batch: the median of the scheduler's 40-step `gen throughput`
    lines over each batch size's intervals, the first dropped (it spans the batch's prefill). SGLang's own
    count, read where a grid's one_batch_server result was lost (a call cut short at its time limit)."""
    model = MODEL_PATH.search(text)
    by_batch: dict[int, list[tuple[int, float]]] = {}
    for m in DECODE_LOG.finditer(text):
        by_batch.setdefault(int(m[1]), []).append((int(m[2]), float(m[3])))
    rows = []
    for batch, seen in sorted(by_batch.items()):
        rates = [rate for _, rate in seen[1:]]
        if not rates:
            continue
        rows.append({"model": model[1] if model else None, "batch": batch, "context": seen[0][0] // batch,
                     "intervals": len(rates), "tok_s_per_user": round(statistics.median(rates) / batch, 1)})
    return rows


def _num(x, fmt):
    return "" if x is None else format(x, fmt)


def markdown(result: dict) -> str:
    lines = ["# Served on a GPU: the real `sglang.launch_server` with sglang-ext",
             "", f"SGLang {result.get('sglang')}, torch {result.get('torch')}, Triton {result.get('triton')}; "
             f"flags: `{' '.join(result.get('flags', []))}`", "",
             "## Parity (tiny checkpoints, against transformers on the same weights)", "",
             "tokens: greedy tokens equal to transformers' before the first difference; where they part, the served "
             "log-probs against the fp32 truth (`lp err`) stay inside the reference's own error (`ref err`) and the "
             "truth's margin at the flip is smaller still: a near-tie. min margin: the truth's smallest top-2 gap "
             "(nats) along the served tokens (random weights decode near-ties; `trained_*` checkpoints learnt a task, "
             "so all their tokens must match). probe err: against the reference head on transformers' hidden states "
             "in the served dtype / in fp32. prefix hit: a 200-token cached prefix; where it parts from the cold run, "
             "its step, the truth's margin there and its own log-prob error.", "",
             "| checkpoint | CUDA graphs | tokens | lp err / ref err / flip margin | min margin "
             "| probe err (served dtype / fp32) | radix hit = cold | prefix hit | 8 streams max gap | SDK / guard | card |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["parity"]:
        if "error" in r:
            lines.append(f"| {r['checkpoint']} | {r['cuda_graph']} | error: {r['error'][:120]} | | | | | | | | "
                         f"{r.get('device')} |")
            continue
        if r.get("prefix_hit_tokens_equal"):
            prefix = "equal"
        elif "prefix_hit_flip_margin" in r:
            prefix = (f"parts at {r['prefix_hit_first_diff']} (margin {r['prefix_hit_flip_margin']:.3f}, "
                      f"lp err {r['prefix_hit_logprob_err']:.3f}){'' if r.get('prefix_hit_ok') else ' FAIL'}")
        else:
            prefix = f"parts at {r.get('prefix_hit_first_diff')}"
        streams = (f"{r['concurrent_8_max_score_gap']:.1e}" if r.get("concurrent_8_max_score_gap") is not None else "")
        sdk = (f"{r['openai_sdk_scores']} scores / {','.join(r['guard_finish_reasons'])}"
               if "openai_sdk_scores" in r else "")
        lines.append(f"| {r['checkpoint']} | {'on' if r['cuda_graph'] else 'off'} | {r['tokens_match']}/"
                     f"{r['tokens_total']} | {r['logprob_err']:.3f} / {r['ref_err']:.3f} / {r['flip_margin']:.3f} | "
                     f"{_num(r.get('truth_min_margin'), '.3f')} | {r['probe_max_abs_err']:.4f} / "
                     f"{r['probe_err_truth']:.4f} | {r['cached_equals_cold']} "
                     f"(gap {r['radix_hit_score_gap']:.1e}) | {prefix} | {streams} | {sdk} | {r.get('device')} |")
    lines += ["", "## Decode (tok/s per user)", "",
              "| model | batch | context | probe | served | harness | served / harness | card | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["decode"], key=lambda r: (r["model"], r["probe"], r["batch"])):
        lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {'on' if r['probe'] else 'off'} | "
                     f"{r['served_tok_s_per_user']} | {r['harness_tok_s_per_user']} | {r['served_over_harness']} | "
                     f"{r['device']} | {r.get('note', '')} |")
    lines += ["", "## Prefill (batch 1)", "", "| model | input tokens | served TTFT ms | harness ms | card |",
              "|---|---|---|---|---|"]
    for r in result["prefill"]:
        lines.append(f"| {r['model']} | {r['input_tokens']} | {r['served_ttft_ms']} | {r['harness_ms']} | "
                     f"{r['device']} |")
    if result.get("serving"):
        lines += ["", "## Online serving (sglang.benchmark.serving, random-ids)", "",
                  "| model | concurrency | probe | tok/s per user (1000 / median TPOT) | output tok/s | median TTFT ms | card |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["serving"]:
            lines.append(f"| {r['model']} | {r['concurrency']} | {'on' if r['probe'] else 'off'} | "
                         f"{r.get('tok_s_per_user') or r.get('error')} | {r.get('output_throughput')} | "
                         f"{r.get('median_ttft_ms')} | {r['device']} |")
    if result.get("profile"):
        lines += ["", "## Batch-1 decode as a client sees it (benchmarks/served/profile_decode.py)", "",
                  "Streamed greedy /generate at the context shown, 256 tokens, inter-token interval (ITL) at the client; "
                  "GPU busy: the union of kernel time per step in SGLang's profiler over 64 steps. `call`: one device "
                  "call (one machine); the harness column is filled where that call ran it.", "",
                  "| model | context | probe | ITL median ms (p10 / p90) | tok/s per user | harness | served / harness "
                  "| GPU busy ms a step | call | card |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(result["profile"], key=lambda r: (r["model"], r["call"], r["probe"])):
            lines.append(f"| {r['model']} | {r['context']} | {'on' if r['probe'] else 'off'} | {r['itl_median_ms']} "
                         f"({r['itl_p10_ms']} / {r['itl_p90_ms']}) | {r['served_tok_s_per_user']} | "
                         f"{r['harness_tok_s_per_user'] or ''} | {r['served_over_harness'] or ''} | "
                         f"{r['gpu_busy_ms_per_step'] or ''} | {r['call']} | {r['device']}"
                         + (f" (host loop {r['host_python_loop_ms']} ms)" if r.get("host_python_loop_ms") else "") + " |")
    if result.get("scheduler_log"):
        lines += ["", "## Decode rate in SGLang's scheduler log (grids cut short)", "",
                  "Where a call ran out of time before one_batch_server wrote its result: the scheduler's own "
                  "`gen throughput` (every 40 decode steps, median over a batch's intervals after its first) in the "
                  "grid's server log, sampled at temperature 1; the harness from the same call where it ran.", "",
                  "| model | batch | context | probe | served (log) | harness | served / harness | intervals | call | card | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(result["scheduler_log"], key=lambda r: (r["model"], r["call"], r["probe"], r["batch"])):
            lines.append(f"| {r['model']} | {r['batch']} | {r['context']} | {'on' if r['probe'] else 'off'} | "
                         f"{r['tok_s_per_user']} | {r['harness_tok_s_per_user'] or ''} | "
                         f"{r['served_over_harness'] or ''} | {r['intervals']} | {r['call']} | {r['device']} | "
                         f"{r.get('note', '')} |")
    if result.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in result["notes"]]
    if result.get("checks"):
        lines += ["", "## Checks", ""] + [f"- {c['name']} ({c['device']}): {c.get('result')}" for c in result["checks"]]
    return "\n".join(lines) + "\n"


JUNIT_OUTCOME = {"failure": "failed", "error": "error", "skipped": "skipped"}  # a junit testcase's child -> outcome


def gpu_tests(call: Path, commit: str | None = None) -> dict | None:
    """The `gpu` tests' outcome from a run_gpu_tests.sh call (its junit file): each test, its result and time."""
    xml = call / "gpu_tests.xml"
    if not xml.exists():
        return None
    suite = ET.parse(xml).getroot().find("testsuite")
    env = load(call / "env.json") or {}
    tests = []
    for case in suite.iter("testcase"):
        mark = next((child for child in case if child.tag in JUNIT_OUTCOME), None)
        outcome = "passed" if mark is None else JUNIT_OUTCOME[mark.tag]
        reason = "" if mark is None else mark.get("message", "")
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "time_s": round(float(case.get("time", 0)), 1), **({"reason": reason[:300]} if reason else {})})
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    return {"device": env.get("device"), "torch": env.get("torch"), "triton": env.get("triton"),
            "commit": commit, "date": suite.get("timestamp"), "wall_s": round(float(suite.get("time", 0)), 1), "counts": counts,
            "command": "OUT=$OUT bash benchmarks/served/run_gpu_tests.sh .carry", "tests": sorted(tests, key=lambda t: t["test"])}


def gpu_tests_markdown(r: dict) -> str:
    c = r["counts"]
    lines = [f"# GPU tests (`-m gpu`) on {r['device']}", "",
             f"`{r['command']}` at commit {r['commit']} — {r['date']}, torch {r['torch']}, Triton {r['triton']}, {r['wall_s']} s.", "",
             f"**{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped.**", "",
             "| test | outcome | s |", "|---|---|---|"]
    lines += [f"| `{t['test']}` | {t['outcome']}{' (' + t['reason'] + ')' if t.get('reason') else ''} | {t['time_s']} |"
              for t in r["tests"]]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--call", type=Path, action="append", default=[])
    ap.add_argument("--note", action="append", default=[], help="a line for the Markdown's notes (kept across runs)")
    ap.add_argument("--clear-notes", action="store_true")
    ap.add_argument("--commit", help="the commit the calls ran (recorded with the GPU tests)")
    args = ap.parse_args(argv)
    result = load(OUT.with_suffix(".json")) or {"parity": [], "decode": [], "prefill": [], "serving": [], "checks": []}
    if args.clear_notes:
        result["notes"] = []
    result["notes"] = result.get("notes", []) + [n for n in args.note if n not in result.get("notes", [])]
    for call in args.call:
        got = rows_of_call(call)
        env = got.pop("env")
        for key in ("device", "torch", "triton", "sglang", "flags", "command"):
            if key in env:
                result[key] = env[key]
        for section, rows in got.items():
            result[section] = merge(result.get(section, []), rows, KEYS[section])
        tests = gpu_tests(call, args.commit)
        if tests:
            GPU_TESTS.with_suffix(".json").write_text(json.dumps(tests, indent=1) + "\n")
            GPU_TESTS.with_suffix(".md").write_text(gpu_tests_markdown(tests))
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
