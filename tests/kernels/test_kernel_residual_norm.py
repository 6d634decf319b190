"""Residual add + RMSNorm (+ probe tap) in one launch (kernels/residual_norm.py) vs the unfused ops.

Oracle: what the model ran before the fusion, `h + delta` in the model dtype, then
`sglang_ext.layers.norm.rms_norm` (eager) and the probe's own feature transform
(`sglang_ext.probe.model.rms_normalize`), all on CPU.
"""

import os
import subprocess
import sys

import pytest
import torch

CHECK = r"""
import torch
from sglang_ext.kernels.residual_norm import residual_rms_norm, residual_rms_norm_ref
from sglang_ext.layers.norm import rms_norm
from sglang_ext.probe.model import rms_normalize

torch.manual_seed(0)
worst = 0.0
for dtype in (torch.float32, torch.bfloat16):
    for t, c, with_delta, with_tap in ((1, 320, True, True), (5, 320, False, True), (3, 100, True, False)):
        h = torch.randn(t, c).to(dtype) * 3
        delta = torch.randn(t, c).to(dtype) if with_delta else None
        w = (torch.rand(c) + 0.5).to(dtype)
        feats = torch.full((t + 2, 3 * c), float("nan"), dtype=dtype)
        tap = (feats, c, 1e-6) if with_tap else None
        s, x = residual_rms_norm(h, delta, w, 1e-5, tap)
        want_s = h + delta if with_delta else h
        assert torch.equal(s, want_s), "the residual sum must be the unfused add, bit for bit"
        want_x = rms_norm(want_s, w, 1e-5)
        ref_s, ref_x = residual_rms_norm_ref(h, delta, w, 1e-5, None)
        assert torch.equal(ref_x, want_x)
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -21
        rel = lambda a, b: ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1.0)).max().item() / ulp
        worst = max(worst, rel(x, want_x))
        if with_tap:
            assert torch.isnan(feats[:, :c].float()).all() and torch.isnan(feats[:, 2 * c:].float()).all()
            assert torch.isnan(feats[t:].float()).all(), "rows past T untouched"
            worst = max(worst, rel(feats[:t, c:2 * c], rms_normalize(want_s).to(dtype)))
print(worst)
"""


def test_residual_norm_matches_unfused_ops_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # In ulps of the dtype: the fp32 statistics are summed in another order, which can move the last bit.
    assert float(out.stdout.strip().splitlines()[-1]) <= 1.0


CHECK_QUANT = r"""
import json
import torch
from sglang_ext.kernels.fp8_gemm import quantize_activation_group128
from sglang_ext.kernels.residual_norm import residual_rms_norm, residual_rms_norm_ref
from sglang_ext.layers import fp8

torch.manual_seed(1)
cases = 0
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    # ragged groups (320 = 2.5 x 128, 2880 = 22.5), a width under one group (100), an all-zero row;
    # up to SLICED_MAX_ROWS rows one program per (row, 128 columns), more rows one program a row
    for t, c, with_delta, with_tap in ((1, 320, True, True), (3, 100, True, False), (2, 2880, False, False),
                                       (20, 320, True, True)):
        h = (torch.randn(t, c) * torch.logspace(-2, 1, c)[torch.randperm(c)]).to(dtype)
        if t > 1:
            h[-1] = 0.0
        delta = torch.randn(t, c).to(dtype) if with_delta else None
        w = (torch.rand(c) + 0.5).to(dtype)
        feats, feats0 = torch.zeros((t, 2 * c), dtype=dtype), torch.full((t, 2 * c), float("nan"), dtype=dtype)
        tap = (feats, c, 1e-6) if with_tap else None
        s, x, (q, scale) = residual_rms_norm(h, delta, w, 1e-5, tap, quantize=True)
        s0, x0 = residual_rms_norm(h, delta, w, 1e-5, (feats0, c, 1e-6) if with_tap else None)
        assert torch.equal(s, s0) and torch.equal(x, x0), "quantize must not change the other outputs"
        if with_tap:
            assert torch.equal(feats[:, c:], feats0[:, c:]), "quantize must not change the tap"
        assert q.shape == (t, c) and q.dtype == torch.float8_e4m3fn and scale.shape == (t, -(-c // 128))
        for name, (qr, sr) in (("torch", fp8.quantize_activation_group128(x)),
                               ("triton", quantize_activation_group128(x))):
            bad = int((q.view(torch.uint8) != qr.view(torch.uint8)).sum())
            assert bad == 0, f"{dtype} T={t} C={c}: {bad} codes differ from the {name} quantiser"
            assert torch.equal(scale, sr), f"{dtype} T={t} C={c}: scales differ from the {name} quantiser"
        # the reference quantises its own norm (which may differ from the kernel's by an ulp)
        _, xr, (qr, sr) = residual_rms_norm_ref(h, delta, w, 1e-5, None, quantize=True)
        qt, st = fp8.quantize_activation_group128(xr)
        assert torch.equal(qr.view(torch.uint8), qt.view(torch.uint8)) and torch.equal(sr, st)
        cases += 1
print(json.dumps({"cases": cases}))
"""


