"""Patch: the Anthropic and Ollama routes report the guard's stop and take its per-request form (SGLang 0.5.23).

SGLang 0.5.23 serves gpt-oss on `/v1/messages` (Anthropic Messages API) and on `/api/chat`,
`/api/generate` (Ollama) too. A request the SingProbe guard stopped (`finish_reason`
`content_filter`) looked like a natural end there: `/v1/messages` mapped it to `stop_reason`
"end_turn" (its map knows only stop / length / tool_calls), the Ollama routes wrote `done_reason`
"stop" whatever ended the request; and all three dropped the request's `custom_params` (their
request models ignore unknown fields), so a per-request `probe_stop` (even an invalid one) was
silently not applied. `/api/chat` with `"messages": []` was a 500 (the chat template raised).

Targets
  - `AnthropicServing.handle_messages` (AROUND): `custom_params` from the body is checked as a
    chat request's is (HTTP 400 `invalid_request_error` naming the problem, before a stream
    starts) and carried onto the converted chat request
    (`AnthropicServing._convert_to_chat_completion_request`, AFTER).
  - `AnthropicServing._convert_response` (AROUND) and `._generate_anthropic_stream` (AROUND): a
    guard stop is `stop_reason` "refusal", the Messages API's reason for a stop made by a
    classifier, in the response and in the stream's `message_delta` event.
  - `OllamaServing.handle_chat` / `.handle_generate` (AROUND): `custom_params` from the body is
    checked (HTTP 400 `{"error": ...}`) and put into the sampling parameters
    (`OllamaServing._convert_options_to_sampling_params`, AFTER); an empty `messages` is a 400;
    a request the engine refuses (a ValueError before any output) is a 400, not a 500; and
    `done_reason` is the request's own finish: "stop", "length", "content_filter", or "abort".
The finish reasons are read where every generation passes (`openai_probe_scores`' hook on
`TokenizerManager.generate_request` calls `observe_output`), for the outputs of this request only
(a context variable set around its own handler or stream).
"""

from __future__ import annotations

import contextvars
import json
import re
from typing import Literal, Optional

from fastapi.responses import ORJSONResponse, StreamingResponse
from pydantic import create_model

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.patches.request_isolation import RequestRejected, check_custom_params

REFUSAL = "refusal"
GUARD_FINISH = "content_filter"
OLLAMA_DONE_REASONS = {"stop": "stop", "length": "length", GUARD_FINISH: GUARD_FINISH, "abort": "abort"}


class FinishSeen:
    """The finish reasons (`meta_info.finish_reason` dicts) of the outputs one handler received."""

    def __init__(self):
        self.reasons: list[dict] = []

    @property
    def guarded(self) -> bool:
        return any(r.get("type") == GUARD_FINISH for r in self.reasons)

    def last_type(self) -> str | None:
        return self.reasons[-1].get("type") if self.reasons else None


_seen: contextvars.ContextVar[FinishSeen | None] = contextvars.ContextVar("sglang_ext_finish_seen", default=None)
_custom_params: contextvars.ContextVar[dict | None] = contextvars.ContextVar("sglang_ext_custom_params",
                                                                               default=None)


def observe_output(content) -> None:
    """Called with every output `TokenizerManager.generate_request` yields."""
    seen = _seen.get()
    if seen is None or not isinstance(content, dict):
        return
    reason = (content.get("meta_info") or {}).get("finish_reason")
    if isinstance(reason, dict):
        seen.reasons.append(reason)


async def _custom_params_of(raw_request) -> tuple[dict | None, str | None]:
    """(the body's custom_params, checked), or (None, why it is refused)."""
    try:
        body = await raw_request.json()
    except Exception:  # noqa: BLE001 - no body to read: nothing to add
        return None, None
    custom = body.get("custom_params") if isinstance(body, dict) else None
    if custom is None:
        return None, None
    try:
        check_custom_params({"custom_params": custom}, has_processor=False)
    except RequestRejected as e:
        return None, str(e)
    return custom, None


# -- Anthropic /v1/messages -------------------------------------------------------------------


async def _messages_with_custom_params(original, serving, request, raw_request, *args, **kwargs):
    custom, problem = await _custom_params_of(raw_request)
    if problem is not None:
        return serving._error_response(status_code=400, error_type="invalid_request_error", message=problem)
    token = _custom_params.set(custom)
    try:
        return await original(serving, request, raw_request, *args, **kwargs)
    finally:
        _custom_params.reset(token)


