"""The fused probe tail kernel (Triton interpreter on CPU) vs its torch reference and the reference head."""

import os
import subprocess
import sys

import torch

CHECK = r"""
import torch
from sglang_ext.kernels.probe_tail import probe_tail, probe_tail_ref
torch.manual_seed(0)
worst = 0.0
for dtype in (torch.float32, torch.float16):
    for t in (1, 3, 17):
        hd, L = 512, 10
        q = torch.randn(t, hd).to(dtype); ctx = torch.randn(t, 8, 64)
        wo = (torch.randn(hd, hd) * 0.05).to(dtype); nw = (1 + 0.1 * torch.randn(hd)).to(dtype)
        wc = (torch.randn(L, hd) * 0.1).to(dtype); bc = torch.randn(L).to(dtype)
        got = probe_tail(q, ctx, wo, nw, wc, bc)
        want = probe_tail_ref(q, ctx, wo, nw, wc, bc)
        worst = max(worst, (got - want).abs().max().item())
print(worst)
"""


def test_tail_kernel_matches_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 2e-5


def test_tail_reference_equals_the_heads_tail():
    from sglang_ext.kernels.probe_tail import probe_tail_ref
    from sglang_ext.probe.config import ProbeConfig
    from sglang_ext.probe.model import SingProbeHead

    cfg = ProbeConfig.from_dict({"architectures": ["SingProbeAttnModel"], "model_type": "sing_probe_attn",
                                 "hidden_size": 32, "base_model_layer_ids": [0, 1], "num_attention_heads": 8,
                                 "head_dim": 64, "sliding_window": 16, "num_labels": 10,
                                 "base_model_name": "x", "torch_dtype": "float32"})
    head = SingProbeHead(cfg)
    for p in head.parameters():
        p.data.normal_(0, 0.1)
    q, ctx = torch.randn(5, 8, 64), torch.randn(5, 8, 64)
    want = head.probs(head.tail(q, ctx))
    got = probe_tail_ref(q, ctx, head.o_proj.weight, head.norm.weight, head.classifier.weight, head.classifier.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
