"""Served correctness on a GPU: the real `python -m sglang.launch_server` with this plugin, on tiny checkpoints
generated in the real formats, against Hugging Face transformers on the same weights.

For each (checkpoint, CUDA graphs on/off) one server with the tiny SingProbe, and for each:
  tokens   greedy tokens of a cold prefill (after /flush_cache) against transformers' greedy on the same weights
           in the served dtype (bf16; for FP8, on the dequantised e4m3 weights with the served layers' w8a8
           activation rounding). Where they part, the served log-probabilities are compared with the fp32 truth
           (the same model in fp32): a flip inside the reference's own rounding error is a near-tie, not a fault
           (`logprob_err`, `ref_err`, `flip_margin`). Random weights decode such near-ties within a few tokens; the
           `trained_*` checkpoints (make_tiny's trained profile, on a prompt of its task) decode with margins of nats
           (`truth_min_margin`), so there every token must match
  probe    served scores against the reference head (sglang_ext.probe.model) on transformers' hidden states
           of the served sequence in the served dtype (`probe_max_abs_err`) and in fp32 (`probe_err_truth`, the
           criterion, 2e-2: the served dtype's reference carries its own rounding, which for FP8 is the larger;
           `probe_ref_err` is that reference's own distance from the truth)
  cached   the same request again as a radix-cache hit, and after a 200-token prefix hit: the cold run's
           tokens and its scores within 2e-2 (`cached_equals_cold`: the radix hit); where a run parts from the
           cold one, its own log-probs against the truth on its own sequence and the truth's margin where they
           part (`*_logprob_err`, `*_flip_margin`, `*_ok`: equal, or a near-tie inside the reference's error)
  extra    (where asked) 8 concurrent streams equal each alone; OpenAI SDK stream one score per token; the
           guard ends a request with content_filter; chunked prefill (a server with --chunked-prefill-size 64)
           gives the cold run's tokens
  stubs    no stubbed sgl_kernel function was called (gpu_env's log)

    eval "$(python3 benchmarks/served/gpu_env.py)"; cd /tmp; python3 $REPO/benchmarks/served/parity.py --out $OUT/parity.json

Also runs on a CPU against the CPU server (graphs off), which checks the harness itself before GPU time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from gpu_env import SERVER_FLAGS  # noqa: E402

from sglang_ext.launch.make_tiny import chain_prompt, random_prompt  # noqa: E402
from sglang_ext.launch.server import SGLangServer  # noqa: E402

PROMPT_LEN, NEW_TOKENS, PREFIX = 300, 48, 200
LABELS = [f"label_{i}" for i in range(10)]
PROBE_TOL = 2e-2


def generate(url, ids, n=NEW_TOKENS, logprobs=True, **sampling):
    body = {"input_ids": ids, "return_logprob": logprobs,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **sampling}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def scores_of(out) -> torch.Tensor:
    return torch.tensor([[row[k] for k in LABELS] for row in out["meta_info"]["token_probe_probs"]])


def logprobs_of(out) -> torch.Tensor:
    return torch.tensor([lp for lp, _tok, _txt in out["meta_info"]["output_token_logprobs"]])


def flush(url):
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()


# -- references -----------------------------------------------------------------------------------------------
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def hf_model(path, dtype, device=DEVICE, w8a8=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    if w8a8:
        quantize_inputs_as_fp8_layers(model)
    return model


def _fake_quant(x: torch.Tensor) -> torch.Tensor:
    from sglang_ext.layers.fp8 import dequantize_activation_group128, quantize_activation_group128

    flat = x.reshape(-1, x.shape[-1])
    return dequantize_activation_group128(*quantize_activation_group128(flat)).to(x.dtype).reshape(x.shape)


def quantize_inputs_as_fp8_layers(model) -> None:
    """transformers' gpt-oss with the served FP8 layers' activation rounding (w8a8: each GEMM input in e4m3,
    one scale per token per 128 columns): the inputs of q/k/v/o and of both expert GEMMs. The weights are
    already the dequantised e4m3 blocks (fp8_as_hf), so this model computes what the FP8 kernels compute, up to
    accumulation order."""
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
            proj.register_forward_pre_hook(lambda _m, args: (_fake_quant(args[0]), *args[1:]))
        experts = layer.mlp.experts
        experts.register_forward_pre_hook(lambda _m, args, kwargs: ((_fake_quant(args[0]), *args[1:]), kwargs),
                                          with_kwargs=True)
        gate = experts._apply_gate
        experts._apply_gate = lambda gate_up, gate=gate: _fake_quant(gate(gate_up))


@torch.no_grad()
def hf_greedy(model, ids, n=NEW_TOKENS):
    out = model.generate(torch.tensor([ids], device=model.device), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def hf_logprobs_and_hidden(model, sequence, prompt_len):
    out = model(torch.tensor([sequence], device=model.device), output_hidden_states=True)
    lp = torch.log_softmax(out.logits[0, prompt_len - 1 : -1].double(), -1).cpu()
    return lp, out.hidden_states


@torch.no_grad()
def reference_scores(hidden_states, probe_dir, prompt_len, n):
    from sglang_ext.probe.config import ProbeConfig
    from sglang_ext.probe.model import SingProbeHead, tap_features

    cfg = ProbeConfig.from_json_file(f"{probe_dir}/config.json")
    head = SingProbeHead.from_checkpoint(probe_dir, dtype=torch.float32).to(hidden_states[0].device)
    feats = tap_features([hidden_states[i].float() for i in cfg.base_model_layer_ids], torch.float32)
    probs = head.probs(head(feats))[0]
    return probs[prompt_len - 1 : prompt_len - 1 + n].cpu()


def fp8_as_hf(fp8_dir: Path, out_dir: Path) -> Path:
    """The FP8 checkpoint's weights dequantised into a float32 transformers checkpoint (experts back in
    transformers' [E, in, out] layout): the same weights the server holds, for the oracle."""
    from safetensors.torch import load_file, save_file

    from sglang_ext.layers.fp8 import dequantize_weight_block128

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(fp8_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    dense = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        if t.dtype == torch.float8_e4m3fn:
            if scale is None:
                raise KeyError(f"{name}: e4m3 without its scale")
            t = dequantize_weight_block128(t, scale, torch.float32)
            if ".experts." in name:
                t = t.transpose(-1, -2)
        dense[name] = t.float().contiguous()
    save_file(dense, str(out_dir / "model.safetensors"))
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    for extra in fp8_dir.iterdir():
        if extra.suffix in (".json", ".jinja") and extra.name not in ("config.json", "model.safetensors.index.json"):
            (out_dir / extra.name).write_bytes(extra.read_bytes())
    return out_dir


# -- one server -----------------------------------------------------------------------------------------------
def server_args(probe_dir, cuda_graph: bool, max_graph_bs: int, extra=()):
    args = ["--probe-ckpt", str(probe_dir), *SERVER_FLAGS, "--enable-custom-logit-processor",
            "--max-running-requests", "64"]
    if DEVICE == "cuda":  # (the CPU server's own settings come from SGLangServer, as in the CPU tests)
        args += ["--max-total-tokens", "65536", "--mem-fraction-static", "0.3"]
        args += ["--cuda-graph-max-bs-decode", str(max_graph_bs)] if cuda_graph else ["--disable-cuda-graph"]
    return args + list(extra)


def check_server(name, model_dir, ref_dir, ref_dtype, probe_dir, cuda_graph, max_graph_bs, log_dir,
                 extras=False, truth_dir=None, w8a8=False, prompt=None):
    row = {"checkpoint": name, "cuda_graph": cuda_graph}
    prompt = prompt or random_prompt(PROMPT_LEN, seed=0)
    t0 = time.time()
    with SGLangServer(model_dir, server_args(probe_dir, cuda_graph, max_graph_bs),
                      log_path=log_dir / f"server_{name}_{'graph' if cuda_graph else 'eager'}.log",
                      startup_timeout=420, cpu=DEVICE == "cpu") as srv:
        row["startup_s"] = round(time.time() - t0, 1)
        flush(srv.url)
        cold = generate(srv.url, prompt)
        again = generate(srv.url, prompt)
        flush(srv.url)
        generate(srv.url, prompt[:PREFIX], n=1)
        prefix_hit = generate(srv.url, prompt)
        row["cached_tokens"] = [again["meta_info"]["cached_tokens"], prefix_hit["meta_info"]["cached_tokens"]]
        if extras:
            row.update(extra_checks(srv, prompt, cold))
    served = cold["output_ids"]
    ref = hf_model(ref_dir, ref_dtype, w8a8=w8a8)
    want = hf_greedy(ref, prompt)
    sequence = prompt + served
    ref_lp, hidden = hf_logprobs_and_hidden(ref, sequence, PROMPT_LEN)
    truth = (hf_model(truth_dir or ref_dir, torch.float32, w8a8=w8a8) if (truth_dir or ref_dtype != torch.float32)
             else ref)
    truth_lp, truth_hidden = hf_logprobs_and_hidden(truth, sequence, PROMPT_LEN)
    steps = torch.arange(len(served))
    served_lp = logprobs_of(cold).double()
    agree = next((i for i, (a, b) in enumerate(zip(served, want)) if a != b), len(served))
    row.update(tokens_match=agree, tokens_total=len(served),
               logprob_err=float((served_lp - truth_lp[steps, served]).abs().max()),
               ref_err=float((ref_lp - truth_lp).abs().max()),
               flip_margin=float((truth_lp.max(-1).values - truth_lp[steps, served]).max()),
               truth_min_margin=float(truth_lp.topk(2, -1).values.diff(dim=-1).abs().min()))
    # The reference head on transformers' hidden states in the served dtype (the criterion, as the CPU bf16 test),
    # and on the fp32 truth's (how far both are from exact)
    want_scores = reference_scores(hidden, probe_dir, PROMPT_LEN, len(served))
    got_scores = scores_of(cold)
    truth_scores = reference_scores(truth_hidden, probe_dir, PROMPT_LEN, len(served))
    row["probe_max_abs_err"] = float((got_scores - want_scores).abs().max())
    row["probe_err_truth"] = float((got_scores - truth_scores).abs().max())
    # How far the served dtype's own rounding moves the scores (the reference against the truth): where a model's
    # hidden states amplify rounding, this exceeds 2e-2 and bounds what any implementation in that dtype can show
    row["probe_ref_err"] = float((want_scores - truth_scores).abs().max())
    # The bound for comparing served runs with each other (`*_ok`): 2e-2, or that rounding's own reach where it is larger
    row["probe_tol"] = max(PROBE_TOL, row["probe_ref_err"])
    row["probe_scores_std"] = float(got_scores.std())
    # Cached against cold: where the tokens part, each run is judged on its own sequence against the fp32 truth
    # (a path that is wrong drifts from the truth; a near-tie parts both runs inside the served dtype's error).
    for label, other in (("radix_hit", again), ("prefix_hit", prefix_hit)):
        ids = other["output_ids"][: len(served)]
        first = next((i for i, (a, b) in enumerate(zip(ids, served)) if a != b), None)
        own_lp = truth_lp if first is None else hf_logprobs_and_hidden(truth, prompt + ids, PROMPT_LEN)[0]
        own_steps = torch.arange(len(ids))
        shared = len(served) if first is None else first  # steps whose inputs are identical in both runs
        row[f"{label}_tokens_equal"] = first is None and len(ids) == len(served)
        row[f"{label}_first_diff"] = first
        row[f"{label}_score_gap"] = float((scores_of(other)[:shared] - got_scores[:shared]).abs().max()) \
            if shared else 0.0
        row[f"{label}_logprob_err"] = float((logprobs_of(other).double()[: len(ids)]
                                             - own_lp[own_steps, ids]).abs().max())
        row[f"{label}_flip_margin"] = (None if first is None else
                                       float((truth_lp[first, served[first]] - truth_lp[first, ids[first]]).abs()))
        row[f"{label}_ok"] = (row[f"{label}_score_gap"] <= row["probe_tol"] and (
            row[f"{label}_tokens_equal"] or (row[f"{label}_flip_margin"] <= row["ref_err"]
                                             and row[f"{label}_logprob_err"] <= row["ref_err"])))
    # The criterion: a radix-cache hit gives the cold run's tokens and its scores within 2e-2
    row["cached_equals_cold"] = row["radix_hit_tokens_equal"] and row["radix_hit_score_gap"] <= PROBE_TOL
    del ref, truth
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row, cold


def extra_checks(srv, prompt, cold) -> dict:
    out = {}
    prompts = [random_prompt(30 + 37 * i, seed=10 + i) for i in range(8)]
    alone = [generate(srv.url, p, n=12, logprobs=False) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: generate(srv.url, p, n=12, logprobs=False), prompts))
    # On a CPU a batch of 8 reproduces each stream alone to float rounding; a GPU picks kernels and CUDA graphs by
    # batch size, so there the bound is the probe's tolerance (cross-talk between streams would show as the
    # scores' own spread, ~0.25).
    bound = 1e-5 if DEVICE == "cpu" else PROBE_TOL
    same = [a["output_ids"] == t["output_ids"] for a, t in zip(alone, together)]
    out["concurrent_8_tokens_equal"] = sum(same)
    out["concurrent_8_max_score_gap"] = max(float((scores_of(a) - scores_of(t)).abs().max())
                                            for a, t, s in zip(alone, together, same) if s) if any(same) else None
    out["concurrent_8_equal_alone"] = all(same) and out["concurrent_8_max_score_gap"] <= bound
    from openai import OpenAI

    client = OpenAI(base_url=srv.url + "/v1", api_key="none")
    chunks = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=16, stream=True))
    per_token = [row for c in chunks for ch in (c.choices or []) for row in
                 ((getattr(ch, "model_extra", None) or {}).get("token_probe_probs") or [])]
    usage = [c for c in chunks if getattr(c, "usage", None)]
    out["openai_sdk_scores"] = len(per_token)
    out["openai_sdk_ok"] = len(per_token) == 16 and all(set(r) == set(LABELS) for r in per_token)
    guarded = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True,
        extra_body={"custom_params": {"probe_stop": {"label_3": 0.0}}})
    reasons = [c.choices[0].finish_reason for c in guarded if c.choices and c.choices[0].finish_reason]
    body = generate(srv.url, prompt[:50], n=16, logprobs=False, custom_params={"probe_stop": {"label_3": 0.0}})
    out["guard_finish_reasons"] = reasons
    out["guard_ok"] = reasons == ["content_filter"] and body["meta_info"]["finish_reason"]["type"] == "content_filter"
    del usage
    return out


