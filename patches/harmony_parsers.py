"""Patch: gpt-oss reasoning and tool-call parsers on openai-harmony's token parser (SGLang 0.5.23).

SGLang's ``gpt-oss`` parsers read decoded text with regexes: tool calls arrive whole, calls on
the analysis channel or without ``<|constrain|>json`` are dropped, a malformed header loses
the message. Ours (``sglang_ext.harmony``) parse the token ids with openai-harmony behind a
normalizer that repairs malformed output instead of raising, and stream arguments as they
decode. Registered under the existing names, so ``--reasoning-parser gpt-oss`` and
``--tool-call-parser gpt-oss`` (and SGLang's auto-detection for gpt-oss) get them.

Targets
  - ``ReasoningParser`` and ``FunctionCallParser`` (class REPLACE): subclasses whose
    ``DetectorMap`` / ``ToolCallParserEnum`` map ``gpt-oss`` to our detectors; every other
    name is SGLang's. A class, not the dicts, because the REPLACE also rebinds the
    ``from ... import`` copies in serving_chat, the scheduler and the HTTP server.
  - ``OpenAIServingChat._generate_stream_content`` (BEFORE): parses the new token ids of the
    choice (``content["output_ids"]``, cumulative or incremental) into the choice's stream, kept
    in the response's own ``stream_offsets`` dict, and binds it for the parsers that run next.
    When no reasoning parser runs (``separate_reasoning: false``) it replaces the chunk's text
    with the markup-free text, which SGLang then streams as content. The probe scores patch
    (``openai_probe_scores``, AROUND on the same method) is untouched: it attaches scores by
    token offset, whatever chunks the parsers make.
  - ``OpenAIServingChat._build_chat_response`` (BEFORE) and ``._decode_response`` (AFTER): the
    same for a whole response, per choice from ``ret_item["output_ids"]``.
Also, at plugin load: point openai-harmony at an offline o200k vocabulary
(``sglang_ext.harmony.encoding.configure_offline_vocab``; one startup line if there is none).
"""

from __future__ import annotations

import contextvars
import functools
import inspect

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import get_serving

from sglang_ext.harmony.detectors import (HarmonyReasoningDetector, HarmonyToolCallDetector, bind_response,
                                          bind_stream)
from sglang_ext.harmony.encoding import configure_offline_vocab, harmony_available
from sglang_ext.harmony.streaming import OpenAIHarmonyStream, Route

_STREAM_KEY = "sglang_ext_harmony_stream"
_CHAT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
# The Route of the whole (non-streamed) response being built in this request's task.
_response_route: contextvars.ContextVar = contextvars.ContextVar("sglang_ext_harmony_route", default=None)


def _incremental() -> bool:
    try:
        return bool(get_serving().incremental_streaming_output)
    except ValueError:  # SGLang's "config namespace 'serving' not published": no server in this process
        return False


def uses_harmony_parsers(serving) -> bool:
    """Our parsers run for this server, and no other parser reads the same output."""
    reasoning, tools = serving.reasoning_parser, serving.tool_call_parser
    if reasoning not in (None, "gpt-oss") or tools not in (None, "gpt-oss"):
        return False
    return (reasoning == "gpt-oss" or tools == "gpt-oss") and harmony_available()


def _route(serving, request):
    separate = bool(serving.reasoning_parser) and bool(request.separate_reasoning)
    calls = serving.tool_call_parser == "gpt-oss" and serving._tool_call_parsing_active(request)
    return Route(separate_reasoning=separate, calls="tool_calls" if calls else "inline")


def _matched_stop_token(item: dict):
    # A stop token that ended generation closes the last Harmony message (<|call|> makes a call
    # complete); feed it should the ids leave it out.
    reason = (item.get("meta_info") or {}).get("finish_reason") or {}
    return reason.get("matched") if reason.get("type") == "stop" else None


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


def _parse_stream_chunk(self, *args, **kwargs):
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat  # heavy: ~2900 modules

    if not uses_harmony_parsers(self) or self._encoding_output() is not None:
        bind_stream(None)
        return None
    bound = _signature(OpenAIServingChat._generate_stream_content).bind(self, *args, **kwargs)
    a = bound.arguments
    content, index, request = a["content"], a["index"], a["request"]
    offsets = a["stream_offsets"]
    stream = offsets.get((_STREAM_KEY, index))
    if stream is None:
        stream = OpenAIHarmonyStream(_route(self, request), request_id=content["meta_info"].get("id"))
        offsets[(_STREAM_KEY, index)] = stream
    ids = content.get("output_ids") or []
    # Non-incremental chunks carry the live, growing list of ids: take a snapshot of the new ones.
    stream.feed(list(ids) if _incremental() else list(ids[stream.tokens:]))
    if a["finish_reason_type"] is not None:
        stream.finish_with(_matched_stop_token(content))
    bind_stream(stream)
    if stream.route.separate_reasoning:
        return None
    # No reasoning parser runs: what SGLang sends on (to the tool-call parser or straight to
    # the client) must already be the markup-free text, in the chunk's own convention.
    new_text = stream.take_content()
    a["content"] = {**content, "text": new_text if _incremental() else stream.content}
    return bound.args, bound.kwargs


def _bind_response_route(self, request, *args, **kwargs):
    _response_route.set(_route(self, request) if uses_harmony_parsers(self) and self._encoding_output() is None else None)
    bind_response(None)


def _parse_response(text, self, ret_item, *args, **kwargs):
    route = _response_route.get()
    if route is None or not isinstance(text, str) or "output_ids" not in ret_item:
        bind_response(None)
        return None
    stream = OpenAIHarmonyStream(route, request_id=(ret_item.get("meta_info") or {}).get("id"))
    stream.feed(ret_item["output_ids"])
    stream.finish_with(_matched_stop_token(ret_item))
    if not route.separate_reasoning:
        text = stream.content
    bind_response(stream, text)
    return text


def _parser_classes():
    # Local names: the class REPLACE below rebinds every module-level copy of these two to our subclasses.
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    class HarmonyReasoningParser(ReasoningParser):
        DetectorMap = {**ReasoningParser.DetectorMap, "gpt-oss": HarmonyReasoningDetector}

    class HarmonyFunctionCallParser(FunctionCallParser):
        ToolCallParserEnum = {**FunctionCallParser.ToolCallParserEnum, "gpt-oss": HarmonyToolCallDetector}

    return HarmonyReasoningParser, HarmonyFunctionCallParser


def register() -> None:
    configure_offline_vocab()
    reasoning_parser, function_call_parser = _parser_classes()
    HookRegistry.register("sglang.srt.parser.reasoning_parser.ReasoningParser", reasoning_parser,
                          HookType.REPLACE)
    HookRegistry.register("sglang.srt.function_call.function_call_parser.FunctionCallParser",
                          function_call_parser, HookType.REPLACE)
    HookRegistry.register(f"{_CHAT}._generate_stream_content", _parse_stream_chunk, HookType.BEFORE)
    HookRegistry.register(f"{_CHAT}._build_chat_response", _bind_response_route, HookType.BEFORE)
    HookRegistry.register(f"{_CHAT}._decode_response", _parse_response, HookType.AFTER)
