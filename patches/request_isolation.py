"""Patch: one bad request costs one error, never the server (SGLang 0.5.23).

Upstream 0.5.23 lets a single request take the whole server down: the scheduler runs
each batch in one try-less loop, so any exception there ends the scheduler process and
the launcher answers with SIGQUIT (every in-flight request lost). Seen on this CPU:
token ids outside the model's vocabulary (`IndexError` in the embedding), an empty
prompt (a zero-token extend batch), `top_logprobs_num` above the vocabulary size (top-k
out of range in the sampler), and a custom logit processor that raises. Our own
per-request code (guard thresholds, score extraction, chat/completion stream hooks
such as Harmony parsing) runs on the same paths, so it must fail the same way: alone.

Targets
  - `TokenizerManager._validate_one_request` (BEFORE), the one check every generate
    request passes (single and batch, native and OpenAI) before it is sent to the
    scheduler: HTTP 400 for an empty prompt, input token ids that are not integers in
    [0, vocab_size) (the message names the first bad id, its position and the vocab
    size), a custom logit processor that is not one string (a list on a single request ended
    the scheduler) or cannot be loaded, `custom_params` that is not
    an object, `top_logprobs_num` above the vocabulary size, a list where one request takes one
    `top_logprobs_num` / `logprob_start_len`, `sampling_params` that is not an object,
    `custom_params` nested past 32 levels (its pickling to the scheduler raised RecursionError, a 500),
    `stop_token_ids` outside the vocabulary (with `min_new_tokens` they ended the scheduler),
    `top_k` past int32 (it ended the scheduler), a `stop_regex` Python cannot compile (a 500),
    `session_params` with unknown fields or wrong types (a non-string id ended the scheduler),
    a `logit_bias` value past 1e30 (over a small temperature: inf logits, NaN probabilities, and the
    sampler ended the scheduler),
    and an invalid per-request
    `probe_stop` (the guard's own parser, plus its labels against the probe's, and no
    probe loaded at all), so a bad spec is refused before it reaches the scheduler and an
    unknown label is not silently ignored.
  - `fastapi._compat.v2.ModelField.validate` (AROUND): SGLang's OpenAI request models run "before"
    validators that assume a JSON object (`values.get(...)` on the body, `response_format.get(...)`);
    given a JSON array body or a string `response_format` they raised an AttributeError that
    pydantic passes through, and the client got a 500. Such a crash becomes a validation error, so
    SGLang's own handler answers 400, naming the field whose value fails its type (validated alone).
    The same hook answers 400 for fields the models would drop without a word where a client may have
    meant a guard threshold (`custom_params` at the top of a /generate body, `extra_body` or
    `sampling_params` in an OpenAI body), and for /vertex_generate `parameters` that its handler's
    `GenerateReqInput(**parameters)` has no field for (a TypeError, a 500).
  - `sglang.srt.layers.sampler.apply_custom_logit_processor` (REPLACE): upstream's loop,
    with each processor group applied under `try`; when a group raises (or returns a
    tensor of the wrong shape), its rows are retried one by one so only the rows that
    fail are failed. A failed row keeps its unprocessed logits for this step and its
    request is finished through `req.to_finish` with FINISH_ABORT carrying the message
    and status 400 (the user's code failed); the batch and the server go on. The token
    of the failing step is appended before the finish (SGLang appends every sampled
    token): native streams show it, OpenAI streams end with the error object first.
  - `CustomLogitProcessor.from_str` (AROUND): a processor that cannot be rebuilt in the
    scheduler (where the batch is assembled, outside any per-request guard) becomes a
    stand-in that raises on call, so it fails its rows like any raising processor.
  - `sglang_ext.probe_runtime.ProbeRuntime.score` (AROUND) and
    `SchedulerBatchResultProcessor.process_batch_result_{prefill,decode}` (BEFORE): the
    probe is batched, so when it raises no request of that forward has a score; each
    gets a NaN row and is finished with the error and status 500 (fail closed: a
    guarded request never continues unscored). The rest of the server keeps serving.
  - `Scheduler.expert_distribution_handle` (AROUND) and the tokenizer manager's
    `{start,stop,dump}_expert_distribution_record` (AROUND): an operator endpoint that upstream
    lets end the scheduler from one GET on a server without `--expert-distribution-recorder-mode`
    answers 400 saying so, and a failure of the recorder stays in the scheduler's log.
  - `OpenAIServingChat._generate_chat_stream` and
    `OpenAIServingCompletion._generate_completion_stream` (AROUND, outermost): upstream's
    chat stream catches only ValueError, so any other exception in a parser or in our
    score hooks cut the HTTP response without a word. After the first chunk such an
    exception ends the stream with an SSE error object carrying the message and
    `data: [DONE]`, and the request is aborted in the scheduler (its KV released).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
from http import HTTPStatus
from typing import get_args, get_type_hints

import torch
from fastapi import HTTPException
from pydantic import TypeAdapter, ValidationError

from sglang.srt.constants import GPU_MEMORY_ALL_TYPES
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.runtime_context import get_exec
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from sglang_ext.patches.exact_abort import abort_owned
from sglang_ext.patches.probe_stop import ProbeStopSpecError, agreed_score_rows, parse_probe_stop, row_unscored
from sglang_ext.probe.checkpoint import ENV_VAR as PROBE_CKPT_ENV
from sglang_ext.probe.config import ProbeConfig

logger = logging.getLogger(__name__)

PROCESSOR_ERROR = "CustomLogitProcessorError"
PROBE_ERROR = "ProbeError"


class RequestRejected(ValueError, HTTPException):
    """Bad input, HTTP 400: SGLang answers a ValueError from its request validation with a 400, and an
    HTTPException reaches the client as one from code its handlers do not guard (a parser built from a
    request's name, the operator endpoints). Outside a request (a parser at startup) a ValueError."""

    def __init__(self, message: str):
        ValueError.__init__(self, message)
        HTTPException.__init__(self, status_code=400, detail=message)

    def __str__(self):
        return self.detail


# -- input validation (tokenizer manager, before the scheduler sees the request) -------------


def first_bad_token_id(input_ids, vocab_size: int):
    """(position, id) of the first id that is not an int in [0, vocab_size), or None."""
    try:
        # Fast path for the common case: one pass in C over a list of ints.
        if min(input_ids) >= 0 and max(input_ids) < vocab_size and all(
                type(t) is int for t in input_ids):
            return None
    except TypeError:
        pass  # mixed types: found below
    for position, token in enumerate(input_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            return position, token
    return None


def check_input_ids(input_ids, vocab_size: int) -> None:
    if len(input_ids) == 0:
        raise RequestRejected("the prompt is empty: a request needs at least one input token")
    bad = first_bad_token_id(input_ids, vocab_size)
    if bad is not None:
        position, token = bad
        raise RequestRejected(
            f"input token id {token!r} at position {position} is outside the model's vocabulary: "
            f"ids must be integers in [0, {vocab_size}) (vocab size {vocab_size})")


INT32_MAX = 2**31 - 1
LOGIT_BIAS_MAX = 1e30  # / 1e-6 (the smallest sampled temperature) stays well inside float32
REPETITION_PENALTY_MIN = 1e-6  # a logit of 1e4 / 1e-6 / 1e-6 (temperature) stays well inside float32 too


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_one_request_scalars(obj) -> None:
    # A list here passed the /generate schema ("int or list", meant for batches) and reached the
    # scheduler of a single request, which compares it with an int and ends.
    for field in ("logprob_start_len", "top_logprobs_num"):
        value = getattr(obj, field, None)
        if value is not None and not _is_int(value):
            raise RequestRejected(f"{field} of one request must be an integer, got {type(value).__name__}")
    start = getattr(obj, "logprob_start_len", None)
    if start is not None and start < -1:
        # -1 is "the output's logprobs only"; below it, with return_logprob, the scheduler's prefill
        # logprob bookkeeping asserted and the server ended (found by fuzzing).
        raise RequestRejected(f"logprob_start_len must be -1 (output only) or a prompt position >= 0, got {start}")
    overrides = getattr(obj, "positional_embed_overrides", None)
    if overrides is not None:
        from sglang.srt.managers.io_struct import PositionalEmbeds  # heavy: ~2700 modules

        if not isinstance(overrides, PositionalEmbeds):
            # An Engine-API object no JSON body can express: a string or object from HTTP reached the
            # scheduler's `.reconstruct(...)` and ended the server.
            raise RequestRejected("positional_embed_overrides cannot be sent over HTTP (it is an Engine-API "
                                  f"object), got {type(overrides).__name__}")


def check_sampling_params(sampling_params, vocab_size: int) -> None:
    """What the scheduler uses unchecked and ends on: stop ids out of the vocabulary (with
    min_new_tokens they index a vocabulary-wide tensor), top_k past int32 (its batch tensor), a
    stop_regex Python cannot compile (a 500 from the tokenizer manager); and a logit_bias so large
    that the logits over the temperature overflow (the sampler ended, or greedy served token 0)."""
    if not isinstance(sampling_params, dict):
        raise RequestRejected(f"sampling_params of one request must be a JSON object, got "
                              f"{type(sampling_params).__name__}")
    stop_ids = sampling_params.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, (list, tuple, set)):
            raise RequestRejected(f"stop_token_ids must be a list of token ids, got {type(stop_ids).__name__}")
        bad = first_bad_token_id(list(stop_ids), vocab_size) if stop_ids else None
        if bad is not None:
            raise RequestRejected(f"stop_token_ids: {bad[1]!r} is not a token id: ids must be integers in "
                                  f"[0, {vocab_size}) (vocab size {vocab_size})")
    top_k = sampling_params.get("top_k")
    if _is_int(top_k) and top_k > INT32_MAX:  # a float is refused by the schemas (or made an int)
        raise RequestRejected(f"top_k must be at most {INT32_MAX} (-1: the whole vocabulary), got {top_k}")
    bias = sampling_params.get("logit_bias")
    for token, value in (bias.items() if isinstance(bias, dict) else ()):
        # The biased logits are divided by the temperature (>= 1e-6 when sampled) in float32: past
        # LOGIT_BIAS_MAX they reach inf, the probabilities NaN, and the sampler's multinomial ended the
        # scheduler (greedy rows served token 0 every step instead).
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not abs(value) <= LOGIT_BIAS_MAX:
            raise RequestRejected(f"logit_bias of token {token}: {value!r} is not a number within "
                                  f"[-{LOGIT_BIAS_MAX:.0e}, {LOGIT_BIAS_MAX:.0e}]")
    penalty = sampling_params.get("repetition_penalty")
    if _is_number(penalty) and 0 < penalty < REPETITION_PENALTY_MIN:
        # Seen tokens' positive logits are divided by it: 1e-45 made them +inf, the probabilities NaN,
        # and the sampler's multinomial ended the scheduler. Upstream's own check refuses <= 0 and > 2.
        raise RequestRejected(f"repetition_penalty must be in [{REPETITION_PENALTY_MIN:g}, 2] (1.0 = no penalty), "
                              f"got {penalty!r}")
    patterns = sampling_params.get("stop_regex")
    for pattern in ([patterns] if isinstance(patterns, str) else patterns or []):
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError, TypeError) as e:
            raise RequestRejected(f"stop_regex {pattern!r} is not a regular expression Python can compile: "
                                  f"{e}") from None