def chunked_row(name, model_dir, probe_dir, cold_ref, log_dir, max_graph_bs, seed=0):
    prompt = random_prompt(PROMPT_LEN, seed=seed)
    with SGLangServer(model_dir, server_args(probe_dir, True, max_graph_bs, ["--chunked-prefill-size", "64"]),
                      log_path=log_dir / f"server_{name}_chunked.log", startup_timeout=420,
                      cpu=DEVICE == "cpu") as srv:
        flush(srv.url)
        chunked = generate(srv.url, prompt)
    same = chunked["output_ids"] == cold_ref["output_ids"]
    gap = float((scores_of(chunked) - scores_of(cold_ref)).abs().max()) if same else math.inf
    return {"chunked_prefill_tokens_equal": same, "chunked_prefill_score_gap": gap,
            "chunked_prefill_first_diff": next((i for i, (a, b) in
                                                enumerate(zip(chunked["output_ids"], cold_ref["output_ids"]))
                                                if a != b), None)}


def make_checkpoints(root: Path, inits=("calm", "default", "trained")) -> dict:
    """The checkpoints of the given init profiles (the calm one always: its probe serves the default init's rows).
    Only those asked: the trained profile costs 45 minutes on a CPU."""
    from sglang_ext.launch.make_tiny import generate as make_tiny
    from sglang_ext.launch.make_tiny_probe import generate as make_probe

    out = {}
    folders = {"calm": "tiny_calm", "default": "tiny", "trained": "tiny_trained"}
    for init in ["calm"] + [i for i in inits if i != "calm"]:
        folder = folders[init]
        made = make_tiny(root / folder, variants=("bf16", "fp32"), log=print, init=init)
        out[f"{init}_bf16"], out[f"{init}_fp32"] = Path(made["bf16"]), Path(made["fp32"])
        if init == "default":
            continue
        out[f"{init}_probe"] = Path(make_probe(str(root / folder / "probe"), base_dir=made["fp32"], log=lambda *_: None))
        fp8 = root / folder / "fp8"
        if not (fp8 / "config.json").exists():
            subprocess.run([sys.executable, "-m", "sglang_ext.launch.convert", made["bf16"], str(fp8)], check=True,
                           stdout=subprocess.DEVNULL)
        out[f"{init}_fp8"], out[f"{init}_fp8_hf"] = fp8, fp8_as_hf(fp8, root / folder / "fp8_as_hf")
    return out


