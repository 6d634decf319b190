"""Bounded load test on loopback: N concurrent streaming clients for D seconds.

Each client loops until the deadline: it picks an endpoint (OpenAI chat, OpenAI
completions, native /generate) and a prompt from a small pool, streams it greedily
(the prompt fixes the length, so the same (endpoint, prompt) recurs as a greedy twin)
and, for a fraction of requests, drops the connection after a random number of chunks
(zero: right after the headers). What must hold, checked at the end:

- every request ended (finished, dropped by the client, or answered with an error)
  within its timeout: none hangs;
- no score lands on the wrong request: each finished stream carries exactly one
  `token_probe_probs` row per completion token, and greedy twins carry equal tokens
  and equal scores (a row from another request, which has another prompt, would
  differ by far more than the tolerance);
- afterwards nothing runs or waits, the KV pool (which also indexes the probe's K/V)
  is empty after a cache flush, and SGLang's idle leak check logged nothing.

It records p50/p99 time to first token (TTFT) and inter-token latency (ITL: the gap
between token-bearing chunks, divided over the tokens they carry) and writes
benchmarks/results/load_cpu.{json,md}.

    python benchmarks/bench_load.py --clients 64 --duration 120          # starts its own CPU server
    python benchmarks/bench_load.py --url http://127.0.0.1:30000 ...     # or loads a running one
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]

SCORES_KEY = "token_probe_probs"
ENDPOINTS = ("chat", "completions", "generate")
LEAK_MARKERS = ("memory leak detected", "double free", "use-after-free")


@dataclass
class Outcome:
    endpoint: str
    prompt_id: int
    dropped_after: int | None  # chunks read before the client hung up; None: read to the end
    status: str = "pending"  # finished | dropped | error | hung
    error: str = ""
    tokens: int = 0  # completion tokens the server reports (usage / meta_info)
    scores: list = field(default_factory=list)
    token_ids: list | None = None
    text: str = ""
    finish_reason: object = None
    ttft_s: float | None = None
    itl_s: list = field(default_factory=list)


def prompt_pool(n: int, seed: int) -> list[dict]:
    """Prompts with distinct texts and token ids, each with its own greedy length."""
    rng = random.Random(seed)
    words = ("river", "copper", "lantern", "orbit", "meadow", "cipher", "harbor", "violet",
             "engine", "glacier", "sparrow", "quartz", "thunder", "willow", "ember", "atlas")
    pool = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 24))) + f" #{i}"
        ids = [rng.randrange(1000, 199_000) for _ in range(rng.randint(8, 160))]
        pool.append({"text": text, "ids": ids, "max_tokens": rng.randint(8, 32)})
    return pool


def _request(url: str, endpoint: str, prompt: dict) -> tuple[str, dict]:
    n = prompt["max_tokens"]
    if endpoint == "chat":
        return url + "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": prompt["text"]}],
            "max_tokens": n, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "completions":
        return url + "/v1/completions", {
            "model": "default", "prompt": prompt["text"], "max_tokens": n, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    return url + "/generate", {
        "input_ids": prompt["ids"], "stream": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}


def stream_one(url: str, outcome: Outcome, prompt: dict, timeout_s: float) -> Outcome:
    """Stream one request, recording tokens, scores and chunk timing into `outcome`."""
    target, body = _request(url, outcome.endpoint, prompt)
    start = time.perf_counter()
    last_token_t = None
    chunks = 0
    try:
        with requests.post(target, json=body, stream=True, timeout=(10, timeout_s)) as r:
            if r.status_code != 200:
                outcome.status, outcome.error = "error", f"HTTP {r.status_code}: {r.text[:200]}"
                return outcome
            if outcome.dropped_after == 0:
                outcome.status = "dropped"
                return outcome
            for line in r.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    outcome.status, outcome.error = "error", json.dumps(event["error"])[:300]
                    return outcome
                now = time.perf_counter()
                new_tokens = _consume(outcome, event)
                if new_tokens:
                    if outcome.ttft_s is None:
                        outcome.ttft_s = now - start
                    else:
                        outcome.itl_s.extend([(now - last_token_t) / new_tokens] * new_tokens)
                    last_token_t = now
                chunks += 1
                if outcome.dropped_after is not None and chunks >= outcome.dropped_after:
                    outcome.status = "dropped"
                    return outcome  # leaving the `with` closes the connection mid-stream
    except requests.Timeout as e:
        outcome.status, outcome.error = "hung", str(e)[:200]
        return outcome
    except requests.RequestException as e:
        outcome.status, outcome.error = "error", f"{type(e).__name__}: {str(e)[:200]}"
        return outcome
    outcome.status = "finished"
    return outcome


def _consume(outcome: Outcome, event: dict) -> int:
    """Fold one SSE event into `outcome`; returns how many new tokens it carried."""
    if outcome.endpoint == "generate":
        meta = event.get("meta_info") or {}
        before = outcome.tokens
        outcome.tokens = int(meta.get("completion_tokens", before))
        outcome.scores.extend(meta.get(SCORES_KEY) or [])  # each chunk: the rows of its new tokens
        outcome.token_ids = event.get("output_ids")
        outcome.text = event.get("text", "")
        outcome.finish_reason = meta.get("finish_reason")
        return outcome.tokens - before
    if event.get("usage"):
        outcome.tokens = int(event["usage"]["completion_tokens"])
    new = 0
    for choice in event.get("choices") or []:
        rows = choice.get(SCORES_KEY) or []
        outcome.scores.extend(rows)  # each chunk carries only its own tokens' rows
        new += len(rows)
        delta = choice.get("delta") or {}
        outcome.text += (delta.get("content") or "") + (delta.get("reasoning_content") or "") + (
            choice.get("text") or "")
        if choice.get("finish_reason"):
            outcome.finish_reason = choice["finish_reason"]
    return new


def server_load(url: str) -> dict:
    body = requests.get(url + "/v1/loads", timeout=30).json()
    loads = body.get("loads", body) if isinstance(body, dict) else body
    return loads[0] if isinstance(loads, list) else loads


def wait_idle(url: str, timeout_s: float = 120.0) -> dict:
    deadline = time.time() + timeout_s
    while True:
        load = server_load(url)
        if (load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0) or time.time() > deadline:
            return load
        time.sleep(0.5)


def pool_tokens_after_flush(url: str, settle_s: float = 5.0) -> int:
    """KV tokens still held once nothing runs and the radix cache is flushed (a leak if > 0)."""
    wait_idle(url)
    # The load snapshot can lag a request that just arrived; the scheduler refuses to flush
    # while anything runs, so retry until it is really idle.
    deadline = time.time() + 120
    while True:
        r = requests.post(url + "/flush_cache", timeout=60)
        if r.status_code == 200 or time.time() > deadline:
            r.raise_for_status()
            break
        time.sleep(0.2)
    # An idle scheduler publishes its load snapshot at once; allow a few beats for it.
    deadline = time.time() + settle_s
    while True:
        used = int(server_load(url)["num_used_tokens"])
        if used == 0 or time.time() > deadline:
            return used
        time.sleep(0.1)


def group_rss_bytes(pgid: int | None) -> int | None:
    """Resident memory of every process in the server's process group."""
    if pgid is None:
        return None
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # field 5 of /proc/PID/stat: the process group
                total += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")  # field 24: rss pages
        except (OSError, IndexError, ValueError):
            continue
    return total


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def twin_mismatches(outcomes: list[Outcome], atol: float) -> tuple[int, int, list[str]]:
    """Greedy twins (same endpoint and prompt, both finished): (pairs compared, pairs diverged
    before any score could be compared, mismatches)."""
    first: dict[tuple, Outcome] = {}
    compared = diverged = 0
    problems = []
    for o in outcomes:
        if o.status != "finished":
            continue
        key = (o.endpoint, o.prompt_id)
        ref = first.setdefault(key, o)
        if ref is o:
            continue
        # The score of token k comes from the context up to token k-1, so twins' scores agree
        # up to and including the first token where (batch-dependent rounding) they diverge.
        if o.token_ids is not None and ref.token_ids is not None:
            same = next((k for k, (a, b) in enumerate(zip(o.token_ids, ref.token_ids)) if a != b),
                        min(len(o.token_ids), len(ref.token_ids)))
            upto = min(same + 1, len(o.scores), len(ref.scores))
        elif o.text == ref.text:
            upto = min(len(o.scores), len(ref.scores))
        else:
            upto = 1  # texts diverged somewhere; the first score is always comparable
        if upto == 0:
            diverged += 1
            continue
        compared += 1
        worst = max(abs(a[label] - b[label]) for a, b in zip(o.scores[:upto], ref.scores[:upto]) for label in a)
        if worst > atol:
            problems.append(f"{key}: twin scores differ by {worst:.4f} over the first {upto} tokens")
    return compared, diverged, problems


