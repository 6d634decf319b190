"""Patch: SingProbe scores, the guard's stop and token usage in the OpenAI Responses API (SGLang 0.5.23).

gpt-oss is served on `/v1/responses` through SGLang's Harmony path (`OpenAIServingResponses`
with `HarmonyContext` / `StreamingHarmonyContext`). Upstream, that path returned no probe
scores, reported a request the SingProbe guard stopped as `completed`, and reported
`input_tokens` 0 (it reads the prompt length only when `meta_info` has `prompt_token_ids`,
which SGLang never sends) and, streamed, `output_tokens` 0 (the streaming context counts
nothing); a request without `model` (upstream: "whatever is loaded") generated and then failed.

Targets
  - `OpenAIServingResponses.create_responses` (AROUND): a request without `model` is given the
    served model's name. A `ResponseRecord` keyed by the
    request id collects the scores of every generation turn of the request (filled by
    `openai_probe_scores`' `generate_request` hook, which sees each turn's engine outputs;
    built-in tool turns reuse the request id). Then
      * not streamed: the response object gets `token_probe_probs`, one `{label: p}` per
        generated token, all turns in order;
      * streamed: each SSE event carries, as `token_probe_probs` beside `type`, the scores of
        the tokens decoded since the previous event that carried any, so the concatenation
        over a stream is one score per token whatever the Harmony parser held back; the final
        event's `response` carries the whole list, as a non-streamed response does;
      * a request the guard stopped (finish reason `content_filter`) ends `incomplete` with
        `incomplete_details` `{"reason": "content_filter", label, score, threshold}` (OpenAI's
        reason for a filtered response), streamed as `response.incomplete`, also in the
        response store (`GET /v1/responses/{id}`).
    Background requests (`background: true`, not streamed) get the guard's status in the store
    once their task ends, but no scores: the stored response object has no field for them.
  - `HarmonyContext.append_output` (AROUND): the prompt length from `meta_info.prompt_tokens`.
  - `StreamingHarmonyContext.append_output` (AROUND): prompt, cached and output tokens, the
    output tokens counted as the tokens its parser was fed.
Without `--probe-ckpt`, meta_info has no scores and nothing is added.
"""

from __future__ import annotations

import json
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.probe import SCORES_KEY

FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")


class ResponseRecord:
    """What the engine returned for one /v1/responses request, turn by turn."""

    def __init__(self) -> None:
        self.turns: list[list] = []
        self.finish_reason: Any = None

    def new_turn(self) -> list:
        self.turns.append([])
        return self.turns[-1]

    def scores(self) -> list:
        return [s for turn in self.turns for s in turn]

    def guard_stop(self) -> dict | None:
        """`incomplete_details` for a request the SingProbe guard stopped, else None."""
        reason = self.finish_reason
        if not (isinstance(reason, dict) and reason.get("type") == "content_filter"):
            return None
        return {"reason": "content_filter",
                **{k: reason[k] for k in ("label", "score", "threshold") if k in reason}}


# request id of a live /v1/responses request -> its record
_records: dict[str, ResponseRecord] = {}


def record_of(obj) -> ResponseRecord | None:
    """The record a `GenerateReqInput` belongs to (`openai_probe_scores` calls this per request)."""
    rid = getattr(obj, "rid", None)
    return _records.get(rid) if isinstance(rid, str) and _records else None


def _event_with(sse: str, pending: list, record: ResponseRecord) -> tuple[str, bool]:
    """One SSE event with `pending` scores attached (and whether they were); the final event also
    gets the whole list and the guard's status. What is not one JSON event passes unchanged."""
    if not pending and not any(t in sse for t in FINAL_EVENTS):
        return sse, False
    head, sep, body = sse.partition("data: ")
    try:
        payload = json.loads(body) if sep else None
    except ValueError:
        payload = None
    if not isinstance(payload, dict):
        return sse, False
    if pending:
        payload[SCORES_KEY] = pending
    event_type = payload.get("type")
    response = payload.get("response")
    if event_type in FINAL_EVENTS and isinstance(response, dict):
        scores = record.scores()
        if scores:
            response[SCORES_KEY] = scores
        stop = record.guard_stop()
        if stop is not None and event_type == "response.completed":
            payload["type"] = "response.incomplete"
            response["status"] = "incomplete"
            response["incomplete_details"] = stop
            head = head.replace("response.completed", "response.incomplete")
    return head + "data: " + json.dumps(payload, ensure_ascii=False) + "\n\n", bool(pending)


def _finish(serving, record: ResponseRecord, rid: str, response=None) -> None:
    """The guard's status on `response` and on the stored copy (the response id is the request id);
    then the record is dropped."""
    stop = record.guard_stop()
    stored = getattr(serving, "response_store", {}).get(rid)
    for r in (response, stored):
        if stop is not None and r is not None and r.status == "completed":
            r.status, r.incomplete_details = "incomplete", stop
    _records.pop(rid, None)


async def _stream_with_scores(serving, events, record: ResponseRecord, rid: str):
    sent = 0
    try:
        async for event in events:
            if isinstance(event, str):
                scores = record.scores()
                event, attached = _event_with(event, scores[sent:], record)
                if attached:
                    sent = len(scores)
            yield event
    finally:
        _finish(serving, record, rid)


async def _create_responses_with_scores(original, self, request, *args, **kwargs):
    if getattr(request, "model", "") is None:
        # "None means whatever is loaded" upstream, but the response object requires a model name:
        # without this a request with no model generated in full and then failed (a 400 naming
        # ResponsesResponse, or an empty stream).
        request.model = self.tokenizer_manager.served_model_name
    rid = getattr(request, "request_id", None)
    if not isinstance(rid, str) or rid in _records:
        return await original(self, request, *args, **kwargs)
    record = _records[rid] = ResponseRecord()
    kept = False
    try:
        result = await original(self, request, *args, **kwargs)
        if hasattr(result, "__aiter__"):
            kept = True
            return _stream_with_scores(self, result, record, rid)
        if getattr(result, "status", None) == "queued":
            task = getattr(self, "background_tasks", {}).get(getattr(result, "id", None))
            if task is not None:
                kept = True
                task.add_done_callback(lambda _: _finish(self, record, rid))
            return result
        if not hasattr(result, "model_dump_json"):
            return result
        _finish(self, record, rid, result)
        scores = record.scores()
        if not scores:
            return result
        from fastapi.responses import Response

        payload = json.loads(result.model_dump_json())
        payload[SCORES_KEY] = scores
        return Response(content=json.dumps(payload, ensure_ascii=False), media_type="application/json")
    finally:
        if not kept:
            _records.pop(rid, None)


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
    if isinstance(meta, dict):
        if "prompt_tokens" in meta:
            self.num_prompt_tokens = meta["prompt_tokens"]
        if "cached_tokens" in meta:
            self.num_cached_tokens = meta["cached_tokens"]
        # The tokens its parser was fed this call (upstream's own cumulative/incremental rule).
        self.num_output_tokens += max(0, getattr(self, "num_processed_tokens", 0) - before)
    return result


def register() -> None:
    responses = "sglang.srt.entrypoints.openai.serving_responses.OpenAIServingResponses"
    context = "sglang.srt.entrypoints.context"
    HookRegistry.register(f"{responses}.create_responses", _create_responses_with_scores, HookType.AROUND)
    HookRegistry.register(f"{context}.HarmonyContext.append_output", _harmony_append_with_prompt_tokens,
                          HookType.AROUND)
    HookRegistry.register(f"{context}.StreamingHarmonyContext.append_output", _streaming_append_with_usage,
                          HookType.AROUND)
