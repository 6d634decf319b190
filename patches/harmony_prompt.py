"""Patch: gpt-oss chat prompts with tool history rendered by openai-harmony (SGLang 0.5.23).

The official gpt-oss chat template keeps only the first tool call of an assistant turn,
names every tool result after the latest call, and re-serialises arguments and results with
``|tojson``; a multi-turn agent loop then shows the model a history it never wrote
(``sglang_ext.harmony.chat_render`` has the details). Requests whose messages carry tool calls
or tool results are rendered by openai-harmony instead; all others keep the template, so
plain chats are unchanged. A function tool without a description (valid OpenAI input) gets an empty
one, as if the client had sent "": the official template concatenates the description into a comment
line and failed on None, and upstream's retry answered a 400 reading "'dict object' has no attribute
'function'".

Target
  - ``OpenAIServingChat._encode_messages`` (AROUND): SGLang's hook for custom renderers ("Returns
    prompt_ids if handled, None to use default encoding"). Ours answers for gpt-oss served with
    our Harmony parsers (``harmony_parsers``), when the history has tool calls or results and
    no continuation of the last assistant message is asked for.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.patches.harmony_parsers import uses_harmony_parsers


def _render_with_harmony(original, self, messages, request, thinking_mode, tools=None, **kwargs):
    # imports openai_harmony, optional at plugin load (harmony_available falls back without it)
    from sglang_ext.harmony.chat_render import has_tool_history, render_chat_for_completion

    if getattr(self, "is_gpt_oss", False):
        # the caller renders these same dicts with the template after this hook returns None
        _fill_missing_descriptions(tools)
    if (not getattr(self, "is_gpt_oss", False) or self._encoding_adapter is not None
            or self.chat_encoding_spec is not None or request.continue_final_message
            or request._format_add_generation_prompt is False or not uses_harmony_parsers(self)):
        return original(self, messages, request, thinking_mode, tools=tools, **kwargs)
    # The request's own messages: SGLang's copies have tool-call arguments parsed into dicts.
    raw = [m.model_dump() if hasattr(m, "model_dump") else dict(m) for m in request.messages]
    if not has_tool_history(raw):
        return original(self, messages, request, thinking_mode, tools=tools, **kwargs)
    template_kwargs = request.chat_template_kwargs or {}
    builtin_tools = template_kwargs.get("builtin_tools") or ()
    if not isinstance(builtin_tools, (list, tuple)) or not all(isinstance(t, str) for t in builtin_tools):
        raise ValueError(f"chat_template_kwargs.builtin_tools must be a list of tool names, got {builtin_tools!r}")
    identity = template_kwargs.get("model_identity")
    if identity is not None and not isinstance(identity, str):
        raise ValueError(f"chat_template_kwargs.model_identity must be a string, got {type(identity).__name__}")
    return render_chat_for_completion(
        raw, tools, reasoning_effort=request.reasoning_effort, builtin_tools=tuple(builtin_tools),
        model_identity=identity)


def _fill_missing_descriptions(tools) -> None:
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("description") is None:
            function["description"] = ""


def register() -> None:
    HookRegistry.register("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._encode_messages",
                          _render_with_harmony, HookType.AROUND)