def check_session_params(session_params) -> None:
    """Field names and types of SGLang's SessionParams (a msgspec struct, built without type checks):
    a session id that is not a string ended the scheduler (unhashable), an unknown field was a 500."""
    from sglang.srt.managers.io_struct import SessionParams  # heavy: ~2700 modules

    if session_params is None:
        return
    if not isinstance(session_params, dict):
        raise RequestRejected(f"session_params must be a JSON object, got {type(session_params).__name__}")
    hints = get_type_hints(SessionParams)
    for key, value in session_params.items():
        if key not in SessionParams.__struct_fields__:
            raise RequestRejected(f"session_params: unknown field {key!r}; the fields are "
                                  f"{list(SessionParams.__struct_fields__)}")
        allowed = tuple(t for t in get_args(hints[key]) if t is not type(None)) or (hints[key],)
        if value is None or (isinstance(value, allowed) and (bool in allowed or not isinstance(value, bool))):
            continue
        raise RequestRejected(f"session_params.{key} must be {' or '.join(t.__name__ for t in allowed)} or "
                              f"null, got {type(value).__name__}")


def check_top_logprobs_num(obj, vocab_size: int) -> None:
    # The sampler's top-k over the vocabulary raises (and ends the scheduler) above it.
    k = getattr(obj, "top_logprobs_num", None)
    if getattr(obj, "return_logprob", False) and isinstance(k, int) and not 0 <= k <= vocab_size:
        raise RequestRejected(f"top_logprobs_num must lie in [0, {vocab_size}] (the vocab size), got {k}")


