"""Patch: give the model the KV pools so SingProbe allocates its K/V beside them (SGLang 0.5.23).

Target: `sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends`
(AFTER). The KV pools exist once the attention backends are built, and CUDA graphs are
captured after this point, so this is the one place where the probe can allocate its
static K/V pool (one row of 128 values per base-model KV slot) before capture.
Models without `bind_kv_pools` (anything but ours) are untouched.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def _bind_kv_pools(result, model_runner, *args, **kwargs):
    bind = getattr(model_runner.model, "bind_kv_pools", None)
    if bind is not None:
        bind(model_runner.req_to_token_pool, model_runner.token_to_kv_pool)


def register() -> None:
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends",
        _bind_kv_pools,
        HookType.AFTER,
    )
