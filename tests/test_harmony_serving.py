"""Harmony end to end: a real CPU server, the official openai SDK, scripted gpt-oss output.

The tiny checkpoint's weights are random, so the assistant tokens are forced through SGLang's
custom logit processor (``sglang_ext.harmony.forced_tokens``) to a Harmony sequence rendered by
openai-harmony. What the client receives (reasoning_content, content, streamed tool_calls,
finish_reason) must be what the documented mapping derives from openai-harmony's parse of that
sequence, or of the sequence the model meant where the script is malformed on purpose. The
server runs with the tiny SingProbe, so every token must still carry one score however the
parsers chunk the text. One server (module scope), started with the flags users already pass:
``--reasoning-parser gpt-oss --tool-call-parser gpt-oss``.
"""

from __future__ import annotations

import datetime

import openai
import pytest
from openai_harmony import Conversation, DeveloperContent, Message, Role, SystemContent, ToolDescription
from test_harmony_parser import (assistant, call, completion_tokens, enc, openai_view, raw, tool_result)

from sglang_ext.launch.server import SGLangServer

pytestmark = pytest.mark.server

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": CITY}}]
QUESTION = [{"role": "user", "content": "Weather in Paris and Rome?"}]


@pytest.fixture(scope="module")
def tiny_probe(tiny_checkpoints):
    from sglang_ext.launch.make_tiny_probe import generate

    return generate(str(tiny_checkpoints["fp32"].parent / "probe"), base_dir=str(tiny_checkpoints["fp32"]),
                    log=lambda *_: None)


@pytest.fixture(scope="module")
def server(tiny_checkpoints, tiny_probe, vocab_dir):
    args = ["--dtype", "float32", "--probe-ckpt", tiny_probe, "--enable-custom-logit-processor",
            "--reasoning-parser", "gpt-oss", "--tool-call-parser", "gpt-oss"]
    with SGLangServer(tiny_checkpoints["fp32"], args, vocab_dir=vocab_dir) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)


def scripted(client, ids, stream, messages=QUESTION, max_tokens=None, **extra):
    from sglang_ext.harmony.forced_tokens import PARAM, ForcedTokens

    body = {"custom_logit_processor": ForcedTokens.to_str(), "custom_params": {PARAM: list(ids)}, **extra}
    kwargs = {"stream_options": {"include_usage": True}} if stream else {}
    return client.chat.completions.create(model="default", messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=max_tokens or len(ids) + 8, stream=stream,
                                          extra_body=body, **kwargs)


def collect(chunks):
    """What a streaming client assembles, plus the shape of every tool-call delta."""
    got = {"reasoning": "", "content": "", "calls": {}, "call_deltas": [], "finish": None, "scores": 0,
           "usage": None}
    for chunk in chunks:
        got["usage"] = chunk.usage or got["usage"]
        for choice in chunk.choices:
            got["scores"] += len((choice.model_extra or {}).get("token_probe_probs") or [])
            delta = choice.delta
            got["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            got["content"] += delta.content or ""
            for tc in delta.tool_calls or []:
                got["call_deltas"].append(tc)
                entry = got["calls"].setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            got["finish"] = choice.finish_reason or got["finish"]
    got["calls"] = [tuple(got["calls"][i]) for i in sorted(got["calls"])]
    return got


def test_streamed_reasoning_preamble_and_tool_call(client):
    meant = [assistant("The user wants the weather. Call the tool.", "analysis"),
             assistant("Let me look that up.", "commentary"),
             call("functions.get_weather", '{"city": "Paris", "unit": "celsius"}')]
    ids = completion_tokens(meant)
    assert ids[-1] == 200012  # <|call|>: generation stops there, as with the real model
    got = collect(scripted(client, ids, stream=True))
    want_reasoning, want_content, want_calls = openai_view(enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT))
    assert (got["reasoning"], got["content"], got["calls"]) == (want_reasoning, want_content, want_calls)
    assert got["finish"] == "tool_calls"
    first, rest = got["call_deltas"][0], got["call_deltas"][1:]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert len(rest) > 1, "arguments stream as they decode, not as one piece"
    assert all(d.id is None and d.function.name is None for d in rest)
    # One probe score per generated token, whatever the parsers held back.
    assert got["scores"] == got["usage"].completion_tokens == len(ids)


def test_non_streamed_matches_streamed(client):
    meant = [assistant("Plan: one call.", "analysis"), call("functions.get_weather", '{"city":"Rome"}')]
    ids = completion_tokens(meant)
    response = scripted(client, ids, stream=False)
    choice = response.choices[0]
    message = choice.message
    want_reasoning, want_content, want_calls = openai_view(enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT))
    assert (message.model_extra or {}).get("reasoning_content") == want_reasoning
    assert (message.content or "") == want_content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == want_calls
    assert choice.finish_reason == "tool_calls"
    assert len((choice.model_extra or {})["token_probe_probs"]) == response.usage.completion_tokens == len(ids)


