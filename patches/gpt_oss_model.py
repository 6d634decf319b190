"""Patch: serve `GptOssForCausalLM` with sglang-ext's model class (SGLang 0.5.23).

Target: `sglang.srt.models.registry._ModelRegistry.resolve_model_cls` (BEFORE): the
first time a process resolves a model class, our classes from `sglang_ext.models`
enter the registry, overriding upstream's of the same name. Classes are keyed by
`__name__`, so ours keeps the upstream name and every gpt-oss decision keyed on that
string (config overrides, the hybrid SWA pool, the chat serving checks) still applies.
Registering lazily keeps the launcher and the detokenizer from importing the model.

Why: upstream's class runs on CPU only through the Triton interpreter in fp32, its
native MoE path recompiles with torch.compile on every new shape (about 1.4 tok/s on
the tiny model here), and the FP8 block-128 layers, fused biases, probe taps and our
kernels need a model whose forward we own.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

MODEL_PACKAGE = "sglang_ext.models"


def _register_ours(registry, *args, **kwargs):
    if not getattr(registry, "_sglang_ext_registered", False):
        from sglang.srt.models.registry import import_model_classes

        registry.models.update(import_model_classes(MODEL_PACKAGE, strict=True))
        registry._sglang_ext_registered = True


def register() -> None:
    HookRegistry.register(
        "sglang.srt.models.registry._ModelRegistry.resolve_model_cls",
        _register_ours,
        HookType.BEFORE,
    )