# GenerateReqInput's fields that a batch gives one entry per request (after normalization): a
# shorter list was an IndexError in the tokenizer manager's batch split, an HTTP 500.
PER_REQUEST_FIELDS = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                      "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
                      "custom_logit_processor", "lora_path", "lora_id", "modalities")
EMPTY_MEANS_NONE = ("modalities",)  # GenerateReqInput.__getitem__: `self.modalities[i] if self.modalities else None`


def check_batch_lengths(result, obj, *args, **kwargs):
    rid = getattr(obj, "rid", None)
    if getattr(obj, "is_single", True) and rid is not None and not isinstance(rid, str):
        # A list on one request (native, chat or completion: all pass here) was a 500: unhashable, in the
        # tokenizer manager's state table.
        raise RequestRejected(f"rid of one request must be a string, got {type(rid).__name__}")
    if getattr(obj, "is_single", True) or not isinstance(rid, list):
        return result
    count = len(obj.rid)  # the requests the tokenizer manager splits the batch into
    copies = getattr(obj, "parallel_sample_num", 1) or 1
    for field in PER_REQUEST_FIELDS:
        value = getattr(obj, field, None)
        if field in EMPTY_MEANS_NONE and not value:
            continue  # the batch split reads an empty list as none given (the chat endpoint sends [] with n > 1)
        if isinstance(value, list) and len(value) < count:
            given = len(value) // copies if field == "sampling_params" else len(value)
            raise RequestRejected(
                f"{field} has {given} entries for a batch of {obj.batch_size} requests: give one entry per "
                "request, or one value (not a list) for all of them")
    return result


def probe_labels() -> list[str] | None:
    """The loaded probe's labels (from --probe-ckpt, carried in the environment), None without a probe."""
    folder = os.environ.get(PROBE_CKPT_ENV) or None
    return None if folder is None else _labels_of(folder)


@functools.lru_cache(maxsize=4)
def _labels_of(folder: str) -> list[str]:
    return list(ProbeConfig.from_json_file(os.path.join(folder, "config.json")).labels)


def check_probe_stop(spec, labels: list[str] | None) -> None:
    try:
        thresholds = parse_probe_stop(spec)
    except ProbeStopSpecError as e:
        raise RequestRejected(str(e)) from None
    if not thresholds:
        return
    if labels is None:
        raise RequestRejected("probe_stop needs a server started with --probe-ckpt")
    unknown = sorted(set(thresholds) - set(labels))
    if unknown:
        raise RequestRejected(f"probe_stop: unknown label(s) {unknown}; the probe's labels are {labels}")


# custom_params travels to the scheduler by pickle, which recurses per level: ~480 levels raised RecursionError
# in the tokenizer manager, a 500.
CUSTOM_PARAMS_MAX_DEPTH = 32