def test_residual_norm_quantized_output_is_the_quantiser_bits_under_interpreter():
    """quantize=True: codes and scales of the rounded norm, bit-equal to the torch quantiser (and
    the Triton one) on the returned x, for fp32/bf16/fp16; the other outputs unchanged."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK_QUANT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"cases": 12' in out.stdout


def test_layers_norm_quantize_on_the_torch_path():
    """sglang_ext.layers.norm on CPU (torch path): the third result is the torch quantiser's."""
    from sglang_ext.layers import fp8
    from sglang_ext.layers.norm import residual_rms_norm

    h, d = torch.randn(3, 320).to(torch.bfloat16), torch.randn(3, 320).to(torch.bfloat16)
    w = torch.rand(320).to(torch.bfloat16) + 0.5
    s, x, (q, scale) = residual_rms_norm(h, d, w, 1e-5, quantize=True)
    s0, x0 = residual_rms_norm(h, d, w, 1e-5)
    qr, sr = fp8.quantize_activation_group128(x)
    assert torch.equal(s, s0) and torch.equal(x, x0)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(scale, sr)


def test_residual_norm_rejects_a_tap_that_does_not_fit():
    from sglang_ext.kernels.residual_norm import residual_rms_norm

    h = torch.randn(2, 8)
    with pytest.raises(ValueError, match="does not fit the tap buffer"):
        residual_rms_norm(h, None, torch.ones(8), 1e-5, (torch.zeros(2, 12), 6, 1e-6))
    with pytest.raises(ValueError, match="delta must be"):
        residual_rms_norm(h, torch.randn(2, 7), torch.ones(8), 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 128, 8192])
def test_residual_norm_gpu_full_width(tokens):
    from sglang_ext.kernels.residual_norm import residual_rms_norm

    torch.manual_seed(tokens)
    c = 2880
    h = torch.randn(tokens, c, device="cuda", dtype=torch.bfloat16) * 3
    delta = torch.randn(tokens, c, device="cuda", dtype=torch.bfloat16)
    w = (torch.rand(c, device="cuda") + 0.5).to(torch.bfloat16)
    feats = torch.full((tokens, 3 * c), float("nan"), device="cuda", dtype=torch.bfloat16)
    s, x = residual_rms_norm(h, delta, w, 1e-5, (feats, 2 * c, 1e-6))
    assert torch.equal(s, h + delta)
    sd = s.double()
    inv = torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-5)
    for got, want in ((x, w.double() * sd * inv), (feats[:, 2 * c:], sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6))):
        assert ((got.double() - want).abs() / want.abs().clamp_min(1.0)).max().item() <= 2.0 ** -8
    assert torch.isnan(feats[:, :2 * c].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 16, 17, 128])
def test_residual_norm_gpu_quantized_output(tokens):
    """Compiled (the cast rounds to e4m3): the codes and scales of the rounded norm equal the torch
    quantiser's on the returned x, bit for bit, and feed fp8_linear's x_quant."""
    from sglang_ext.kernels.fp8_gemm import fp8_linear
    from sglang_ext.kernels.residual_norm import residual_rms_norm
    from sglang_ext.layers import fp8

    torch.manual_seed(tokens)
    c = 2880
    h = torch.randn(tokens, c, device="cuda", dtype=torch.bfloat16) * 3
    delta = torch.randn(tokens, c, device="cuda", dtype=torch.bfloat16)
    w = (torch.rand(c, device="cuda") + 0.5).to(torch.bfloat16)
    s, x, (q, scale) = residual_rms_norm(h, delta, w, 1e-5, quantize=True)
    qr, sr = fp8.quantize_activation_group128(x)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(scale, sr)
    wq, ws = fp8.quantize_weight_block128(torch.randn(5120, c, device="cuda") * 0.05)
    assert torch.equal(fp8_linear(x, wq, ws, None, x_quant=(q, scale)), fp8_linear(x, wq, ws, None, x_quant=(qr, sr)))