def _carry_custom_params(chat_request, serving, anthropic_request, *args, **kwargs):
    custom = _custom_params.get()
    if custom is not None:
        chat_request.custom_params = custom
    return chat_request


_REFUSABLE = {}


def _refusable(response_cls):
    """`response_cls` whose stop_reason may also be "refusal" (upstream's Literal lacks it)."""
    if response_cls not in _REFUSABLE:
        stop = Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]]
        _REFUSABLE[response_cls] = create_model(f"Refusable{response_cls.__name__}", __base__=response_cls,
                                                stop_reason=(stop, None))
    return _REFUSABLE[response_cls]


def _convert_response_with_refusal(original, serving, response, *args, **kwargs):
    converted = original(serving, response, *args, **kwargs)
    choices = getattr(response, "choices", None) or []
    if choices and getattr(choices[0], "finish_reason", None) == GUARD_FINISH:
        fields = {name: getattr(converted, name) for name in type(converted).model_fields}
        fields["stop_reason"] = REFUSAL
        converted = _refusable(type(converted)).model_construct(
            _fields_set=converted.model_fields_set | {"stop_reason"}, **fields)
    return converted


_END_TURN = re.compile(r'"stop_reason":\s*"end_turn"')


async def _anthropic_stream_with_refusal(original, serving, *args, **kwargs):
    seen = FinishSeen()
    _seen.set(seen)  # this stream's own task: the chat stream it reads runs inside it
    async for event in original(serving, *args, **kwargs):
        if seen.guarded and isinstance(event, str) and "message_delta" in event:
            event = _END_TURN.sub(f'"stop_reason":"{REFUSAL}"', event)
        yield event


# -- Ollama /api/chat, /api/generate -----------------------------------------------------------


def _ollama_error(message: str, status: int = 400):
    return ORJSONResponse(status_code=status, content={"error": message})


def _done_reason(seen: FinishSeen) -> str:
    return OLLAMA_DONE_REASONS.get(seen.last_type(), "stop")


async def _ndjson_with_done_reason(body_iterator):
    seen = FinishSeen()
    _seen.set(seen)  # the body is iterated in the response's own task
    async for chunk in body_iterator:
        if seen.reasons and isinstance(chunk, (bytes, str)):
            line = json.loads(chunk)
            if line.get("done"):
                line["done_reason"] = _done_reason(seen)
                chunk = json.dumps(line, ensure_ascii=False).encode() + b"\n"
        yield chunk


async def _ollama_handler(original, serving, request, raw_request, *args, **kwargs):
    if getattr(request, "messages", True) == []:
        return _ollama_error("messages is empty: a chat needs at least one message")
    custom, problem = await _custom_params_of(raw_request)
    if problem is not None:
        return _ollama_error(problem)
    token = _custom_params.set(custom)
    seen = FinishSeen()
    seen_token = _seen.set(seen)
    try:
        result = await original(serving, request, raw_request, *args, **kwargs)
    except ValueError as e:  # refused by the engine's checks before any output
        return _ollama_error(str(e))
    finally:
        _seen.reset(seen_token)
        _custom_params.reset(token)
    if isinstance(result, StreamingResponse):
        result.body_iterator = _ndjson_with_done_reason(result.body_iterator)
    elif hasattr(result, "done_reason") and seen.reasons:
        result.done_reason = _done_reason(seen)
    return result


def _ollama_sampling_params_with_custom(sampling_params, serving, *args, **kwargs):
    custom = _custom_params.get()
    if custom is not None:
        sampling_params["custom_params"] = custom
    return sampling_params


def register() -> None:
    anthropic = "sglang.srt.entrypoints.anthropic.serving.AnthropicServing"
    HookRegistry.register(f"{anthropic}.handle_messages", _messages_with_custom_params, HookType.AROUND)
    HookRegistry.register(f"{anthropic}._convert_to_chat_completion_request", _carry_custom_params, HookType.AFTER)
    HookRegistry.register(f"{anthropic}._convert_response", _convert_response_with_refusal, HookType.AROUND)
    HookRegistry.register(f"{anthropic}._generate_anthropic_stream", _anthropic_stream_with_refusal,
                          HookType.AROUND)
    ollama = "sglang.srt.entrypoints.ollama.serving.OllamaServing"
    for handler in ("handle_chat", "handle_generate"):
        HookRegistry.register(f"{ollama}.{handler}", _ollama_handler, HookType.AROUND)
    HookRegistry.register(f"{ollama}._convert_options_to_sampling_params", _ollama_sampling_params_with_custom,
                          HookType.AFTER)
