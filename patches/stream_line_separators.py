"""Patch: streamed JSON carries no Unicode line separators (SGLang 0.5.23).

The server's streams are lines: SSE (`data: {json}`: native `/generate`, OpenAI chat and completions,
the Responses and Anthropic APIs) and NDJSON (the Ollama routes). Their JSON encoders (orjson,
msgspec, pydantic, `json.dumps(ensure_ascii=False)`) write U+2028, U+2029 and U+0085 raw inside
strings, as JSON allows; but a client that splits the stream with Unicode line rules (Python's
`str.splitlines`, `requests.iter_lines(decode_unicode=True)`, which uses it) reads such a chunk
as two lines and fails to parse either half. The tiny model's vocabulary holds these characters,
so any response may carry one.

Target: `http_server.launch_server` (BEFORE) installs an ASGI middleware that, in responses of
type `text/event-stream` or `application/x-ndjson` without a Content-Length, writes each of the
three characters as its JSON escape (`\\u2028`, `\\u2029`, `\\u0085`). They can only occur inside
JSON strings there (no encoder emits them elsewhere, and SSE's own line ends are CR / LF), so
every event parses to the same value; a character split across two body chunks is held back
until the next one.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

ESCAPES = {"\u2028".encode(): b"\\u2028", "\u2029".encode(): b"\\u2029", "\u0085".encode(): b"\\u0085"}
STREAM_TYPES = (b"text/event-stream", b"application/x-ndjson")
# proper prefixes of the encoded characters, held back when a chunk ends with one
_PARTIALS = sorted({seq[:i] for seq in ESCAPES for i in range(1, len(seq))}, key=len, reverse=True)


def escape_line_separators(data: bytes) -> bytes:
    for raw, escaped in ESCAPES.items():
        if raw in data:
            data = data.replace(raw, escaped)
    return data


def split_partial_tail(data: bytes) -> tuple[bytes, bytes]:
    """(data without a trailing incomplete separator, that tail)."""
    for partial in _PARTIALS:
        if data.endswith(partial):
            return data[: -len(partial)], partial
    return data, b""


class LineSeparatorEscapeMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"rewrite": False, "tail": b""}

        async def send_escaped(message):
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or [])
                content_type = headers.get(b"content-type", b"")
                state["rewrite"] = (content_type.split(b";")[0].strip() in STREAM_TYPES
                                    and b"content-length" not in headers)
            elif message["type"] == "http.response.body" and state["rewrite"]:
                body = state["tail"] + message.get("body", b"")
                more = message.get("more_body", False)
                if more:
                    body, state["tail"] = split_partial_tail(body)
                else:
                    state["tail"] = b""
                message = {**message, "body": escape_line_separators(body)}
            await send(message)

        await self.app(scope, receive, send_escaped)


def _install_middleware(*args, **kwargs):
    from sglang.srt.entrypoints.http_server import app  # builds the HTTP app on import: ~3700 modules

    if not any(m.cls is LineSeparatorEscapeMiddleware for m in app.user_middleware):
        app.add_middleware(LineSeparatorEscapeMiddleware)


def register() -> None:
    HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", _install_middleware, HookType.BEFORE)
