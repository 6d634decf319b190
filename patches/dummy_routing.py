"""Patch: weightless gpt-oss (`--load-format dummy`) routes each token to its own experts (SGLang 0.5.23).

Target: `sglang.srt.model_loader.loader.DummyModelLoader.load_model` (AFTER): for sglang-ext's gpt-oss,
the routers are redrawn (`models.gpt_oss_core.redraw_routers`) before SGLang captures its CUDA graphs.

Why: the dummy loader fills every parameter with the same seeded uniform(-1e-3, 1e-3) draw per shape.
gpt-oss's router logits are then set by the router bias, the same for every token, so every token of a
batch picks the same 4 experts: a served decode at batch 8 read 4 experts a layer where a trained model
reads up to 32, and measured faster than the bytes it must move allow. Only weightless runs change; a
checkpoint's routers are never touched.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

logger = logging.getLogger(__name__)


def _route_like_trained(model, *args, **kwargs):
    from sglang_ext.models.gpt_oss_core import GptOssDecoder, redraw_routers  # model code: scheduler only

    decoder = getattr(model, "model", None)
    if not isinstance(decoder, GptOssDecoder):
        return model

    with torch.no_grad():
        redraw_routers(decoder)
    logger.info("sglang-ext: --load-format dummy: gpt-oss routers redrawn (N(0, 1), no bias) so that tokens "
                "spread over the experts as with trained weights")
    return model


def register() -> None:
    HookRegistry.register("sglang.srt.model_loader.loader.DummyModelLoader.load_model", _route_like_trained,
                          HookType.AFTER)
