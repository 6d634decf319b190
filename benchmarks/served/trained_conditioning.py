"""How much do rounding errors move the probe scores of a trained tiny checkpoint? One row per training recipe.

The served parity check (parity.py) holds a served FP8 run to the fp32 truth on the same weights (with the same
w8a8 activation rounding) within 2e-2. Part of any served run's distance from that truth is the model's own
amplification of rounding: transformers in bf16 with the same w8a8 rounding (`fp8_probe_ref_err`) is a correct
implementation too, and its distance from the truth bounds what a served run can show. This script trains the
trained profile's task (make_tiny.train_chain) under several recipes and measures, for each, without a server:

  loss            the last training step's loss
  chain_ok        fp32 greedy tokens that follow the task's chain, of 48, on parity's prompt
  min_margin      the fp32 truth's smallest top-2 gap (nats) along those tokens (every served token must match)
  bf16_probe_ref_err / fp8_probe_ref_err   max |reference - truth| of the probe scores, bf16 and FP8 (w8a8)
  bf16_tokens / fp8_tokens                 reference greedy tokens equal to the truth's before the first difference
  *_routing_flips (layer, token) pairs where the reference picks other experts than the truth on the same sequence
  tap_rel_err     relative L2 distance of the FP8 reference's hidden states from the truth's at the probe's taps

    eval "$(python3 benchmarks/served/gpu_env.py .carry)"; cd /tmp
    python3 $REPO/benchmarks/served/trained_conditioning.py --only NAME --out $OUT/cond_NAME.json
    python3 benchmarks/served/trained_conditioning.py --collect CALL_DIR...   (here: into benchmarks/results/)

One recipe at a time: recipes run side by side on one GPU gain nothing (it time-slices between processes: the
default recipe took 193 s beside four others, 37-44 s alone). On an H100 the batch-32 recipes took 138 s each with
two side by side; on 2 CPU cores the kept one (500 steps at batch 32) trained in 45 minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import parity  # noqa: E402

from sglang_ext.launch import make_tiny as mt  # noqa: E402
from sglang_ext.launch.make_tiny_probe import generate as make_probe  # noqa: E402

# The first recipe's task; each recipe below is (init profile the training starts from, overrides of it).
# make_tiny's trained profile is PROFILE.
PROFILE = "calm_b32_500_wd0.3_rm1"
BASE_TASK = {"tokens": 512, "lag": 2, "seed": 1, "steps": 600, "batch": 8, "length": 384, "lr": 3e-3}
RECIPES = {
    "calm_b32_500_wd0.3_rm1": ("calm", {"batch": 32, "steps": 500, "weight_decay": 0.3, "router_margin": 1.0}),
    "calm_b32_500": ("calm", {"batch": 32, "steps": 500}),
    "calm_b32_500_wd0.3": ("calm", {"batch": 32, "steps": 500, "weight_decay": 0.3}),
    "default_wd1": ("default", {"weight_decay": 1.0}),
    "default": ("default", {}),
}


def follows_chain(prompt, tokens, task):
    ids, step = mt.chain_task(task)
    pos = {int(t): i for i, t in enumerate(ids)}
    seq, lag = prompt + tokens, task["lag"]
    return sum(1 for i in range(len(prompt), len(seq))
               if seq[i - lag] in pos and seq[i] == int(ids[step[pos[seq[i - lag]]]]))


@torch.no_grad()
def expert_choices(model, sequence) -> torch.Tensor:
    """[layers, tokens, top_k] sorted expert ids the model routes ``sequence`` through."""
    got = []
    hooks = [layer.mlp.router.register_forward_hook(lambda _m, _a, out: got.append(out[2].sort(-1).values.cpu()))
             for layer in model.model.layers]
    model(torch.tensor([sequence], device=model.device))
    for h in hooks:
        h.remove()
    return torch.stack(got)


def checkpoint(root: Path, init: str, task: dict, log) -> dict:
    """make_tiny's trained profile with this recipe (make_tiny reads both at call time)."""
    mt.INIT_PROFILES["trained"], mt.CHAIN_TASK = mt.INIT_PROFILES[init], task
    made = mt.generate(root, variants=("bf16", "fp32"), init="trained", log=log)
    fp8 = root / "fp8"
    if not (fp8 / "config.json").exists():
        subprocess.run([sys.executable, "-m", "sglang_ext.launch.convert", made["bf16"], str(fp8)], check=True,
                       stdout=subprocess.DEVNULL)
    return {"bf16": Path(made["bf16"]), "fp32": Path(made["fp32"]), "fp8_hf": parity.fp8_as_hf(fp8, root / "fp8_as_hf"),
            "probe": Path(make_probe(str(root / "probe"), base_dir=made["fp32"], log=lambda *_: None))}


