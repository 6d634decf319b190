"""The README's results table, generated from benchmarks/results/served_gpu.json so that nobody types a number.

Rewrites the block between `<!-- results:begin -->` and `<!-- results:end -->` in README.md:
model x batch -> served tok/s per user, % of copy bandwidth, harness tok/s per user, served / harness,
probe overhead, 8k prefill TTFT, and a hardware line (GPU, torch, Triton, SGLang, and the commit and date
of the results file, from `git log`).

    python benchmarks/readme_table.py           # rewrite the block
    python benchmarks/readme_table.py --check   # exit 1 if the README's block is stale

The hardware line names the commit that last changed served_gpu.json, so commit new results first and
then regenerate the README (a commit cannot name itself). Where git cannot say (no repository, or a
shallow clone whose history may not reach that commit), `--check` compares everything but that line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "served_gpu.json"
README = ROOT / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
PREFILL_TOKENS = 8192
PROVENANCE = "Results file: "  # the line --check may skip when git cannot name the commit


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance(path: Path = RESULTS) -> tuple[str, str] | None:
    """(short commit, date) of the last commit that changed `path`, or None where git cannot say."""
    if _git("rev-parse", "--is-shallow-repository") != "false":
        return None
    line = _git("log", "-1", "--format=%h,%cs", "--", str(path.relative_to(ROOT)))
    if not line or "," not in line:
        return None
    commit, date = line.split(",", 1)
    return commit, date


def _num(value, fmt: str, suffix: str = "") -> str:
    return "–" if value is None else format(value, fmt) + suffix


def _short_model(model: str) -> str:
    return model.removeprefix("gpt-oss-")


def render(data: dict, prov: tuple[str, str] | None) -> str:
    """The Markdown between the markers (without them)."""
    everything = data.get("decode") or []
    withheld = sorted({r["batch"] for r in everything if str(r.get("note", "")).startswith("invalid")})
    decode = sorted((r for r in everything if not str(r.get("note", "")).startswith("invalid")),
                    key=lambda r: (r["model"], r.get("device", ""), r["batch"]))
    prefill = {(r["model"], r.get("device")): r for r in data.get("prefill") or []
               if r.get("input_tokens") == PREFILL_TOKENS}
    devices = sorted({r.get("device") for r in decode} | {d for _, d in prefill})
    several = len(devices) > 1
    head = ["model", "batch", "ctx", "probe", "served tok/s/user", "% copy BW", "harness tok/s/user",
            "served / harness", "probe overhead (harness)", "8k prefill TTFT ms"]
    if several:
        head.append("GPU")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    shown_prefill = set()
    for r in decode:
        served_bw, harness_bw = r.get("served_pct_copy_bw"), r.get("harness_pct_copy_bw")
        if served_bw is not None:
            bw = f"{served_bw:.0f} (served)"
        elif harness_bw is not None:
            bw = f"{harness_bw:.0f} (harness)"
        else:
            bw = "–"
        key = (r["model"], r.get("device"))
        ttft = ""
        if key in prefill and key not in shown_prefill:  # once per model, on its first (smallest-batch) row
            ttft = _num(prefill[key].get("served_ttft_ms"), ".1f")
            shown_prefill.add(key)
        cells = [_short_model(r["model"]), str(r["batch"]), f"{r['context'] // 1024}k",
                 "on" if r.get("probe") else "off",
                 _num(r.get("served_tok_s_per_user"), ".1f"), bw, _num(r.get("harness_tok_s_per_user"), ".1f"),
                 _num(r.get("served_over_harness"), ".2f"), _num(r.get("harness_probe_overhead_pct"), ".2f", " %"),
                 ttft]
        if several:
            cells.append(r.get("device") or "?")
        lines.append("| " + " | ".join(cells) + " |")
    for (model, device), p in sorted(prefill.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        if (model, device) not in shown_prefill:  # a prefill row without decode rows still shows
            cells = [_short_model(model), "–", "–", "on" if p.get("probe") else "off", "–", "–", "–", "–", "–",
                     _num(p.get("served_ttft_ms"), ".1f")]
            if several:
                cells.append(device or "?")
            lines.append("| " + " | ".join(cells) + " |")
    gpu = ", ".join(d for d in devices if d) or data.get("device", "?")
    hardware = (f"GPU: {gpu} · torch {data.get('torch', '?')} · Triton {data.get('triton', '?')} · "
                f"SGLang {data.get('sglang', '?')}")
    extra = " ".join(data.get("flags") or [])
    flags = f" and `{extra}` (that machine's setup)" if extra else ""
    where = f"commit {prov[0]}, {prov[1]}" if prov else "commit unknown (no git history here)"
    return "\n".join([
        "",
        hardware + "  ",
        f"{PROVENANCE}`benchmarks/results/served_gpu.json` ({where}); "
        "regenerate with `python benchmarks/readme_table.py`.",
        "",
        *lines,
        "",
        "Served: the real `sglang.launch_server` with this plugin, `--load-format dummy` on the official config, "
        f"`--probe-ckpt` where the probe is on{flags}, measured with SGLang's `one_batch_server`; harness: the "
        "same layers timed on their own paged cache in the same call. % copy BW: the bytes a step must read over "
        "the device's measured copy bandwidth (served where measured, else the harness's).",
        "",
        *([f"Rows at batch {', '.join(map(str, withheld))} are withheld as invalid measurements; each row's note in "
           "`served_gpu.md` says why, and they wait for a re-run.", ""] if withheld else []),
        *_profile_lines(data.get("profile") or []),
    ])


def _profile_lines(rows: list) -> list:
    """One sentence per model: batch-1 streamed decode at the client, per machine (served_gpu.md has the table)."""
    out = []
    for model in sorted({r["model"] for r in rows}):
        parts, mine = [], sorted((r for r in rows if r["model"] == model), key=lambda r: (r["call"], not r["probe"]))
        for r in mine:
            ratio = f", {r['served_over_harness']:.2f} x its harness" if r.get("served_over_harness") else ""
            parts.append(f"{r['itl_median_ms']:.3f} ms probe {'on' if r['probe'] else 'off'} ({r['call']}{ratio})")
        out += [f"Batch-1 decode streamed to a client, {_short_model(model)} at {mine[0]['context'] // 1024}k, "
                f"median inter-token time: {'; '.join(parts)} (served_gpu.md: the harness on each machine, and why "
                "one was slower).", ""]
    return out


def replace_block(text: str, block: str) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md lacks the markers {BEGIN} ... {END}")
    return text[:start + len(BEGIN)] + "\n" + block.strip("\n") + "\n" + text[end:]


def _without_provenance(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith(PROVENANCE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md's block is not what the results give")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    data = json.loads(args.results.read_text())
    prov = provenance(args.results.resolve())
    text = args.readme.read_text()
    want = replace_block(text, render(data, prov))
    if args.check:
        same = want == text if prov else _without_provenance(want) == _without_provenance(text)
        if not same:
            print(f"{args.readme} results table is stale: run python benchmarks/readme_table.py", file=sys.stderr)
            return 1
        return 0
    if want != text:
        args.readme.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main())
