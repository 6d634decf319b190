"""The real SGLang server with this plugin on a GPU: tiny bf16 and FP8 checkpoints with CUDA graphs (random weights,
and weights trained on a task so that every greedy token must match), against transformers on the same weights (benchmarks/served/parity.py does the work; its committed results are
benchmarks/results/served_gpu.json). Skipped without CUDA. On the GPU test machine, which has no SGLang of its
own, run it under the carry's environment (benchmarks/served/gpu_env.py)."""

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.server]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "served"))
import parity  # noqa: E402

GRAPH_CONFIGS = [c for c in parity.CONFIGS if c[3]]  # CUDA graphs on, as served by default


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return parity.make_checkpoints(tmp_path_factory.mktemp("served_gpu"), {c[1] for c in GRAPH_CONFIGS})


@pytest.mark.parametrize("config", GRAPH_CONFIGS, ids=lambda c: c[0])
def test_served_tokens_scores_and_cache_on_gpu(checkpoints, config, tmp_path):
    name, init, weights, graphs, bs, extras = config
    row, _ = parity.check_config(checkpoints, name, init, weights, graphs, bs, extras, tmp_path)
    print(row)
    if init == "trained":
        # Margins of nats: every token equal. The probe: 2e-2 of the fp32 truth or, where the reference in the served
        # dtype is itself farther than that from the truth, twice its distance: the served run and that reference are
        # two independent draws of the same rounding (trained FP8 on the CPU: the reference 0.028 from the truth, the
        # served run 0.035; a wrong path moves scores by a good part of their 0.25 spread).
        assert row["tokens_match"] == row["tokens_total"], row
        assert row["probe_err_truth"] <= max(parity.PROBE_TOL, 2 * row["probe_ref_err"]), row
        assert row["radix_hit_ok"] and row["prefix_hit_ok"], row
    else:  # every token equal, or a flip only where the truth's own margin is inside the reference's rounding error
        assert row["tokens_match"] == row["tokens_total"] or row["flip_margin"] <= row["ref_err"]
        assert row["probe_err_truth"] <= parity.PROBE_TOL and row["cached_equals_cold"] and row["prefix_hit_ok"], row
    assert row["probe_scores_std"] > 0.05
    if extras:
        assert row["concurrent_8_equal_alone"] and row["openai_sdk_ok"] and row["guard_ok"]
    assert parity.stub_calls() == []