def measure(ck: dict, task: dict) -> dict:
    prompt, n, p = mt.chain_prompt(parity.PROMPT_LEN, task=task), parity.NEW_TOKENS, parity.PROMPT_LEN
    row = {}
    for label, ref_dir, truth_dir, w8a8 in (("bf16", ck["bf16"], ck["fp32"], False),
                                            ("fp8", ck["fp8_hf"], ck["fp8_hf"], True)):
        truth = parity.hf_model(truth_dir, torch.float32, w8a8=w8a8)
        want = parity.hf_greedy(truth, prompt)
        truth_lp, truth_hidden = parity.hf_logprobs_and_hidden(truth, prompt + want, p)
        ref = parity.hf_model(ref_dir, torch.bfloat16, w8a8=w8a8)
        got = parity.hf_greedy(ref, prompt)
        _, ref_hidden = parity.hf_logprobs_and_hidden(ref, prompt + want, p)
        truth_scores = parity.reference_scores(truth_hidden, ck["probe"], p, n)
        ref_scores = parity.reference_scores(ref_hidden, ck["probe"], p, n)
        row[f"{label}_tokens"] = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), n)
        row[f"{label}_probe_ref_err"] = float((ref_scores - truth_scores).abs().max())
        # (layer, token) pairs whose expert set differs between the reference and the truth on the same sequence
        row[f"{label}_routing_flips"] = int((expert_choices(ref, prompt + want)
                                             != expert_choices(truth, prompt + want)).any(-1).sum())
        if label == "fp8":
            row["chain_ok"] = follows_chain(prompt, want, task)
            row["min_margin"] = float(truth_lp.topk(2, -1).values.diff(dim=-1).abs().min())
            taps = json.loads((ck["probe"] / "config.json").read_text())["base_model_layer_ids"]
            row["tap_rel_err"] = [round(float((ref_hidden[i].float() - truth_hidden[i].float()).norm()
                                              / truth_hidden[i].float().norm()), 5) for i in taps]
        del truth, ref
    return row


RESULTS = HERE.parents[1] / "benchmarks" / "results" / "trained_conditioning.json"
COLUMNS = ["recipe", "init", "steps", "batch", "lr", "weight_decay", "router_margin", "loss", "chain_ok", "min_margin",
           "bf16_tokens", "bf16_probe_ref_err", "bf16_routing_flips", "fp8_tokens", "fp8_probe_ref_err",
           "fp8_routing_flips", "tap_rel_err", "card", "call"]


SERVED = ["checkpoint", "tokens_match", "tokens_total", "truth_min_margin", "probe_max_abs_err", "probe_err_truth",
          "probe_ref_err", "radix_hit_score_gap", "prefix_hit_score_gap", "cached_equals_cold"]