def nesting_depth(value, limit: int) -> int:
    """How deep JSON-like `value` nests (a scalar 0, {} or [] 1), counted without recursion up to limit + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list, tuple)):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_custom_params(sampling_params: dict, has_processor: bool) -> None:
    custom = sampling_params.get("custom_params")
    if custom is None:
        if has_processor:
            # Upstream hands a processor's dict params a weak `__req__` back-reference;
            # with an empty dict every processor row can be traced to its request.
            sampling_params["custom_params"] = {}
        return
    if not isinstance(custom, dict):
        raise RequestRejected(f"custom_params must be a JSON object, got {type(custom).__name__}")
    if nesting_depth(custom, CUSTOM_PARAMS_MAX_DEPTH) > CUSTOM_PARAMS_MAX_DEPTH:
        raise RequestRejected(f"custom_params nests more than {CUSTOM_PARAMS_MAX_DEPTH} levels deep")
    if "probe_stop" in custom:
        check_probe_stop(custom["probe_stop"], probe_labels())


def check_custom_logit_processor(serialized) -> None:
    for text in serialized if isinstance(serialized, list) else [serialized]:
        if text is None:
            continue
        if not isinstance(text, str):
            raise RequestRejected(f"custom_logit_processor must be a string, got {type(text).__name__}")
        processor = CustomLogitProcessor.from_str(text)
        if isinstance(processor, UnloadableProcessor):
            raise RequestRejected(processor.message)


def _validate_request(original, tokenizer_manager, obj, input_ids, *args, **kwargs):
    _check_request(tokenizer_manager, obj, input_ids)
    return _type_errors_rejected(original, tokenizer_manager, obj, input_ids, *args, **kwargs)


def _type_errors_rejected(original, *args, **kwargs):
    try:
        return original(*args, **kwargs)
    except TypeError as e:
        # A field of the wrong type that no schema checked (/vertex_generate builds its request
        # without one): max_new_tokens "8" or temperature "x" were 500s from the arithmetic on them.
        raise RequestRejected(f"a request field has the wrong type: {e}") from None


# Exceptions pydantic does not turn into a ValidationError: a "before" model validator of SGLang's
# request models that assumed a JSON object (ChatCompletionRequest's `values.get(...)` on a JSON
# array body, `response_format.get("type")` on a string) raised one of these out of FastAPI's body
# validation, and the client got a 500.
_VALIDATOR_CRASHES = (AttributeError, TypeError, KeyError, IndexError)


def _fields_that_do_not_validate(model, body: dict) -> list[str]:
    """"name: pydantic's message" for each field of `body` whose value fails that field's own type,
    validated alone (nothing else of the model runs): names the culprit the model's validator
    tripped on, which its exception does not."""
    fields = {(info.alias or name): info for name, info in getattr(model, "model_fields", {}).items()}
    bad = []
    for key, value in body.items():
        info = fields.get(key)
        if info is None:
            continue
        try:
            TypeAdapter(info.annotation).validate_python(value)
        except ValidationError as e:
            bad.append(f"{key}: {e.errors(include_url=False)[0]['msg']}")
        except Exception:  # noqa: BLE001 - a validator of the field's own type crashed on it
            bad.append(f"{key}: {type(value).__name__} value cannot be read")
    return bad


@functools.lru_cache(maxsize=1)
def _checked_bodies() -> tuple[type, frozenset, dict]:
    """/vertex_generate's body model and the keys its `parameters` may hold (its handler passes them as
    keywords to GenerateReqInput beside the prompt it builds itself); and per body model, the fields
    clients put in the wrong place, which the model would drop without a word: a guard threshold sent
    there would never apply."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from sglang.srt.managers.io_struct import GenerateReqInput, VertexGenerateReqInput

    prompt = {"text", "input_ids", "input_embeds", "image_data"}
    vertex_names = frozenset(f.name for f in dataclasses.fields(GenerateReqInput) if f.init) - prompt
    openai = {"extra_body": "the OpenAI SDK's extra_body argument: send its keys at the top level of the body",
              "sampling_params": "a /generate field: OpenAI requests take sampling fields and custom_params "
                                 "at the top level"}
    misplaced = {GenerateReqInput: {"custom_params": "on /generate it goes in sampling_params.custom_params"},
                 ChatCompletionRequest: openai, CompletionRequest: openai}
    return VertexGenerateReqInput, vertex_names, misplaced


def _body_problem(model, value) -> str | None:
    if not isinstance(value, dict):
        return None
    vertex, vertex_names, misplaced = _checked_bodies()
    if model is vertex and isinstance(value.get("parameters"), dict):
        unknown = sorted(set(value["parameters"]) - vertex_names)
        return f"parameters: unknown field(s) {unknown}" if unknown else None
    wrong = [f"{key}: {why}" for key, why in misplaced.get(model, {}).items() if key in value]
    return "; ".join(wrong) or None


def _body_validator_crash_is_400(original, field, value, *args, **kwargs):
    """FastAPI's ModelField.validate (AROUND): a crash inside a request model's validator becomes a
    validation error (SGLang's handler answers 400) naming the body's problem instead of a 500; so do
    a /vertex_generate `parameters` key that its handler's GenerateReqInput(**parameters) has no field for,
    and a field sent where the model drops it (`_checked_bodies`)."""
    loc = kwargs.get("loc", ())
    model = getattr(field.field_info, "annotation", None)
    problem = _body_problem(model, value)
    if problem is not None:
        return None, [{"type": "value_error", "loc": tuple(loc), "msg": problem, "input": value}]
    try:
        return original(field, value, *args, **kwargs)
    except _VALIDATOR_CRASHES as e:
        if not isinstance(value, dict):
            msg = f"the request body must be a JSON object, got {type(value).__name__}"
        else:
            bad = _fields_that_do_not_validate(model, value)
            msg = ("; ".join(bad) if bad
                   else f"the request body could not be read ({type(e).__name__}: {e})")
        logger.info("request body refused (%s): %s", getattr(model, "__name__", model), msg)
        return None, [{"type": "value_error", "loc": tuple(loc), "msg": msg, "input": value}]


def _unreadable_prompt_is_400(original, obj, *args, **kwargs):
    """GenerateReqInput.normalize_batch_and_arguments (AROUND): `input_embeds: []` (no text, no ids) was
    an IndexError in upstream's batch-size probe, a 500; a prompt field of a shape it cannot read is a 400."""
    try:
        return original(obj, *args, **kwargs)
    except (IndexError, TypeError, KeyError) as e:
        raise RequestRejected(f"the prompt (text / input_ids / input_embeds) has a shape that cannot be read: "
                              f"{type(e).__name__}: {e}") from None


