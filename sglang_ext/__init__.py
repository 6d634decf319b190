"""sglang-ext: gpt-oss on SGLang with sink attention, FP8 block-128 layers and SingProbe.

Importing this package imports nothing from SGLang; the SGLang-facing glue lives in
`sglang_ext.plugin`, `sglang_ext.patches` and the backend/model modules, loaded by
SGLang through the `sglang.srt.plugins` entry point.
"""

__version__ = "0.1.0"

# The patches in sglang_ext.patches are written against this exact release.
PINNED_SGLANG_VERSION = "0.5.23"

# The `--attention-backend` name of sglang_ext.attention_backend (registered by patches.sink_attention_backend).
ATTENTION_BACKEND = "ext_sinks"
