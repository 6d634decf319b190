"""SingProbe served in bf16: the issue's 2e-2 criterion on the "calm" tiny gpt-oss.

Its own file (it starts its own server) so that pytest-xdist can run it beside
test_probe_serving.py, whose shared fp32 server and chunked-prefill server keep one worker busy.
Oracle and helpers as there: HF transformers' hidden states -> the plain-torch reference head.
"""

import pytest
import torch
from test_probe_serving import PROMPT_LEN, as_matrix, generate, reference_scores, tiny_probe  # noqa: F401

from sglang_ext.launch.make_tiny import random_prompt
from sglang_ext.launch.server import IDS_ONLY_ARGS, SGLangServer

pytestmark = pytest.mark.server


def test_bf16_served_scores_within_2e2_of_hf(tiny_calm_checkpoints, tiny_probe, vocab_dir):
    """The issue's bf16 criterion: served bf16 scores within 2e-2 of HF transformers' hidden states
    through the reference head. On the default tiny model HF's own bf16 run is 0.085 off its fp32
    run (the random weights amplify bf16 rounding ~16 % by the deepest tap), so two correct bf16
    implementations cannot agree to 2e-2 there; the "calm" init (same architecture, smaller
    attention/expert weights: ~1 % hidden-state drift) makes the check meaningful. The default
    model keeps its fp32 checks at 2e-4 (test_probe_serving.py)."""
    prompt = random_prompt(PROMPT_LEN, seed=6)
    calm = tiny_calm_checkpoints
    # Token ids in, token ids and scores out: a tokenizer-free server.
    with SGLangServer(calm["bf16"], ["--probe-ckpt", tiny_probe, *IDS_ONLY_ARGS], vocab_dir=vocab_dir) as srv:
        out = generate(srv.url, prompt)
    labels, want = reference_scores(calm["bf16"], tiny_probe, prompt, out["output_ids"], dtype=torch.bfloat16)
    _, truth = reference_scores(calm["fp32"], tiny_probe, prompt, out["output_ids"])
    got = as_matrix(out["meta_info"]["token_probe_probs"], labels)
    err_hf, err_truth = (got - want).abs().max().item(), (got - truth).abs().max().item()
    print(f"bf16 served scores (calm tiny): max |error| {err_hf:.4f} vs HF bf16 + reference head, "
          f"{err_truth:.4f} vs the fp32 truth (HF bf16 vs truth {(want - truth).abs().max().item():.4f})")
    assert got.std() > 0.05
    assert err_hf <= 2e-2 and err_truth <= 2e-2
