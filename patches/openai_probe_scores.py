"""Patch: SingProbe scores in the OpenAI-compatible API (SGLang 0.5.23).

SGLang returns `customized_info` keys only in the native API's `meta_info`; the
upstream SingProbe pull request adds nothing to the OpenAI schema. We add, per
choice, `token_probe_probs`: a list with one `{label: probability}` dict per
generated token, in token order.

Targets
  - `OpenAIServingChat._generate_stream_content` (AROUND): every SSE chunk of a choice
    carries the scores of the tokens decoded since that choice's previous chunk, so
    the concatenation over a stream is exactly one score per completion token. When
    a parser holds text back (reasoning or a tool call in progress) and yields no
    chunk, an empty-delta chunk carries the scores: they stay aligned by token
    offset, never by text.
  - `OpenAIServingCompletion._generate_completion_stream` (AROUND) with
    `TokenizerManager.generate_request` (AROUND): the completions stream is one
    monolithic generator, so the scores each generation result carries are recorded
    in a sink keyed by the request object the stream hands to `generate_request`
    (only completions streams register one, so concurrent requests never see each
    other's) and attached to the next chunk of that choice.
  - The same `generate_request` hook fills the records of `/v1/responses` requests and puts
    their custom logit processor on each engine call (`responses_api`, which attaches them), and
    shows each output to `guard_endpoints.observe_output` (the Anthropic and Ollama routes read
    the guard's finish there).
  - `http_server.serve_generate_request` (BEFORE) marks a streamed native `/generate` request, and the
    same `generate_request` hook gives each of its chunks only the scores of the tokens decoded since
    the previous chunk of that output: upstream's native stream (without
    `--incremental-streaming-output`) repeats everything so far in each chunk, which for scores that
    every request carries would send n^2/2 rows for n tokens and slow every long stream's client
    and HTTP server; concatenated, the chunks' scores are one per output token, as on the OpenAI
    streams (with `--incremental-streaming-output` upstream already sends them so).
  - `OpenAIServingChat._build_chat_response` and
    `OpenAIServingCompletion._build_completion_response` (AROUND): the full list on
    each choice of a non-streamed response.
Without `--probe-ckpt`, meta_info has no scores and both are a pass-through.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, List, Optional, get_args

import orjson  # every chunk of every scored stream is parsed and rewritten here: a tenth of json's time
from pydantic import create_model

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import get_serving

from sglang_ext.patches.guard_endpoints import observe_output
from sglang_ext.patches.responses_api import record_of, with_processor
from sglang_ext.probe import SCORES_KEY, json_scores

# How many scores a choice has received is kept in the stream's own `stream_offsets`
# dict (upstream reads it only by integer choice index), so it lives and dies with the
# stream: a disconnected client leaves nothing behind in this process.
_SENT = "sglang_ext_probe_scores_sent"


def _incremental_meta_info() -> bool:
    try:
        return bool(get_serving().incremental_streaming_output)
    except ValueError:  # SGLang's "config namespace 'serving' not published": no server in this process
        return False


def _with_scores(sse: str, index: int, scores: list) -> str | None:
    """The chunk with `scores` attached to choice `index`, or None if it has no such choice."""
    if not sse.startswith("data: ") or sse.startswith("data: [DONE]"):
        return None
    try:
        payload = orjson.loads(sse[len("data: "):])
    except ValueError:
        return None
    for choice in payload.get("choices") or []:
        if choice.get("index") == index:
            choice[SCORES_KEY] = json_scores(scores)
            return "data: " + orjson.dumps(payload).decode() + "\n\n"
    return None


@functools.lru_cache(maxsize=None)
def _signature(fn) -> inspect.Signature:
    return inspect.signature(fn)


async def _stream_content_with_scores(original, self, *args, **kwargs):
    bound = _signature(original).bind(self, *args, **kwargs).arguments
    content, index = bound["content"], bound["index"]
    all_scores = (content.get("meta_info") or {}).get(SCORES_KEY)
    if all_scores is None:
        async for chunk in original(self, *args, **kwargs):
            yield chunk
        return
    offsets, key = bound["stream_offsets"], (_SENT, index)
    start = 0 if _incremental_meta_info() else offsets.get(key, 0)
    pending = list(all_scores[start:])
    offsets[key] = start + len(pending)
    async for chunk in original(self, *args, **kwargs):
        if pending:
            with_scores = _with_scores(chunk, index, pending)
            if with_scores is not None:
                chunk, pending = with_scores, []
        yield chunk
    if pending:
        request = bound["request"]
        carrier = {
            "id": content["meta_info"]["id"],
            "object": "chat.completion.chunk",
            "created": bound["created"],
            "model": request.model,
            "choices": [{"index": index, "delta": {}, "finish_reason": None, SCORES_KEY: json_scores(pending)}],
        }
        yield "data: " + orjson.dumps(carrier).decode() + "\n\n"


# id(GenerateReqInput) of a live completions stream -> {choice index: cumulative scores}
_completion_sinks: dict[int, dict] = {}
# Set on a GenerateReqInput that the native /generate route streams (its __dict__; upstream keeps its own
# caches there too).
_NATIVE_STREAM = "_sglang_ext_native_stream"


def _mark_native_stream(obj, *args, **kwargs):
    if getattr(obj, "stream", False) and hasattr(obj, "__dict__"):
        obj.__dict__[_NATIVE_STREAM] = True


def _own_scores(content: dict, sent: dict) -> dict:
    """A native stream chunk whose scores are those of its output's tokens since its previous chunk:
    the chunk is copied (upstream's meta_info and its score list are its request state)."""
    meta = content.get("meta_info")
    scores = meta.get(SCORES_KEY) if isinstance(meta, dict) else None
    if scores is None:
        return content
    index = content.get("index", 0)
    start = sent.get(index, 0)
    sent[index] = len(scores)
    return {**content, "meta_info": {**meta, SCORES_KEY: scores[start:]}}


async def _generate_request_recording_scores(original, self, obj, *args, **kwargs):
    sink = _completion_sinks.get(id(obj))
    record = record_of(obj)
    turn = None
    if record is not None:
        turn = record.new_turn(obj)
        with_processor(obj, record)
    native = getattr(obj, "__dict__", {}).get(_NATIVE_STREAM, False) and not _incremental_meta_info()
    sent: dict[int, int] = {}
    async for content in original(self, obj, *args, **kwargs):
        observe_output(content)
        if (sink is not None or record is not None) and isinstance(content, dict):
            meta = content.get("meta_info") or {}
            scores = meta.get(SCORES_KEY)
            if scores is not None and sink is not None:
                index = content.get("index", 0)
                if _incremental_meta_info():
                    sink.setdefault(index, []).extend(scores)
                else:
                    sink[index] = scores
            if record is not None:
                record.update(turn, meta, _incremental_meta_info())
        if native and isinstance(content, dict):
            content = _own_scores(content, sent)
        yield content


async def _completion_stream_with_scores(original, self, adapted_request, *args, **kwargs):
    sink: dict = {}
    _completion_sinks[id(adapted_request)] = sink
    sent: dict[int, int] = {}
    try:
        async for chunk in original(self, adapted_request, *args, **kwargs):
            for index, scores in sink.items():
                if len(scores) > sent.get(index, 0):
                    with_scores = _with_scores(chunk, index, list(scores[sent.get(index, 0):]))
                    if with_scores is not None:
                        chunk = with_scores
                        sent[index] = len(scores)
            yield chunk
    finally:
        _completion_sinks.pop(id(adapted_request), None)


@functools.lru_cache(maxsize=None)
def _scored_response_class(response_cls):
    """`response_cls` (ChatCompletionResponse / CompletionResponse) whose choices also carry SCORES_KEY: a
    subclass, so every caller that checks the type still accepts it (the Anthropic /v1/messages handler
    calls the chat handler and turned anything else into "Request failed"), and `model_json_response`
    writes it as upstream writes the response, plus the scores."""
    choice_cls = get_args(response_cls.model_fields["choices"].annotation)[0]
    scored_choice = create_model(f"Scored{choice_cls.__name__}", __base__=choice_cls,
                                 **{SCORES_KEY: (Optional[list], None)})
    return create_model(f"Scored{response_cls.__name__}", __base__=response_cls,
                        choices=(List[scored_choice], ...)), scored_choice


def _response_with_scores(original, self, request, ret: list[dict[str, Any]], created, *args, **kwargs):
    response = original(self, request, ret, created, *args, **kwargs)
    scores = [(item.get("meta_info") or {}).get(SCORES_KEY) for item in ret]
    if all(s is None for s in scores) or not hasattr(response, "choices"):
        return response  # no probe, or an error response
    scored_cls, scored_choice = _scored_response_class(type(response))
    choices = []
    for choice in response.choices:
        i = choice.index
        extra = {SCORES_KEY: json_scores(scores[i])} if i < len(scores) and scores[i] is not None else {}
        choices.append(scored_choice.model_construct(_fields_set=choice.model_fields_set | set(extra),
                                                     **dict(choice), **extra))
    fields = dict(response)
    fields["choices"] = choices
    return scored_cls.model_construct(_fields_set=response.model_fields_set, **fields)


def register() -> None:
    chat = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat"
    completions = "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion"
    HookRegistry.register(f"{chat}._generate_stream_content", _stream_content_with_scores, HookType.AROUND)
    HookRegistry.register(f"{chat}._build_chat_response", _response_with_scores, HookType.AROUND)
    HookRegistry.register(f"{completions}._build_completion_response", _response_with_scores, HookType.AROUND)
    HookRegistry.register(f"{completions}._generate_completion_stream", _completion_stream_with_scores,
                          HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
                          _generate_request_recording_scores, HookType.AROUND)
    HookRegistry.register("sglang.srt.entrypoints.http_server.serve_generate_request", _mark_native_stream,
                          HookType.BEFORE)
