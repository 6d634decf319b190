"""Token-level Harmony parsing that never raises: openai-harmony's StreamableParser behind a normalizer.

openai-harmony's ``StreamableParser`` is the parser of record: every message we report is the
message it parsed. It is strict, though: one stray token ("Unexpected token 200002 while
expecting start token 200006"), a header without ``<|message|>``, or a duplicated ``to=`` raises,
and the message in flight is lost. So the tokens reach it through a normalizer that only ever
hands it a well-formed stream:

- headers are held until ``<|message|>`` and then passed whole; one harmony rejects is passed
  again rebuilt from a lenient reading (channel, first ``to=``, content type), so a call with a
  duplicated recipient is still a call;
- a header cut short by a stop token, ``<|start|>``, a newline or sheer length lost its
  ``<|message|>``: its structural words stay header, the rest becomes the message's content;
- ``<|start|>`` or ``<|channel|>`` inside content close the message first (a missing
  ``<|end|>``); ``<|channel|>`` or text after a message opens an assistant message (a missing
  ``<|start|>assistant``); other special tokens where they make no sense are dropped (they
  carry no text);
- content bytes reach harmony only as valid UTF-8 (its decoder otherwise holds every later
  token of the message back); invalid bytes become U+FFFD, as a lossy decode would show them.

Every decoded character of a non-special token ends up in exactly one place: a message's
content or its header text (``HarmonyMessage.header_text``: role, channel, recipient, content
type as the model wrote them); ``HarmonyStreamParser.log`` keeps the headers that never became a
message. Nothing here imports SGLang.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field

from sglang_ext.harmony.encoding import (CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START, encode_bounded,
                                         harmony_encoding)

STOP_NAMES = {END: "end", RETURN: "return", CALL: "call"}
KNOWN_CHANNELS = ("analysis", "commentary", "final")
ROLES = ("system", "developer", "user", "assistant", "tool")
# Content types a header may carry without <|constrain|> (`to=functions.x json`, `... code`).
BARE_CONTENT_TYPES = ("json", "code")
# Real headers are a dozen tokens; past this the model is writing content into a header whose
# <|message|> it skipped, and holding it back would stall the stream.
MAX_HEADER_TOKENS = 32

_SPECIAL_NAMES = {RETURN: "<|return|>", CONSTRAIN: "<|constrain|>", CHANNEL: "<|channel|>", START: "<|start|>",
                  END: "<|end|>", MESSAGE: "<|message|>", CALL: "<|call|>"}
_HEADER_MARKERS = {"<|channel|>", "<|constrain|>"}
# Where a dropped token sat in a held header: the text on either side is decoded apart, as it
# would be in content.
_RUN_BREAK = -1


@dataclass
class HarmonyMessage:
    role: str
    name: str | None  # the author name of tool messages ("functions.get_weather")
    channel: str | None
    recipient: str | None
    content_type: str | None
    content: str
    header_text: str  # the header's text as decoded, special tokens left out
    end: str  # "end" | "return" | "call" | "eos" (the stream stopped inside the message)
    repairs: tuple[str, ...] = ()
    dropped: bool = False  # a header that never became a message (only in HarmonyStreamParser.log)


@dataclass
class MessageStart:
    index: int
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None


@dataclass
class ContentDelta:
    index: int
    text: str


@dataclass
class MessageEnd:
    index: int
    message: HarmonyMessage


@dataclass
class _Header:
    implicit_role: str | None  # the role the header starts with without saying so
    tokens: list[int] = field(default_factory=list)


@dataclass
class _LenientHeader:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    header_text: str
    content: str  # header text that cannot be structure: content whose <|message|> is missing
    notes: list[str]
    tail: bytes = b""  # bytes of an unfinished character at the end (only when the run goes on)


class HarmonyStreamParser:
    """Feed token ids (any chunking), get events; ``messages`` are openai-harmony's parse.

    ``role="assistant"``: the tokens continue a prompt that ended in ``<|start|>assistant``
    (a completion). ``role=None``: the tokens are a whole conversation starting at ``<|start|>``.
    """

    def __init__(self, role: str | None = "assistant", encoding=None):
        from openai_harmony import StreamableParser  # optional: harmony_available falls back without it

        self._enc = encoding or harmony_encoding()
        self._new_inner = lambda: StreamableParser(self._enc, None)
        self._inner = self._new_inner()
        self.log: list[HarmonyMessage] = []
        self.repairs: list[str] = []
        self._events: list = []
        self._index = 0  # index of the message in flight (or the next one)
        self._header: _Header | None = _Header(role) if role is not None else None
        self._state = "header" if role is not None else "expect_start"
        self._msg_repairs: list[str] = []
        self._header_text = ""
        self._content: list[str] = []
        self._utf8 = _Utf8Guard(self)
        self._token_bytes: dict[int, bytes | None] = {}
        self.finished = False

    # -- public ------------------------------------------------------------------------------

    @property
    def messages(self) -> list[HarmonyMessage]:
        return [m for m in self.log if not m.dropped]

    @property
    def state(self) -> str:
        """"expect_start" | "header" | "content"."""
        return self._state

    def feed(self, token_ids) -> list:
        for t in token_ids:
            self._step(int(t))
        return self._drain()

    def finish(self) -> list:
        """The stream ended: close the message in flight (a truncated one ends with end="eos")."""
        if not self.finished:
            self.finished = True
            try:
                self._eos()
            except Exception as e:  # noqa: BLE001 - see _step
                self._internal_error(e)
        return self._drain()

    # -- normalizer --------------------------------------------------------------------------

    def _step(self, t: int) -> None:
        if self.finished:
            self._repair(f"token {t} after the end of the stream dropped")
            return
        try:
            if self._state == "content":
                self._content_token(t)
            elif self._state == "header":
                self._header_token(t)
            else:
                self._expect_start_token(t)
        except Exception as e:  # noqa: BLE001 - a bug here must cost one token, not the request
            self._internal_error(e)

    def _kind(self, t: int) -> str:
        if t in _SPECIAL_NAMES:
            return _SPECIAL_NAMES[t]
        if self._bytes(t) is None:
            return "invalid"
        try:
            special = self._enc.is_special_token(t)
        except Exception:  # noqa: BLE001
            return "invalid"
        return "special" if special else "text"

    def _bytes(self, t: int) -> bytes | None:
        if t not in self._token_bytes:
            try:
                self._token_bytes[t] = bytes(self._enc._inner.decode_bytes([t])) if t >= 0 else None
            except Exception:  # noqa: BLE001 - an id outside the vocabulary
                self._token_bytes[t] = None
        return self._token_bytes[t]

    def _expect_start_token(self, t: int) -> None:
        kind = self._kind(t)
        if kind == "<|start|>":
            self._open_header(None)
        elif kind in ("<|channel|>", "<|message|>", "text"):
            self._repair("missing <|start|>assistant")
            self._open_header("assistant")
            self._header_token(t)
        else:
            self._repair(f"stray {self._name(t, kind)} between messages dropped")

    def _header_token(self, t: int) -> None:
        kind = self._kind(t)
        header = self._header
        if kind == "<|message|>":
            self._close_header()
        elif kind in ("text", "<|channel|>", "<|constrain|>"):
            header.tokens.append(t)
            if kind == "text" and (b"\n" in self._bytes(t) or len(header.tokens) > MAX_HEADER_TOKENS):
                if b"\n" in self._bytes(t) or self._lenient(header).content:
                    self._header_without_message("header runs on without <|message|>", run_goes_on=True)
        elif kind in ("<|end|>", "<|return|>", "<|call|>"):
            self._header_without_message(f"header ended by {kind} without <|message|>")
            self._content_token(t)
        elif kind == "<|start|>":
            if self._lenient(header).content:
                self._header_without_message("header ended by <|start|> without <|message|>")
                self._close_message_implicitly("<|start|>")
                self._open_header(None)
            else:
                self._drop_header("header replaced by a new <|start|>")
                self._open_header(None)
        else:
            self._repair(f"stray {self._name(t, kind)} in a header dropped")
            header.tokens.append(_RUN_BREAK)

    def _content_token(self, t: int) -> None:
        kind = self._kind(t)
        if kind == "text":
            self._utf8.push(t, self._bytes(t))
        elif kind in ("<|end|>", "<|return|>", "<|call|>"):
            self._utf8.flush()
            self._inner.process(t)
            self._message_ended(STOP_NAMES[t])
        elif kind == "<|start|>":
            self._close_message_implicitly("<|start|>")
            self._open_header(None)
        elif kind == "<|channel|>":
            self._close_message_implicitly("<|channel|>")
            self._repair("missing <|start|>assistant")
            self._open_header("assistant")
            self._header.tokens.append(t)
        else:
            self._utf8.flush()
            self._repair(f"stray {self._name(t, kind)} in content dropped")

    def _eos(self) -> None:
        if self._state == "content":
            self._utf8.flush()
            self._inner.process_eos()
            self._message_ended("eos")
        elif self._state == "header":
            if self._lenient(self._header).content:
                self._header_without_message("stream ended in a header without <|message|>")
                self._inner.process_eos()
                self._message_ended("eos")
            else:
                self._drop_header("stream ended inside a header")

    # -- headers -----------------------------------------------------------------------------

    def _open_header(self, implicit_role: str | None) -> None:
        self._header = _Header(implicit_role)
        self._state = "header"

    def _close_header(self) -> None:
        """<|message|> arrived: hand harmony the header as written, else rebuilt leniently."""
        header, self._header = self._header, None
        written = [START] + self._role_tokens(header) + [x for x in header.tokens if x != _RUN_BREAK] + [MESSAGE]
        lenient = self._lenient(header)
        self._header_text = lenient.header_text + lenient.content
        try:
            for x in written:
                self._inner.process(x)
        except Exception as e:  # noqa: BLE001 - harmony rejected the header; it is back at ExpectStart
            self._repair(f"malformed header {lenient.header_text + lenient.content!r} rebuilt ({e})")
            self._feed_header(lenient)
        for note in lenient.notes:
            self._repair(note)
        self._message_started()

    def _header_without_message(self, why: str, run_goes_on: bool = False) -> None:
        """The header lost its <|message|>: its structure opens the message, its other words are content.

        ``run_goes_on``: the text continues into content with no special token between, so an
        unfinished character at the end of the header is completed by the content that follows.
        """
        header, self._header = self._header, None
        lenient = self._lenient(header, final=not run_goes_on)
        self._repair(why)
        for note in lenient.notes:
            self._repair(note)
        self._header_text = lenient.header_text
        self._feed_header(lenient)
        self._message_started()
        if lenient.content:
            self._utf8.push_text(lenient.content)
        if lenient.tail:
            self._utf8.push_unfinished(lenient.tail)

    def _feed_header(self, h: _LenientHeader) -> None:
        text = h.role
        if h.recipient:
            text += f" to={h.recipient}"
        if h.channel:
            text += f"<|channel|>{h.channel}"
        if h.recipient and h.content_type:
            text += f" {h.content_type}"
        try:
            tokens = self._enc.encode(text, allowed_special=_HEADER_MARKERS)
            for x in [START] + tokens + [MESSAGE]:
                self._inner.process(x)
        except Exception:  # noqa: BLE001 - cannot happen for the shapes built above; never lose the message
            self._inner = self._new_inner()
            for x in [START] + self._enc.encode("assistant") + [MESSAGE]:
                self._inner.process(x)

    def _drop_header(self, why: str) -> None:
        header, self._header = self._header, None
        lenient = self._lenient(header)
        self._repair(why)
        self.log.append(HarmonyMessage(role=lenient.role, name=None, channel=lenient.channel,
                                       recipient=lenient.recipient, content_type=lenient.content_type,
                                       content="", header_text=lenient.header_text + lenient.content,
                                       end="dropped", repairs=tuple(self._msg_repairs), dropped=True))
        self._msg_repairs = []
        self._state = "expect_start"

    def _role_tokens(self, header: _Header) -> list[int]:
        return self._enc.encode(header.implicit_role) if header.implicit_role else []

    def _lenient(self, header: _Header, final: bool = True) -> _LenientHeader:
        """Read a header the forgiving way: structure first, the rest is content."""
        pieces: list[tuple[str, str]] = []  # ("text", s) | ("marker", "<|channel|>")
        run: list[int] = []
        tail = b""
        for t in header.tokens:
            if t in (CHANNEL, CONSTRAIN, _RUN_BREAK):
                if run:
                    pieces.append(("text", self._run_text(run)))
                    run = []
                if t != _RUN_BREAK:
                    pieces.append(("marker", _SPECIAL_NAMES[t]))
            else:
                run.append(t)
        if run:
            if final:
                pieces.append(("text", self._run_text(run)))
            else:
                decoder = codecs.getincrementaldecoder("utf-8")("replace")
                pieces.append(("text", decoder.decode(b"".join(self._bytes(t) or b"" for t in run), final=False)))
                tail = decoder.getstate()[0]
        words: list[tuple[str, int, str | None]] = []  # (word, offset into text, marker before it)
        text, marker = "", None
        for kind, value in pieces:
            if kind == "marker":
                marker = value
                continue
            for m in re.finditer(r"\S+", value):
                words.append((m.group(), len(text) + m.start(), marker))
                marker = None
            text += value
        role, channel, recipient, content_type = header.implicit_role, None, None, None
        notes: list[str] = []
        content_at = None
        structure_seen = any(kind == "marker" for kind, _ in pieces)
        for i, (word, at, before) in enumerate(words):
            structure_seen = structure_seen or i > 0  # every word before the content word was structure
            if before == "<|channel|>" and channel is None:
                channel, rest = _split_glued(word, KNOWN_CHANNELS)
                if rest.startswith("to=") and len(rest) > 3 and recipient is None:
                    recipient = _clean_value(rest[3:])  # "commentaryto=functions.x"
                elif rest:
                    content_at = at + len(channel)  # "finalThe answer": <|message|> missing
                    break
                continue
            if before == "<|constrain|>" and content_type is None:
                content_type = "<|constrain|>" + word
                continue
            if i == 0 and before is None:
                said, rest = _split_glued(word, ROLES)
                if said in ROLES and rest in KNOWN_CHANNELS and channel is None:
                    # "assistantfinal<|message|>": the <|channel|> token is missing
                    role, channel = said, rest
                    continue
                if header.implicit_role is None:
                    role = said if said in ROLES and not rest else word if "." in word else "assistant"
                    continue  # tool authors are "functions.x"
                if word == header.implicit_role:
                    continue  # "<|start|>assistant" in the prompt and again from the model
            if word.startswith("to=") and len(word) > 3:
                if recipient is None:
                    recipient = _clean_value(word[3:])
                elif word[3:] != recipient:
                    notes.append(f"second recipient {word!r} ignored")
                else:
                    notes.append("duplicated to=")
                continue
            if word in BARE_CONTENT_TYPES and recipient is not None and content_type is None:
                content_type = word
                continue
            content_at = at
            break
        if channel is not None:
            channel = _clean_value(channel) or None
        if role is None:
            role = "assistant"
        if role not in ROLES and recipient is None:
            role = "assistant"  # harmony reads a lone unknown role word as an error, not a tool author
        if content_at is not None and header.implicit_role and not structure_seen:
            content_at = 0  # text with no header at all: its leading whitespace is content too
        if content_at is None:
            return _LenientHeader(role, channel, recipient, content_type, text, "", notes, tail)
        return _LenientHeader(role, channel, recipient, content_type, text[:content_at], text[content_at:],
                              notes, tail)

    def _run_text(self, tokens: list[int]) -> str:
        return b"".join(self._bytes(t) or b"" for t in tokens).decode("utf-8", errors="replace")

    # -- messages ----------------------------------------------------------------------------

    def _message_started(self) -> None:
        inner = self._inner
        role = inner.current_role
        self._state = "content"
        self._content = []
        self._events.append(MessageStart(self._index, role.value if role is not None else "assistant",
                                         inner.current_channel, inner.current_recipient,
                                         inner.current_content_type))

    def _content_text(self, text: str) -> None:
        self._content.append(text)
        self._events.append(ContentDelta(self._index, text))

    def _forward_content(self, tokens: list[int]) -> None:
        for x in tokens:
            self._inner.process(x)
            delta = self._inner.last_content_delta
            if delta:
                self._content_text(delta)

    def _close_message_implicitly(self, by: str) -> None:
        self._repair(f"missing <|end|> before {by}")
        self._utf8.flush()
        self._inner.process(END)
        self._message_ended("end")

    def _message_ended(self, end: str) -> None:
        try:
            message = self._from_harmony(json.loads(self._inner._inner.messages)[-1], end)
        except Exception:  # noqa: BLE001 - harmony lost it (see _internal_error): report ours
            message = HarmonyMessage("assistant", None, None, None, None, "".join(self._content),
                                     self._header_text, end, tuple(self._msg_repairs))
        self.log.append(message)
        self._events.append(MessageEnd(self._index, message))
        self._index += 1
        self._msg_repairs = []
        self._content = []
        self._state = "expect_start"

    def _from_harmony(self, m: dict, end: str) -> HarmonyMessage:
        author = m.get("author") or {}
        role = author.get("role") or m.get("role") or "assistant"
        name = author.get("name") if author else m.get("name")
        content = m.get("content") or ""
        text = content if isinstance(content, str) else "".join(
            c.get("text", "") for c in content if isinstance(c, dict))
        return HarmonyMessage(role=role, name=name, channel=m.get("channel"), recipient=m.get("recipient"),
                              content_type=m.get("content_type"), content=text, header_text=self._header_text,
                              end=end, repairs=tuple(self._msg_repairs))

    # -- bookkeeping ---------------------------------------------------------------------------

    def _repair(self, what: str) -> None:
        self.repairs.append(what)
        self._msg_repairs.append(what)

    def _internal_error(self, e: Exception) -> None:
        """A state we did not foresee: keep what the message has, restart harmony, go on."""
        self._repair(f"parser reset after {type(e).__name__}: {e}")
        if self._state == "content":
            message = HarmonyMessage("assistant", None, None, None, None, "".join(self._content),
                                     self._header_text, "eos", tuple(self._msg_repairs))
            self.log.append(message)
            self._events.append(MessageEnd(self._index, message))
            self._index += 1
        self._inner = self._new_inner()
        self._utf8 = _Utf8Guard(self)
        self._header = None
        self._msg_repairs = []
        self._content = []
        self._state = "expect_start"

    def _name(self, t: int, kind: str) -> str:
        if kind in ("text", "special"):
            return (self._bytes(t) or b"").decode("utf-8", errors="replace") or str(t)
        return kind if kind != "invalid" else f"token id {t}"

    def _drain(self) -> list:
        events, self._events = self._events, []
        return events


class _Utf8Guard:
    """Content tokens reach harmony only as complete, valid UTF-8.

    While the bytes are valid the original tokens go through (harmony decodes them itself);
    tokens ending inside a character wait for the rest. After invalid bytes the run is decoded
    here with U+FFFD replacements and passed on as re-encoded text, until the next special
    token: the same text a lossy decode of the run gives.
    """

    def __init__(self, parser: HarmonyStreamParser):
        self._p = parser
        self._strict = codecs.getincrementaldecoder("utf-8")("strict")
        self._lossy = None
        self._held: list[int] = []
        self._held_bytes = b""

    def push(self, t: int, data: bytes) -> None:
        if self._lossy is not None:
            self._emit_text(self._lossy.decode(data, final=False))
            return
        self._held.append(t)
        self._held_bytes += data
        try:
            self._strict.decode(data, final=False)
        except UnicodeDecodeError:
            self._lossy = codecs.getincrementaldecoder("utf-8")("replace")
            held, self._held, self._held_bytes = self._held_bytes, [], b""
            self._strict.reset()
            self._emit_text(self._lossy.decode(held, final=False))
            return
        if not self._strict.getstate()[0]:
            tokens, self._held, self._held_bytes = self._held, [], b""
            self._p._forward_content(tokens)

    def push_text(self, text: str) -> None:
        self.flush()
        self._emit_text(text)

    def push_unfinished(self, data: bytes) -> None:
        """Bytes of a character the next tokens may finish (the end of a header turned content)."""
        self.flush()
        self._lossy = codecs.getincrementaldecoder("utf-8")("replace")
        self._emit_text(self._lossy.decode(data, final=False))

    def flush(self) -> None:
        """A run of text ends (special token or end of stream): decode what is left, lossily."""
        if self._lossy is not None:
            self._emit_text(self._lossy.decode(b"", final=True))
            self._lossy = None
        elif self._held:
            held, self._held, self._held_bytes = self._held_bytes, [], b""
            self._strict.reset()
            self._emit_text(held.decode("utf-8", errors="replace"))

    def _emit_text(self, text: str) -> None:
        if text:
            self._p._forward_content(encode_bounded(self._p._enc, text, allowed_special=set()))


def _split_glued(word: str, known: tuple[str, ...]) -> tuple[str, str]:
    """"finalThe" -> ("final", "The") when a known name starts the word; else (word, "")."""
    if word in known:
        return word, ""
    for name in known:
        if word.startswith(name):
            return name, word[len(name):]
    return word, ""


def _clean_value(value: str) -> str:
    # A header value never holds markup; cut where a literal "<|" starts.
    return value.split("<|", 1)[0]
