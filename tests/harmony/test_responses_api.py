"""patches/responses_api.py without a server.

The served checks (scores against the reference head, usage, the guard's stop, streamed, not
and in the background, a scripted Harmony output) are in test_probe_serving.py; its requests have
one generation turn and one streaming mode. Here: a scripted event stream, with the engine's (cumulative) scores growing
between events the way the tokenizer manager delivers them (every event carries the scores decoded
since the previous event that carried any, none twice, none lost, the final event the whole list);
the record (turns, both streaming modes, another request reusing the id); the guard's status and
details; NaN rows as JSON null; the streaming context's usage across a built-in tool's turn.
"""

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from sglang_ext.patches import openai_probe_scores, responses_api
from sglang_ext.probe import SCORES_KEY

GUARD = {"type": "content_filter", "label": "label_8", "score": 0.97, "threshold": 0.9, "message": "m"}
GUARD_DETAILS = {"reason": "content_filter", "label": "label_8", "score": 0.97, "threshold": 0.9}


def sse(event_type, **fields):
    return f"event: {event_type}\ndata: {json.dumps({'type': event_type, **fields})}\n\n"


def score(i):
    return {"label_0": i / 10, "label_1": 1 - i / 10}


def strict_json(text):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


class Serving:
    aborted: list = []

    class tokenizer_manager:  # noqa: N801
        rid_to_state: dict = {}

        @staticmethod
        def abort_request(rid):
            Serving.aborted.append(rid)


def run_stream(script, finish_reason=None):
    """`script`: ("turn", None) starts a generation turn; (ids, event) says the engine has delivered the
    scores of tokens `ids` in this turn so far (cumulative), then yields `event` (None: no event for
    those tokens). `finish_reason`: the engine's, known before the final event. Returns the events
    as the client receives them, each as (event line, payload) or as the raw text."""
    record = responses_api.ResponseRecord("resp_test")
    record.finish_reason = finish_reason

    async def events():
        turn = None
        for delivered, event in script:
            if delivered == "turn":
                turn = record.new_turn(None)
                continue
            record.update(turn, {SCORES_KEY: [score(i) for i in delivered]}, incremental=False)
            if event is not None:
                yield event

    async def collect():
        return [e async for e in responses_api._stream_with_scores(Serving(), events(), record)]

    out = asyncio.run(collect())
    return [(e.split("\n", 1)[0], strict_json(e.split("data: ", 1)[1])) if e.startswith("event: ") else e
            for e in out]


def test_each_event_carries_the_scores_since_the_previous_one():
    final = sse("response.completed", response={"status": "completed"})
    script = [("turn", None),
              ([], sse("response.created", response={})),
              ([0, 1], sse("response.output_text.delta", delta="a")),
              ([0, 1, 2], None),  # a markup token: no event of its own
              ([0, 1, 2, 3], sse("response.output_text.delta", delta="b")),
              ([0, 1, 2, 3], sse("response.output_text.done", text="ab")),
              ("turn", None),  # a built-in tool's second generation turn
              ([0], None),
              ([0, 1], final)]
    got = run_stream(script)
    carried = [p.get(SCORES_KEY) for _, p in got]
    assert carried == [None, [score(0), score(1)], [score(2), score(3)], None, [score(0), score(1)]]
    assert got[-1][1]["response"][SCORES_KEY] == [score(i) for i in (0, 1, 2, 3, 0, 1)]
    assert got[-1][1]["response"]["status"] == "completed" and got[-1][0] == "event: response.completed"
    assert [p["type"] for _, p in got] == ["response.created", "response.output_text.delta",
                                           "response.output_text.delta", "response.output_text.done",
                                           "response.completed"]


