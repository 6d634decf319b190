"""OpenAI chat messages rendered as a Harmony prompt by openai-harmony itself.

The official gpt-oss chat template renders tool history wrongly: only the first call of an
assistant turn survives ("We assume max 1 tool call per message"), every tool result is
attributed to the most recent call's name, results and arguments are re-serialised with
``|tojson`` (a string result arrives quoted, a JSON one escaped), and a preamble becomes
analysis. Here each call is its own commentary message to ``functions.<name>``, each result
is a tool message from the call its ``tool_call_id`` names, and text is passed verbatim: the
conversation is what openai-harmony renders (reference: the openai-harmony docs).

The mapping is the inverse of ``sglang_ext.harmony.streaming``: reasoning_content (or
``thinking``) -> analysis, content of a turn with tool calls -> commentary (a preamble),
other assistant content -> final. Analysis before the last final answer is dropped by
openai-harmony, as in the template. Nothing here imports SGLang.
"""

from __future__ import annotations

import datetime
import json

from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role,
                            SystemContent, ToolDescription)

from sglang_ext.harmony.encoding import harmony_encoding, render_for_completion_linear

BUILTIN_NAMESPACES = ("browser", "python", "container")


def has_tool_history(messages: list[dict]) -> bool:
    return any(m.get("role") == "tool" or (m.get("role") == "assistant" and m.get("tool_calls")) for m in messages)


def text_of(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)


def _arguments(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _recipient(name, function_names: set[str], where: str) -> str:
    if not isinstance(name, str) or not name:
        # A bad request, not a server fault: these were 500s ("'NoneType' object has no attribute 'split'").
        raise ValueError(f"{where} must be a non-empty string, got {name!r}")
    if name in function_names or name.split(".", 1)[0] not in BUILTIN_NAMESPACES:
        return f"functions.{name}"
    return name


def chat_conversation(messages: list[dict], tools: list[dict] | None = None, reasoning_effort: str | None = None,
                      builtin_tools=(), model_identity: str | None = None, date: str | None = None) -> Conversation:
    system = SystemContent.new().with_conversation_start_date(date or datetime.date.today().isoformat())
    if reasoning_effort in ("low", "medium", "high"):
        system = system.with_reasoning_effort(ReasoningEffort[reasoning_effort.upper()])
    if model_identity:
        system = system.with_model_identity(model_identity)
    if "browser" in builtin_tools:
        system = system.with_browser_tool()
    if "python" in builtin_tools:
        system = system.with_python_tool()
    out = [Message.from_role_and_content(Role.SYSTEM, system)]

    functions = [t.get("function", t) for t in tools or []]
    function_names = {f["name"] for f in functions}
    rest = list(messages)
    instructions = None
    if rest and rest[0].get("role") in ("system", "developer"):
        instructions = text_of(rest.pop(0).get("content"))
    if instructions or functions:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if functions:
            developer = developer.with_function_tools([
                ToolDescription.new(f["name"], f.get("description") or "", parameters=f.get("parameters"))
                for f in functions])
        out.append(Message.from_role_and_content(Role.DEVELOPER, developer))

    call_names: dict[str, str] = {}  # tool_call_id -> recipient
    last_recipient = None
    for i, m in enumerate(rest, start=len(messages) - len(rest)):
        role = m.get("role")
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, text_of(m.get("content"))))
        elif role in ("system", "developer"):
            out.append(Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_instructions(text_of(m.get("content")))))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("thinking")
            content = text_of(m.get("content"))
            calls = m.get("tool_calls") or []
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content)
                           .with_channel("commentary" if calls else "final"))
            for j, call in enumerate(calls):
                function = call.get("function") or {}
                recipient = _recipient(function.get("name"), function_names,
                                       f"messages[{i}].tool_calls[{j}].function.name")
                message = (Message.from_role_and_content(Role.ASSISTANT, _arguments(function.get("arguments", "")))
                           .with_channel("commentary").with_recipient(recipient))
                if recipient.startswith("functions."):
                    message = message.with_content_type("<|constrain|>json")
                out.append(message)
                if call.get("id"):
                    call_names[call["id"]] = recipient
                last_recipient = recipient
        elif role == "tool":
            recipient = call_names.get(m.get("tool_call_id") or "")
            if recipient is None:
                recipient = (_recipient(m["name"], function_names, f"messages[{i}].name") if m.get("name")
                             else last_recipient)
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, recipient or "functions.unknown"),
                                                       text_of(m.get("content")))
                       .with_recipient("assistant").with_channel("commentary"))
    return Conversation.from_messages(out)


def render_chat_for_completion(messages: list[dict], tools: list[dict] | None = None, **kwargs) -> list[int]:
    """Prompt token ids ending in ``<|start|>assistant``, for the model to continue."""
    return render_for_completion_linear(harmony_encoding(), chat_conversation(messages, tools, **kwargs),
                                        Role.ASSISTANT)