# (name, init, weights, CUDA graphs, max graph batch, extras). The bf16 model's reference is transformers in
# bf16 on the same file, its truth the same in fp32. The FP8 model runs bf16 activations around its e4m3 GEMMs: its
# reference is transformers in bf16 with the dequantised weights and the same activation rounding (w8a8), its
# truth the same in fp32. Random weights (calm, default) decode near-ties; the trained ones have margins of nats,
# so there every served token must equal the reference's.
CONFIGS = [
    ("fp8", "calm", "fp8", True, 32, True),
    ("bf16", "calm", "bf16", True, 8, True),
    ("trained_bf16", "trained", "bf16", True, 8, False),
    ("trained_fp8", "trained", "fp8", True, 32, False),
    ("bf16", "calm", "bf16", False, 8, False),
    ("fp8", "calm", "fp8", False, 32, False),
    ("bf16_default_init", "default", "bf16", False, 8, False),
]


def check_config(ck, name, init, weights, graphs, max_graph_bs, extras, log_dir):
    """One CONFIGS row on the checkpoints of make_checkpoints."""
    fp8 = weights == "fp8"
    model, ref = (ck[f"{init}_fp8"], ck[f"{init}_fp8_hf"]) if fp8 else (ck[f"{init}_bf16"],) * 2
    truth = ref if fp8 else ck[f"{init}_fp32"]
    probe = ck.get(f"{init}_probe", ck["calm_probe"])
    prompt = chain_prompt(PROMPT_LEN) if init == "trained" else None
    return check_server(name, model, ref, torch.bfloat16, probe, graphs, max_graph_bs, log_dir, extras, truth,
                        w8a8=fp8, prompt=prompt)


