"""Patch: weightless gpt-oss (`--load-format dummy`) routes each token to its own experts (SGLang 0.5.23).

Target: `sglang.srt.model_loader.loader.DummyModelLoader.load_model` (AFTER): for sglang-ext's gpt-oss (and
upstream's, where this patch is loaded alone to time the peer), the routers and the token embedding are redrawn
(`models.gpt_oss_core.redraw_routing`) before SGLang captures its CUDA graphs.

Why: the dummy loader fills every parameter with the same seeded uniform(-1e-3, 1e-3) draw per shape.
gpt-oss's router logits are then set by the router bias, the same for every token, and the residual
stream of every token converges with depth to the sum of the layers' (equal) biases, so every token of a
batch picks nearly the same experts: a served decode at batch 8 read 4 experts a layer where a trained model
reads up to 32, and measured faster than the bytes it must move allow. Only weightless runs change; a checkpoint's
weights are never touched.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)


def _routers_of(model) -> object | None:
    """The decoder whose layers hold gpt-oss routers (`.mlp.router` with weight [E, H] and bias [E]): ours, or
    upstream's when only this patch is loaded (the GPU machine's peer run), else None."""
    from sglang_ext.models.gpt_oss_core import GptOssDecoder  # model code: scheduler only

    decoder = getattr(model, "model", None)
    if isinstance(decoder, GptOssDecoder):
        return decoder
    if type(model).__name__ != "GptOssForCausalLM" or not hasattr(decoder, "layers"):
        return None
    routers = [getattr(getattr(layer, "mlp", None), "router", None) for layer in decoder.layers]
    if all(getattr(r, "bias", None) is not None and getattr(r, "weight", None) is not None for r in routers):
        return decoder
    return None


def _route_like_trained(model, *args, **kwargs):
    from sglang_ext.models.gpt_oss_core import redraw_routing  # model code: scheduler only

    decoder = _routers_of(model)
    if decoder is None:
        return model
    with torch.no_grad():
        redraw_routing(decoder)
    logger.info("sglang-ext: --load-format dummy: gpt-oss routers (N(0, 1), no bias) and token embedding "
                "(N(0, 1)) redrawn so that tokens spread over the experts as with trained weights")
    return model


_registered = False


def register() -> None:
    """Also an entry point of its own on the GPU machine (benchmarks/served/gpu_env.py), for the upstream peer's
    weightless runs; registering twice would redraw twice."""
    global _registered
    if _registered:
        return
    HookRegistry.register("sglang.srt.model_loader.loader.DummyModelLoader.load_model", _route_like_trained,
                          HookType.AFTER)
    _registered = True
