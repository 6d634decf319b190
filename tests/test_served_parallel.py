"""Sharded gpt-oss with the probe inside real multi-rank SGLang servers on this CPU.

`--tp 2` shards attention heads and each expert's intermediate dimension over two scheduler
processes (gloo all-reduces), `--tp 2 --ep-size 2` puts half the experts on each rank, `--dp 2`
runs two replicas behind SGLang's data-parallel controller. Oracles, as for the single-rank server:
transformers' GptOssForCausalLM greedy tokens on the same tiny checkpoint, and the plain-torch
reference SingProbe head on its hidden states (test_probe_serving.reference_scores).
The model-parallel maths is also checked rank by rank in one process (test_model_parallel_shards.py);
this is the served path: SGLang's own process groups, weight loading per rank, the probe per rank.
Without patches/cpu_tensor_parallel.py the two TP servers die at start.
"""

import pytest
import requests
import torch
from test_probe_serving import as_matrix, reference_scores
from test_served_parity import hf_greedy, hf_model

from sglang_ext.launch.make_tiny import random_prompt
from sglang_ext.launch.server import IDS_ONLY_ARGS, SGLangServer

pytestmark = pytest.mark.server

PROMPT_LEN, NEW_TOKENS = 300, 24  # past the 128-token window
CONFIGS = {"tp2": ["--tp", "2"], "tp2_ep2": ["--tp", "2", "--ep-size", "2"], "dp2": ["--dp", "2"]}


@pytest.fixture(scope="module")
def tiny_probe(tiny_checkpoints):
    from sglang_ext.launch.make_tiny_probe import generate

    return generate(str(tiny_checkpoints["fp32"].parent / "probe"), base_dir=str(tiny_checkpoints["fp32"]),
                    log=lambda *_: None)


@pytest.fixture(scope="module")
def prompt():
    return random_prompt(PROMPT_LEN, seed=3)


@pytest.fixture(scope="module")
def want_tokens(tiny_checkpoints, prompt):
    return hf_greedy(hf_model(tiny_checkpoints["fp32"], torch.float32), prompt, n=NEW_TOKENS)


def generate(url, ids):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_sharded_server_serves_transformers_tokens_and_reference_scores(config, tiny_checkpoints, tiny_probe,
                                                                        vocab_dir, prompt, want_tokens):
    args = ["--dtype", "float32", "--probe-ckpt", tiny_probe, *IDS_ONLY_ARGS, *CONFIGS[config]]
    with SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir, startup_timeout=600) as srv:
        out = generate(srv.url, prompt)
        # the second request of a DP server goes to the other replica (round robin)
        again = generate(srv.url, prompt)
    assert out["output_ids"] == want_tokens
    assert again["output_ids"] == want_tokens
    labels, want = reference_scores(tiny_checkpoints["fp32"], tiny_probe, prompt, out["output_ids"])
    for answer in (out, again):
        got = as_matrix(answer["meta_info"]["token_probe_probs"], labels)
        assert got.shape == (NEW_TOKENS, len(labels)) and got.std() > 0.05
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4)


def test_pynccl_is_left_out_of_gloo_groups_only():
    from sglang_ext.patches.cpu_tensor_parallel import _no_nccl_on_cpu

    seen = []
    record = lambda ranks, local, backend, *args, **kwargs: seen.append((backend, args, kwargs))  # noqa: E731
    _no_nccl_on_cpu(record, [[0, 1]], 0, "gloo")
    _no_nccl_on_cpu(record, [[0, 1]], 0, "gloo", None, True)
    _no_nccl_on_cpu(record, [[0, 1]], 0, "gloo", use_pynccl=True)  # a caller's explicit choice stands
    _no_nccl_on_cpu(record, [[0, 1]], 0, "nccl")
    assert seen == [("gloo", (), {"use_pynccl": False}), ("gloo", (False, True), {}),
                    ("gloo", (), {"use_pynccl": True}), ("nccl", (), {})]