def test_scores_delivered_after_the_last_text_event_ride_the_final_event():
    script = [("turn", None), ([0], sse("response.output_text.delta", delta="a")), ([0, 1, 2], None),
              ([0, 1, 2], sse("response.incomplete", response={"status": "incomplete"}))]
    got = run_stream(script)
    assert got[-1][1][SCORES_KEY] == [score(1), score(2)]
    assert got[-1][1]["response"][SCORES_KEY] == [score(0), score(1), score(2)]


def test_scores_are_not_lost_on_events_that_are_not_json_objects():
    odd = ["data: [DONE]\n\n", ": keep-alive\n\n", "event: x\ndata: [1, 2]\n\n"]
    script = [("turn", None), ([0], odd[0]), ([0, 1], odd[1]), ([0, 1], odd[2]),
              ([0, 1, 2], sse("response.output_text.delta", delta="a"))]
    got = run_stream(script)
    assert got[:3] == [odd[0], odd[1], ("event: x", [1, 2])]
    assert got[3][1][SCORES_KEY] == [score(0), score(1), score(2)]


def test_an_exception_inside_the_stream_ends_it_with_an_error_event_and_aborts_the_request():
    class Boom:
        def __init__(self):
            self.sent = 0

        def __aiter__(self):
            return self

        async def __anext__(self):
            self.sent += 1
            if self.sent == 3:
                raise ValueError("Harmony rewrote previously emitted tool input")
            return sse("response.output_text.delta", delta="a", sequence_number=self.sent + 4)

    # The stream's own engine request holds the rid, then another client's does (a duplicate request_id,
    # refused before this stream registered any): only the first is aborted.
    own, other = SimpleNamespace(rid="resp_boom"), SimpleNamespace(rid="resp_boom")
    for holder, aborted in ((own, ["resp_boom"]), (other, [])):
        Serving.aborted.clear()
        Serving.tokenizer_manager.rid_to_state = {"resp_boom": SimpleNamespace(obj=holder)}
        record = responses_api.ResponseRecord("resp_boom")
        record.new_turn(own)

        async def collect():
            return [e async for e in responses_api._stream_with_scores(Serving(), Boom(), record)]

        out = asyncio.run(collect())
        assert len(out) == 3 and out[-1].startswith("event: error\n")
        error = strict_json(out[-1].split("data: ", 1)[1])
        assert error == {"type": "error", "code": "invalid_request_error", "param": None, "sequence_number": 7,
                         "message": "ValueError: Harmony rewrote previously emitted tool input"}
        assert Serving.aborted == aborted


def test_the_guard_stop_is_incomplete_with_its_details_and_ends_the_tool_loop():
    def upstream_status(reason):
        return "incomplete" if (reason or {}).get("type") == "length" else "completed"

    assert responses_api._status_with_guard(upstream_status, GUARD) == "incomplete"
    assert responses_api._status_with_guard(upstream_status, {"type": "stop"}) == "completed"
    assert responses_api._status_with_guard(upstream_status, {"type": "length"}) == "incomplete"

    class Response:  # what upstream's _build_response makes of an incomplete status
        def __init__(self, status):
            self.status = status
            self.incomplete_details = {"reason": "max_output_tokens"} if status == "incomplete" else None

    def built(reason, status):
        record = responses_api.ResponseRecord("resp_x")
        record.finish_reason = reason
        token = responses_api._current.set(record)
        try:
            return responses_api._response_with_guard_details(Response, status)
        finally:
            responses_api._current.reset(token)

    assert built(GUARD, "incomplete").incomplete_details == GUARD_DETAILS
    assert built({"type": "length"}, "incomplete").incomplete_details == {"reason": "max_output_tokens"}
    assert built(GUARD, "in_progress").incomplete_details is None  # only the final, incomplete one

    class Context:
        finish_reason = GUARD

        def need_builtin_tool_call(self):
            return True

    assert responses_api._no_tool_turn_after_guard(Context.need_builtin_tool_call, Context()) is False
    Context.finish_reason = {"type": "stop"}
    assert responses_api._no_tool_turn_after_guard(Context.need_builtin_tool_call, Context()) is True


