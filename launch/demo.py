"""The sglang-ext demo: a real SGLang server on this CPU, a tiny gpt-oss with a SingProbe head, per-token scores.

    bash launch/demo.sh [--port N] [--max-tokens N] [--keep-cache] [--no-probe] [--playground]
                        [--write-benchmark]

(module ``sglang_ext.launch.demo``). Steps:

1. make the tiny gpt-oss checkpoint (bf16 variant, official Hugging Face layout, random
   weights) in ``<repo>/.cache/tiny`` (``make_tiny.generate``) and the tiny SingProbe bound to it
   (``make_tiny_probe.generate``, released format, random weights);
2. start ``python -m sglang.launch_server`` on 127.0.0.1 with that checkpoint and ``--probe-ckpt``
   through ``SGLangServer`` (the CPU shims are applied for us; on a CPU the plugin picks the
   ``ext_sinks`` attention backend and our GptOssForCausalLM by itself);
3. stream one chat through the official ``openai`` SDK, each token shown with its score
   (``stream_client.TokenView``: coloured by label_8, marked where label_9 is high), and the
   per-label maxima;
4. the same chat with a per-request guard (``custom_params.probe_stop``) that stops it
   (``finish_reason: content_filter``), and where, which label, score and threshold;
5. the same guarded request on native ``/generate`` (the chat's prompt token ids), whose
   ``meta_info.token_probe_probs`` and ``finish_reason`` carry the same numbers;
6. stop the server (always, in a ``finally``); ``--playground`` first keeps it serving
   ``/playground`` until Ctrl-C.

``--no-probe`` is the plain run: no probe, one streamed chat and one streamed ``/generate``.
``--write-benchmark`` also measures greedy non-streaming ``/generate`` decode speed and writes
``benchmarks/results/cpu_demo_decode.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

NOISE_NOTE = (
    "random tiny weights: the words are noise; what matters is that tokens stream from "
    "the real SGLang server through sglang-ext"
)
PROBE_NOISE_NOTE = (
    "the weights of the model AND of the probe are random: the words are noise and so are the scores; "
    "what is real is the path (a SingProbe head scoring every token inside the SGLang server, the scores "
    "on both APIs, the guard stopping a request)"
)
GUARD_LABEL = "label_8"  # SingProbe's response_unsafe
MARK_LABEL = "label_9"  # SingProbe's hallucination
CHAT_MESSAGE = "Explain in one sentence why the sky is blue."
GENERATE_PROMPT = "The quick brown fox"
BENCH_TOKENS = 64  # >= 48 decoded tokens per benchmark request
BENCH_REPEATS = 3


def repo_root() -> Path:
    """The checkout this module lives in (launch/ is mapped to sglang_ext.launch, editable)."""
    here = Path(__file__).resolve().parents[1]
    if (here / "pyproject.toml").is_file():
        return here
    return Path.cwd()


def header(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(3, 74 - len(title)), flush=True)


def show(text: str) -> str:
    """One line per stream: make newlines and tabs visible instead of breaking the layout."""
    return text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


def sse_events(resp: requests.Response):
    """Yield the JSON payload of each `data:` line of a server-sent-event stream, until [DONE]."""
    for raw in resp.iter_lines(decode_unicode=False):
        if not raw:
            continue
        line = raw.decode("utf-8", errors="replace")
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if isinstance(event, dict) and "error" in event:
            raise RuntimeError(f"server returned an error in the stream: {event['error']}")
        yield event


class StreamPrinter:
    """Prints labelled text pieces inline, separated by '|', starting a new line per label."""

    def __init__(self, indent: str = "  "):
        self.indent = indent
        self.label = None
        self.col = 0

    def piece(self, label: str, text: str) -> None:
        if label != self.label:
            if self.label is not None:
                sys.stdout.write("\n")
            sys.stdout.write(f"{self.indent}[{label}] ")
            self.label, self.col = label, 0
        elif self.col:
            sys.stdout.write("|")
        sys.stdout.write(show(text))
        self.col += 1
        sys.stdout.flush()

    def end(self) -> None:
        if self.label is not None:
            sys.stdout.write("\n")
            sys.stdout.flush()


def stream_chat(url: str, model: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": CHAT_MESSAGE}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    print(f"  POST {url}/v1/chat/completions  stream=true max_tokens={max_tokens} temperature=0")
    print(f"  user: {CHAT_MESSAGE!r}")
    print("  (each |-separated piece below is one streamed delta, printed as it arrived)")
    printer = StreamPrinter()
    t0 = time.perf_counter()
    t_first = None
    pieces = {"reasoning": 0, "content": 0}
    usage, finish = None, None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for ev in sse_events(r):
            if ev.get("usage"):
                usage = ev["usage"]
            for choice in ev.get("choices") or []:
                delta = choice.get("delta") or {}
                for key, label in (("reasoning_content", "reasoning"), ("content", "content")):
                    text = delta.get(key)
                    if text:
                        if t_first is None:
                            t_first = time.perf_counter()
                        pieces[label] += 1
                        printer.piece(label, text)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
    t_end = time.perf_counter()
    printer.end()
    if not any(pieces.values()):
        print("  (no text deltas: the stream carried no reasoning or content)")
    return {"pieces": pieces, "usage": usage, "finish_reason": finish, "t0": t0, "t_first": t_first, "t_end": t_end}


def stream_generate(url: str, max_tokens: int) -> dict:
    body = {
        "text": GENERATE_PROMPT,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    print(f"  POST {url}/generate  stream=true max_new_tokens={max_tokens} temperature=0 (greedy)")
    print(f"  prompt: {GENERATE_PROMPT!r}")
    print("  (each |-separated piece below is the new text of one streamed chunk)")
    printer = StreamPrinter()
    t0 = time.perf_counter()
    t_first, t_last_tok = None, None
    prev_text, chunks, meta = "", 0, {}
    tokens_seen = 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for ev in sse_events(r):
            text = ev.get("text", "")
            meta = ev.get("meta_info") or meta
            new = text[len(prev_text):] if text.startswith(prev_text) else text
            prev_text = text if text.startswith(prev_text) else prev_text + text
            n = int(meta.get("completion_tokens", tokens_seen))
            if n > tokens_seen:
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                t_last_tok = now
                tokens_seen = n
            if new:
                chunks += 1
                printer.piece("text", new)
    t_end = time.perf_counter()
    printer.end()
    return {
        "chunks": chunks,
        "tokens": int(meta.get("completion_tokens", tokens_seen)),
        "prompt_tokens": meta.get("prompt_tokens"),
        "finish_reason": meta.get("finish_reason"),
        "e2e_latency": meta.get("e2e_latency"),
        "t0": t0,
        "t_first": t_first,
        "t_last": t_last_tok or t_end,
        "t_end": t_end,
    }


def server_facts(url: str) -> dict:
    """What the running server resolved: attention backend, device, dtype, version."""
    try:
        info = requests.get(url + "/server_info", timeout=30).json()
    except (requests.RequestException, ValueError):
        return {}
    keys = ("version", "device", "attention_backend", "dtype")
    return {k: info.get(k) for k in keys if info.get(k) not in (None, "auto")}


def start_with_progress(server, every: float = 20.0) -> None:
    """server.start() in the calling thread, a helper thread printing a line every `every` seconds so a slow
    start is visibly alive. Not the other way round: the server is started with a parent-death signal
    (launch/server.py with_parent_death), which the kernel sends when the *thread* that spawned it exits, so
    a server spawned by a helper thread was killed as soon as that thread returned, right after it came up."""
    done = threading.Event()
    t0 = time.perf_counter()

    def tick():
        while not done.wait(every):
            print(f"  ... starting ({time.perf_counter() - t0:.0f} s)", flush=True)

    ticker = threading.Thread(target=tick, name="sglang-ext-demo-progress", daemon=True)
    ticker.start()
    try:
        server.start()
    finally:
        done.set()
        ticker.join()


def served_model_id(url: str, fallback: str) -> str:
    try:
        data = requests.get(url + "/v1/models", timeout=30).json()["data"]
        return data[0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError):
        return fallback


# ------------------------------------------------------------------------------------------------
# the probe: scores per token, the guard, both APIs
# ------------------------------------------------------------------------------------------------


def probe_labels(probe_dir: str) -> tuple[list[str], bool]:
    """(the probe's label names, whether its config names them; released configs carry only num_labels)."""
    from sglang_ext.probe.config import ProbeConfig

    raw = json.loads((Path(probe_dir) / "config.json").read_text())
    return list(ProbeConfig.from_json_file(str(Path(probe_dir) / "config.json")).labels), bool(raw.get("labels"))


def pick_threshold(values: list[float], target: int, margin: float = 0.002) -> tuple[float, int] | None:
    """(t, k): a threshold on a 0.01 grid whose first crossing (score > t) is token k >= 1, k nearest `target`;
    no score up to k lies within `margin` of t, so a re-run's last-digit noise cannot move the stop."""
    best = None
    for step in range(1, 100):
        t = step / 100
        k = next((i for i, v in enumerate(values) if v > t), None)
        if k is None or k < 1 or min(abs(v - t) for v in values[: k + 1]) < margin:
            continue
        if best is None or abs(k - target) < abs(best[1] - target):
            best = (t, k)
    return best


def show_scores_chat(url: str, model: str, prompt: str, max_tokens: int, label: str, stop: dict | None = None):
    """The chat streamed through the official openai SDK, each token printed with its score as it arrives."""
    from sglang_ext.launch.stream_client import TokenView, stream_with_openai_sdk, use_colour

    view = TokenView(label=label, mark=MARK_LABEL, colour=use_colour("auto", sys.stdout), out=sys.stdout)
    extra = f", extra_body={{'custom_params': {{'probe_stop': {stop}}}}}" if stop else ""
    print(f"  openai.OpenAI(base_url='{url}/v1').chat.completions.create(stream=True, max_tokens={max_tokens}, "
          f"temperature=0{extra})")
    print(f"  user: {prompt!r}")
    result = stream_with_openai_sdk(url, model, prompt, max_tokens, view=view, stop=stop)
    if not result.tokens:
        raise RuntimeError("the chat stream carried no token_probe_probs: is the server running with --probe-ckpt?")
    print("  " + view.legend())
    return result, view


def prompt_ids_of_chat(url: str, model: str, prompt: str) -> list[int]:
    """The token ids the server renders the chat into (Harmony), so /generate can get the same prompt."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0,
            "return_prompt_token_ids": True}
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    ids = r.json()["choices"][0].get("prompt_token_ids")
    if not ids:
        raise RuntimeError("the chat response carried no prompt_token_ids")
    return ids


def generate_with_scores(url: str, input_ids: list[int], max_tokens: int, stop: dict) -> dict:
    """Native /generate, streamed, greedy, with the guard in sampling_params.custom_params."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                "custom_params": {"probe_stop": stop}}}
    print(f"  POST {url}/generate  input_ids=<the chat's {len(input_ids)} prompt ids> stream=true "
          f"max_new_tokens={max_tokens} temperature=0 custom_params={{'probe_stop': {stop}}}")
    scores, meta = [], {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for ev in sse_events(r):
            meta = ev.get("meta_info") or meta
            # each chunk's meta_info holds the scores of the tokens since the previous chunk
            scores += (ev.get("meta_info") or {}).get("token_probe_probs") or []
    return {"scores": scores, "finish_reason": meta.get("finish_reason"),
            "completion_tokens": int(meta.get("completion_tokens", len(scores)))}


def run_probe_steps(url: str, model: str, max_tokens: int, labels: list[str]) -> int:
    """Steps 3-5 of the probe demo; 0 when every number arrived as it should."""
    from sglang_ext.launch.stream_client import guard_stop_report, resolve_label

    label = resolve_label(GUARD_LABEL, labels)
    header("3/6  per-token scores: OpenAI chat, streamed through the openai SDK")
    free, view = show_scores_chat(url, model, CHAT_MESSAGE, max_tokens, label)
    print("  per-label maximum over the answer:")
    for line in view.maxima_lines():
        print("    " + line)
    print(f"  ({len(free.tokens)} tokens, {len(free)} scores, finish_reason {free.finish_reason})")

    header("4/6  the guard: the same chat with a per-request threshold (custom_params.probe_stop)")
    values = [tok.scores[label] for tok in free.tokens]
    picked = pick_threshold(values, target=len(values) // 2)
    if picked is None:  # every score within noise of the grid: stop at the first token
        picked = (0.0, 0)
    threshold, expect = picked
    stop = {label: threshold}
    print(f"  threshold {label} > {threshold}: picked from step 3's scores so the stop lands mid-answer, at token "
          f"{expect + 1} (a real guard's threshold is calibrated on labelled data)")
    guarded, _ = show_scores_chat(url, model, CHAT_MESSAGE, max_tokens, label, stop=stop)
    report = guard_stop_report(guarded)
    print(f"  finish_reason: {guarded.finish_reason}")
    print("  guard: " + (report or "did not stop the answer"))
    rc = 0
    if guarded.finish_reason != "content_filter":
        print(f"ERROR: the guard did not stop the chat (finish_reason {guarded.finish_reason})", file=sys.stderr)
        rc = 1

    header("5/6  the same request on native /generate (meta_info.token_probe_probs)")
    ids = prompt_ids_of_chat(url, model, CHAT_MESSAGE)
    native = generate_with_scores(url, ids, max_tokens, stop)
    for i, row in enumerate(native["scores"]):
        print(f"  token {i + 1:>3}: {label}={row[label]:.4f}  {MARK_LABEL if MARK_LABEL in row else ''}"
              + (f"={row[MARK_LABEL]:.4f}" if MARK_LABEL in row else ""))
    print(f"  meta_info.finish_reason: {json.dumps(native['finish_reason'])}")
    reason = native["finish_reason"] if isinstance(native["finish_reason"], dict) else {}
    if reason.get("type") == "content_filter":
        print(f"  guard: stopped at token {len(native['scores'])}: {reason.get('label')} = {reason.get('score'):.4f} "
              f"> threshold {reason.get('threshold')} (finish_reason content_filter)")
    same = min(len(native["scores"]), len(guarded))
    if same:
        diff = max(abs(a[n] - b[n]) for a, b in zip(native["scores"][:same], list(guarded)[:same]) for n in a)
        print(f"  {same} tokens on both APIs; largest difference between their scores: {diff:.2e}")
    if reason.get("type") != "content_filter" or len(native["scores"]) != native["completion_tokens"]:
        print("ERROR: /generate did not stop with content_filter and one score per token", file=sys.stderr)
        rc = 1
    return rc


def serve_playground(url: str) -> None:
    """Keep the server up for the browser until Ctrl-C (the page is on the server's own 127.0.0.1 port)."""
    header("playground")
    print(f"  open {url}/playground in a browser on this machine; Ctrl-C stops the server")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print()


# ------------------------------------------------------------------------------------------------
# benchmark
# ------------------------------------------------------------------------------------------------


def _generate_once(url: str, max_new_tokens: int) -> dict:
    body = {
        "text": GENERATE_PROMPT,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return {"completion_tokens": int(meta["completion_tokens"]), "e2e_latency": float(meta["e2e_latency"])}


def measure_decode(url: str) -> dict:
    """Greedy non-streaming /generate: completion_tokens / meta_info.e2e_latency (median of
    BENCH_REPEATS; prompt prefix cached by a warm-up). Also the rate net of prefill and
    request overhead: (N - 1) / (e2e(N) - e2e(1))."""
    load_before = loadavg()
    _generate_once(url, BENCH_TOKENS)  # warm-up (and caches the prompt prefix)
    runs = [_generate_once(url, BENCH_TOKENS) for _ in range(BENCH_REPEATS)]
    one = [_generate_once(url, 1)["e2e_latency"] for _ in range(BENCH_REPEATS)]
    rates = [x["completion_tokens"] / x["e2e_latency"] for x in runs]
    e2e_n = statistics.median(x["e2e_latency"] for x in runs)
    e2e_1 = statistics.median(one)
    n = runs[0]["completion_tokens"]
    net = (n - 1) / (e2e_n - e2e_1) if e2e_n > e2e_1 else None
    return {
        "completion_tokens": n,
        "repeats": BENCH_REPEATS,
        "e2e_latency_s": [round(x["e2e_latency"], 4) for x in runs],
        "decode_tok_per_s": round(statistics.median(rates), 2),
        "e2e_latency_1_token_s": round(e2e_1, 4),
        "decode_tok_per_s_excl_prefill": round(net, 2) if net else None,
        "loadavg_before": load_before,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def nproc() -> int:
    try:
        return int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, ValueError, subprocess.CalledProcessError):
        return os.cpu_count() or 0


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def write_benchmark(root: Path, bench: dict, facts: dict, server_cmd: list[str], ckpt: Path) -> tuple[Path, Path]:
    import torch

    import sglang_ext

    from importlib.metadata import version

    try:
        ckpt_dtype = json.loads((ckpt / "config.json").read_text()).get("torch_dtype", "?")
    except (OSError, ValueError):
        ckpt_dtype = "?"
    facts = dict(facts)
    facts.setdefault("dtype", f"{ckpt_dtype} (--dtype auto: the checkpoint's)")
    out_dir = root / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "cpu_demo_decode",
        "what": (
            f"greedy non-streaming /generate of {bench['completion_tokens']} tokens (ignore_eos) on the tiny "
            "random gpt-oss bf16 checkpoint (6 layers, hidden 64, 8 experts, vocab 201088), batch 1; "
            "decode_tok_per_s = completion_tokens / meta_info.e2e_latency, median of "
            f"{bench['repeats']} runs after a warm-up"
        ),
        **{k: v for k, v in bench.items() if k != "loadavg_before"},
        "prompt": GENERATE_PROMPT,
        "server": facts,
        "machine": {
            "nproc": nproc(),
            "cpu_model": cpu_model(),
            "torch": torch.__version__,
            "sglang": version("sglang"),
            "sglang_ext": sglang_ext.__version__,
            "python": platform.python_version(),
            "loadavg_before": bench["loadavg_before"],
        },
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join(["python", "-m", "sglang_ext.launch.demo", *sys.argv[1:]]),
        "server_command": shlex.join(["python", *server_cmd[1:]]),
    }
    js = out_dir / "cpu_demo_decode.json"
    js.write_text(json.dumps(record, indent=2) + "\n")
    m = record["machine"]
    net = bench["decode_tok_per_s_excl_prefill"]
    md = out_dir / "cpu_demo_decode.md"
    md.write_text(
        "# CPU demo decode speed (tiny random gpt-oss, bf16)\n\n"
        f"Written by `bash launch/demo.sh --write-benchmark` ({record['date']}). {record['what']}.\n"
        "The tiny model makes this a measure of the serving path (scheduler, attention backend, "
        "per-token overhead), not of gpt-oss-sized compute. On a small shared machine the number moves a lot "
        "with other load (torch's threads compete for the same cores); the load average is recorded below.\n\n"
        "| metric | value |\n|---|---|\n"
        f"| decode tok/s (completion_tokens / e2e_latency) | **{bench['decode_tok_per_s']}** |\n"
        f"| decode tok/s excluding prefill ((N-1) / (e2e(N) - e2e(1))) | {net if net else 'n/a'} |\n"
        f"| completion tokens per request | {bench['completion_tokens']} |\n"
        f"| e2e latency per run (s) | {', '.join(str(x) for x in bench['e2e_latency_s'])} |\n"
        f"| e2e latency of a 1-token request (s) | {bench['e2e_latency_1_token_s']} |\n"
        f"| attention backend | {facts.get('attention_backend', '?')} |\n"
        f"| device / dtype | {facts.get('device', '?')} / {facts.get('dtype', '?')} |\n"
        f"| nproc | {m['nproc']} |\n"
        f"| load average (1/5/15 min) before measuring (includes this demo's own server) | {m['loadavg_before']} |\n"
        f"| CPU | {m['cpu_model']} |\n"
        f"| torch | {m['torch']} |\n"
        f"| sglang / sglang-ext | {m['sglang']} / {m['sglang_ext']} |\n"
        f"| date (UTC) | {record['date']} |\n"
        f"| command | `{record['command']}` |\n"
        f"| server command | `{record['server_command']}` |\n"
    )
    return js, md


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="bash launch/demo.sh",
        description="Start a real SGLang server with sglang-ext on this CPU (tiny random gpt-oss and SingProbe) "
        "and stream tokens with their per-token safety scores.",
    )
    ap.add_argument("--port", type=int, default=None, help="server port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens to generate per request (default 48)")
    ap.add_argument(
        "--keep-cache",
        action="store_true",
        help="keep the tiny checkpoint this run generated in .cache/tiny/bf16 (default: remove it at the end; "
        "a checkpoint that was already there, e.g. from the tests, is always kept)",
    )
    ap.add_argument(
        "--write-benchmark",
        action="store_true",
        help="also measure greedy /generate decode speed and write benchmarks/results/cpu_demo_decode.{json,md}",
    )
    ap.add_argument("--no-probe", action="store_true",
                    help="the plain run: no SingProbe, one streamed chat and one streamed /generate")
    ap.add_argument("--playground", action="store_true",
                    help="after the demo, keep the server running with GET /playground (--enable-playground) "
                    "until Ctrl-C")
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    try:
        sys.stdout.reconfigure(errors="replace")
    except AttributeError:
        pass

    from openai import OpenAIError

    from sglang_ext import PINNED_SGLANG_VERSION, __version__
    from sglang_ext.launch.make_tiny import generate, is_current
    from sglang_ext.launch.server import ServerFailed, SGLangServer
    from sglang_ext.launch.tokenizer import ensure_o200k_vocab

    root = repo_root()
    probe = not args.no_probe
    steps = 6 if probe else 4
    print(f"sglang-ext {__version__} demo: a real SGLang {PINNED_SGLANG_VERSION} server on this CPU, tiny gpt-oss"
          + (" with a SingProbe head" if probe else ""))
    print()
    print("NOTE: " + (PROBE_NOISE_NOTE if probe else NOISE_NOTE) + ".")

    header(f"1/{steps}  tiny gpt-oss checkpoint" + (" and tiny SingProbe" if probe else ""))
    tiny_root = root / ".cache" / "tiny"
    ckpt = tiny_root / "bf16"
    existed = is_current(str(ckpt))
    t = time.perf_counter()
    try:
        vocab_dir = ensure_o200k_vocab()
    except RuntimeError as e:  # no cached copy and no package index reachable: its message says where it looked
        print(f"\nERROR: {e}", file=sys.stderr)
        return 1
    generate(str(tiny_root), variants=("bf16",), log=lambda m: print("  " + m))
    print(f"  vocabulary (o200k, offline): {vocab_dir}")
    print(f"  checkpoint: {ckpt}  ({'reused' if existed else 'generated'}, {time.perf_counter() - t:.1f} s)")
    print("  gpt-oss architecture in the official HF layout, 6 layers, hidden 64, 8 experts (4 active), "
          "sinks + 128-token sliding window, o200k_harmony tokenizer; weights are random")
    server_args, labels = [], []
    if probe:
        from sglang_ext.launch.make_tiny_probe import SINGPROBE_LABEL_NAMES
        from sglang_ext.launch.make_tiny_probe import generate as generate_probe

        probe_dir = generate_probe(str(tiny_root / "probe"), base_dir=str(ckpt), log=lambda m: print("  " + m))
        labels, named = probe_labels(probe_dir)
        print(f"  probe: {probe_dir}  (released SingProbe format: taps of 3 layers -> attention head -> "
              f"{len(labels)} sigmoids per token; weights are random)")
        if named:
            print("  labels (from the probe's config): " + ", ".join(labels))
        else:
            print(f"  labels: {labels[0]} .. {labels[-1]} (the config names none, as released probes; in the "
                  f"SingProbe contract {GUARD_LABEL} is {SINGPROBE_LABEL_NAMES[8]}, {MARK_LABEL} "
                  f"{SINGPROBE_LABEL_NAMES[9]})")
        server_args += ["--probe-ckpt", probe_dir]
    if args.playground:
        server_args.append("--enable-playground")

    server = SGLangServer(ckpt, server_args, port=args.port, vocab_dir=vocab_dir)
    rc = 0
    try:
        header(f"2/{steps}  start the SGLang server" + (" with --probe-ckpt" if probe else ""))
        print("  $ " + shlex.join(["python", *server.command()[1:]]))
        print(f"  log: {server.log_path}")
        print("  (CPU shims applied automatically: SGLANG_USE_CPU_ENGINE=1, stub libcuda.so.1; "
              "sglang-ext loads through the sglang.srt.plugins entry point)")
        print("  (startup takes about a minute on an idle small CPU: imports, tokenizer, model, KV pool)")
        t = time.perf_counter()
        try:
            start_with_progress(server)
        except ServerFailed as e:
            first = str(e).splitlines()[0]
            sys.stdout.flush()
            print(f"\nERROR: the server did not come up: {first}", file=sys.stderr)
            print("----- server log (tail) -----", file=sys.stderr)
            print(server.log_tail(60), file=sys.stderr)
            print("-----------------------------", file=sys.stderr)
            return 1
        print(f"  ready at {server.url} after {time.perf_counter() - t:.1f} s")
        facts = server_facts(server.url)
        if facts:
            print("  server resolved: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
        model = served_model_id(server.url, str(ckpt))

        if probe:
            rc = run_probe_steps(server.url, model, args.max_tokens, labels)
            header("summary")
            print("  (" + PROBE_NOISE_NOTE + ")")
            print("  the same view for any server: python -m sglang_ext.launch.stream_client --base-url URL "
                  f"--label {GUARD_LABEL} --stop {GUARD_LABEL}=0.9 \"your prompt\"")
        else:
            header("3/4  OpenAI /v1/chat/completions, streamed")
            chat = stream_chat(server.url, model, args.max_tokens)
            header("4/4  native /generate, streamed")
            gen = stream_generate(server.url, args.max_tokens)

            header("summary")
            print("  (" + NOISE_NOTE + ")")
            p = chat["pieces"]
            usage = chat["usage"] or {}
            chat_ttft = (chat["t_first"] - chat["t0"]) if chat["t_first"] else None
            print(
                f"  chat:     {usage.get('completion_tokens', '?')} tokens, {p['reasoning']} reasoning + "
                f"{p['content']} content deltas, finish_reason={chat['finish_reason']}, "
                f"total {chat['t_end'] - chat['t0']:.2f} s"
                + (f", time to first delta {chat_ttft * 1000:.0f} ms" if chat_ttft is not None else "")
            )
            if p["content"] and not p["reasoning"]:
                print("            (all text came as content: random weights never emit Harmony's <|channel|> markers, "
                      "which the gpt-oss reasoning parser splits on)")
            n = gen["tokens"]
            ttft = (gen["t_first"] - gen["t0"]) if gen["t_first"] else None
            decode = (n - 1) / (gen["t_last"] - gen["t_first"]) if gen["t_first"] and n > 1 and gen["t_last"] > gen["t_first"] else None
            print(
                f"  generate: {n} tokens in {gen['chunks']} chunks, finish_reason="
                f"{(gen['finish_reason'] or {}).get('type') if isinstance(gen['finish_reason'], dict) else gen['finish_reason']}, "
                f"total {gen['t_end'] - gen['t0']:.2f} s"
            )
            if ttft is not None:
                print(f"            time to first token {ttft * 1000:.0f} ms"
                      + (f", decode {decode:.1f} tok/s (tokens 2..{n} over their arrival time)" if decode else ""))
            if n < 1:
                sys.stdout.flush()
                print("ERROR: /generate streamed no tokens", file=sys.stderr)
                rc = 1

        if args.playground:
            serve_playground(server.url)
        if args.write_benchmark:
            header("benchmark: greedy /generate decode speed (non-streaming)")
            print(f"  {BENCH_REPEATS} x {BENCH_TOKENS} tokens after a warm-up, tok/s = completion_tokens / meta_info.e2e_latency")
            bench = measure_decode(server.url)
            print(f"  e2e latency per run: {bench['e2e_latency_s']} s")
            print(f"  decode: {bench['decode_tok_per_s']} tok/s "
                  f"({bench['decode_tok_per_s_excl_prefill']} tok/s excluding prefill and request overhead)")
            js, md = write_benchmark(root, bench, facts, server.command(), ckpt)
            print(f"  wrote {js.relative_to(root)} and {md.relative_to(root)}")
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        rc = 130
    except (requests.RequestException, OpenAIError, RuntimeError, ValueError) as e:
        sys.stdout.flush()
        print(f"\nERROR: {type(e).__name__}: {e}", file=sys.stderr)
        print("----- server log (tail) -----", file=sys.stderr)
        print(server.log_tail(60), file=sys.stderr)
        print("-----------------------------", file=sys.stderr)
        rc = 1
    finally:
        if server.proc is not None:
            header("stop")
            server.stop()
            print(f"  server stopped (log kept at {server.log_path})")
        if not args.keep_cache and not existed and ckpt.is_dir():
            shutil.rmtree(ckpt, ignore_errors=True)
            print(f"  removed {ckpt.relative_to(root)} (generated by this run; --keep-cache keeps it)")
    if rc == 0:
        print("\ndone: " + ("tokens and their SingProbe scores streamed from the real SGLang server through "
                            "sglang-ext, and the guard stopped a request." if probe else
                            "tokens streamed from the real SGLang server through sglang-ext."))
    return rc


if __name__ == "__main__":
    sys.exit(main())
