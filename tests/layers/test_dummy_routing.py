"""Weightless serving (`--load-format dummy`) routes tokens as trained weights do (patches/dummy_routing.py).

Oracle: SGLang's own dummy initialiser on the model's parameters, and the reference router
(`layers.moe.route`) on token-like hidden states: under SGLang's draw every token picks the same experts
(why the patch exists); after the patch's redraw, 64 tokens spread over most of the 32 experts. And
transformers' gpt-oss forward under SGLang's draw: with only the routers redrawn, the tokens' hidden states
converge with depth and so do their experts; with the embedding redrawn too, every layer spreads them.
"""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.model_loader.weight_utils import initialize_dummy_weights  # noqa: E402
from transformers import GptOssConfig  # noqa: E402

import sglang_ext.models.gpt_oss_core as core  # noqa: E402
from sglang_ext.layers.moe import route  # noqa: E402
from sglang_ext.layers.norm import rms_norm  # noqa: E402
from sglang_ext.layers.parallel import ParallelLayout  # noqa: E402
from sglang_ext.patches import dummy_routing  # noqa: E402

EXPERTS, TOP_K, TOKENS = 32, 4, 64


class _Model(torch.nn.Module):  # as GptOssForCausalLM holds its decoder
    def __init__(self, decoder):
        super().__init__()
        self.model = decoder


def experts_chosen(decoder, layer: int = 0) -> set:
    mlp, norm = decoder.layers[layer].mlp, decoder.layers[layer].post_attention_layernorm
    h = torch.empty(TOKENS, decoder.config.hidden_size).uniform_(-1e-3, 1e-3, generator=torch.Generator().manual_seed(1))
    x = rms_norm(h, norm.weight, decoder.config.rms_norm_eps)
    _, ids = route(x, mlp.router.weight.float(), mlp.router.bias.float(), TOP_K)
    return set(ids.flatten().tolist())


@pytest.fixture
def dummy_decoder():
    cfg = GptOssConfig(hidden_size=256, intermediate_size=256, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_hidden_layers=2,
                       vocab_size=512, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    decoder = core.GptOssDecoder(cfg, core.RankGroups(ParallelLayout(1, 0)), fp8=False)
    initialize_dummy_weights(decoder)
    return decoder


def test_sglang_dummy_weights_send_every_token_to_the_same_experts(dummy_decoder):
    assert len(experts_chosen(dummy_decoder)) == TOP_K


def test_patch_spreads_tokens_over_the_experts(dummy_decoder):
    model = _Model(dummy_decoder)
    assert dummy_routing._route_like_trained(model) is model
    for layer in range(2):
        assert len(experts_chosen(dummy_decoder, layer)) >= 24
    assert not dummy_decoder.layers[0].mlp.router.bias.any()
    again = core.GptOssDecoder(dummy_decoder.config, core.RankGroups(ParallelLayout(1, 0)), fp8=False)
    initialize_dummy_weights(again)
    dummy_routing._route_like_trained(_Model(again))  # every rank draws the same routers
    assert torch.equal(again.layers[1].mlp.router.weight, dummy_decoder.layers[1].mlp.router.weight)


def test_patch_redraws_upstreams_gpt_oss_too(dummy_decoder):
    """The GPU machine times upstream's gpt-oss with this patch alone: its layers hold routers of the same shapes."""
    class Router(torch.nn.Module):
        def __init__(self, mine):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(mine.weight.clone()), torch.nn.Parameter(mine.bias.clone())

    layers = torch.nn.ModuleList(torch.nn.Module() for _ in dummy_decoder.layers)
    for theirs, mine in zip(layers, dummy_decoder.layers):
        theirs.mlp = torch.nn.Module()
        theirs.mlp.router = Router(mine.mlp.router)
    upstream = type("GptOssForCausalLM", (torch.nn.Module,), {})()
    upstream.model = torch.nn.Module()
    upstream.model.layers = layers
    dummy_routing._route_like_trained(upstream)
    dummy_routing._route_like_trained(_Model(dummy_decoder))
    for theirs, mine in zip(layers, dummy_decoder.layers):
        assert torch.equal(theirs.mlp.router.weight, mine.mlp.router.weight) and not theirs.mlp.router.bias.any()


def test_patch_leaves_other_models_alone():
    other = _Model(torch.nn.Linear(4, 4))
    before = other.model.weight.clone()
    assert dummy_routing._route_like_trained(other) is other
    assert torch.equal(other.model.weight, before)


def test_patch_target_exists():
    module, cls, fn = "sglang.srt.model_loader.loader.DummyModelLoader.load_model".rsplit(".", 2)
    assert callable(getattr(getattr(importlib.import_module(module), cls), fn))


def test_patch_spreads_tokens_in_every_layer_of_a_real_forward():
    """transformers' GptOssForCausalLM (the class name upstream's model has, so the patch takes it as upstream's)
    under SGLang's dummy draw, 12 layers, 64 random tokens in one sequence: the experts each layer's router picks."""
    from transformers import GptOssForCausalLM

    cfg = GptOssConfig(hidden_size=256, intermediate_size=256, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=64, num_hidden_layers=12,
                       vocab_size=4096, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 6)
    cfg._attn_implementation = "eager"
    model = GptOssForCausalLM(cfg).eval().requires_grad_(False)
    initialize_dummy_weights(model)
    sglang_embedding = model.model.embed_tokens.weight.clone()
    picked = []
    for layer in model.model.layers:
        layer.mlp.router.register_forward_hook(lambda _m, _a, out: picked.append(len(set(out[-1].flatten().tolist()))))
    ids = torch.randint(0, 4096, (1, TOKENS), generator=torch.Generator().manual_seed(0))

    def experts_per_layer():
        picked.clear()
        with torch.no_grad():
            model(ids)
        return list(picked)

    dummy_routing._route_like_trained(model)
    redrawn = experts_per_layer()
    assert min(redrawn) >= 24, redrawn
    assert not torch.equal(model.model.embed_tokens.weight, sglang_embedding)
    model.model.embed_tokens.weight.copy_(sglang_embedding)  # the routers alone: the last layers collapse
    routers_only = experts_per_layer()
    assert routers_only[0] >= 16 and max(routers_only[-4:]) <= 8, routers_only
