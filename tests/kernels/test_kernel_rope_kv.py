"""RoPE + KV-cache write in one launch (kernels/rope_kv.py) vs the model's own RoPE and indexed stores.

The oracle is what the model ran before the fusion: `sglang_ext.layers.rope.apply_rope` on q and k and
`cache[loc] = k/v`. q, k, v are strided column views of one qkv GEMM output, as the model passes them;
cache slots that no token writes are poisoned and must stay untouched.
"""

import os
import subprocess
import sys

import pytest
import torch

CHECK = r"""
import torch
from sglang_ext.kernels.rope_kv import rope_store_kv, rope_store_kv_ref
from sglang_ext.layers.rope import YarnRope, apply_rope

torch.manual_seed(0)
rope = YarnRope(head_dim=16)
cache = rope.cos_sin_cache(200)
worst = {}
for dtype in (torch.float32, torch.bfloat16):
    for t, hq, hkv in ((1, 8, 2), (5, 8, 2), (3, 12, 3)):
        d = 16
        qkv = torch.randn(t, (hq + 2 * hkv) * d + 7).to(dtype)  # +7: a row stride that is not the width
        q = qkv[:, :hq * d].view(t, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d:(hq + 2 * hkv) * d].view(t, hkv, d)
        pos = torch.randint(0, 200, (t,))
        cos_sin = cache[pos]
        slots = 4 * t + 3
        loc = torch.randperm(slots)[:t].to(torch.int32)
        kc = torch.full((slots, hkv, d), float("nan"), dtype=dtype)
        vc = torch.full((slots, hkv, d), float("nan"), dtype=dtype)
        kc2, vc2 = kc.clone(), vc.clone()
        got_q = rope_store_kv(q, k, v, cos_sin, kc, vc, loc)
        want_q = apply_rope(q, cos_sin)
        kc2[loc.long()] = apply_rope(k, cos_sin)
        vc2[loc.long()] = v
        ref_q = rope_store_kv_ref(q, k, v, cos_sin, kc.clone(), vc.clone(), loc)
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[loc.long()] = False
        assert torch.isnan(kc[untouched].float()).all() and torch.isnan(vc[untouched].float()).all(), "wrote a foreign slot"
        assert torch.equal(vc[loc.long()], v), "v must be copied exactly"
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -20
        for name, a, b in (("q", got_q, want_q), ("k", kc[loc.long()], kc2[loc.long()]), ("q_ref", ref_q, want_q)):
            err = ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1.0)).max().item()
            worst[(str(dtype), name)] = max(worst.get((str(dtype), name), 0.0), err / ulp)
print(max(worst.values()))
"""


def test_rope_kv_matches_apply_rope_and_indexed_stores_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # In ulps of the dtype (relative to max(|x|, 1)): fp32 maths then one rounding, like apply_rope; a
    # different fused multiply-add contraction may move the last bit.
    assert float(out.stdout.strip().splitlines()[-1]) <= 1.0


def test_rope_kv_rejects_mismatched_shapes():
    from sglang_ext.kernels.rope_kv import rope_store_kv

    q, k = torch.randn(2, 8, 16), torch.randn(2, 2, 16)
    kc = torch.zeros(5, 2, 16)
    with pytest.raises(ValueError, match="cos_sin must be"):
        rope_store_kv(q, k, k, torch.zeros(2, 8), kc, kc.clone(), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="caches must be"):
        rope_store_kv(q, k, k, torch.zeros(2, 16), torch.zeros(5, 3, 16), kc, torch.zeros(2, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 128, 4096])
def test_rope_kv_gpu_full_shapes(tokens):
    from sglang_ext.kernels.rope_kv import rope_store_kv
    from sglang_ext.layers.rope import YarnRope

    torch.manual_seed(tokens)
    hq, hkv, d = 64, 8, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(tokens, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
    cos_sin = YarnRope(head_dim=d).cos_sin_cache(131072, device="cuda")[torch.randint(0, 131072, (tokens,), device="cuda")]
    slots = 2 * tokens + 1
    loc = torch.randperm(slots, device="cuda")[:tokens].to(torch.int32)
    kc = torch.full((slots, hkv, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    vc = kc.clone()
    got = rope_store_kv(q, k, v, cos_sin, kc, vc, loc)
    cos, sin = cos_sin[:, None, :d // 2].double(), cos_sin[:, None, d // 2:].double()

    def rope64(x):
        a, b = x.double()[..., :d // 2], x.double()[..., d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    for a, b in ((got, rope64(q)), (kc[loc.long()], rope64(k))):
        assert ((a.double() - b).abs() / b.abs().clamp_min(1.0)).max().item() <= 2.0 ** -8  # one bf16 rounding
    assert torch.equal(vc[loc.long()], v)
    untouched = torch.ones(slots, dtype=torch.bool, device="cuda")
    untouched[loc.long()] = False
    assert torch.isnan(kc[untouched].float()).all()
