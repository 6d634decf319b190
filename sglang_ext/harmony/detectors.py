"""SGLang's ``gpt-oss`` reasoning and tool-call parsers, rebuilt on ``OpenAIHarmonyStream``.

SGLang hands its parsers decoded text; ours want the token ids. In chat completions the patch
``harmony_parsers`` parses each choice's ids itself, just before SGLang's parsers run, and binds
the choice's ``OpenAIHarmonyStream`` here (``bind_stream`` while streaming, ``bind_response`` for
a whole response). The detectors then read the stream and ignore the text, so the two parsers
split one parse between them: the reasoning parser gives reasoning_content and content, the
tool-call parser passes that content through and adds the calls.

Called where nothing was bound (SGLang's ``/separate_reasoning`` and ``/parse_function_call``,
which only have text), they encode the text and parse that; without the o200k vocabulary they
are SGLang's own text parsers (the classes they subclass).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from sglang.srt.function_call.core_types import StreamingParseResult as ToolParseResult
from sglang.srt.function_call.core_types import ToolCallItem
from sglang.srt.function_call.gpt_oss_detector import GptOssDetector as UpstreamToolDetector
from sglang.srt.parser.reasoning_parser import GptOssDetector as UpstreamReasoningDetector
from sglang.srt.parser.reasoning_parser import StreamingParseResult as ReasoningParseResult

from sglang_ext.harmony.encoding import harmony_available
from sglang_ext.harmony.streaming import OpenAIHarmonyStream, Route, ToolCallDelta


@dataclass
class BoundResponse:
    stream: OpenAIHarmonyStream
    text: str  # the text SGLang hands to the parsers for this choice


_streaming: contextvars.ContextVar[OpenAIHarmonyStream | None] = contextvars.ContextVar(
    "sglang_ext_harmony_streaming", default=None)
_response: contextvars.ContextVar[BoundResponse | None] = contextvars.ContextVar(
    "sglang_ext_harmony_response", default=None)


def bind_stream(stream: OpenAIHarmonyStream | None) -> None:
    _streaming.set(stream)


def bind_response(stream: OpenAIHarmonyStream | None, text: str = "") -> None:
    _response.set(BoundResponse(stream, text) if stream is not None else None)


def _response_for(text: str) -> OpenAIHarmonyStream | None:
    # The text check keeps a stale binding from answering for a text it did not parse.
    bound = _response.get()
    if bound is not None and text in (bound.text, bound.stream.content):
        return bound.stream
    return None


class HarmonyReasoningDetector(UpstreamReasoningDetector):
    """``--reasoning-parser gpt-oss``: analysis -> reasoning_content, final and preambles -> content."""

    def __init__(self, stream_reasoning: bool = True, force_reasoning: bool = True,
                 continue_final_message: bool = False, previous_content: str = "",
                 force_nonempty_content: bool = False, tool_call_parser_active: bool = False):
        super().__init__(stream_reasoning=stream_reasoning, force_reasoning=force_reasoning,
                         continue_final_message=continue_final_message, previous_content=previous_content,
                         force_nonempty_content=force_nonempty_content)
        # Text-only callers with a tool-call parser downstream get calls back as Harmony markup,
        # which that parser reads (SGLang's contract for this parser pair).
        self._text_route = Route(separate_reasoning=True, calls="markup" if tool_call_parser_active else "inline")
        self._text_stream: OpenAIHarmonyStream | None = None
        self._held_reasoning = ""

    def parse_streaming_increment(self, new_text: str) -> ReasoningParseResult:
        stream = _streaming.get()
        if stream is None:
            if not harmony_available():
                return super().parse_streaming_increment(new_text)
            stream = self._own_stream()
            stream.feed_text(new_text)
        return self._take(stream, final=stream.finished)

    def finish(self) -> ReasoningParseResult:
        stream = _streaming.get()
        if stream is None:
            if self._text_stream is None:
                return super().finish() if not harmony_available() else ReasoningParseResult()
            stream = self._text_stream
            stream.finish()
        return self._take(stream, final=True)

    def detect_and_parse(self, text: str) -> ReasoningParseResult:
        stream = _response_for(text)
        if stream is None:
            if not harmony_available():
                return super().detect_and_parse(text)
            stream = OpenAIHarmonyStream(self._text_route)
            stream.feed_text(text)
            stream.finish()
        result = ReasoningParseResult(normal_text=stream.content, reasoning_text=stream.reasoning)
        return self._maybe_apply_force_nonempty_content(result)

    def _own_stream(self) -> OpenAIHarmonyStream:
        if self._text_stream is None:
            self._text_stream = OpenAIHarmonyStream(self._text_route)
        return self._text_stream

    def _take(self, stream: OpenAIHarmonyStream, final: bool) -> ReasoningParseResult:
        reasoning = stream.take_reasoning()
        if not self.stream_reasoning:
            # stream_reasoning=false: the reasoning of a message arrives whole, once it ends.
            self._held_reasoning += reasoning
            reasoning = ""
            if final or not stream.in_reasoning:
                reasoning, self._held_reasoning = self._held_reasoning, ""
        return ReasoningParseResult(normal_text=stream.take_content(), reasoning_text=reasoning)


class HarmonyToolCallDetector(UpstreamToolDetector):
    """``--tool-call-parser gpt-oss``: every Harmony message with a recipient is a tool call."""

    def __init__(self):
        super().__init__()
        self._text_stream: OpenAIHarmonyStream | None = None
        self._stream_for_state: OpenAIHarmonyStream | None = None

    @classmethod
    def parses_without_tools(cls) -> bool:
        # A call the model makes without declared tools (built-in browser/python from
        # chat_template_kwargs, or an undeclared function) must not end up in content.
        return True

    @property
    def incomplete_tool_call_indices(self) -> set[int]:
        # Read by SGLang: a call cut off by the end of the stream keeps finish_reason "length".
        stream = self._stream_for_state
        return stream.incomplete_tool_calls if stream is not None else set()

    def has_tool_call(self, text: str) -> bool:
        stream = _response_for(text)
        if stream is None:
            if not harmony_available():
                return super().has_tool_call(text)
            stream = self._one_shot(text)
        return bool(stream.tool_calls)

    def detect_and_parse(self, text: str, tools) -> ToolParseResult:
        stream = _response_for(text)
        normal = text
        if stream is None:
            if not harmony_available():
                return super().detect_and_parse(text, tools)
            stream = self._one_shot(text)
            normal = stream.content
        self._stream_for_state = stream
        calls = [ToolCallItem(tool_index=c.index, name=c.name, parameters=c.arguments) for c in stream.tool_calls]
        self._record([ToolCallDelta(c.index, c.name, c.arguments) for c in stream.tool_calls])
        return ToolParseResult(normal_text=normal, calls=calls)

    def parse_streaming_increment(self, new_text: str, tools) -> ToolParseResult:
        stream = _streaming.get()
        normal = new_text  # bound: the content is already clean (the reasoning parser or the patch made it)
        if stream is None:
            if not harmony_available():
                return super().parse_streaming_increment(new_text, tools)
            if self._text_stream is None and "<|" not in new_text:
                return ToolParseResult(normal_text=new_text)  # plain text, no Harmony in sight
            stream = self._own_stream()
            stream.feed_text(new_text)
            normal = stream.take_content()
        return ToolParseResult(normal_text=normal, calls=self._take(stream))

    def finish(self, tools) -> ToolParseResult:
        stream = _streaming.get()
        normal = ""
        if stream is None:
            if self._text_stream is None:
                return super().finish(tools) if not harmony_available() else ToolParseResult()
            stream = self._text_stream
            stream.finish()
            normal = stream.take_content()
        return ToolParseResult(normal_text=normal, calls=self._take(stream))

    def _own_stream(self) -> OpenAIHarmonyStream:
        if self._text_stream is None:
            self._text_stream = OpenAIHarmonyStream(Route(separate_reasoning=True, calls="tool_calls"))
        return self._text_stream

    def _one_shot(self, text: str) -> OpenAIHarmonyStream:
        stream = OpenAIHarmonyStream(Route(separate_reasoning=True, calls="tool_calls"))
        stream.feed_text(text)
        stream.finish()
        return stream

    def _take(self, stream: OpenAIHarmonyStream) -> list[ToolCallItem]:
        self._stream_for_state = stream
        deltas = stream.take_tool_call_deltas()
        self._record(deltas)
        return [ToolCallItem(tool_index=d.index, name=d.name, parameters=d.arguments) for d in deltas]

    def _record(self, deltas: list[ToolCallDelta]) -> None:
        # SGLang's serving layer compares prev_tool_call_arr with streamed_args_for_tool at the
        # end to send arguments it thinks are missing; both hold exactly what was streamed.
        for d in deltas:
            while len(self.prev_tool_call_arr) <= d.index:
                self.prev_tool_call_arr.append({"name": None, "arguments": ""})
                self.streamed_args_for_tool.append("")
            entry = self.prev_tool_call_arr[d.index]
            if d.name is not None:
                entry["name"] = d.name
            entry["arguments"] += d.arguments
            self.streamed_args_for_tool[d.index] += d.arguments
            self.current_tool_id = d.index
            self.current_tool_name_sent = True
