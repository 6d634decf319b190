"""The real SGLang server with this plugin on a GPU: tiny bf16 and FP8 checkpoints with CUDA graphs, against
transformers on the same weights (benchmarks/served/parity.py does the work; its committed results are
benchmarks/results/served_gpu.json). Skipped without CUDA. On the GPU test machine, which has no SGLang of its
own, run it under the carry's environment (benchmarks/served/gpu_env.py)."""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.server]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "served"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import parity

    return parity.make_checkpoints(tmp_path_factory.mktemp("served_gpu"))


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_served_tokens_scores_and_cache_on_gpu(checkpoints, name, tmp_path):
    import parity

    ck = checkpoints
    if name == "bf16":
        row, _ = parity.check_server("bf16", ck["calm_bf16"], ck["calm_bf16"], torch.bfloat16, ck["probe"], True, 8,
                                     tmp_path, extras=True, truth_dir=ck["calm_fp32"])
    else:
        row, _ = parity.check_server("fp8", ck["fp8"], ck["fp8_hf"], torch.bfloat16, ck["probe"], True, 32, tmp_path,
                                     extras=True, truth_dir=ck["fp8_hf"], w8a8=True)
    print(row)
    # every token equal, or a flip only where the truth's own margin is inside the reference's rounding error
    assert row["tokens_match"] == row["tokens_total"] or row["flip_margin"] <= row["ref_err"]
    assert row["probe_err_truth"] <= parity.PROBE_TOL and row["probe_scores_std"] > 0.05
    assert row["cached_equals_cold"] and row["prefix_hit_ok"], row
    assert row["concurrent_8_equal_alone"] and row["openai_sdk_ok"] and row["guard_ok"]
    assert parity.stub_calls() == []
