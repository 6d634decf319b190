"""The SGLang-free gpt-oss layers against independent references (float64 loops, transformers)."""

import math

import pytest
import torch

from sglang_ext.layers import moe
from sglang_ext.layers.rope import YarnRope, apply_rope


def moe_reference(x, weight, bias, top_k, w13, b13, w2, b2, limit):
    """float64, token by token, written from SPEC §1 (softmax over the top-k logits)."""
    x, weight, bias, w13, b13, w2, b2 = (t.double() for t in (x, weight, bias, w13, b13, w2, b2))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = weight @ x[t] + bias
        top = torch.topk(logits, top_k)
        probs = torch.softmax(top.values, 0)
        for p, e in zip(probs, top.indices):
            h = w13[e] @ x[t] + b13[e]
            g, l = h[0::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
            out[t] += p * (w2[e] @ (g * torch.sigmoid(1.702 * g) * (l + 1)) + b2[e])
    return out


def _moe_weights(e=8, h=32, i=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.3: torch.randn(*s, generator=g) * std
    return dict(weight=r(e, h, std=1.0), bias=r(e), w13=r(e, 2 * i, h), b13=r(e, 2 * i), w2=r(e, h, i), b2=r(e, h))


@pytest.mark.parametrize("tokens", [1, 3, 8, 40])  # 1..8: gathered path; 40: per-expert path
def test_moe_matches_float64(tokens):
    w = _moe_weights()
    x = torch.randn(tokens, 32)
    weights, ids = moe.route(x, w["weight"], w["bias"], 4)
    got = moe.experts_torch(x, weights, ids, w["w13"], w["b13"], w["w2"], w["b2"], limit=7.0)
    want = moe_reference(x, w["weight"], w["bias"], 4, w["w13"], w["b13"], w["w2"], w["b2"], 7.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [2, 40])
def test_moe_expert_and_tensor_parallel_shards_sum_to_whole(tokens):
    w = _moe_weights()
    x = torch.randn(tokens, 32)
    weights, ids = moe.route(x, w["weight"], w["bias"], 4)
    whole = moe.experts_torch(x, weights, ids, w["w13"], w["b13"], w["w2"], w["b2"], 7.0)
    # expert parallel: two ranks of 4 experts each
    ep = sum(moe.experts_torch(x, weights, ids, w["w13"][r * 4:(r + 1) * 4], w["b13"][r * 4:(r + 1) * 4],
                               w["w2"][r * 4:(r + 1) * 4], w["b2"][r * 4:(r + 1) * 4], 7.0, expert_offset=r * 4)
             for r in range(2))
    torch.testing.assert_close(ep, whole, rtol=1e-5, atol=1e-5)
    # tensor parallel: intermediate split in halves (interleaved gate/up rows), mlp2 bias once
    parts = []
    for lo, hi in ((0, 12), (12, 24)):
        parts.append(moe.experts_torch(x, weights, ids, w["w13"][:, 2 * lo:2 * hi], w["b13"][:, 2 * lo:2 * hi],
                                       w["w2"][:, :, lo:hi], None, 7.0))
    tp = moe.add_down_bias(parts[0] + parts[1], weights, ids, w["b2"])
    torch.testing.assert_close(tp, whole, rtol=1e-5, atol=1e-5)


def test_routing_softmax_runs_in_bf16_over_top_k_only():
    w = _moe_weights()
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    w["weight"] = w["weight"] * 0.05  # logits of order 1: mass spreads beyond the top 4
    weights, ids = moe.route(x, w["weight"].bfloat16(), w["bias"].bfloat16(), 4)
    assert weights.dtype == torch.bfloat16
    # Independent: the bf16 router logits, ranked and normalised in float64.
    logits = (x.double() @ w["weight"].bfloat16().double().t() + w["bias"].bfloat16().double()).bfloat16().double()
    # The chosen 4 are the 4 largest; bf16 logits can tie, and either of two tied experts is a correct pick.
    unchosen = logits.scatter(1, ids, float("-inf"))
    assert (logits.gather(1, ids).min(-1).values >= unchosen.max(-1).values).all()
    assert all(len(set(row.tolist())) == 4 for row in ids)
    top4 = torch.softmax(logits.gather(1, ids), dim=-1)
    over_all = torch.softmax(logits, dim=-1).gather(1, ids)
    half_ulp = top4 * 2.0 ** -8
    assert ((weights.double() - top4).abs() <= half_ulp).all()  # softmax over the 4, one bf16 rounding
    assert ((weights.double() - over_all).abs() > 8 * half_ulp).all()  # not a softmax over every expert


def test_yarn_matches_transformers():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = GptOssConfig(head_dim=64, hidden_size=2880, num_attention_heads=64, rope_theta=150000,
                       rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "original_max_position_embeddings": 4096, "truncate": False})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = YarnRope.from_hf_config(cfg)
    torch.testing.assert_close(ours.inv_freq(), inv_freq.float(), rtol=1e-6, atol=0)
    assert ours.concentration == pytest.approx(scaling) == pytest.approx(0.1 * math.log(32) + 1)


def test_rope_is_half_split_rotation():
    torch.manual_seed(0)
    rope = YarnRope(head_dim=8)
    cache = rope.cos_sin_cache(16)
    x = torch.randn(16, 2, 8, dtype=torch.float64)
    got = apply_rope(x, cache)
    cos, sin = cache[:, None, :4].double(), cache[:, None, 4:].double()
    want = torch.cat([x[..., :4] * cos - x[..., 4:] * sin, x[..., 4:] * cos + x[..., :4] * sin], -1)
    torch.testing.assert_close(got, want)


def test_mxfp4_dequant_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from sglang_ext.layers.mxfp4 import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 134, (2, 6, 3), dtype=torch.uint8, generator=g)
    ours = dequantize_mxfp4(blocks, scales, dtype=torch.float32)  # [E, rows, K]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0)


@pytest.mark.gpu
def test_compiled_norm_and_rope_equal_eager_on_cuda(ext_env):
    """On CUDA, RMSNorm and RoPE run as torch.compile'd kernels: the same maths as eager, up to
    one rounding of the output dtype (Inductor may reorder fp32 sums)."""
    from sglang_ext.layers.norm import rms_norm
    from sglang_ext.layers.rope import YarnRope, apply_rope

    g = torch.Generator(device="cuda").manual_seed(0)
    cache = YarnRope().cos_sin_cache(9000, device="cuda")
    for tokens in (1, 7, 256):
        x = torch.randn(tokens, 2880, device="cuda", generator=g).bfloat16() * 3
        w = torch.randn(2880, device="cuda", generator=g).bfloat16()
        q = torch.randn(tokens, 64, 64, device="cuda", generator=g).bfloat16()
        pos = torch.randint(0, 9000, (tokens,), device="cuda", generator=g)
        ext_env("SGLANG_EXT_COMPILE", "1")
        got_n, got_r = rms_norm(x, w, 1e-5), apply_rope(q, cache[pos])
        ext_env("SGLANG_EXT_COMPILE", "0")
        want_n, want_r = rms_norm(x, w, 1e-5), apply_rope(q, cache[pos])
        torch.testing.assert_close(got_n.float(), want_n.float(), rtol=2 ** -7, atol=1e-2)
        torch.testing.assert_close(got_r.float(), want_r.float(), rtol=2 ** -7, atol=1e-2)
