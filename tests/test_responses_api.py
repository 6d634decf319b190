"""patches/responses_api.py without a server: how a /v1/responses stream's events get their scores.

The served checks (scores against the reference head, usage, the guard's stop, streamed and not)
are in test_probe_serving.py; the tiny model's random tokens rarely form Harmony messages, so
there the scores mostly arrive with the final event. Here a scripted event stream, with the
engine's (cumulative) scores growing between events the way the tokenizer manager delivers
them, checks the alignment: every event carries the scores decoded since the previous event
that carried any, none twice, none lost, and the final event the whole list.
"""

import asyncio
import json

from sglang_ext.patches import responses_api
from sglang_ext.probe import SCORES_KEY


def sse(event_type, **fields):
    return f"event: {event_type}\ndata: {json.dumps({'type': event_type, **fields})}\n\n"


def score(i):
    return {"label_0": i / 10, "label_1": 1 - i / 10}


class Stored:
    """A response in the server's store."""
    status, incomplete_details = "completed", None


def run_stream(script, finish_reason=None, stored=None):
    """`script`: ("turn", None) starts a generation turn; (ids, event) says the engine has delivered the
    scores of tokens `ids` in this turn so far (cumulative, as the tokenizer manager streams them), then
    yields `event` (None: no event for those tokens). `finish_reason`: the engine's, known before the
    final event. Returns the events as the client receives them, each as (event line, payload or the raw
    text)."""
    rid = "resp_test"
    serving = type("Serving", (), {"response_store": {rid: stored} if stored else {}})()
    record = responses_api._records[rid] = responses_api.ResponseRecord()
    record.finish_reason = finish_reason

    async def events():
        turn = None
        for delivered, event in script:
            if delivered == "turn":
                turn = record.new_turn()
                continue
            turn[:] = [score(i) for i in delivered]
            if event is not None:
                yield event

    async def collect():
        return [e async for e in responses_api._stream_with_scores(serving, events(), record, rid)]

    out = asyncio.run(collect())
    assert rid not in responses_api._records  # the record ends with its stream
    return [(e.split("\n", 1)[0], json.loads(e.split("data: ", 1)[1])) if e.startswith("event: ") else e
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


def test_a_guard_stop_turns_the_final_event_incomplete_here_and_in_the_store():
    reason = {"type": "content_filter", "label": "label_8", "score": 0.97, "threshold": 0.9, "message": "m"}
    stored = Stored()
    script = [("turn", None), ([0], sse("response.output_text.delta", delta="a")),
              ([0, 1], sse("response.completed", response={"status": "completed", "incomplete_details": None}))]
    got = run_stream(script, finish_reason=reason, stored=stored)
    want = {"reason": "content_filter", "label": "label_8", "score": 0.97, "threshold": 0.9}
    head, payload = got[-1]
    assert head == "event: response.incomplete" and payload["type"] == "response.incomplete"
    assert payload["response"]["status"] == "incomplete" and payload["response"]["incomplete_details"] == want
    assert (stored.status, stored.incomplete_details) == ("incomplete", want)
    # Any other finish leaves both as they were.
    stored = Stored()
    got = run_stream(script, finish_reason={"type": "length", "length": 2}, stored=stored)
    assert got[-1][0] == "event: response.completed" and stored.status == "completed"


def test_scores_are_not_lost_on_events_that_are_not_json_objects():
    odd = ["data: [DONE]\n\n", ": keep-alive\n\n", "event: x\ndata: [1, 2]\n\n"]
    script = [("turn", None), ([0], odd[0]), ([0, 1], odd[1]), ([0, 1], odd[2]),
              ([0, 1, 2], sse("response.output_text.delta", delta="a"))]
    got = run_stream(script)
    assert got[:3] == [odd[0], odd[1], ("event: x", [1, 2])]
    assert got[3][1][SCORES_KEY] == [score(0), score(1), score(2)]