def test_record_turns_both_streaming_modes_and_sticky_guard():
    for incremental in (False, True):
        record = responses_api.ResponseRecord("r")
        turn = record.new_turn(None)
        so_far = []
        for chunk in ([0, 1], [2], [3, 4, 5]):
            so_far += chunk
            record.update(turn, {SCORES_KEY: [score(i) for i in (chunk if incremental else so_far)]}, incremental)
        turn2 = record.new_turn(None)  # a built-in tool's next turn: its cumulative scores start again
        record.update(turn2, {SCORES_KEY: [score(9)]}, incremental)
        record.update(turn2, {SCORES_KEY: [score(8)] if incremental else [score(9), score(8)]}, incremental)
        assert record.scores == [score(i) for i in (0, 1, 2, 3, 4, 5, 9, 8)]
    record.update(turn, {"finish_reason": GUARD}, False)
    record.update(turn2, {"finish_reason": {"type": "stop"}}, False)  # a later turn's stop
    assert responses_api.guard_details(record.finish_reason) == GUARD_DETAILS


def test_only_the_requests_own_engine_calls_fill_its_record():
    class Req:
        def __init__(self, rid):
            self.rid = rid

    async def engine(self, obj):
        for n in (1, 2):
            yield {"meta_info": {SCORES_KEY: [score(i) for i in range(n)],
                                 "finish_reason": GUARD if n == 2 else None}}

    async def drain(obj):
        return [c async for c in openai_probe_scores._generate_request_recording_scores(engine, None, obj)]

    record = responses_api.ResponseRecord("resp_a")
    token = responses_api._current.set(record)
    try:
        asyncio.run(drain(Req("resp_a")))
        asyncio.run(drain(Req("resp_b")))  # another request in the same task
        asyncio.run(drain(Req(["resp_a"])))  # a batch
    finally:
        responses_api._current.reset(token)
    assert record.scores == [score(0), score(1)] and record.finish_reason == GUARD
    asyncio.run(drain(Req("resp_a")))  # outside the request: the id alone does not find the record
    assert record.scores == [score(0), score(1)]


def test_non_finite_scores_are_json_null():
    bad = [{"label_0": math.nan, "label_1": 0.5}, {"label_0": math.inf, "label_1": 0.25}]
    record = responses_api.ResponseRecord("r")
    record.update(record.new_turn(None), {SCORES_KEY: bad}, False)
    event, attached = responses_api._event_with(
        sse("response.completed", response={"status": "completed"}), bad, record)
    payload = strict_json(event.split("data: ", 1)[1])
    assert attached and payload[SCORES_KEY] == payload["response"][SCORES_KEY] == [
        {"label_0": None, "label_1": 0.5}, {"label_0": None, "label_1": 0.25}]
    chunk = 'data: {"choices": [{"index": 0, "delta": {}}]}\n\n'
    out = openai_probe_scores._with_scores(chunk, 0, bad)
    assert strict_json(out[len("data: "):])["choices"][0][SCORES_KEY][0] == {"label_0": None, "label_1": 0.5}


