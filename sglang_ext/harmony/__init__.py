"""Harmony for gpt-oss: openai-harmony's token-level parser behind a normalizer, mapped onto the OpenAI API.

``parser`` (token ids -> Harmony messages and events) and ``streaming`` (events -> OpenAI
reasoning_content / content / tool_calls) import nothing from SGLang; ``detectors`` are the
SGLang reasoning and tool-call parsers built on them, registered as ``gpt-oss`` by
``sglang_ext.patches.harmony_parsers``.
"""
