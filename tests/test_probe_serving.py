"""SingProbe served end to end: scores from the real server vs the reference head on HF hidden states.

Oracle: transformers' GptOssForCausalLM hidden states (`output_hidden_states[i]` is the
input of layer i) -> weightless RMS-norm taps -> the plain-torch reference head over the
whole sequence -> sigmoid. The score that arrives with output token k is the row of
position (prompt_len - 1 + k).
"""

import json

import pytest
import requests
import torch

from sglang_ext.launch.make_tiny import random_prompt
from sglang_ext.launch.server import SGLangServer

pytestmark = pytest.mark.server

PROMPT_LEN, NEW_TOKENS = 300, 24


@pytest.fixture(scope="module")
def tiny_probe(tiny_checkpoints):
    from sglang_ext.launch.make_tiny_probe import generate

    return generate(str(tiny_checkpoints["fp32"].parent / "probe"), base_dir=str(tiny_checkpoints["fp32"]),
                    log=lambda *_: None)


@pytest.fixture(scope="module")
def probe_server(tiny_checkpoints, tiny_probe, vocab_dir):
    args = ["--dtype", "float32", "--probe-ckpt", tiny_probe]
    with SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir) as srv:
        yield srv


def generate(url, ids, n=NEW_TOKENS):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def reference_scores(base_dir, probe_dir, prompt, output_ids):
    from transformers import AutoModelForCausalLM

    from sglang_ext.probe.config import ProbeConfig
    from sglang_ext.probe.model import SingProbeHead, tap_features

    cfg = ProbeConfig.from_json_file(f"{probe_dir}/config.json")
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    head = SingProbeHead.from_checkpoint(probe_dir, dtype=torch.float32)
    with torch.no_grad():
        hs = model(torch.tensor([prompt + output_ids]), output_hidden_states=True).hidden_states
        feats = tap_features([hs[i] for i in cfg.base_model_layer_ids], torch.float32)
        probs = head.probs(head(feats))[0]
    rows = probs[len(prompt) - 1 : len(prompt) - 1 + len(output_ids)]
    return cfg.labels, rows


def as_matrix(scores, labels):
    return torch.tensor([[s[name] for name in labels] for s in scores])


def test_served_scores_equal_reference_head(probe_server, tiny_checkpoints, tiny_probe):
    prompt = random_prompt(PROMPT_LEN, seed=3)
    out = generate(probe_server.url, prompt)
    scores = out["meta_info"]["token_probe_probs"]
    assert len(scores) == len(out["output_ids"]) == NEW_TOKENS
    labels, want = reference_scores(tiny_checkpoints["fp32"], tiny_probe, prompt, out["output_ids"])
    assert list(scores[0]) == labels == [f"label_{i}" for i in range(10)]
    got = as_matrix(scores, labels)
    assert got.std() > 0.05  # the scores move: a constant would not test alignment
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)


def test_radix_hit_reuses_probe_kv(probe_server):
    prompt = random_prompt(PROMPT_LEN, seed=4)
    requests.post(probe_server.url + "/flush_cache", timeout=60)
    cold = generate(probe_server.url, prompt)
    requests.post(probe_server.url + "/flush_cache", timeout=60)
    generate(probe_server.url, prompt[:260], n=1)
    hit = generate(probe_server.url, prompt)
    assert hit["meta_info"]["cached_tokens"] >= 200
    assert hit["output_ids"] == cold["output_ids"]
    torch.testing.assert_close(as_matrix(hit["meta_info"]["token_probe_probs"], [f"label_{i}" for i in range(10)]),
                               as_matrix(cold["meta_info"]["token_probe_probs"], [f"label_{i}" for i in range(10)]),
                               rtol=0, atol=1e-5)


def test_openai_chat_carries_one_score_per_token(probe_server):
    body = {"model": "default", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 20, "temperature": 0}
    full = requests.post(probe_server.url + "/v1/chat/completions", json=body, timeout=600).json()
    choice = full["choices"][0]
    assert len(choice["token_probe_probs"]) == full["usage"]["completion_tokens"] == 20
    streamed, chunks = [], 0
    with requests.post(probe_server.url + "/v1/chat/completions", json={**body, "stream": True},
                       stream=True, timeout=600) as r:
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            for c in json.loads(line[6:]).get("choices", []):
                streamed.extend(c.get("token_probe_probs", []))
    assert chunks > 1
    # The second request hits the first's prompt in the radix cache: same scores up to fp32 noise.
    labels = [f"label_{i}" for i in range(10)]
    assert len(streamed) == 20
    torch.testing.assert_close(as_matrix(streamed, labels), as_matrix(choice["token_probe_probs"], labels),
                               rtol=0, atol=1e-5)


def test_scheduler_received_probe_flag(probe_server, tiny_probe):
    requests.get(probe_server.url + "/health", timeout=30)
    assert f"scheduler received --probe-ckpt {tiny_probe}" in probe_server.log_path.read_text()


def test_chunked_prefill_scores_equal_one_shot(probe_server, tiny_checkpoints, tiny_probe, vocab_dir):
    prompt = random_prompt(PROMPT_LEN, seed=5)
    requests.post(probe_server.url + "/flush_cache", timeout=60)
    want = generate(probe_server.url, prompt)
    args = ["--dtype", "float32", "--probe-ckpt", tiny_probe, "--chunked-prefill-size", "64"]
    with SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir) as srv:
        got = generate(srv.url, prompt)
    assert got["output_ids"] == want["output_ids"]
    labels = [f"label_{i}" for i in range(10)]
    torch.testing.assert_close(as_matrix(got["meta_info"]["token_probe_probs"], labels),
                               as_matrix(want["meta_info"]["token_probe_probs"], labels), rtol=0, atol=1e-5)


def test_probe_bound_to_another_model_stops_launch(tiny_checkpoints, tmp_path):
    import shutil
    import subprocess
    import sys

    from sglang_ext.launch.cpu_shims import cpu_server_env
    from sglang_ext.launch.make_tiny_probe import generate as make_probe

    bad = tmp_path / "probe_bad"
    good = tmp_path / "probe_good"
    make_probe(str(good), base_dir=str(tiny_checkpoints["fp32"]), log=lambda *_: None)
    shutil.copytree(good, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["base_model_layer_ids"] = [1, 3, 9]  # the tiny base has 6 layers
    (bad / "config.json").write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path",
                          str(tiny_checkpoints["fp32"]), "--device", "cpu", "--probe-ckpt", str(bad)],
                         capture_output=True, text=True, timeout=300, env=cpu_server_env())
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("--probe-ckpt: ") and "9" in last, last
    assert "Traceback" not in out.stderr