def run_load(url: str, clients: int, duration_s: float, drop_fraction: float = 0.2, seed: int = 0,
             prompts: int = 12, request_timeout_s: float = 120.0, twin_atol: float = 1e-3,
             server_log: Path | None = None, server_pgid: int | None = None) -> dict:
    """Run the load, check it and return the report (`report["problems"]` empty when all holds)."""
    pool = prompt_pool(prompts, seed)
    log_start = server_log.stat().st_size if server_log and server_log.exists() else 0
    # Warm every (endpoint, prompt) once so the RSS baseline includes steady-state buffers.
    for endpoint in ENDPOINTS:
        stream_one(url, Outcome(endpoint, 0, None), pool[0], request_timeout_s)
    rss_before = group_rss_bytes(server_pgid)
    leaked_before = pool_tokens_after_flush(url)

    outcomes: list[Outcome] = []
    lock = threading.Lock()
    deadline = time.time() + duration_s
    load_start = time.perf_counter()

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        first = True
        while time.time() < deadline:
            if first:
                # Every client opens with prompt 0, read to the end: greedy twins on every endpoint
                # however short the run, batched with the other endpoints' different sequences.
                o, first = Outcome(ENDPOINTS[i % len(ENDPOINTS)], 0, None), False
            else:
                drop = rng.randint(0, 6) if rng.random() < drop_fraction else None
                o = Outcome(rng.choice(ENDPOINTS), rng.randrange(len(pool)), drop)
            prompt_id = o.prompt_id
            stream_one(url, o, pool[prompt_id], request_timeout_s)
            with lock:
                outcomes.append(o)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + request_timeout_s + 60)
    wall_s = time.perf_counter() - load_start
    still_running = sum(t.is_alive() for t in threads)

    idle = wait_idle(url)
    leaked_tokens = pool_tokens_after_flush(url)
    rss_after = group_rss_bytes(server_pgid)
    leak_lines = []
    if server_log and server_log.exists():
        with open(server_log, errors="replace") as f:
            f.seek(log_start)
            leak_lines = [line.strip() for line in f if any(m in line for m in LEAK_MARKERS)]

    problems = []
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
        if o.status == "finished" and len(o.scores) != o.tokens:
            problems.append(f"{o.endpoint} prompt {o.prompt_id}: {len(o.scores)} score rows for {o.tokens} tokens")
        if o.status == "finished" and o.tokens == 0:
            problems.append(f"{o.endpoint} prompt {o.prompt_id}: finished with no tokens")
    for o in outcomes:
        if o.status in ("error", "hung"):
            problems.append(f"{o.endpoint} prompt {o.prompt_id}: {o.status}: {o.error}")
    compared, diverged, twin_problems = twin_mismatches(outcomes, twin_atol)
    problems += twin_problems
    if still_running:
        problems.append(f"{still_running} client threads never returned")
    if idle["num_running_reqs"] or idle["num_waiting_reqs"]:
        problems.append(f"requests still in the server after the load: {idle}")
    if leaked_tokens != leaked_before:
        problems.append(f"KV pool holds {leaked_tokens} tokens after a flush (before the load: {leaked_before})")
    problems += [f"server log: {line}" for line in leak_lines[:5]]

    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    itl = [x for o in outcomes for x in o.itl_s]
    finished = [o for o in outcomes if o.status == "finished"]
    total_tokens = sum(o.tokens for o in finished)

    def ms(v):
        return None if v is None else round(1000 * v, 1)

    return {
        "clients": clients, "duration_s": duration_s, "wall_s": round(wall_s, 1),
        "drop_fraction": drop_fraction, "seed": seed, "prompts": prompts,
        "requests": len(outcomes), "by_status": by_status,
        "by_endpoint": {e: sum(o.endpoint == e for o in outcomes) for e in ENDPOINTS},
        "finished_tokens": total_tokens,
        "output_tok_per_s": round(total_tokens / wall_s, 1) if wall_s else None,
        "ttft_ms": {"p50": ms(percentile(ttft, 50)), "p99": ms(percentile(ttft, 99)), "n": len(ttft)},
        "itl_ms": {"p50": ms(percentile(itl, 50)), "p99": ms(percentile(itl, 99)), "n": len(itl)},
        "twins": {"compared": compared, "diverged_before_first_score": diverged, "atol": twin_atol},
        "kv_tokens_after_flush": {"before": leaked_before, "after": leaked_tokens},
        "server_rss_bytes": {"before": rss_before, "after": rss_after},
        "leak_log_lines": len(leak_lines),
        "problems": problems,
    }