def test_streamed_usage_and_parser_input_across_a_tool_turn():
    from openai_harmony import Author, Message, Role
    from sglang.srt.entrypoints.context import StreamingHarmonyContext

    from sglang_ext.harmony.encoding import harmony_encoding

    harmony_encoding()  # the offline vocabulary for SGLang's own loader
    append = StreamingHarmonyContext.append_output
    append = getattr(append, "__wrapped__", append)  # upstream's, even if this process applied the hooks
    ctx = StreamingHarmonyContext([], {})
    fed = []
    ctx.parser = type("Parser", (), {"process": lambda self, tok: fed.append(tok)})()

    def engine_output(ids, prompt=50, cached=7):
        return {"output_ids": ids, "meta_info": {"completion_tokens": len(ids), "prompt_tokens": prompt,
                                                 "cached_tokens": cached}}

    for ids in ([101, 102, 103], [101, 102, 103, 104, 105]):  # cumulative, as without incremental output
        responses_api._streaming_append_with_usage(append, ctx, engine_output(ids))
    tool = Message.from_author_and_content(Author.new(Role.TOOL, "browser.search"), "result")
    responses_api._streaming_append_with_usage(append, ctx, [tool])
    tool_tokens = fed[5:]
    for ids in ([201, 202], [201, 202, 203]):
        responses_api._streaming_append_with_usage(append, ctx, engine_output(ids, prompt=80, cached=60))
    assert fed == [101, 102, 103, 104, 105, *tool_tokens, 201, 202, 203]  # upstream lost 201 and 202
    assert (ctx.num_output_tokens, ctx.num_prompt_tokens, ctx.num_cached_tokens) == (8, 80, 60)


@pytest.mark.parametrize("model,want", [(None, "served"), ("named", "named")])
def test_a_request_without_model_means_the_served_one(model, want):
    class Request:
        request_id = None

    class Serving:
        tokenizer_manager = type("TM", (), {"served_model_name": "served"})()

    async def create(serving, request):
        return request.model

    request = Request()
    request.model = model
    assert asyncio.run(responses_api._create_responses_with_scores(create, Serving(), request)) == want


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_non_streamed_scores_keep_the_response_type(kind):
    """The scored response is still a ChatCompletionResponse / CompletionResponse (the Anthropic /v1/messages
    handler calls the chat handler and answered "Request failed" to anything else) and writes upstream's JSON
    plus one score list per choice (null where a probe step failed)."""
    from sglang.srt.entrypoints.openai import protocol as p
    from sglang.srt.utils.json_response import model_json_response

    if kind == "chat":
        cls = p.ChatCompletionResponse
        choices = [p.ChatCompletionResponseChoice(index=i, message=p.ChatMessage(role="assistant", content=f"c{i}"),
                                                  finish_reason="stop") for i in range(2)]
    else:
        cls = p.CompletionResponse
        choices = [p.CompletionResponseChoice(index=i, text=f"c{i}", finish_reason="length") for i in range(2)]
    usage = p.UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)
    plain = cls(id="x", model="m", choices=choices, usage=usage)
    scores = [[{"label_0": 0.25}], [{"label_0": math.nan}]]
    ret = [{"meta_info": {SCORES_KEY: s}} for s in scores]
    scored = openai_probe_scores._response_with_scores(lambda *a, **k: plain, None, None, ret, 0)
    assert isinstance(scored, cls)
    got = strict_json(model_json_response(scored).body)
    want = strict_json(model_json_response(plain).body)
    assert [c.pop(SCORES_KEY) for c in got["choices"]] == [[{"label_0": 0.25}], [{"label_0": None}]]
    assert got == want
    no_probe = openai_probe_scores._response_with_scores(lambda *a, **k: plain, None, None, [{"meta_info": {}}], 0)
    assert no_probe is plain


def test_a_request_id_that_names_a_stored_response_is_refused():
    """With the response store on, upstream stored a second response with a reused request_id over the first;
    here it is a 400, before anything runs. A new id, or store=False, runs as before."""
    class Request:
        model = "m"
        store = True

    class Serving:
        enable_response_store = True
        response_store = {"resp_old": object()}
        response_store_lock = asyncio.Lock()

        def create_error_response(self, message):
            return ("400", message)

    async def create(serving, request):
        return "ran"

    request = Request()
    for rid, store, want in (("resp_old", True, "400"), ("resp_new", True, "ran"), ("resp_old", False, "ran")):
        request.request_id, request.store = rid, store
        got = asyncio.run(responses_api._create_responses_with_scores(create, Serving(), request))
        if want == "400":
            assert got[0] == "400" and "'resp_old' already names a stored response" in got[1], got
        else:
            assert got == want
