"""L2 prefetch from earlier decode kernels (kernels/l2_prefetch.py): off where it cannot run, and on a GPU
the prefetching launches really issue the prefetch and change no bit.

Oracle: the same launch without the prefetch. A prefetch has no destination and writes nothing, so every
output must be equal bit for bit; the compiled PTX must hold the instruction (an inline asm the compiler
dropped as dead would make the benchmark measure nothing)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from sglang_ext.kernels import l2_prefetch as l2

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_prefetch_is_off_on_cpu_and_under_the_interpreter(monkeypatch):
    w = torch.zeros(256, 128, dtype=torch.float8_e4m3fn)
    assert l2.prefetch_args(l2.PrefetchL2(w), torch.device("cpu")) == {}
    assert l2.prefetch_args(None, torch.device("cuda")) == {}
    l2.set_l2_prefetch(True)
    try:
        assert not l2.l2_prefetch_enabled(torch.device("cpu"))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not l2.l2_prefetch_enabled(torch.device("cuda"))  # inline PTX cannot run interpreted
    finally:
        l2.set_l2_prefetch(None)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("SGLANG_EXT_L2_PREFETCH", "1")
    assert l2.l2_prefetch_enabled(torch.device("cuda"))
    monkeypatch.setenv("SGLANG_EXT_L2_PREFETCH", "0")
    assert not l2.l2_prefetch_enabled(torch.device("cuda"))
    with pytest.raises(ValueError, match="evict_last"):
        l2.set_l2_prefetch_policy("sometimes")


CHECK_INTERPRETED = r"""
import torch
from sglang_ext.kernels.l2_prefetch import PrefetchL2
from sglang_ext.kernels.residual_norm import residual_rms_norm
from sglang_ext.kernels.sink_attention import sink_attention_decode

torch.manual_seed(0)
pf = PrefetchL2(torch.zeros(64, 128))
h, d, w = torch.randn(2, 256), torch.randn(2, 256), torch.rand(256) + 0.5
for quantize in (False, True):
    a = residual_rms_norm(h, d, w, 1e-5, quantize=quantize)
    b = residual_rms_norm(h, d, w, 1e-5, quantize=quantize, l2_prefetch=pf)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
q, kb, vb = torch.randn(2, 8, 16), torch.randn(64, 2, 16), torch.randn(64, 2, 16)
r2t = torch.randperm(64).view(2, 32).int()
args = (q, kb, vb, r2t, torch.arange(2), torch.tensor([30, 17], dtype=torch.int32), torch.randn(8), -1, 0.25)
assert torch.equal(sink_attention_decode(*args), sink_attention_decode(*args, l2_prefetch=pf))
print("ok")
"""


def test_launchers_take_the_prefetch_and_ignore_it_interpreted():
    """Off the GPU the launchers accept `l2_prefetch` and run exactly as without it."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK_INTERPRETED], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def _ptx_has_prefetch(kernel) -> bool:
    return any("prefetch.global.L2" in c.asm["ptx"] for dev in kernel.device_caches.values()
               for c in dev[0].values())


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["evict_last", "normal"])
def test_prefetching_launches_issue_it_and_change_no_bit(policy):
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("prefetch.global.L2::evict_last needs sm80+")
    from sglang_ext.kernels import residual_norm, sink_attention

    torch.manual_seed(0)
    dev = torch.device("cuda")
    weight = torch.randn(5120, 2880, device=dev).to(torch.float8_e4m3fn)
    pf = l2.PrefetchL2(weight)
    l2.set_l2_prefetch_policy(policy)
    try:
        for rows, quantize in ((1, True), (1, False), (4, True), (64, False)):
            h = torch.randn(rows, 2880, device=dev, dtype=torch.bfloat16)
            d = torch.randn(rows, 2880, device=dev, dtype=torch.bfloat16)
            w = torch.rand(2880, device=dev) + 0.5
            plain = residual_norm.residual_rms_norm(h, d, w, 1e-5, quantize=quantize)
            pre = residual_norm.residual_rms_norm(h, d, w, 1e-5, quantize=quantize, l2_prefetch=pf)
            for a, b in zip(plain, pre):
                for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                    assert torch.equal(x, y), (rows, quantize)
        assert _ptx_has_prefetch(residual_norm._residual_rms_norm_kernel)

        # the decode attention, one-shot (8k table) and split loop (a server's 131072-wide table)
        hq, hkv, d_ = 64, 8, 64
        for batch, width in ((1, 8192), (1, 131072), (4, 8192)):
            slots = batch * 8192
            kb = torch.randn(slots, hkv, d_, device=dev, dtype=torch.bfloat16)
            vb = torch.randn(slots, hkv, d_, device=dev, dtype=torch.bfloat16)
            r2t = torch.zeros(batch, width, dtype=torch.int32, device=dev)
            r2t[:, :8192] = torch.randperm(slots, device=dev).view(batch, 8192).int()
            q = torch.randn(batch, hq, d_, device=dev, dtype=torch.bfloat16)
            sinks = torch.randn(hq, device=dev)
            seq = torch.full((batch,), 8000, dtype=torch.int32, device=dev)
            idx = torch.arange(batch, device=dev)
            for window in (-1, 127):
                a = sink_attention.sink_attention_decode(q, kb, vb, r2t, idx, seq, sinks, window, 0.125)
                b = sink_attention.sink_attention_decode(q, kb, vb, r2t, idx, seq, sinks, window, 0.125, l2_prefetch=pf)
                assert torch.equal(a, b), (batch, width, window)
        assert _ptx_has_prefetch(sink_attention._sink_decode_oneshot_kernel)
        assert _ptx_has_prefetch(sink_attention._sink_decode_kernel)
    finally:
        l2.set_l2_prefetch_policy("evict_last")


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_step_bits_equal_with_and_without_prefetch(batch):
    """The harness step (PDL on) captured with and without the prefetches: the same logits on every replay."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the decode chain's PDL needs sm90+")
    import bench_common as bc
    from model_step import GPT_OSS_20B, ModelStep, Sharding

    from sglang_ext.kernels import pdl

    torch.manual_seed(0)
    dims = dataclasses.replace(GPT_OSS_20B, num_layers=3, probe_layers=(0, 1, 2))
    model = ModelStep(dims, Sharding(1, 1, 1, 0), batch=batch, context=4096)
    inputs = model.decode_inputs(4096)
    outs, graphs = {}, {}
    try:
        pdl.set_pdl(True)
        for use in (False, True):
            l2.set_l2_prefetch(use)
            graphs[use] = bc.capture_graph(lambda use=use: outs.__setitem__(use, model.forward(**inputs)))
    finally:
        l2.set_l2_prefetch(None)
        pdl.set_pdl(None)
    graphs[False].replay()
    torch.cuda.synchronize()
    reference = outs[False].clone()
    assert torch.isfinite(reference.float()).all()
    for i in range(50):
        graphs[True].replay()
        if i % 10 == 0:
            torch.cuda.synchronize()
            assert torch.equal(outs[True], reference), f"replay {i}"
    torch.cuda.synchronize()
    assert torch.equal(outs[True], reference)