def collect(call_dirs: list[Path], results: Path = RESULTS) -> dict:
    """Merge the rows of device calls (each a folder of cond_*.json and env.json) into ``results`` (+ .md): a
    recipe measured again replaces its older row."""
    data = json.loads(results.read_text()) if results.exists() else {"rows": []}
    by_recipe = {r["recipe"]: r for r in data["rows"]}
    for d in call_dirs:
        card = json.loads((d / "env.json").read_text())["device"]
        for f in sorted(d.glob("cond_*.json")):
            for r in json.loads(f.read_text())["rows"]:
                by_recipe[r["recipe"]] = dict(r, card=card, call=d.name)
        # parity.py's rows on make_tiny's trained profile, where the call ran it
        for f in sorted(d.glob("parity*.json")):
            for r in json.loads(f.read_text())["parity"]:
                served = [s for s in data.get("served", []) if (s["checkpoint"], s["card"]) != (r["checkpoint"], card)]
                data["served"] = served + [{k: r.get(k) for k in SERVED} | {"card": card, "call": d.name}]
    data["rows"] = sorted(by_recipe.values(), key=lambda r: r["fp8_probe_ref_err"])
    data["command"] = ("python3 benchmarks/served/trained_conditioning.py --only RECIPE --out $OUT/cond_RECIPE.json "
                       "(under gpu_env.py), one recipe at a time")
    results.write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# Trained tiny checkpoints: how far rounding moves their probe scores, per training recipe", "",
             "`benchmarks/served/trained_conditioning.py`. Each row trains make_tiny's chain task under one recipe and "
             "compares, on parity.py's prompt and the truth's 48 greedy tokens, transformers in bf16 (and bf16 with the "
             "FP8 layers' w8a8 rounding on the dequantised e4m3 weights) with the same model in fp32: the probe "
             "scores' max distance (`probe ref err`), the (layer, token) pairs routed to other experts "
             "(`routing flips`, of 6 x 348), and the relative distance of the FP8 reference's hidden states at the "
             "probe's three taps. A served run is held to 2e-2 of the truth; this is what a correct implementation "
             "in that dtype already spends.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in data["rows"]:
        flat = dict(r, **{k: r["task"].get(k) for k in ("steps", "batch", "lr", "weight_decay", "router_margin")})
        cells = [f"{flat.get(c):.4g}" if isinstance(flat.get(c), float) else str(flat.get(c, "")) for c in COLUMNS]
        lines.append("| " + " | ".join("" if c == "None" else c for c in cells) + " |")
    if data.get("served"):
        lines += ["", "## Served on the trained profile (parity.py, SGLang with this plugin)", "",
                  "make_tiny's trained profile (" + PROFILE + "), served by the real `launch_server`; probe errors "
                  "against the reference in the served dtype and against the fp32 truth, and that reference's own "
                  "distance from the truth.", "",
                  "| " + " | ".join(SERVED + ["card", "call"]) + " |", "|" + "---|" * (len(SERVED) + 2)]
        for r in data["served"]:
            lines.append("| " + " | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
                                           for c in SERVED + ["card", "call"]) + " |")
    results.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return data


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--collect", nargs="+", type=Path, help="merge these device calls' rows into the results")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/sglang_ext_conditioning"))
    ap.add_argument("--only", default="")
    ap.add_argument("--steps", type=int, default=None, help="override every recipe's steps (a quick check)")
    args = ap.parse_args(argv)
    if args.collect:
        collect(args.collect)
        return
    only = set(filter(None, args.only.split(",")))
    rows = []
    for name, (init, overrides) in RECIPES.items():
        if only and name not in only:
            continue
        task = dict(BASE_TASK, **overrides)
        if args.steps:
            task["steps"] = args.steps
        losses = []
        t0 = time.time()
        ck = checkpoint(args.work / name, init, task, log=lambda m: (losses.append(m), print(m, flush=True)))
        row = {"recipe": name, "init": init, "task": task, "train_s": round(time.time() - t0, 1),
               "loss": next((float(m.rsplit(" ", 1)[1]) for m in reversed(losses) if "train_chain step" in m), None)}
        row.update(measure(ck, task))
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                                        "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