def test_several_calls_and_malformed_ones_are_recovered(client):
    # ignore_eos lets the stream run past <|call|>: two calls, the second one malformed the way
    # gpt-oss writes them in the wild (analysis channel, recipient twice, no <|constrain|>), and a
    # final answer without its <|message|> token.
    good = completion_tokens([assistant("Two cities, two calls.", "analysis"),
                              call("functions.get_weather", '{"city":"Paris"}')])
    bad = raw('<|start|>assistant<|channel|>analysis to=functions.get_weather to=functions.get_weather code'
              '<|message|>{"city":"Rome"}<|call|><|start|>assistant<|channel|>final Paris sunny, Rome rainy.'
              '<|return|>')
    meant = completion_tokens([assistant("Two cities, two calls.", "analysis"),
                               call("functions.get_weather", '{"city":"Paris"}'),
                               call("functions.get_weather", '{"city":"Rome"}', channel="analysis", content_type="code"),
                               assistant("Paris sunny, Rome rainy.", "final")])
    ids = good + bad
    got = collect(scripted(client, ids, stream=True, max_tokens=len(ids), ignore_eos=True))
    assert (got["reasoning"], got["content"], got["calls"]) == openai_view(
        enc().parse_messages_from_completion_tokens(meant, Role.ASSISTANT))
    assert [d.index for d in got["call_deltas"] if d.id] == [0, 1]
    assert got["scores"] == got["usage"].completion_tokens == len(ids)


def test_without_reasoning_separation_content_has_all_text_and_no_markup(client):
    ids = completion_tokens([assistant("Thinking about it.", "analysis"), assistant("It is sunny.", "final")])
    got = collect(scripted(client, ids, stream=True, separate_reasoning=False))
    assert got["reasoning"] == "" and got["content"] == "Thinking about it.It is sunny."
    assert got["finish"] == "stop"


def test_multi_turn_tool_results_are_rendered_as_openai_harmony_renders_them(client):
    history = QUESTION + [
        {"role": "assistant", "content": "", "reasoning_content": "Two calls.",
         "tool_calls": [{"id": "call_a", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                        {"id": "call_b", "type": "function",
                         "function": {"name": "get_time", "arguments": '{"city":"Rome"}'}}]},
        # Answered out of order: each result is attributed by its tool_call_id.
        {"role": "tool", "tool_call_id": "call_b", "content": "17:05"},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "clear", "temp": 21}'},
    ]
    response = scripted(client, [enc().encode("ok")[0]], stream=False, messages=history, max_tokens=1,
                        return_prompt_token_ids=True)
    served = response.choices[0].model_extra["prompt_token_ids"]
    conversation = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(
            datetime.date.today().isoformat())),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_function_tools(
            [ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                 parameters=t["function"]["parameters"]) for t in TOOLS])),
        Message.from_role_and_content(Role.USER, QUESTION[0]["content"]),
        assistant("Two calls.", "analysis"),
        call("functions.get_weather", '{"city":"Paris"}'),
        call("functions.get_time", '{"city":"Rome"}'),
        tool_result("functions.get_time", "17:05"),
        tool_result("functions.get_weather", '{"sky": "clear", "temp": 21}'),
    ])
    want = enc().render_conversation_for_completion(conversation, Role.ASSISTANT)
    assert served == list(want)


def test_unscripted_output_streamed_and_not_is_the_parse_of_its_tokens(client):
    # The tiny model's own (random) output: special tokens anywhere. Served streamed and not,
    # it must be what our parser makes of the very tokens the server generated, every token scored.
    from sglang_ext.harmony.streaming import OpenAIHarmonyStream

    kwargs = dict(model="default", messages=[{"role": "user", "content": "Say something."}], tools=TOOLS,
                  max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    choice = full.choices[0]
    ids = choice.model_extra["response_token_ids"]
    want = OpenAIHarmonyStream()
    want.feed(ids)
    want.finish()
    want_calls = [(c.name, c.arguments) for c in want.tool_calls]
    assert len(choice.model_extra["token_probe_probs"]) == full.usage.completion_tokens == len(ids)
    assert ((choice.message.model_extra or {}).get("reasoning_content") or "") == want.reasoning
    assert (choice.message.content or "") == want.content
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == want_calls
    got = collect(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert (got["reasoning"], got["content"], got["calls"]) == (want.reasoning, want.content, want_calls)
    assert got["scores"] == got["usage"].completion_tokens == len(ids)