def _check_request(tokenizer_manager, obj, input_ids) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput  # heavy: ~2700 modules

    has_embeds = getattr(obj, "input_embeds", None) is not None
    has_mm = bool(getattr(obj, "contains_mm_input", lambda: False)())
    if input_ids is not None and not has_embeds and not has_mm:
        check_input_ids(input_ids, tokenizer_manager.model_config.vocab_size)
    if isinstance(obj, GenerateReqInput):
        vocab_size = tokenizer_manager.model_config.vocab_size
        check_one_request_scalars(obj)
        check_top_logprobs_num(obj, vocab_size)
        check_sampling_params(obj.sampling_params, vocab_size)
        check_session_params(getattr(obj, "session_params", None))
        processor = obj.custom_logit_processor
        if processor is not None and not isinstance(processor, str):
            # One request, one serialized processor. A list reached the scheduler's batch assembly
            # (`processor_str not in processor_dict`: TypeError, unhashable) and ended the server.
            raise RequestRejected("custom_logit_processor of one request must be a string (a serialized "
                                  f"processor), got {type(processor).__name__}")
        if processor and get_exec().features.enable_custom_logit_processor:
            check_custom_logit_processor(processor)
        check_custom_params(obj.sampling_params, bool(processor))


def check_detokenize_ids(result, serving, request, *args, **kwargs):
    """/detokenize: an id outside the vocabulary was a 500 ("out of range integral type conversion")."""
    if result:
        return result
    tokens = getattr(request, "tokens", None)
    if not isinstance(tokens, list):
        return result
    vocab_size = serving.tokenizer_manager.model_config.vocab_size
    for row, ids in enumerate(tokens if tokens and isinstance(tokens[0], list) else [tokens]):
        bad = first_bad_token_id(ids, vocab_size) if isinstance(ids, list) and ids else None
        if bad is not None:
            where = f"tokens[{row}][{bad[0]}]" if isinstance(tokens[0], list) else f"tokens[{bad[0]}]"
            return (f"{where} = {bad[1]!r} is not a token id: ids must be integers in [0, {vocab_size}) "
                    f"(vocab size {vocab_size})")
    return result


def check_tool_call_parser_name(parser, tools=None, tool_call_parser=None, *args, **kwargs):
    # /parse_function_call builds a parser from the request's name; an unknown one (or none) was a 500.
    known = type(parser).ToolCallParserEnum
    if tool_call_parser not in known:
        raise RequestRejected(f"unknown tool_call_parser {tool_call_parser!r}; the parsers are {sorted(known)}")


def check_reasoning_parser_name(parser, model_type=None, *args, **kwargs):
    # /separate_reasoning: the same for the request's reasoning_parser.
    known = type(parser).DetectorMap
    if not isinstance(model_type, str) or model_type.lower() not in known:
        raise RequestRejected(f"unknown reasoning_parser {model_type!r}; the parsers are {sorted(known)}")


REQUEST_LOG_LEVELS = (0, 1, 2, 3)  # RequestLogger._compute_metadata's


def check_logging_config(tokenizer_manager, obj, *args, **kwargs):
    """/configure_logging: upstream applied the request's fields one by one and raised on the first bad
    one (a 500 for an unknown log_level, the fields before it already applied); a request_log level
    past 3 was stored and made every later request's logging raise. All are checked before any is applied."""
    level = getattr(obj, "log_requests_level", None)
    if level is not None and level not in REQUEST_LOG_LEVELS:
        raise RequestRejected(f"log_requests_level must be one of {list(REQUEST_LOG_LEVELS)}, got {level!r}")
    name = getattr(obj, "log_level", None)
    if name is not None and (not isinstance(name, str) or not isinstance(
            logging.getLevelName(name.upper()), int)):
        raise RequestRejected(f"unknown log_level {name!r}; the levels are "
                          f"{[logging.getLevelName(n).lower() for n in (10, 20, 30, 40, 50)]}")


# -- custom logit processors (scheduler) ------------------------------------------------


class UnloadableProcessor:
    """Stands in for a processor that could not be rebuilt; raises when applied."""

    def __init__(self, message: str):
        self.message = message

    def __call__(self, logits, custom_param_list=None):
        raise RuntimeError(self.message)


def _from_str_or_stand_in(original, cls, json_str, *args, **kwargs):
    try:
        return original(cls, json_str, *args, **kwargs)
    except Exception as e:
        return UnloadableProcessor(f"custom logit processor could not be loaded: {type(e).__name__}: {e}")


def _finish_with_error(req, message: str, err_type: str, status: HTTPStatus) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT  # heavy: ~2700 modules

    if req.finished() or getattr(req, "to_finish", None) is not None:
        return
    # With an HTTP status the message reaches every client: the native stream's last
    # finish_reason, an SSE error object on OpenAI streams, an HTTP error otherwise
    # (without one, OpenAI responses would say only finish_reason "abort").
    req.to_finish = FINISH_ABORT(message=message, status_code=status, err_type=err_type)


def _request_of(custom_params):
    req = custom_params.get("__req__") if isinstance(custom_params, dict) else None
    try:
        return req if req is not None and req.rid is not None else None
    except ReferenceError:  # the request is gone already
        return None


def _processed(processor, selected: torch.Tensor, params: list) -> torch.Tensor:
    result = processor(selected, params)
    if not isinstance(result, torch.Tensor) or result.shape != selected.shape:
        shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        raise ValueError(f"returned {shape}, expected a tensor of shape {tuple(selected.shape)}")
    if not bool(torch.isfinite(result.amax(dim=-1)).all()):
        # A row with no finite logit (every token -inf) or with NaN / +inf has no distribution to
        # sample: the sampler's multinomial raised and ended the scheduler.
        raise ValueError("returned a row with no finite logit, or with NaN or +inf: nothing to sample from")
    return result


