"""Patch: register the `ext_sinks` attention backend and make it gpt-oss's default (SGLang 0.5.23).

Why: upstream cannot serve gpt-oss on a CPU without Intel AMX. Its gpt-oss override
picks `triton` (usable only under TRITON_INTERPRET=1 and only in fp32, and its decode
sliding window is one key short: 127 instead of 128), `torch_native` has no sinks and
is refused, and `intel_amx` needs AMX plus a CPU build of sgl_kernel.

Targets
  - `sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS` through its
    registration API `register_attention_backend`, and the CLI choices list
    `sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES` (argparse reads that list
    object when `--attention-backend` is added), so `--attention-backend ext_sinks` parses.
  - gpt-oss's config-time override registry (`register_model_override`, upstream's own
    extension API): when the user named no attention backend, `ext_sinks` is chosen on
    CUDA and on a CPU without AMX (upstream picks `fa3` on Hopper, whose sgl_kernel
    kernels know nothing of this model class's paged layout contract, and `triton` on
    such a CPU); when the user left `--moe-runner-backend auto`, it becomes `triton`
    instead of upstream's `triton_kernel` (whose MXFP4 weight layout this model class
    does not load: its experts run on sglang-ext's own MoE, and on CPU `triton`
    dispatches to the native MoE). A CPU with AMX keeps upstream's choices.
  - `sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments` (AROUND): its
    gpt-oss branch asserts the attention backend is in a hard-coded list; during that
    call our backend is presented under the name of an allowed sink backend.
"""

from __future__ import annotations

import logging

import sglang.srt.arg_groups.model_overrides.gpt_oss  # noqa: F401  (upstream's gpt-oss providers, before ours)
from sglang.srt.arg_groups import choices
from sglang.srt.arg_groups import model_override_base as mob
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import get_platform
from sglang.srt.utils.common import is_cpu

from sglang_ext import ATTENTION_BACKEND

logger = logging.getLogger(__name__)

GPT_OSS_ARCH = "GptOssForCausalLM"


def _register_backend() -> None:
    if ATTENTION_BACKEND not in choices.ATTENTION_BACKEND_CHOICES:
        choices.ATTENTION_BACKEND_CHOICES.append(ATTENTION_BACKEND)
    if ATTENTION_BACKEND not in ATTENTION_BACKENDS:

        def create(runner):
            from sglang_ext.attention_backend import SinkAttnBackend  # heavy, scheduler only; imports this module

            return SinkAttnBackend(runner)

        ATTENTION_BACKENDS[ATTENTION_BACKEND] = create


def _cpu_with_amx() -> bool:
    return is_cpu() and get_platform().has_amx


def gpt_oss_overrides(server_args, hf_config) -> dict:
    """Declared after upstream's gpt-oss provider, so these win where they apply."""
    if _cpu_with_amx():
        return {}
    overrides = {}
    user_named_backend = any(
        getattr(server_args, name, None)
        for name in ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    )
    if not user_named_backend:
        overrides["attention_backend"] = ATTENTION_BACKEND
    if getattr(server_args, "moe_runner_backend", "auto") == "auto":
        overrides["moe_runner_backend"] = "triton"
    return overrides


def _register_override() -> None:
    providers = mob._MODEL_OVERRIDE_FNS.setdefault(GPT_OSS_ARCH, [])
    if gpt_oss_overrides not in providers:
        mob.register_model_override(GPT_OSS_ARCH)(gpt_oss_overrides)


def _accept_ext_sinks_for_gpt_oss(original, server_args, *args, **kwargs):
    from sglang.srt.arg_groups import model_hook  # heavy: ~200 modules

    upstream_backends_of = model_hook.attention_backends_of

    def backends_of(cfg):
        # "triton" is an allowed sink backend; ours implements the same contract.
        return tuple("triton" if b == ATTENTION_BACKEND else b for b in upstream_backends_of(cfg))

    model_hook.attention_backends_of = backends_of
    try:
        return original(server_args, *args, **kwargs)
    finally:
        model_hook.attention_backends_of = upstream_backends_of


def register() -> None:
    _register_backend()
    _register_override()
    HookRegistry.register(
        "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments",
        _accept_ext_sinks_for_gpt_oss,
        HookType.AROUND,
    )
