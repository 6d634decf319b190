"""Patch: SingProbe scores, the guard's stop and token usage in the OpenAI Responses API (SGLang 0.5.23).

gpt-oss is served on `/v1/responses` through SGLang's Harmony path (`OpenAIServingResponses`
with `HarmonyContext` / `StreamingHarmonyContext`). Upstream, that path returned no probe
scores; reported a request the SingProbe guard stopped as `completed`, and ran a built-in tool
the stopped output had called and generated on; reported `input_tokens` 0 (it reads the prompt
length only when `meta_info` has `prompt_token_ids`, which SGLang never sends) and, streamed,
`output_tokens` 0 (the streaming context counts nothing), and after a built-in tool's turn fed
its parser only the next turn's tokens past the previous turn's length; and a request without
`model` (upstream: "whatever is loaded") generated in full and then failed.

Targets
  - `OpenAIServingResponses.create_responses` (AROUND): a request without `model` is given the
    served model's name. A `ResponseRecord` for the request, held in a context variable (so only
    this request's own engine calls, in its own task or the background task it starts, fill it:
    not another request that reuses its id), collects the scores of every generation turn
    (`openai_probe_scores`' `generate_request` hook calls `record_of`). Then
      * not streamed: the response object gets `token_probe_probs`, one `{label: p}` per
        generated token, all turns in order;
      * streamed: each SSE event carries, as `token_probe_probs` beside `type`, the scores of
        the tokens decoded since the previous event that carried any, so the concatenation
        over a stream is one score per token whatever the Harmony parser held back; the final
        event's `response` carries the whole list, as a non-streamed response does.
    Background requests (`background: true`, not streamed) carry no scores: the stored
    response object has no field for them. The request's `custom_params` (per-request guard
    thresholds, `probe_stop`) and `custom_logit_processor`, which the Responses request model
    drops, are read from the body: the first goes into the sampling parameters
    (`ResponsesRequest.to_sampling_params`, AROUND), the second onto each engine call
    (`with_processor`); both are checked as a chat request's are, before a stream starts (HTTP
    400 naming the problem). An exception inside a stream (upstream catches none: the response
    was cut without a word and the request kept running) ends it with an `error` event and
    aborts the request in the scheduler.
  - `OpenAIServingResponses._status_from_finish_reason` (AROUND): the guard's finish reason
    (`content_filter`) is `incomplete`, for the response and for the output item it cut, as
    a length stop is.
  - `OpenAIServingResponses._build_response` (AROUND), where every final response object is
    made (non-streamed, background, and the streams' final events): a guard stop's
    `incomplete_details` are `{"reason": "content_filter", label, score, threshold}` (OpenAI's
    reason for a filtered response; upstream wrote `max_output_tokens` for every incomplete
    one), before upstream stores the object (`GET /v1/responses/{id}` with
    `--enable-response-store`).
  - `HarmonyContext.need_builtin_tool_call` (AROUND): no built-in tool turn after a guard stop.
  - `HarmonyContext.append_output` (AROUND): the prompt length from `meta_info.prompt_tokens`
    (the last turn's, as upstream meant it).
  - `StreamingHarmonyContext.append_output` (AROUND): prompt, cached and output tokens, the
    output tokens counted as the tokens its parser was fed; after a tool's message the next
    turn's cumulative outputs are read from their start.
  - `harmony_utils.render_for_completion` (AROUND): the prompt's tokens in time linear in its text
    (`sglang_ext.harmony.encoding.render_for_completion_linear`, the same tokens): openai-harmony's
    BPE took 36 s over a 300k-character run of punctuation in one input item, with the server's
    tokenizer held all that time.
Without `--probe-ckpt`, meta_info has no scores and nothing is added.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
from typing import Any

import orjson  # each streamed event is parsed and rewritten: a tenth of json's time
from fastapi.responses import Response

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import get_exec

from sglang_ext.harmony.encoding import render_for_completion_linear
from sglang_ext.patches.exact_abort import abort_owned
from sglang_ext.patches.request_isolation import (RequestRejected, check_custom_logit_processor,
                                                  check_custom_params)
from sglang_ext.probe import SCORES_KEY, json_scores

logger = logging.getLogger(__name__)

FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


def guard_details(finish_reason: Any) -> dict | None:
    """`incomplete_details` for the SingProbe guard's finish reason (`probe_stop`), else None."""
    if not (isinstance(finish_reason, dict) and finish_reason.get("type") == "content_filter"):
        return None
    return {"reason": "content_filter",
            **{k: finish_reason[k] for k in ("label", "score", "threshold") if k in finish_reason}}