def stub_calls() -> list[str]:
    path = os.environ.get("KERNEL_STUB_LOG")
    if not path or not os.path.exists(path):
        return []
    return sorted({line.split(" ", 1)[1].strip() for line in open(path) if " " in line})


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/sglang_ext_parity"))
    ap.add_argument("--only", default="", help="comma-separated config names")
    ap.add_argument("--cuda-graph", choices=("on", "off", "both"), default="both")
    ap.add_argument("--no-chunked", dest="chunked", action="store_false")
    args = ap.parse_args(argv)
    log_dir = args.out.parent
    only = set(filter(None, args.only.split(",")))
    chosen = [c for c in CONFIGS if (not only or c[0] in only)
              and (args.cuda_graph == "both" or c[3] == (args.cuda_graph == "on"))]
    ck = make_checkpoints(args.work, {c[1] for c in chosen})
    rows, colds = [], {}
    for name, init, weights, graphs, bs, extras in chosen:
        try:
            row, cold = check_config(ck, name, init, weights, graphs, bs, extras, log_dir)
            colds[(name, graphs)] = cold
        except Exception as e:  # one broken configuration is a row, the rest still run
            row = {"checkpoint": name, "cuda_graph": graphs, "error": f"{type(e).__name__}: {e}"[:2000],
                   "traceback": traceback.format_exc()[-3000:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps({"parity": rows, "stub_calls": stub_calls()}, indent=1))
    if args.chunked and ("fp8", True) in colds:
        try:
            rows[[(r["checkpoint"], r["cuda_graph"]) for r in rows].index(("fp8", True))].update(
                chunked_row("fp8", ck["calm_fp8"], ck["calm_probe"], colds[("fp8", True)], log_dir, 32))
        except Exception as e:
            rows.append({"checkpoint": "fp8", "chunked_error": f"{type(e).__name__}: {e}"[:2000]})
    result = {"parity": rows, "stub_calls": stub_calls()}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["stub_calls"]))


if __name__ == "__main__":
    main()
