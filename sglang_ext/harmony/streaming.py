"""Harmony messages onto the OpenAI chat API: reasoning_content, content and streamed tool_calls.

One ``OpenAIHarmonyStream`` per choice of a response. It takes the choice's token ids as they
are generated and sorts the text of each Harmony message, as it decodes, into three outlets:

- ``analysis`` -> reasoning_content;
- ``final``, ``commentary`` without a recipient (a preamble) and channels we do not know ->
  content, each character once;
- a message with a recipient is a call, on whatever channel it came (``analysis`` too), with or
  without ``<|constrain|>json``, recipient after the channel or in the role header. It becomes a
  tool call: a first delta with the name (``functions.get_weather`` -> ``get_weather``;
  built-in recipients keep their full name: ``browser.search``, ``python``), then the
  arguments as they decode, verbatim (JSON for functions and browser, source code for python).
  Names the request did not declare are surfaced too: dropping a call loses the model's turn.

``Route`` says what the request asked for: without reasoning separation analysis text joins
the content; without tool-call parsing a call's body joins the reasoning (or the content), or,
for a text-only tool parser downstream, is written back as canonical Harmony markup.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from sglang_ext.harmony.encoding import encode_bounded
from sglang_ext.harmony.parser import ContentDelta, HarmonyStreamParser, MessageEnd, MessageStart

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    separate_reasoning: bool = True
    calls: str = "tool_calls"  # "tool_calls" | "inline" (the body joins reasoning/content) | "markup"


@dataclass
class ToolCallDelta:
    index: int  # the call's ordinal in this choice (OpenAI's tool_calls[].index)
    name: str | None  # only on the call's first delta
    arguments: str


@dataclass
class ToolCall:
    index: int
    name: str
    recipient: str
    channel: str | None
    content_type: str | None
    arguments: str = ""
    complete: bool = False  # closed by <|call|> (or <|end|>/<|return|>), not cut off by the stream's end


def tool_name(recipient: str) -> str:
    return recipient[len("functions."):] if recipient.startswith("functions.") else recipient


def is_call(role: str, recipient: str | None) -> bool:
    # Messages *to* the assistant are tool results (role tool), not calls.
    return bool(recipient) and recipient != "assistant" and role != "tool"


@dataclass
class _Outlets:
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[ToolCallDelta] = field(default_factory=list)


class OpenAIHarmonyStream:
    def __init__(self, route: Route = Route(), role: str | None = "assistant", encoding=None,
                 request_id: str | None = None):
        self.route = route
        self.request_id = request_id
        self.parser = HarmonyStreamParser(role=role, encoding=encoding)
        self.tool_calls: list[ToolCall] = []
        self.reasoning = ""  # everything routed to reasoning so far
        self.content = ""  # everything routed to content so far
        self.tokens = 0  # token ids fed so far
        self.last_token: int | None = None
        self._pending = _Outlets()
        self._outlet: str | None = None  # where the message in flight goes
        self._logged_repairs = 0

    # -- input -------------------------------------------------------------------------------

    def feed(self, token_ids) -> None:
        token_ids = list(token_ids)
        self.tokens += len(token_ids)
        if token_ids:
            self.last_token = token_ids[-1]
        self._route(self.parser.feed(token_ids))

    def finish_with(self, stop_token: int | None = None) -> None:
        """The stream ended; ``stop_token``: the stop token it matched, fed first if the ids left it out."""
        if isinstance(stop_token, int) and not isinstance(stop_token, bool) and stop_token != self.last_token:
            self.feed([stop_token])
        self.finish()

    def feed_text(self, text: str) -> None:
        """For callers that only have text (special tokens spelled out): encode, then feed."""
        if text:
            self.feed(encode_bounded(self.parser._enc, text, allowed_special="all"))

    def finish(self) -> None:
        self._route(self.parser.finish())

    @property
    def finished(self) -> bool:
        return self.parser.finished

    # -- output ------------------------------------------------------------------------------

    def take_reasoning(self) -> str:
        text, self._pending.reasoning = "".join(self._pending.reasoning), []
        return text

    def take_content(self) -> str:
        text, self._pending.content = "".join(self._pending.content), []
        return text

    def take_tool_call_deltas(self) -> list[ToolCallDelta]:
        deltas, self._pending.calls = self._pending.calls, []
        return deltas

    @property
    def in_reasoning(self) -> bool:
        return self._outlet == "reasoning"

    @property
    def incomplete_tool_calls(self) -> set[int]:
        return {c.index for c in self.tool_calls if not c.complete}

    @property
    def repairs(self) -> list[str]:
        return self.parser.repairs

    # -- routing -----------------------------------------------------------------------------

    def _route(self, events) -> None:
        for ev in events:
            if isinstance(ev, MessageStart):
                self._start(ev)
            elif isinstance(ev, ContentDelta):
                self._text(ev.text)
            elif isinstance(ev, MessageEnd):
                self._end(ev)
        self._log_repairs()

    def _start(self, ev: MessageStart) -> None:
        text_outlet = "reasoning" if self.route.separate_reasoning else "content"
        if is_call(ev.role, ev.recipient):
            if self.route.calls == "tool_calls":
                call = ToolCall(len(self.tool_calls), tool_name(ev.recipient), ev.recipient, ev.channel,
                                ev.content_type)
                self.tool_calls.append(call)
                self._pending.calls.append(ToolCallDelta(call.index, call.name, ""))
                self._outlet = "call"
                return
            if self.route.calls == "markup":
                header = f"<|start|>assistant<|channel|>{ev.channel or 'commentary'} to={ev.recipient}"
                if ev.content_type:
                    header += f" {ev.content_type}"
                self._emit("content", header + "<|message|>")
                self._outlet = "content"
                return
            self._outlet = text_outlet
        elif ev.channel == "analysis" or ev.role == "tool":
            self._outlet = text_outlet
        else:
            self._outlet = "content"

    def _text(self, text: str) -> None:
        if self._outlet == "call":
            call = self.tool_calls[-1]
            call.arguments += text
            last = self._pending.calls[-1] if self._pending.calls else None
            if last is not None and last.index == call.index:
                last.arguments += text
            else:
                self._pending.calls.append(ToolCallDelta(call.index, None, text))
        elif self._outlet is not None:
            self._emit(self._outlet, text)

    def _end(self, ev: MessageEnd) -> None:
        m = ev.message
        if self._outlet == "call":
            self.tool_calls[-1].complete = m.end != "eos"
        elif self.route.calls == "markup" and is_call(m.role, m.recipient):
            self._emit("content", {"eos": ""}.get(m.end, f"<|{m.end}|>"))
        self._outlet = None

    def _emit(self, outlet: str, text: str) -> None:
        if outlet == "reasoning":
            self.reasoning += text
            self._pending.reasoning.append(text)
        else:
            self.content += text
            self._pending.content.append(text)

    def _log_repairs(self) -> None:
        # One line per request, at the first repair: a broken stream must be visible, not a flood.
        repairs = self.parser.repairs
        if len(repairs) > self._logged_repairs:
            if self._logged_repairs == 0:
                logger.warning("sglang-ext harmony: request %s: repaired malformed output: %s",
                               self.request_id or "-", repairs[0])
            for r in repairs[max(self._logged_repairs, 1):]:
                logger.debug("sglang-ext harmony: request %s: %s", self.request_id or "-", r)
            self._logged_repairs = len(repairs)
