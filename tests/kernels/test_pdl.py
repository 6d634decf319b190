"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, and on a GPU the
decode step's bits do not depend on it.

Oracle for the GPU test: the same harness step captured with plain launches. Every kernel only
changes *when* its loads are issued under PDL, never its arithmetic, so the logits must be equal
bit for bit; a kernel that read its predecessor's output before its wait would differ (on some
replays: the test replays many times)."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

from sglang_ext.kernels import pdl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # `pytest` without `python -m`: benchmarks/ is a package of the checkout
    sys.path.insert(0, ROOT)


def test_pdl_is_off_on_cpu_and_under_the_interpreter(monkeypatch):
    assert pdl.pdl_launch_kwargs(torch.device("cpu"), 1) == {"USE_PDL": False, "launch_pdl": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pdl.set_pdl(True)  # a forced "on" still cannot run inline PTX in the interpreter
    try:
        assert not pdl.pdl_enabled(torch.device("cuda"))
    finally:
        pdl.set_pdl(None)


def test_plain_families_start_plainly_but_keep_their_wait_and_release(monkeypatch):
    # pdl_enabled as on an sm90 GPU, so the table alone decides (CPU: the kernels never see USE_PDL)
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    cuda = torch.device("cuda")
    # the measured table (diag_pdl_families*.md)
    assert pdl.PDL_PLAIN_FROM_ROWS == {"moe": 1, "gemv": 1, "probe": 1}
    for rows in (1, 4, 8, 16):
        assert pdl.pdl_launch_kwargs(cuda, rows) == {"USE_PDL": True, "launch_pdl": True}
        assert pdl.pdl_launch_kwargs(cuda, rows, "attention") == {"USE_PDL": True, "launch_pdl": True}
        assert pdl.pdl_launch_kwargs(cuda, rows, "gemv_xonce") == {"USE_PDL": True, "launch_pdl": True}
        # the MoE's expert kernels and the K-loop GEMV: wait and release in the kernel, a plain launch
        assert pdl.pdl_launch_kwargs(cuda, rows, "moe") == {"USE_PDL": True, "launch_pdl": False}
        assert pdl.pdl_launch_kwargs(cuda, rows, "gemv") == {"USE_PDL": True, "launch_pdl": False}
        # the probe's step beside the LM head (diag_probe_variants2.md)
        assert pdl.pdl_launch_kwargs(cuda, rows, "probe") == {"USE_PDL": True, "launch_pdl": False}
    assert pdl.pdl_launch_kwargs(cuda, pdl.PDL_MAX_ROWS + 1, "attention") == {"USE_PDL": False, "launch_pdl": False}
    monkeypatch.setitem(pdl.PDL_PLAIN_FROM_ROWS, "attention", 9)  # a family plain from some row count on
    assert pdl.pdl_launch_kwargs(cuda, 8, "attention")["launch_pdl"]
    assert not pdl.pdl_launch_kwargs(cuda, 9, "attention")["launch_pdl"]
    pdl.set_pdl_plain({"attention"})  # a benchmark's override: exactly these, at every row count
    try:
        assert not pdl.pdl_launch_kwargs(cuda, 1, "attention")["launch_pdl"]
        assert pdl.pdl_launch_kwargs(cuda, 16, "gemv")["launch_pdl"]
        assert pdl.pdl_launch_kwargs(cuda, 16, "moe")["launch_pdl"]
        assert pdl.pdl_launch_kwargs(cuda, 16, "attention")["USE_PDL"]
    finally:
        pdl.set_pdl_plain(None)
    assert not pdl.pdl_launch_kwargs(cuda, 16, "moe")["launch_pdl"]


@pytest.mark.gpu
def test_pdl_only_up_to_its_row_limit():
    assert pdl.pdl_launch_kwargs(torch.device("cuda"), pdl.PDL_MAX_ROWS)["launch_pdl"] == pdl.pdl_enabled(
        torch.device("cuda"))
    assert pdl.pdl_launch_kwargs(torch.device("cuda"), pdl.PDL_MAX_ROWS + 1) == {"USE_PDL": False, "launch_pdl": False}


@pytest.mark.gpu
# 1, 3: the one-shot kernels; 5: the split-K GEMVs (o on x_once), the split-loop attention and the MoE's GEMV
# row (20 pairs on 32 experts); 8: the MoE's TMA row (many pairs); 16: the loop GEMV for o too
@pytest.mark.parametrize("batch", [1, 3, 5, 8, 16])
def test_decode_step_bits_equal_with_and_without_pdl(batch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm90+")
    from benchmarks import bench_common as bc
    from benchmarks.model_step import GPT_OSS_20B, ModelStep, parallel_layout

    torch.manual_seed(0)
    # three layers: sliding and full attention, the MoE, the norms' quantisation, all at real width
    dims = dataclasses.replace(GPT_OSS_20B, num_layers=3, probe_layers=(0, 1, 2))
    model = ModelStep(dims, parallel_layout(1, 1, 1, 0), batch=batch, context=4096)
    inputs = model.decode_inputs(4096)
    outs, graphs = {}, {}
    try:
        for use in (False, True):
            pdl.set_pdl(use)
            graphs[use] = bc.capture_graph(lambda use=use: outs.__setitem__(use, model.forward(**inputs)))
    finally:
        pdl.set_pdl(None)
    graphs[False].replay()
    torch.cuda.synchronize()
    reference = outs[False].clone()
    assert torch.isfinite(reference.float()).all()
    for i in range(100):
        graphs[True].replay()
        if i % 10 == 0:  # back-to-back replays in between: the early starts overlap real work
            torch.cuda.synchronize()
            assert torch.equal(outs[True], reference), f"replay {i}"
    torch.cuda.synchronize()
    assert torch.equal(outs[True], reference)
