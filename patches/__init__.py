"""Every change sglang-ext makes to SGLang 0.5.23, one module each.

Each module has a `register()` that registers its hooks through SGLang's
`HookRegistry` (applied by `load_plugins()` right after the plugins run) and a
docstring naming the target, the pinned version and why the change exists.
"""

from __future__ import annotations

import importlib

PATCH_MODULES = (
    "probe_ckpt_flag",
    "sink_attention_backend",
    "gpt_oss_model",
    "dummy_routing",
    "probe_kv_pool",
    "openai_probe_scores",
    "responses_api",
    "probe_stop",
    "probe_cuda_graph",
    "harmony_parsers",
    "harmony_prompt",
    "request_isolation",
    "cpu_tensor_parallel",
    "operator_routes",
    "exact_abort",
    "probe_health",
    "stream_line_separators",
    "guard_endpoints",
    "playground",
)

_registered = False


def register_all() -> None:
    global _registered
    if _registered:
        return
    for name in PATCH_MODULES:
        importlib.import_module(f"{__name__}.{name}").register()
    _registered = True