class ResponseRecord:
    """What the engine returned for one /v1/responses request: every turn's scores, in order (a
    request's turns run one after another), and the finish reason."""

    def __init__(self, rid: str, extras: dict | None = None) -> None:
        self.rid = rid
        # SGLang's request extras that the Responses schema drops (`REQUEST_EXTRAS`), from the body.
        self.extras = extras or {}
        self.scores: list = []
        self.finish_reason: Any = None
        self.requests: list = []  # each turn's GenerateReqInput: what an abort of this response may end

    def new_turn(self, obj) -> int:
        """A generation turn (engine request `obj`) starts: its handle for `update` is where its scores begin."""
        self.requests.append(obj)
        return len(self.scores)

    def update(self, turn: int, meta: dict, incremental: bool) -> None:
        """One engine output of `turn`: its scores (new ones only, or all of the turn so far) and
        finish reason."""
        scores = meta.get(SCORES_KEY)
        if scores is not None:
            self.scores.extend(scores if incremental else scores[len(self.scores) - turn:])
        reason = meta.get("finish_reason")
        if reason is not None and guard_details(self.finish_reason) is None:  # a guard stop sticks
            self.finish_reason = reason


# What chat requests take beyond OpenAI's schema and the Responses request model drops unread:
# per-request guard thresholds (`custom_params.probe_stop`) and SGLang's custom logit processor.
REQUEST_EXTRAS = ("custom_params", "custom_logit_processor")


async def request_extras(raw_request) -> dict:
    """`REQUEST_EXTRAS` present in the request's JSON body (already read and cached by FastAPI)."""
    try:
        body = await raw_request.json()
    except Exception:  # no request (the Python API), or a body that is not JSON: nothing to add
        return {}
    return {k: body[k] for k in REQUEST_EXTRAS if isinstance(body, dict) and body.get(k) is not None}


_current: contextvars.ContextVar[ResponseRecord | None] = contextvars.ContextVar(
    "sglang_ext_response_record", default=None)


def record_of(obj) -> ResponseRecord | None:
    """The record a `GenerateReqInput` fills: the current request's, if the ids match."""
    record = _current.get()
    return record if record is not None and record.rid == getattr(obj, "rid", None) else None


def _event_with(sse: str, pending: list, record: ResponseRecord) -> tuple[str, bool]:
    """One SSE event with `pending` scores attached (and whether they were); the final event's response
    also gets the whole list. What is not one JSON event passes unchanged."""
    if not pending and not any(t in sse for t in FINAL_EVENTS):
        return sse, False
    head, sep, body = sse.partition("data: ")
    try:
        payload = orjson.loads(body) if sep else None
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return sse, False
    if pending:
        payload[SCORES_KEY] = json_scores(pending)
    response = payload.get("response")
    if payload.get("type") in FINAL_EVENTS and isinstance(response, dict) and record.scores:
        response[SCORES_KEY] = json_scores(record.scores)
    return head + "data: " + orjson.dumps(payload).decode() + "\n\n", bool(pending)


def error_event(message: str, code: str, sequence_number: int | None) -> str:
    """The Responses API's stream error event."""
    payload = {"type": "error", "code": code, "message": message, "param": None,
               "sequence_number": sequence_number}
    return "event: error\ndata: " + json.dumps(payload, ensure_ascii=False) + "\n\n"


_SEQUENCE = re.compile(r'"sequence_number":\s*(\d+)')


async def _stream_with_scores(serving, events, record: ResponseRecord):
    # The body is iterated after create_responses returned, in the response's task: the record is
    # made current here for the engine calls the iteration makes.
    _current.set(record)
    sent, last = 0, ""
    try:
        async for event in events:
            if isinstance(event, str):
                event, attached = _event_with(event, record.scores[sent:], record)
                if attached:
                    sent = len(record.scores)
                last = event
            yield event
    except Exception as e:
        # Upstream's stream catches nothing: an exception (a bad request found by the engine's checks,
        # a Harmony parse it refuses) cut the response without a word and left the request running.
        message = f"{type(e).__name__}: {e}"
        logger.exception("sglang-ext: /v1/responses stream %s failed: %s; only this request stops", record.rid,
                         message)
        try:
            for obj in record.requests:  # not a request of another client that holds the same rid
                abort_owned(serving.tokenizer_manager, obj)
        except Exception as abort_failed:  # the error event still goes out
            logger.warning("sglang-ext: aborting %s failed: %s", record.rid, abort_failed)
        code = "invalid_request_error" if isinstance(e, ValueError) else "server_error"
        found = _SEQUENCE.search(last)
        yield error_event(message, code, int(found.group(1)) + 1 if found else None)
    finally:
        _current.set(None)
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