def apply_custom_logit_processor(logits: torch.Tensor, sampling_batch_info, num_tokens_in_batch: int = 1):
    """Upstream's loop (sampler.py, 0.5.23) with each processor group isolated."""
    batch_size = len(sampling_batch_info)
    assert logits.shape[0] == batch_size * num_tokens_in_batch, (
        f"The batch size of logits ({logits.shape[0]}) does not match the batch size of "
        f"sampling_batch_info ({batch_size}) x num_tokens_in_batch ({num_tokens_in_batch})")
    assert len(sampling_batch_info.custom_params) == batch_size
    token_offsets = (None if num_tokens_in_batch == 1
                     else torch.arange(num_tokens_in_batch, device=sampling_batch_info.device))

    def expand(indices):
        if token_offsets is None:
            return indices
        return (indices[:, None] * num_tokens_in_batch + token_offsets).flatten()

    def params_of(rows):
        return [sampling_batch_info.custom_params[i] for i in rows for _ in range(num_tokens_in_batch)]

    for entry in sampling_batch_info.custom_logit_processor.values():
        rows, indices = entry.rows, entry.indices
        assert len(rows) == indices.numel()
        assert not rows or rows[-1] < batch_size
        flat = expand(indices)
        try:
            result = _processed(entry.processor, logits.index_select(0, flat), params_of(rows))
        except Exception:
            pass  # find the rows that fail, below
        else:
            logits.index_copy_(0, flat, result.to(logits.dtype))
            continue
        for j, row in enumerate(rows):
            row_flat = expand(indices[j : j + 1])
            try:
                result = _processed(entry.processor, logits.index_select(0, row_flat), params_of([row]))
            except Exception as e:
                message = (entry.processor.message if isinstance(entry.processor, UnloadableProcessor) else
                           f"custom logit processor {type(entry.processor).__name__} failed: "
                           f"{type(e).__name__}: {e}")
                req = _request_of(sampling_batch_info.custom_params[row])
                logger.error("sglang-ext: %s (request %s); only this request stops",
                             message, getattr(req, "rid", "?"))
                if req is not None:
                    _finish_with_error(req, message, PROCESSOR_ERROR, HTTPStatus.BAD_REQUEST)
                continue
            logits.index_copy_(0, row_flat, result.to(logits.dtype))


