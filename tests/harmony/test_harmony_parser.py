"""The Harmony parser (sglang_ext.harmony) against openai-harmony, its own oracle.

- Round trips: assistant output and whole conversations rendered by openai-harmony are fed
  token by token, whole and in random chunks; the messages equal openai-harmony's own parse,
  and the OpenAI view (reasoning_content, content, streamed tool_calls) is the one the
  documented rule derives from that parse.
- Regression fixtures of real-world malformed output: each is compared with openai-harmony's
  parse of the output the model meant (rendered by openai-harmony), and where openai-harmony
  itself raises on the malformed tokens, that is asserted too.
- A hypothesis fuzz over random token sequences with special tokens mixed in: nothing raises,
  the chunking does not matter, and every decoded character of every non-special token is
  accounted for (in a message's content or its header text) exactly once, in order.

CPU only, no server.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import (Author, Conversation, DeveloperContent, HarmonyError, Message, Role,
                            SystemContent, ToolDescription)

from sglang_ext.harmony.encoding import (CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START,
                                         harmony_encoding)
from sglang_ext.harmony.parser import HarmonyStreamParser
from sglang_ext.harmony.streaming import OpenAIHarmonyStream, Route


@pytest.fixture(scope="module", autouse=True)
def _vocab(vocab_dir):
    import os

    from sglang_ext.launch.tokenizer import harmony_env

    for k, v in harmony_env(vocab_dir).items():
        os.environ.setdefault(k, v)


def enc():
    return harmony_encoding()


# -- conversations, built with openai-harmony -------------------------------------------------

WEATHER = ToolDescription.new("get_weather", "Current weather in a city",
                              parameters={"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]})


def assistant(text, channel):
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def call(recipient, args, channel="commentary", content_type="<|constrain|>json"):
    m = assistant(args, channel).with_recipient(recipient)
    return m.with_content_type(content_type) if content_type else m


def tool_result(name, text):
    return (Message.from_author_and_content(Author.new(Role.TOOL, name), text)
            .with_recipient("assistant").with_channel("commentary"))


OUTPUTS = {
    "reasoning_final": [assistant("The user asks 2+2. That is 4.", "analysis"),
                        assistant("The answer is **4**.", "final")],
    "single_call": [assistant("Need the weather tool.", "analysis"),
                    call("functions.get_weather", '{"city": "Paris"}')],
    "parallel_calls": [assistant("Two cities, two calls.", "analysis"),
                       call("functions.get_weather", '{"city":"Paris"}'),
                       call("functions.get_weather", '{"city":"Rome"}')],
    "preamble_then_call": [assistant("Plan: look it up.", "analysis"),
                           assistant("Let me check the weather for you.", "commentary"),
                           call("functions.get_weather", '{"city": "Tōkyō"}')],
    "unicode_final": [assistant("Währung? 日本語, emoji 🤖.", "analysis"),
                      assistant("Ça coûte 5 € — 🤖🤖\n\n- 一\n- 二", "final")],
    "builtin_tools": [call("browser.search", '{"query": "weather Paris", "topn": 3}', content_type=None),
                      call("python", "print(2 + 2)", channel="analysis", content_type="code")],
}


def completion_tokens(messages):
    """What the model generates after a prompt ending in <|start|>assistant: harmony's rendering,
    with the last final message closed by <|return|> as the model does."""
    ids = []
    for m in messages:
        ids += enc().render(m)
    prefix = [START] + enc().encode("assistant")
    assert ids[:len(prefix)] == prefix
    ids = ids[len(prefix):]
    if messages[-1].channel == "final":
        assert ids[-1] == END
        ids[-1] = RETURN
    return ids


def multi_turn_tokens():
    system = SystemContent.new().with_conversation_start_date("2025-08-05")
    developer = DeveloperContent.new().with_instructions("Answer briefly.").with_function_tools([WEATHER])
    messages = [
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris and Rome?"),
        assistant("Two calls needed.", "analysis"),
        call("functions.get_weather", '{"city":"Paris"}'),
        call("functions.get_weather", '{"city":"Rome"}'),
        tool_result("functions.get_weather", '{"temp": 21, "sky": "clear"}'),
        tool_result("functions.get_weather", "light rain, 17 °C"),
        assistant("Paris: clear, 21 °C. Rome: light rain, 17 °C.", "final"),
        Message.from_role_and_content(Role.USER, "Thanks!"),
    ]
    return enc().render_conversation(Conversation.from_messages(messages))


def key(m):
    """The fields a parse must agree on, from an openai-harmony Message or our HarmonyMessage."""
    if isinstance(m, Message):
        text = "".join(c.text for c in m.content)
        return (m.author.role.value, m.author.name, m.channel, m.recipient, m.content_type, text)
    return (m.role, m.name, m.channel, m.recipient, m.content_type, m.content)


def chunkings(ids, seed):
    rng = random.Random(seed)
    yield "one_by_one", [[t] for t in ids]
    yield "whole", [ids]
    for k in range(3):
        out, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 9)
            out.append(ids[i:i + n])
            i += n
        yield f"random{k}", out


def parse_chunks(chunks, role="assistant"):
    p = HarmonyStreamParser(role)
    for c in chunks:
        p.feed(c)
    p.finish()
    return p


def openai_view(messages):
    """The documented rule, applied to openai-harmony's messages: analysis -> reasoning, a message
    with a recipient -> a tool call (functions.x -> x), everything else -> content."""
    def text(m):
        return "".join(c.text for c in m.content)

    calls = [(m.recipient[len("functions."):] if m.recipient.startswith("functions.") else m.recipient, text(m))
             for m in messages if m.recipient and m.recipient != "assistant"]
    reasoning = "".join(text(m) for m in messages if not m.recipient and m.channel == "analysis")
    content = "".join(text(m) for m in messages if not m.recipient and m.channel != "analysis")
    return reasoning, content, calls


def stream_view(chunks, route=Route()):
    """Feed an OpenAIHarmonyStream chunk by chunk, collecting what a client would receive."""
    s = OpenAIHarmonyStream(route)
    reasoning, content, calls = "", "", {}
    for i, c in enumerate(chunks + [None]):
        if c is None:
            s.finish()
        else:
            s.feed(c)
        reasoning += s.take_reasoning()
        content += s.take_content()
        for d in s.take_tool_call_deltas():
            if d.index not in calls:
                assert d.name is not None, "the first delta of a call carries its name"
                calls[d.index] = [d.name, ""]
            else:
                assert d.name is None, "only the first delta of a call carries its name"
            calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls)))
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], s


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_assistant_output_round_trip(name):
    ids = completion_tokens(OUTPUTS[name])
    want = enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    assert [key(m) for m in want] == [key(m) for m in OUTPUTS[name]]  # the oracle reads back what it wrote
    want_view = openai_view(want)
    for how, chunks in chunkings(ids, seed=len(name)):
        p = parse_chunks(chunks)
        assert [key(m) for m in p.messages] == [key(m) for m in want], how
        assert p.repairs == [], how
        reasoning, content, calls, s = stream_view(chunks)
        assert (reasoning, content, calls) == want_view, how
        assert all(c.complete for c in s.tool_calls)


def test_multi_turn_conversation_with_tool_results_round_trip():
    ids = multi_turn_tokens()
    want = enc().parse_messages_from_completion_tokens(ids, None)
    assert [m.author.role for m in want].count(Role.TOOL) == 2
    for how, chunks in chunkings(ids, seed=7):
        p = parse_chunks(chunks, role=None)
        assert [key(m) for m in p.messages] == [key(m) for m in want], how
        assert p.repairs == [], how


def test_reasoning_not_separated_and_calls_not_parsed_keep_all_text():
    ids = completion_tokens(OUTPUTS["preamble_then_call"])
    want = enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    everything = "".join(c.text for m in want for c in m.content)
    reasoning, content, calls, _ = stream_view([[t] for t in ids], Route(separate_reasoning=False, calls="inline"))
    assert (reasoning, content, calls) == ("", everything, [])
    reasoning, content, calls, _ = stream_view([ids], Route(separate_reasoning=True, calls="inline"))
    analysis, preamble, call_body = (m.content[0].text for m in want)
    assert (reasoning, content, calls) == (analysis + call_body, preamble, [])


def test_calls_as_markup_are_read_back_by_a_text_parser():
    # A text-only tool-call parser downstream of a text-only reasoning parser gets the calls as
    # canonical Harmony markup; parsing that text again gives the same calls.
    ids = completion_tokens(OUTPUTS["parallel_calls"])
    _, content, _, _ = stream_view([ids], Route(calls="markup"))
    again = OpenAIHarmonyStream(Route())
    again.feed_text(content)
    again.finish()
    assert [(c.name, c.arguments) for c in again.tool_calls] == openai_view(
        enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT))[2]


# -- regression fixtures: real-world malformed output ------------------------------------------

def raw(text):
    return enc().encode(text, allowed_special="all")


# (raw model output, the messages the model meant, whether openai-harmony raises on the raw tokens)
FIXTURES = {
    # ~47% of gpt-oss-120b calls (dynamo#10366); SGLang's regex wants <|constrain|>json and drops them.
    "analysis_channel_call": (
        '<|channel|>analysis<|message|>Check weather.<|end|><|start|>assistant<|channel|>analysis '
        'to=functions.get_weather code<|message|>{"city":"Paris"}<|call|>',
        [assistant("Check weather.", "analysis"),
         call("functions.get_weather", '{"city":"Paris"}', channel="analysis", content_type="code")], False),
    "recipient_in_role_header": (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}<|call|>',
        [call("functions.get_weather", '{"city":"Oslo"}', content_type="json")], False),
    "call_without_constrain": (
        '<|channel|>commentary to=functions.get_weather<|message|>{"city":"Oslo"}<|call|>',
        [call("functions.get_weather", '{"city":"Oslo"}', content_type=None)], False),
    # vllm#45213 / dynamo frontend-crates#237: the final answer was lost.
    "missing_message_token": (
        "<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final The answer is 4.<|return|>",
        [assistant("Simple.", "analysis"), assistant("The answer is 4.", "final")], True),
    "missing_message_token_glued": (
        "<|channel|>finalThe answer is 4.<|return|>", [assistant("The answer is 4.", "final")], True),
    # Seen from a scripted server whose forcing lagged one step: the first token twice.
    "duplicated_channel_token": (
        "<|channel|><|channel|>analysis<|message|>Hmm.<|end|>", [assistant("Hmm.", "analysis")], True),
    "missing_channel_token": (
        "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistantfinal<|message|>4<|return|>",
        [assistant("Hmm.", "analysis"), assistant("4", "final")], True),
    # sglang#35299: a duplicated to= crashed the Responses API.
    "duplicated_to": (
        '<|channel|>commentary to=functions.get_weather to=functions.get_weather <|constrain|>json<|message|>'
        '{"city":"Lima"}<|call|>',
        [call("functions.get_weather", '{"city":"Lima"}')], True),
    # harmony#60, vllm#22519: "Unexpected token 200002 while expecting start token 200006".
    "return_mid_stream_then_text": (
        "<|channel|>final<|message|>Hi<|return|> there", [assistant("Hi", "final"), Message.from_role_and_content(
            Role.ASSISTANT, " there")], True),
    "return_mid_stream_then_message": (
        "<|channel|>final<|message|>Hi<|return|><|start|>assistant<|channel|>final<|message|> there<|return|>",
        [assistant("Hi", "final"), assistant(" there", "final")], False),
    "stray_stop_tokens_between_messages": (
        "<|channel|>analysis<|message|>a<|end|><|return|><|call|><|start|>assistant<|channel|>final<|message|>b"
        "<|return|>", [assistant("a", "analysis"), assistant("b", "final")], True),
    "missing_end_before_start": (
        "<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>4<|return|>",
        [assistant("think", "analysis"), assistant("4", "final")], False),
    "missing_end_and_start_before_channel": (
        "<|channel|>analysis<|message|>think<|channel|>final<|message|>4<|return|>",
        [assistant("think", "analysis"), assistant("4", "final")], False),
    "unknown_function": (
        '<|channel|>commentary to=functions.lookup_stock <|constrain|>json<|message|>{"s":"X"}<|call|>',
        [call("functions.lookup_stock", '{"s":"X"}')], False),
    "unknown_namespace": (
        '<|channel|>commentary to=container.exec <|constrain|>json<|message|>{"cmd":["ls"]}<|call|>',
        [call("container.exec", '{"cmd":["ls"]}')], False),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_malformed_output_gives_the_meant_messages(name):
    text, meant, harmony_raises = FIXTURES[name]
    ids = raw(text)
    if harmony_raises:
        with pytest.raises(HarmonyError):
            enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    rendered = completion_tokens(meant) if meant[0].author.role == Role.ASSISTANT else None
    want = enc().parse_messages_from_completion_tokens(rendered, Role.ASSISTANT)
    for how, chunks in chunkings(ids, seed=len(name)):
        p = parse_chunks(chunks)
        assert [key(m)[2:] for m in p.messages] == [key(m)[2:] for m in want], how
        assert bool(p.repairs) == harmony_raises or name.startswith("missing_end"), (how, p.repairs)
        assert stream_view(chunks)[:3] == openai_view(want), how


def test_harmony_alone_leaks_markup_where_an_end_token_is_missing():
    # Why "missing_end_*" needs the normalizer although openai-harmony does not raise there.
    text, _, _ = FIXTURES["missing_end_before_start"]
    leaked = enc().parse_messages_from_completion_tokens(raw(text), Role.ASSISTANT)
    assert "<|start|>" in leaked[0].content[0].text


def test_sglang_detectors_on_text_where_no_token_ids_are_bound():
    # SGLang's /separate_reasoning and /parse_function_call hand the parsers text only. Upstream's
    # gpt-oss tool parser drops the analysis-channel call; ours, fed the same text, keeps it, and
    # the reasoning -> tool-call pair streamed chunk by chunk gives what the token path gives.
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.gpt_oss_detector import GptOssDetector

    from sglang_ext.harmony.detectors import HarmonyReasoningDetector, HarmonyToolCallDetector

    tools = [Tool(type="function", function=Function(name="get_weather", parameters={"type": "object"}))]
    text = FIXTURES["analysis_channel_call"][0] + "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    want_reasoning, want_content, want_calls = stream_view([raw(text)])[:3]
    assert want_calls == [("get_weather", '{"city":"Paris"}')] and want_content == "Done."
    assert GptOssDetector().detect_and_parse(text, tools).calls == []

    one_shot = HarmonyReasoningDetector(tool_call_parser_active=True).detect_and_parse(text)
    assert one_shot.reasoning_text == want_reasoning
    calls = HarmonyToolCallDetector().detect_and_parse(one_shot.normal_text, tools)
    assert (calls.normal_text, [(c.name, c.parameters) for c in calls.calls]) == (want_content, want_calls)

    reasoning_detector, tool_detector = HarmonyReasoningDetector(tool_call_parser_active=True), HarmonyToolCallDetector()
    reasoning, content, streamed = "", "", {}
    pieces = [enc().decode([t]) for t in raw(text)] + [None]
    for piece in pieces:
        r = reasoning_detector.parse_streaming_increment(piece) if piece is not None else reasoning_detector.finish()
        t = tool_detector.parse_streaming_increment(r.normal_text, tools)
        end = tool_detector.finish(tools) if piece is None else None
        reasoning += r.reasoning_text
        content += t.normal_text + (end.normal_text if end else "")
        for c in t.calls + (end.calls if end else []):
            entry = streamed.setdefault(c.tool_index, [c.name, ""])
            entry[1] += c.parameters
    assert (reasoning, content, [tuple(v) for _, v in sorted(streamed.items())]) == (
        want_reasoning, want_content, want_calls)


def test_truncated_call_is_reported_incomplete_with_its_partial_arguments():
    ids = completion_tokens([call("functions.get_weather", '{"city": "Paris"}')])[:-3]
    reasoning, content, calls, s = stream_view([[t] for t in ids])
    want = enc().decode(ids[ids.index(MESSAGE) + 1:])
    assert calls == [("get_weather", want)] and s.incomplete_tool_calls == {0}
    assert (reasoning, content) == ("", "")


@pytest.mark.parametrize("name", ["parallel_calls", "preamble_then_call"])
def test_stop_token_left_out_of_the_ids_ends_the_stream_as_if_fed(name):
    # SGLang may match a stop token without putting it in output_ids; finish_with feeds it, so the
    # last call completes (finish_reason "tool_calls") and the markup route writes its closing token.
    ids = completion_tokens(OUTPUTS[name])
    assert ids[-1] == CALL
    for route in (Route(), Route(calls="markup")):
        fed, cut = OpenAIHarmonyStream(route), OpenAIHarmonyStream(route)
        fed.feed(ids)
        fed.finish_with(CALL)  # already fed: nothing more
        cut.feed(ids[:-1])
        cut.finish_with(CALL)
        views = [(s.take_reasoning(), s.take_content(), [(d.index, d.name, d.arguments) for d in
                                                         s.take_tool_call_deltas()]) for s in (fed, cut)]
        assert views[0] == views[1]
        if route.calls == "markup":
            assert views[1][1].endswith("<|call|>")
        else:
            assert cut.tool_calls and all(c.complete for c in cut.tool_calls)
            assert cut.incomplete_tool_calls == set()


def test_one_log_line_per_request(caplog):
    text = "<|channel|>final<|message|>a<|return|><|return|><|call|> b<|end|><|constrain|>"
    s = OpenAIHarmonyStream(request_id="req-1")
    with caplog.at_level("DEBUG", logger="sglang_ext.harmony.streaming"):
        for t in raw(text):
            s.feed([t])
        s.finish()
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(s.repairs) >= 3 and len(warnings) == 1 and "req-1" in warnings[0].getMessage()


# -- fuzz --------------------------------------------------------------------------------------

HARMONY_SPECIALS = [START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL]
OTHER_SPECIALS = [199998, 199999, 200013, 200018, 201000]
INVALID = [300000, -7]
FRAGMENTS = ["analysis", "final", "commentary", "assistant", " to=functions.get_weather", " to=browser.search",
             "to=", " json", "code", " ", "\n", "\n\n", "Hello", " world", '{"a": [1, 2]}', "é", "日本語", "🤖",
             "functionsfinal", "<|", "|>"]


def _token_runs():
    fragments = st.sampled_from(FRAGMENTS).map(lambda f: enc().encode(f, disallowed_special=()))
    return st.lists(st.one_of(
        st.sampled_from(HARMONY_SPECIALS).map(lambda t: [t]),
        st.sampled_from(OTHER_SPECIALS + INVALID).map(lambda t: [t]),
        fragments,
        st.integers(0, 199997).map(lambda t: [t]),  # any ordinary token: partial UTF-8 bytes included
        st.binary(min_size=1, max_size=3).map(lambda b: [enc().encode(chr(0x80 + b[0] % 0x700))[0]]),
    ), max_size=40).map(lambda parts: [t for part in parts for t in part])


def ordinary_text(ids):
    """The oracle for "no lost text": each run of non-special tokens, decoded lossily on its own."""
    runs, run = [], b""
    for t in ids:
        data = None
        try:
            if t >= 0 and not enc().is_special_token(t):
                data = bytes(enc()._inner.decode_bytes([t]))
        except Exception:  # noqa: BLE001 - ids outside the vocabulary
            data = None
        if data is None:
            runs.append(run)
            run = b""
        else:
            run += data
    runs.append(run)
    return "".join(r.decode("utf-8", errors="replace") for r in runs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ids=_token_runs(), data=st.data())
def test_fuzz_never_raises_never_loses_text(ids, data):
    whole = parse_chunks([ids])
    assert not any("parser reset" in r for r in whole.repairs), whole.repairs
    transcript = "".join(m.header_text + m.content for m in whole.log)
    assert transcript == ordinary_text(ids)

    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(ids) - 1)), max_size=8)))
    chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)]) if a < b]
    assert parse_chunks(chunks).log == whole.log

    reasoning, content, calls, s = stream_view(chunks)
    assert len(reasoning) + len(content) + sum(len(a) for _, a in calls) == sum(len(m.content) for m in whole.messages)
    assert s.content == content and s.reasoning == reasoning


def byte_tokens(data: bytes) -> list[int]:
    """One token per byte (o200k has a token for every single byte)."""
    by_bytes = {bytes(enc()._inner.decode_bytes([t])): t for t in range(1024)}
    return [by_bytes[bytes([b])] for b in data]


def test_utf8_split_across_chunks_waits_split_by_a_special_token_is_replaced():
    head, ret = raw("<|channel|>final<|message|>"), [RETURN]
    euro = byte_tokens("€".encode())
    assert parse_chunks([head + euro[:2], euro[2:] + ret]).messages[0].content == "€"
    stray = head + euro[:1] + [200013] + euro[1:] + ret
    assert parse_chunks([[t] for t in stray]).messages[0].content == "\ufffd\ufffd\ufffd" == ordinary_text(
        stray)[len("final"):]


def test_invalid_utf8_does_not_swallow_the_rest_of_the_message():
    ids = raw("<|channel|>final<|message|>") + byte_tokens(b"\x80") + raw(" and the rest") + [RETURN]
    # openai-harmony alone holds every token after the invalid byte back, and drops them at the end.
    assert enc().parse_messages_from_completion_tokens(ids, Role.ASSISTANT)[0].content[0].text == ""
    assert parse_chunks([ids]).messages[0].content == "\ufffd and the rest"


# -- the o200k vocabulary, offline ----------------------------------------------------------------


@pytest.fixture
def no_vocab_anywhere(tmp_path, monkeypatch):
    for var in ("TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR", "TIKTOKEN_RS_CACHE_DIR",
                "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "SGLANG_EXT_HARMONY_VOCAB"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SGLANG_EXT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr("sglang_ext.launch.tokenizer._installed_quicktok_vocab", lambda: None)
    return tmp_path


def test_vocab_missing_is_one_startup_line_naming_the_options(no_vocab_anywhere, caplog):
    import os

    from sglang_ext.harmony.encoding import configure_offline_vocab

    with caplog.at_level("WARNING", logger="sglang_ext.harmony.encoding"):
        assert configure_offline_vocab() is None
        assert configure_offline_vocab() is None  # a spawned process inherits the verdict: no second line
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "\n" not in lines[0]
    for option in ("TIKTOKEN_ENCODINGS_BASE", "Hugging Face cache", "quicktok-v1"):
        assert option in lines[0]
    assert "TIKTOKEN_ENCODINGS_BASE" not in os.environ


@pytest.mark.parametrize("source", ["TIKTOKEN_ENCODINGS_BASE", "hf_cache"])
def test_vocab_found_offline(source, no_vocab_anywhere, vocab_dir, tiny_checkpoints, monkeypatch):
    import hashlib
    import os
    import shutil

    from sglang_ext.harmony.encoding import configure_offline_vocab
    from sglang_ext.launch.tokenizer import O200K_FILE, O200K_SHA256

    if source == "TIKTOKEN_ENCODINGS_BASE":
        monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", vocab_dir)
    else:
        snapshot = no_vocab_anywhere / "hf" / "hub" / "models--openai--gpt-oss-20b" / "snapshots" / "0"
        snapshot.mkdir(parents=True)
        shutil.copy(tiny_checkpoints["fp32"] / "tokenizer.json", snapshot / "tokenizer.json")
    found = configure_offline_vocab()
    with open(os.path.join(found, O200K_FILE), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == O200K_SHA256
    assert os.environ["TIKTOKEN_ENCODINGS_BASE"] in (found, vocab_dir)


def test_bounded_encoding_gives_harmonys_tokens():
    """encode_bounded: what the text-only parsers (/parse_function_call, /separate_reasoning) encode. Equal to
    openai-harmony's encode, special tokens allowed or not, for short text (harmony's own) and long text
    (tiktoken between the special tokens; harmony alone took 2.1 s for 80k "{", quadratic in a run)."""
    from sglang_ext.harmony.encoding import LINEAR_MIN_CHARS, encode_bounded

    def harmony(text, allowed):
        if allowed == "all":
            return enc().encode(text, allowed_special="all")
        return enc().encode(text, allowed_special=allowed, disallowed_special=())

    rng = random.Random(5)
    words = ["{", "}", "<|channel|>", "<|message|>", "ab", " ", "\U0001F600", "\u00e9", "<|call|>", "<|end",
             "<|endoftext|>", "\n", "12"]
    texts = ["hello <|start|>assistant<|channel|>final<|message|> w\U0001F600rld",
             "<|channel|>commentary to=functions.f<|message|>" + "{" * (5 * LINEAR_MIN_CHARS + 3),
             "".join(rng.choice(words) for _ in range(4 * LINEAR_MIN_CHARS))]
    for text in texts:
        for allowed in ("all", set(), {"<|message|>", "<|call|>"}):
            assert encode_bounded(enc(), text, allowed_special=allowed) == harmony(text, allowed), (text[:40], allowed)


TEXT_PIECES = ["!", "?", ".", " ", "\n", "a", "Z", "\u00e9", "\u65e5", "<|end|>", "<|message|>", "  ", "\t", "1",
               "23", "\u00a7", "{}", '"', "'s", "\U0001F600"]


def _conversation(rng, text) -> Conversation:
    msgs = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new())]
    if rng.random() < 0.5:
        msgs.append(Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(text())
                                                  .with_function_tools([ToolDescription.new("f", "d")])))
    for _ in range(rng.randint(1, 6)):
        r = rng.random()
        if r < 0.3:
            msgs.append(Message.from_role_and_content(Role.USER, text()))
        elif r < 0.5:  # analysis before a final: harmony drops it, marker and all
            msgs.append(Message.from_role_and_content(Role.ASSISTANT, text()).with_channel("analysis"))
        elif r < 0.65:
            msgs.append(Message.from_role_and_content(Role.ASSISTANT, text()).with_channel("commentary")
                        .with_recipient("functions.f").with_content_type("<|constrain|> json"))
        elif r < 0.8:
            msgs.append(Message.from_author_and_content(Author.new(Role.TOOL, "functions.f"), text())
                        .with_recipient("assistant").with_channel("commentary"))
        else:
            msgs.append(Message.from_role_and_content(Role.ASSISTANT, text()).with_channel("final"))
    return Conversation.from_messages(msgs)


def test_linear_rendering_gives_harmonys_tokens(monkeypatch):
    """render_for_completion_linear (our tool-history chat prompts, upstream's /v1/responses prompts) against
    openai-harmony's own rendering: every content is spliced here (threshold 8 characters), over random
    conversations of every role and channel, dropped analysis messages, special-token text and emoji in
    contents; then a client's text posing as a marker beside a dropped analysis message, and a lone surrogate
    (harmony's error); then a 20k-character tool result at the real threshold. (Time: 300k characters of "!"
    0.09 s; harmony's own rendering is quadratic, 2.6 s at 80k, on this project's CPU.)"""
    import sglang_ext.harmony.encoding as encoding

    rng = random.Random(11)

    def text():
        return "".join(rng.choice(TEXT_PIECES) for _ in range(rng.randint(0, 40)))

    monkeypatch.setattr(encoding, "LINEAR_MIN_CHARS", 8)
    for _ in range(200):
        conversation = _conversation(rng, text)
        want = list(enc().render_conversation_for_completion(conversation, Role.ASSISTANT))
        assert encoding.render_for_completion_linear(enc(), conversation, Role.ASSISTANT) == want
    # Marker text from a client (the fixed marker of the first version): with a dropped analysis message, it
    # was found once, in the user's message, and the analysis text spliced there (found by a review).
    monkeypatch.setattr(encoding, "LINEAR_MIN_CHARS", 50)  # the client's texts stay as they are
    for user_text in ("\u00a7sglang-ext-splice-0\u00a7", encoding._SPLICE_MARKER.format("0" * 16, 0)):
        conversation = Conversation.from_messages([
            Message.from_role_and_content(Role.USER, user_text),
            Message.from_role_and_content(Role.ASSISTANT, "x" * 60).with_channel("analysis"),
            Message.from_role_and_content(Role.ASSISTANT, "fin").with_channel("final")])
        want = list(enc().render_conversation_for_completion(conversation, Role.ASSISTANT))
        assert encoding.render_for_completion_linear(enc(), conversation, Role.ASSISTANT) == want
    # a lone surrogate: harmony refuses the conversation, and so does this (tiktoken would have replaced it)
    bad = Conversation.from_messages([Message.from_role_and_content(Role.USER, "a" * 60 + "\udc80")])
    with pytest.raises(ValueError):
        enc().render_conversation_for_completion(bad, Role.ASSISTANT)
    with pytest.raises(ValueError):
        encoding.render_for_completion_linear(enc(), bad, Role.ASSISTANT)
    monkeypatch.undo()
    tool_result = Message.from_author_and_content(Author.new(Role.TOOL, "functions.f"), "!" * 20000)
    conversation = Conversation.from_messages([Message.from_role_and_content(Role.USER, "hi"),
                                               tool_result.with_recipient("assistant").with_channel("commentary")])
    assert (encoding.render_for_completion_linear(enc(), conversation, Role.ASSISTANT)
            == list(enc().render_conversation_for_completion(conversation, Role.ASSISTANT)))


def test_a_call_with_a_very_long_argument_text_is_parsed_whole():
    from sglang.srt.entrypoints.openai.protocol import Function, Tool

    from sglang_ext.harmony.detectors import HarmonyToolCallDetector

    tools = [Tool(type="function", function=Function(name="f", parameters={"type": "object"}))]
    args = "{" * 60000
    text = f"<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}<|call|>"
    calls = HarmonyToolCallDetector().detect_and_parse(text, tools).calls
    assert [(c.name, c.parameters) for c in calls] == [("f", args)]