async def _create_responses_with_scores(original, self, request, *args, **kwargs):
    manager = getattr(self, "tokenizer_manager", None)
    if getattr(request, "model", "") is None and manager is not None:
        # "None means whatever is loaded" upstream, but the response object requires a model name:
        # without this a request with no model generated in full and then failed (a 400 naming
        # ResponsesResponse, or an empty stream).
        request.model = manager.served_model_name
    rid = getattr(request, "request_id", None)
    if not isinstance(rid, str):
        return await original(self, request, *args, **kwargs)
    if getattr(self, "enable_response_store", False) and getattr(request, "store", False):
        # upstream stored the new response over the old one under the same id, so the first was lost to
        # retrieval and to previous_response_id chains (found by fuzzing)
        async with self.response_store_lock:
            taken = rid in self.response_store
        if taken:
            return self.create_error_response(f"request_id {rid!r} already names a stored response; send a new "
                                              "request_id, or none to have one made")
    raw_request = args[0] if args else kwargs.get("raw_request")
    record = ResponseRecord(rid, await request_extras(raw_request) if raw_request is not None else None)
    try:
        check_extras(record.extras)
        check_input_items(getattr(request, "input", None))
        check_max_output_tokens(getattr(request, "max_output_tokens", None))
    except ValueError as e:  # before any byte of a stream: one 400 naming the problem
        return self.create_error_response(str(e))
    token = _current.set(record)  # a background task started inside inherits it
    try:
        result = await original(self, request, *args, **kwargs)
    finally:
        _current.reset(token)
    if hasattr(result, "__aiter__"):
        return _stream_with_scores(self, result, record)
    if not record.scores or not hasattr(result, "model_dump_json") or result.status == "queued":
        return result
    payload = json.loads(result.model_dump_json())
    payload[SCORES_KEY] = json_scores(record.scores)
    return Response(content=json.dumps(payload, ensure_ascii=False), media_type="application/json")


TOOL_OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output")


def check_input_items(items) -> None:
    """What upstream's Harmony rendering of `input` (harmony_utils.parse_response_input) reads unchecked and
    raised on, a 500 each: a tool output without the call_id of the call it answers; a message without a
    string role or with content that is neither text nor a list of part objects; a function / custom tool
    call without a name; an item that is not an object (found by fuzzing)."""
    if items is None or isinstance(items, str):
        return
    if not isinstance(items, list):
        raise RequestRejected(f"input must be a string or a list of items, got {type(items).__name__}")
    for position, item in enumerate(items):
        if isinstance(item, dict):
            fields = item
        elif hasattr(item, "model_dump"):
            fields = item.model_dump()
        else:
            raise RequestRejected(f"input[{position}] must be an object, got {type(item).__name__}")
        kind = fields.get("type")
        if kind in TOOL_OUTPUT_ITEMS and not isinstance(fields.get("call_id"), str):
            raise RequestRejected(f"input[{position}]: a {kind} item needs the call_id of the call it answers")
        if kind is None or kind == "message":
            if not isinstance(fields.get("role"), str):
                raise RequestRejected(f"input[{position}]: a message needs a role (user, assistant, system, "
                                      "developer)")
            content = fields.get("content")
            if not isinstance(content, str) and not (
                    isinstance(content, list) and all(isinstance(part, dict) for part in content)):
                raise RequestRejected(f"input[{position}]: a message's content must be text or a list of content "
                                      f"parts (objects), got {type(content).__name__}")
        if kind in ("function_call", "custom_tool_call") and not (isinstance(fields.get("name"), str)
                                                                    and fields["name"]):
            raise RequestRejected(f"input[{position}]: a {kind} item needs the name of the tool it calls")
        if kind in TOOL_OUTPUT_ITEMS:
            # upstream renders text or a list of text parts; anything else reached openai-harmony and came
            # back as a 400 reading " None" (found by fuzzing)
            output = fields.get("output", "")
            if not isinstance(output, str) and not (
                    isinstance(output, list) and all(isinstance(part, dict) for part in output)):
                raise RequestRejected(f"input[{position}]: a {kind} item's output must be text or a list of content "
                                      f"parts (objects), got {type(output).__name__}")


def check_max_output_tokens(value) -> None:
    """Upstream keeps two tokens of `max_output_tokens` as headroom, so 0 came back as "max_new_tokens must be
    at least 0, got -2" (a field the client never sent); refused here in the client's own terms."""
    if value is not None and value < 1:
        raise RequestRejected(f"max_output_tokens must be at least 1, got {value}")


def check_extras(extras: dict) -> None:
    """The chat path's checks of the extras (raises `RequestRejected`, a ValueError, naming the problem)."""
    processor = extras.get("custom_logit_processor")
    if "custom_params" in extras:
        check_custom_params({"custom_params": extras["custom_params"]}, bool(processor))
    if processor is None:
        return
    if not isinstance(processor, str):
        raise RequestRejected(f"custom_logit_processor must be a string (a serialized processor), "
                              f"got {type(processor).__name__}")
    if not get_exec().features.enable_custom_logit_processor:
        raise RequestRejected("custom_logit_processor needs a server started with --enable-custom-logit-processor")
    check_custom_logit_processor(processor)