def refuse_grammar_without_a_first_token(grammar, backend, *args, **kwargs):
    """A compiled grammar that allows no token at its start can never be satisfied: refused at
    compile time (HTTP 400 "Failed to compile ... grammar"), not found by the sampler mid-batch."""
    from sglang.srt.constrained.base_grammar_backend import InvalidGrammarObject  # heavy: ~700 modules

    matcher = getattr(grammar, "matcher", None)
    if matcher is None or matcher.is_terminated():
        return grammar
    mask = grammar.allocate_vocab_mask(grammar.vocab_size, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    if bool((mask != 0).any()):
        return grammar
    return InvalidGrammarObject("the grammar allows no token at its start, so no output can satisfy it "
                                "(e.g. a schema that only refers to itself, or a rule that never ends)")


def _sampleable_logits(original, sampler, logits, sampling_info, *args, **kwargs):
    """A grammar can leave a row without any allowed token (a schema whose only value is itself,
    `{"$ref": "#"}`; an EBNF rule that never ends; an EOS-only state under min_new_tokens): every
    logit -inf, softmax NaN, and the sampler's multinomial raised in the scheduler, which ended the
    server. Such rows sample from uniform logits instead; the grammar then refuses the token and
    upstream ends that request alone ("Grammar accept_token failed"). No host sync: the rows are
    found and rewritten on the device, for batches with a grammar only."""
    logits = original(sampler, logits, sampling_info, *args, **kwargs)
    if getattr(sampling_info, "grammars", None) and logits.numel():
        dead = ~torch.isfinite(logits.amax(dim=-1, keepdim=True))
        logits.masked_fill_(dead, 0.0)
    return logits


# -- the probe (scheduler) ------------------------------------------------------------------

class _ProbeFailures:
    """Forwards whose probe raised and whose results are not processed yet (scheduler thread only)."""

    pending = 0
    message = "SingProbe scoring failed"


def _score_or_nan(original, runtime, forward_batch, *args, **kwargs):
    try:
        return original(runtime, forward_batch, *args, **kwargs)
    except Exception as e:
        message = f"SingProbe scoring failed: {type(e).__name__}: {e}"
        logger.exception("sglang-ext: %s; the requests of this forward stop", message)
        _ProbeFailures.message = message
        _ProbeFailures.pending += 1
        rows = int(forward_batch.batch_size)
        return torch.full((rows, len(runtime.labels)), math.nan, dtype=torch.float32)


def _finish_unscored(processor, batch, result, *args, **kwargs):
    # Every step, not only after a raise: NaN scores from the numerics (or a replayed graph) must
    # not let a guarded request run on unscored. Cost: one pass over the rows SGLang already holds.
    rows = agreed_score_rows(result, batch)  # every scheduler of a TP / DP-attention group finishes the same ones
    if not rows:
        return
    unscored = [req for req, row in zip(batch.reqs, rows) if row_unscored(row)]
    if not unscored:
        return
    message = _ProbeFailures.message if _ProbeFailures.pending else "SingProbe scores are NaN for this request"
    for req in unscored:
        _finish_with_error(req, message, PROBE_ERROR, HTTPStatus.INTERNAL_SERVER_ERROR)
    _ProbeFailures.pending = 0


# -- OpenAI streams (HTTP process) ---------------------------------------------------------


async def _stream_failing_alone(original, serving, adapted_request, *args, **kwargs):
    stream = original(serving, adapted_request, *args, **kwargs)
    started = False
    try:
        async for chunk in stream:
            started = True
            yield chunk
    except Exception as e:
        if not started:
            raise  # upstream answers with an error response before any byte is sent
        message = f"stream failed: {type(e).__name__}: {e}"
        logger.exception("sglang-ext: %s; only this request stops", message)
        abort_owned(serving.tokenizer_manager, adapted_request)
        error = serving.create_streaming_error_response(message, err_type="InternalServerError",
                                                        status_code=500)
        yield f"data: {error}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()


# -- operator endpoints (scheduler) --------------------------------------------------------


def _expert_distribution_needs_mode(original, tokenizer_manager, *args, **kwargs):
    if getattr(tokenizer_manager.server_args, "expert_distribution_recorder_mode", None) is None:
        raise HTTPException(status_code=400, detail="expert distribution recording needs a server "
                            "started with --expert-distribution-recorder-mode")
    return original(tokenizer_manager, *args, **kwargs)


# OpenAI's bound on top_logprobs. Upstream took any count up to the vocabulary: 201088 a token blocked the
# server for 159 s and answered 315 MB.
OPENAI_TOP_LOGPROBS_MAX = 20
# The arguments the chat endpoint passes to apply_chat_template itself: the same key in a request's
# chat_template_kwargs raised "got multiple values for keyword argument" (a 500)
CHAT_TEMPLATE_OWN_ARGS = ("messages", "conversation", "tools", "add_generation_prompt", "tokenize", "return_dict")


def check_chat_request(result, serving, request, *args, **kwargs):
    if result:
        return result
    extra = getattr(request, "chat_template_kwargs", None) or {}
    taken = sorted(k for k in extra if k in CHAT_TEMPLATE_OWN_ARGS)
    if taken:
        return (f"chat_template_kwargs may not set {taken}: the endpoint passes them itself (messages, tools "
                "and the generation prompt come from the request's own fields)")
    top = getattr(request, "top_logprobs", None)
    if _is_int(top) and top > OPENAI_TOP_LOGPROBS_MAX:
        return f"top_logprobs must be at most {OPENAI_TOP_LOGPROBS_MAX}, got {top}"
    return _check_choices(request)


def _check_choices(request) -> str | None:
    # n = 0 answered "range() arg 3 must not be zero"; a negative n was served as one choice
    n = getattr(request, "n", None)
    return f"n must be at least 1, got {n}" if _is_int(n) and n < 1 else None


def check_completion_request(result, serving, request, *args, **kwargs):
    if result:
        return result
    top = getattr(request, "logprobs", None)
    if _is_int(top) and top > OPENAI_TOP_LOGPROBS_MAX:
        return f"logprobs must be at most {OPENAI_TOP_LOGPROBS_MAX}, got {top}"
    choices = _check_choices(request)
    if choices:
        return choices
    rid, prompt = getattr(request, "rid", None), getattr(request, "prompt", None)
    # A list of rids names the requests of a batch of prompts, one each (else a 500: unhashable). A list on
    # one prompt is refused where every endpoint's request is normalised (check_batch_lengths).
    batch = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else None
    if isinstance(rid, list) and batch is not None:
        if len(rid) != batch or not all(isinstance(r, str) for r in rid):
            return f"rid must be a string, or a list of strings with one per prompt: {batch} prompts, {len(rid)} rids"
    return None


def check_weights_load_format(tokenizer_manager, obj, *args, **kwargs):
    """/update_weights_from_disk: an unknown load_format raised in the scheduler and ended the server."""
    from sglang.srt.configs.load_config import LoadFormat  # heavy: ~150 modules

    load_format = getattr(obj, "load_format", None)
    known = [f.value for f in LoadFormat]
    if load_format is not None and load_format not in known:
        raise RequestRejected(f"unknown load_format {load_format!r}; the formats are {known}")


def check_memory_occupation(tokenizer_manager, obj, *args, **kwargs):
    """/release_memory_occupation, /resume_memory_occupation: an unknown tag (a KeyError) or a server
    without a GPU (its CUDA synchronise) raised in the scheduler and ended the server."""
    unknown = [t for t in (getattr(obj, "tags", None) or []) if t not in GPU_MEMORY_ALL_TYPES]
    if unknown:
        raise RequestRejected(f"unknown memory tag(s) {unknown}; the tags are {GPU_MEMORY_ALL_TYPES}")
    device = getattr(getattr(tokenizer_manager, "server_args", None), "device", None)
    if device == "cpu":
        raise RequestRejected("releasing or resuming memory occupation needs a GPU server; this one runs on the CPU")


def _weights_update_failing_alone(original, updater, recv_req, *args, **kwargs):
    try:
        return original(updater, recv_req, *args, **kwargs)
    except Exception as e:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqOutput  # heavy: ~2700 modules

        logger.exception("sglang-ext: update_weights_from_disk failed; the server keeps serving")
        return UpdateWeightFromDiskReqOutput(success=False, message=f"update failed: {type(e).__name__}: {e}")


def _memory_occupation_failing_alone(original, updater, recv_req, *args, **kwargs):
    # e.g. resuming a tag that was never released (KeyError before anything is resumed)
    try:
        return original(updater, recv_req, *args, **kwargs)
    except Exception as e:
        from sglang.srt.managers import io_struct  # heavy: ~2700 modules

        logger.warning("sglang-ext: %s failed: %s: %s", type(recv_req).__name__, type(e).__name__, e)
        name = type(recv_req).__name__.replace("ReqInput", "ReqOutput")
        return getattr(io_struct, name)()


def check_profile_output_dir(tokenizer_manager, req=None, *args, **kwargs):
    """/start_profile: an output_dir the server cannot write was accepted, and the scheduler's mkdir at
    the profile's end raised and ended the server."""
    folder = getattr(req, "output_dir", None)
    if not folder:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        writable = os.access(folder, os.W_OK | os.X_OK)
    except OSError as e:
        raise RequestRejected(f"profile output_dir {folder!r} cannot be created: {e}") from None
    if not writable:
        raise RequestRejected(f"profile output_dir {folder!r} is not writable by the server")


async def _profile_refusal_is_400(original, tokenizer_manager, req, *args, **kwargs):
    # The scheduler's refusal (e.g. /stop_profile with no profile running) came back as a RuntimeError: a 500.
    try:
        return await original(tokenizer_manager, req, *args, **kwargs)
    except RuntimeError as e:
        raise RequestRejected(str(e)) from None


def _profile_stop_failing_alone(original, manager, *args, **kwargs):
    try:
        return original(manager, *args, **kwargs)
    except Exception as e:
        from sglang.srt.managers.io_struct import ProfileReqOutput  # heavy: ~2700 modules

        logger.exception("sglang-ext: stopping the profile failed; the server keeps serving")
        manager.profile_in_progress = False  # a stop at every later batch would fail the same way
        return ProfileReqOutput(success=False, message=f"stopping the profile failed: {type(e).__name__}: {e}")


def _expert_distribution_failing_alone(original, scheduler, recv_req, *args, **kwargs):
    # Upstream: the recorder's raise (e.g. no recorder mode) ended the scheduler, from one GET.
    try:
        return original(scheduler, recv_req, *args, **kwargs)
    except Exception as e:
        from sglang.srt.managers.io_struct import ExpertDistributionReqOutput  # heavy: ~2700 modules

        logger.warning("sglang-ext: expert distribution request %s failed: %s: %s", getattr(recv_req, "action", None),
                       type(e).__name__, e)
        return ExpertDistributionReqOutput()


def register() -> None:
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                          _validate_request, HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
                          _type_errors_rejected, HookType.AROUND)
    HookRegistry.register("fastapi._compat.v2.ModelField.validate", _body_validator_crash_is_400,
                          HookType.AROUND)
    HookRegistry.register("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments",
                          check_batch_lengths, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments",
                          _unreadable_prompt_is_400, HookType.AROUND)
    HookRegistry.register("sglang.srt.entrypoints.openai.serving_tokenize.OpenAIServingDetokenize._validate_request",
                          check_detokenize_ids, HookType.AFTER)
    HookRegistry.register("sglang.srt.function_call.function_call_parser.FunctionCallParser.__init__",
                          check_tool_call_parser_name, HookType.BEFORE)
    HookRegistry.register("sglang.srt.parser.reasoning_parser.ReasoningParser.__init__",
                          check_reasoning_parser_name, HookType.BEFORE)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.configure_logging",
                          check_logging_config, HookType.BEFORE)
    HookRegistry.register("sglang.srt.layers.sampler.apply_custom_logit_processor",
                          apply_custom_logit_processor, HookType.REPLACE)
    HookRegistry.register("sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend._from_context",
                          refuse_grammar_without_a_first_token, HookType.AFTER)
    HookRegistry.register("sglang.srt.layers.sampler.Sampler._preprocess_logits", _sampleable_logits,
                          HookType.AROUND)
    HookRegistry.register("sglang.srt.sampling.custom_logit_processor.CustomLogitProcessor.from_str",
                          _from_str_or_stand_in, HookType.AROUND)
    HookRegistry.register("sglang_ext.probe_runtime.ProbeRuntime.score", _score_or_nan, HookType.AROUND)
    processor = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
    for step in ("process_batch_result_prefill", "process_batch_result_decode"):
        HookRegistry.register(f"{processor}.{step}", _finish_unscored, HookType.BEFORE)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.expert_distribution_handle",
                          _expert_distribution_failing_alone, HookType.AROUND)
    HookRegistry.register("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._validate_request",
                          check_chat_request, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._validate_request",
        check_completion_request, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.update_weights_from_disk",
                          check_weights_load_format, HookType.BEFORE)
    updater = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
    HookRegistry.register(f"{updater}.update_weights_from_disk", _weights_update_failing_alone, HookType.AROUND)
    for action in ("release", "resume"):
        HookRegistry.register(f"{updater}.{action}_memory_occupation", _memory_occupation_failing_alone,
                              HookType.AROUND)
        HookRegistry.register(
            f"sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.{action}_memory_occupation",
            check_memory_occupation, HookType.BEFORE)
    HookRegistry.register("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin.start_profile",
                          check_profile_output_dir, HookType.BEFORE)
    HookRegistry.register("sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin._execute_profile",
                          _profile_refusal_is_400, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.profiler_manager.SchedulerProfilerManager._stop_profile",
        _profile_stop_failing_alone, HookType.AROUND)
    mixin = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
    for action in ("start", "stop", "dump"):
        HookRegistry.register(f"{mixin}.{action}_expert_distribution_record", _expert_distribution_needs_mode,
                              HookType.AROUND)
    HookRegistry.register("sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._generate_chat_stream",
                          _stream_failing_alone, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._generate_completion_stream",
        _stream_failing_alone, HookType.AROUND)