def write_results(report: dict, out_dir: Path, command: str, server_cmd: str | None) -> tuple[Path, Path]:
    from sglang_ext.launch.demo import cpu_model, loadavg, nproc

    import sglang_ext

    report = {"benchmark": "load_cpu", **report,
              "machine": {"nproc": nproc(), "cpu_model": cpu_model(), "load_average_after": loadavg()},
              "sglang_ext": sglang_ext.__version__, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": command, "server_command": server_cmd}
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "load_cpu.json", out_dir / "load_cpu.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    rss = report["server_rss_bytes"]
    rss_row = ("n/a (external server)" if rss["before"] is None else
               f"{rss['before'] / 2**20:.0f} MiB -> {rss['after'] / 2**20:.0f} MiB")
    rows = [
        ("clients x duration", f"{report['clients']} x {report['duration_s']:.0f} s (wall {report['wall_s']} s)"),
        ("requests (chat / completions / generate)",
         f"{report['requests']} ({' / '.join(str(report['by_endpoint'][e]) for e in ENDPOINTS)})"),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(report["by_status"].items()))),
        ("TTFT p50 / p99", f"**{report['ttft_ms']['p50']} / {report['ttft_ms']['p99']} ms** (n={report['ttft_ms']['n']})"),
        ("inter-token latency p50 / p99",
         f"**{report['itl_ms']['p50']} / {report['itl_ms']['p99']} ms** (n={report['itl_ms']['n']})"),
        ("output tokens of finished streams / s", report["output_tok_per_s"]),
        ("greedy twins compared (scores within atol)",
         f"{report['twins']['compared']} (atol {report['twins']['atol']}; "
         f"{report['twins']['diverged_before_first_score']} diverged before any score)"),
        ("KV tokens held after flush (before / after)",
         f"{report['kv_tokens_after_flush']['before']} / {report['kv_tokens_after_flush']['after']}"),
        ("server RSS (process group) before / after", rss_row),
        ("idle leak-check lines in the server log", report["leak_log_lines"]),
        ("problems", len(report["problems"])),
        ("machine", f"{report['machine']['nproc']} cores, {report['machine']['cpu_model']}, "
                    f"load average after {report['machine']['load_average_after']}"),
        ("date (UTC)", report["date_utc"]),
        ("command", f"`{command}`"),
        ("server command", f"`{server_cmd}`" if server_cmd else "external"),
    ]
    md = [
        "# CPU load test: concurrent streaming clients on loopback (tiny random gpt-oss bf16 + tiny SingProbe)",
        "",
        f"Written by `benchmarks/bench_load.py`. {report['clients']} clients stream greedy requests for "
        f"{report['duration_s']:.0f} s, a mix of OpenAI chat, OpenAI completions and native /generate; "
        f"{report['drop_fraction']:.0%} of requests hang up after 0-6 chunks. Checked: every request "
        "ended, one score row per completion token on every finished stream, equal scores on greedy "
        "twins, nothing left in the KV pool (which also indexes the probe's K/V) after a flush, no idle "
        "leak report. TTFT: request sent to first token-bearing chunk; ITL: gap between token-bearing "
        "chunks divided over their tokens. The tiny model makes this a measure of the serving path "
        "(scheduler, HTTP, SSE, probe plumbing) on 2 shared cores, not of gpt-oss compute.",
        "",
        "| metric | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in rows],
        "",
    ]
    if report["problems"]:
        md += ["## Problems", "", *[f"- {p}" for p in report["problems"][:50]], ""]
    md_path.write_text("\n".join(md))
    return json_path, md_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="load a running server (default: start the tiny CPU server)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    ap.add_argument("--drop-fraction", type=float, default=0.2, help="share of requests the client hangs up on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="folder for load_cpu.{json,md}")
    ap.add_argument("--no-write", action="store_true", help="print the report only")
    args = ap.parse_args(argv)
    command = "python benchmarks/bench_load.py " + " ".join(argv if argv is not None else sys.argv[1:])

    server = None
    url, server_cmd, log, pgid = args.url, None, None, None
    if url is None:
        from sglang_ext.launch.make_tiny import generate as make_tiny
        from sglang_ext.launch.make_tiny_probe import generate as make_probe
        from sglang_ext.launch.server import SGLangServer
        from sglang_ext.launch.tokenizer import ensure_o200k_vocab

        tiny = ROOT / ".cache" / "tiny"
        ckpt = Path(make_tiny(tiny, variants=("bf16", "fp32"), log=lambda *_: None)["bf16"])
        probe = make_probe(str(tiny / "probe"), base_dir=str(tiny / "fp32"), log=lambda *_: None)
        server = SGLangServer(ckpt, ["--probe-ckpt", probe, "--load-snapshot-publish-interval", "1"],
                              vocab_dir=ensure_o200k_vocab(), startup_timeout=900)
        print("starting the CPU server ...", flush=True)
        server.start()
        url, log, pgid = server.url, server.log_path, server.proc.pid
        server_cmd = " ".join(server.command()).replace(str(ROOT) + "/", "")
    try:
        report = run_load(url, args.clients, args.duration, args.drop_fraction, args.seed,
                          server_log=log, server_pgid=pgid)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps({k: v for k, v in report.items() if k != "problems"}, indent=2))
    for p in report["problems"][:30]:
        print("PROBLEM:", p)
    if not args.no_write:
        for path in write_results(report, args.out, command, server_cmd):
            print("wrote", path)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