def _sampling_params_with_extras(original, self, *args, **kwargs):
    params = original(self, *args, **kwargs)
    budget = params.get("max_new_tokens") if isinstance(params, dict) else None
    if budget is not None and budget < 1 and (self.max_output_tokens or 0) >= 1:
        # max_output_tokens 1 or 2, less upstream's 2 tokens of headroom: one token, not a refusal
        params["max_new_tokens"] = 1
    record = _current.get()
    custom = record.extras.get("custom_params") if record is not None and record.rid == self.request_id else None
    if custom is not None and isinstance(params, dict):
        params["custom_params"] = custom  # checked like a chat request's before it is scheduled
    return params


def with_processor(obj, record: ResponseRecord) -> None:
    """The request's custom logit processor on each of its engine calls (`openai_probe_scores`'
    `generate_request` hook calls this; SGLang then checks it as it checks a chat request's)."""
    processor = record.extras.get("custom_logit_processor")
    if processor is not None and getattr(obj, "custom_logit_processor", None) is None:
        obj.custom_logit_processor = processor


def _status_with_guard(original, finish_reason):
    if guard_details(finish_reason) is not None:
        return "incomplete"
    return original(finish_reason)


def _response_with_guard_details(original, *args, **kwargs):
    response = original(*args, **kwargs)
    record = _current.get()
    stop = guard_details(record.finish_reason) if record is not None else None
    if stop is not None and getattr(response, "status", None) == "incomplete":
        response.incomplete_details = stop  # upstream wrote max_output_tokens for every incomplete one
    return response


def _no_tool_turn_after_guard(original, self, *args, **kwargs):
    if guard_details(getattr(self, "finish_reason", None)) is not None:
        return False
    return original(self, *args, **kwargs)


def _harmony_append_with_prompt_tokens(original, self, output, *args, **kwargs):
    result = original(self, output, *args, **kwargs)
    meta = output.get("meta_info") if isinstance(output, dict) and "output_ids" in output else None
    if isinstance(meta, dict) and "prompt_tokens" in meta:
        self.num_prompt_tokens = meta["prompt_tokens"]
    return result


def _streaming_append_with_usage(original, self, output, *args, **kwargs):
    before = getattr(self, "num_processed_tokens", 0)
    result = original(self, output, *args, **kwargs)
    meta = output.get("meta_info") if isinstance(output, dict) and "output_ids" in output else None
    if not isinstance(output, dict):
        # A tool's message: the next turn's cumulative output_ids start again at 0.
        self.num_processed_tokens = 0
    elif isinstance(meta, dict):
        if "prompt_tokens" in meta:
            self.num_prompt_tokens = meta["prompt_tokens"]
        if "cached_tokens" in meta:
            self.num_cached_tokens = meta["cached_tokens"]
        # The tokens its parser was fed this call (upstream's own cumulative/incremental rule).
        self.num_output_tokens += max(0, getattr(self, "num_processed_tokens", 0) - before)
    return result


def _render_linear(original, messages):
    # openai_harmony: optional at plugin load (harmony_available falls back); harmony_utils: ~570 modules
    from openai_harmony import Conversation, Role
    from sglang.srt.entrypoints.harmony_utils import get_encoding

    return render_for_completion_linear(get_encoding(), Conversation.from_messages(messages), Role.ASSISTANT)


def register() -> None:
    HookRegistry.register("sglang.srt.entrypoints.harmony_utils.render_for_completion", _render_linear,
                          HookType.AROUND)
    responses = "sglang.srt.entrypoints.openai.serving_responses.OpenAIServingResponses"
    context = "sglang.srt.entrypoints.context"
    HookRegistry.register(f"{responses}.create_responses", _create_responses_with_scores, HookType.AROUND)
    HookRegistry.register("sglang.srt.entrypoints.openai.protocol.ResponsesRequest.to_sampling_params",
                          _sampling_params_with_extras, HookType.AROUND)
    HookRegistry.register(f"{responses}._status_from_finish_reason", _status_with_guard, HookType.AROUND)
    HookRegistry.register(f"{responses}._build_response", _response_with_guard_details, HookType.AROUND)
    HookRegistry.register(f"{context}.HarmonyContext.need_builtin_tool_call", _no_tool_turn_after_guard,
                          HookType.AROUND)
    HookRegistry.register(f"{context}.HarmonyContext.append_output", _harmony_append_with_prompt_tokens,
                          HookType.AROUND)
    HookRegistry.register(f"{context}.StreamingHarmonyContext.append_output", _streaming_append_with_usage,
                          HookType.AROUND)
