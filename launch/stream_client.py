"""Stream a chat completion and show each token with its SingProbe score; optionally ask the guard to stop it.

The code a user copies (module ``sglang_ext.launch.stream_client``)::

    python -m sglang_ext.launch.stream_client --base-url http://127.0.0.1:30000 --model default \\
        --label label_8 --stop label_8=0.9 "Explain how vaccines work"

Two readers of the same stream:
  - the official `openai` SDK: the scores ride each chunk's choice as the extra field
    `token_probe_probs` (pydantic keeps unknown fields in `model_extra`); the guard's per-request
    thresholds go in the request's `extra_body` as `custom_params.probe_stop`;
  - a plain SSE reader with `requests`, for clients without the SDK.

Each chunk carries one `{label: probability}` dict per token it covers, in order; the score that
arrives with a token was computed from the context before it (the forward that produced the token).
A parser (reasoning, tool calls) may hold a channel's text back and release it with a later token, so
the request asks for `logprobs`, whose `content[].token` is each token's own text, and a token is shown
in the channel (reasoning, content, tool) of the next channel text; `·` marks a token with no text.

Each token is coloured by the score of `--label` (green 0 -> red 1; `--colour never`, a pipe or
NO_COLOR print the score as `‹62›` after the token instead), and marked `†` where `--mark` (SingProbe's
hallucination label, label_9) is above `--mark-threshold`. `label_N` also names the N-th label of a
probe whose config gives its labels names. When the guard stops the answer (`finish_reason`
`content_filter`) the client says at which token, and which label crossed which threshold.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass

SCORES = "token_probe_probs"
GUARD_FINISH = "content_filter"
DEFAULT_LABEL = "label_8"  # SingProbe's response_unsafe
DEFAULT_MARK = "label_9"  # SingProbe's hallucination
DEFAULT_PROMPT = "Explain in one sentence why the sky is blue."
EMPTY_TOKEN = "\u00b7"
MARK = "\u2020"
# xterm-256 backgrounds from green (score 0) to red (score 1), light enough for black text
PALETTE = (114, 150, 186, 222, 216, 210, 203, 196)


class LabelNotFound(ValueError):
    pass


def parse_stop(spec: str) -> dict[str, float]:
    """'label_8=0.9,label_1=0.8' -> {'label_8': 0.9, 'label_1': 0.8}; thresholds in [0, 1]."""
    out = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"expected label=threshold, got {part.strip()!r}")
        try:
            threshold = float(value)
        except ValueError:
            raise ValueError(f"threshold of {name.strip()!r} is not a number: {value.strip()!r}") from None
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold of {name.strip()!r} must lie in [0, 1], got {threshold}")
        out[name.strip()] = threshold
    if not out:
        raise ValueError("no label=threshold given")
    return out


def resolve_label(name: str, labels: list[str]) -> str:
    """`name` itself if the probe has it, else `label_N` as the probe's N-th label."""
    if name in labels:
        return name
    m = re.fullmatch(r"label_(\d+)", name)
    if m and int(m.group(1)) < len(labels):
        return labels[int(m.group(1))]
    raise LabelNotFound(f"the probe has no label {name!r}; its labels are {labels}")


def use_colour(choice: str, out) -> bool:
    if choice == "always":
        return True
    if choice == "never" or os.environ.get("NO_COLOR"):
        return False
    return bool(getattr(out, "isatty", lambda: False)())


def show(text: str) -> str:
    """One line per channel: newlines and tabs made visible instead of breaking the layout."""
    return text.replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")


@dataclass
class Token:
    index: int
    channel: str | None = None  # reasoning | content | tool, once a channel's text covered it
    text: str | None = None
    scores: dict | None = None


class StreamResult(list):
    """The token scores in order (a list, as before), with what else the stream said."""

    def __init__(self, requested_stop: dict | None = None):
        super().__init__()
        self.tokens: list[Token] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.requested_stop = dict(requested_stop or {})


class TokenView:
    """Writes tokens inline as they arrive, coloured by one label's score; keeps per-label maxima.

    Each chunk brings the scores of its tokens, their texts (`logprobs.content[].token`) and text by
    channel (`delta`); a parser may release a channel's text several tokens later. So the three are
    joined by token index, a token takes the channel of the next channel text, and it is printed once
    its channel and text are known."""

    def __init__(self, label: str = DEFAULT_LABEL, mark: str = DEFAULT_MARK, mark_threshold: float = 0.5,
                 colour: bool = False, out=sys.stdout, indent: str = "  "):
        self.label, self.mark, self.mark_threshold = label, mark, mark_threshold
        self.colour, self.out, self.indent = colour, out, indent
        self.tokens: list[Token] = []
        self.maxima: dict[str, tuple[float, int]] = {}
        self.labels: list[str] | None = None
        self._label, self._mark = None, None
        self._scored = self._texted = self._printed = 0
        self._unplaced: list[Token] = []
        self._channel = "content"  # the channel of the latest channel text
        self._line_channel = None  # the channel of the line being printed

    def _resolve(self, scores: dict) -> None:
        self.labels = list(scores)
        self._label = resolve_label(self.label, self.labels)
        try:
            self._mark = resolve_label(self.mark, self.labels) if self.mark else None
        except LabelNotFound:
            self._mark = None  # a probe without that label: nothing to mark

    def legend(self) -> str:
        label = self._label or self.label
        how = "background green (0) to red (1)" if self.colour else "\u2039NN\u203a = score x 100 after each token"
        mark = f"; {MARK} = {self._mark or self.mark} > {self.mark_threshold}" if self.mark else ""
        return f"colour: {label} ({how}){mark}; {EMPTY_TOKEN} = a token with no text of its own"

    def _token(self, index: int) -> Token:
        while len(self.tokens) <= index:
            token = Token(len(self.tokens))
            self.tokens.append(token)
            self._unplaced.append(token)
        return self.tokens[index]

    def scores(self, rows: list[dict]) -> None:
        for row in rows:
            if self.labels is None:
                self._resolve(row)
            token = self._token(self._scored)
            token.scores = row
            for name, p in row.items():
                if name not in self.maxima or p > self.maxima[name][0]:
                    self.maxima[name] = (p, token.index)
            self._scored += 1

    def texts(self, texts: list[str]) -> None:
        for text in texts:
            self._token(self._texted).text = text
            self._texted += 1

    def channel(self, channel: str) -> None:
        """A channel's text arrived: the tokens so far without a channel belong to it."""
        for token in self._unplaced:
            token.channel = channel
        self._unplaced = []
        self._channel = channel

    def chunk(self, choice: dict) -> None:
        """One chunk's choice (a dict, as the SSE JSON or the SDK's model_dump gives it)."""
        self.scores(choice.get(SCORES) or [])
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        self.texts([entry.get("token") or "" for entry in logprobs])
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content"):
            self.channel("reasoning")
        if delta.get("content"):
            self.channel("content")
        if delta.get("tool_calls"):
            self.channel("tool")
        self._print_ready()

    def _print_ready(self, final: bool = False) -> None:
        while self._printed < len(self.tokens):
            token = self.tokens[self._printed]
            if token.channel is None or (token.text is None and not final):
                return
            self._print(token)
            self._printed += 1

    def _print(self, token: Token) -> None:
        if token.channel != self._line_channel:
            if self._line_channel is not None:
                self.out.write("\n")
            self.out.write(f"{self.indent}[{token.channel}] ")
            self._line_channel = token.channel
        shown = show(token.text or "") or EMPTY_TOKEN
        if token.scores is not None:
            shown = self._paint(shown, token.scores[self._label])
            if self._mark is not None and token.scores.get(self._mark, 0.0) > self.mark_threshold:
                shown += MARK
        self.out.write(shown)
        self.out.flush()

    def _paint(self, text: str, p: float) -> str:
        if self.colour:
            bg = PALETTE[min(len(PALETTE) - 1, int(p * len(PALETTE)))]
            return f"\x1b[48;5;{bg}m\x1b[30m{text}\x1b[0m"
        return f"{text}\u2039{round(p * 100):02d}\u203a"

    def end(self) -> None:
        self.channel(self._channel)
        self._print_ready(final=True)
        if self._line_channel is not None:
            self.out.write("\n")
            self.out.flush()
        self._line_channel = None

    def maxima_lines(self) -> list[str]:
        width = max((len(n) for n in self.maxima), default=0)
        return [f"{name:<{width}}  max {p:.4f} at token {i + 1}" for name, (p, i) in self.maxima.items()]


def guard_stop_report(result: StreamResult, operator_stop: dict | None = None) -> str | None:
    """Where the guard stopped the answer and why, or None if it did not. The chat stream says only
    `content_filter`: the label is the one whose score, at the last token, crossed its threshold."""
    if result.finish_reason != GUARD_FINISH:
        return None
    if not result.tokens:
        return "the guard stopped the request before any token (finish_reason content_filter)"
    last = result.tokens[-1]
    if last.scores is None:
        return f"stopped at token {last.index + 1} by the guard (finish_reason content_filter)"
    thresholds = dict(operator_stop or {})
    for name, t in result.requested_stop.items():
        thresholds[name] = min(t, thresholds.get(name, t))
    crossed = [(last.scores[n] - t, n, t) for n, t in thresholds.items()
               if n in last.scores and last.scores[n] > t]
    where = f"stopped at token {last.index + 1} ({last.text!r})"
    if not crossed:
        return f"{where} by the server's guard (finish_reason content_filter)"
    _, name, t = max(crossed)
    return f"{where}: {name} = {last.scores[name]:.4f} > threshold {t} (finish_reason content_filter)"


def _chat_body(model, prompt, max_tokens, stop):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            # each token's own text: a parser may hold a channel's text back for several tokens
            "logprobs": True}
    if stop:
        body["custom_params"] = {"probe_stop": stop}
    return body


def _collect(view: TokenView, result: StreamResult, choice: dict) -> None:
    result.extend(choice.get(SCORES) or [])
    view.chunk(choice)
    if choice.get("finish_reason"):
        result.finish_reason = choice["finish_reason"]


def stream_with_openai_sdk(base_url: str, model: str, prompt: str, max_tokens: int, out=sys.stdout,
                           view: TokenView | None = None, stop: dict | None = None,
                           api_key: str | None = None) -> StreamResult:
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none")
    view = view or TokenView(out=out)
    result = StreamResult(stop)
    body = _chat_body(model, prompt, max_tokens, stop)
    extra = {"custom_params": body["custom_params"]} if stop else None
    stream = client.chat.completions.create(
        model=model, messages=body["messages"], max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, logprobs=True, extra_body=extra)
    for chunk in stream:
        if chunk.usage is not None:
            result.usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            if choice.index == 0:
                _collect(view, result, choice.model_dump(exclude_none=True))
    view.end()
    result.tokens = view.tokens
    return result


def stream_with_sse(base_url: str, model: str, prompt: str, max_tokens: int, out=sys.stdout,
                    view: TokenView | None = None, stop: dict | None = None,
                    api_key: str | None = None) -> StreamResult:
    import requests

    view = view or TokenView(out=out)
    result = StreamResult(stop)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with requests.post(base_url.rstrip("/") + "/v1/chat/completions", json=_chat_body(model, prompt, max_tokens, stop),
                       headers=headers, stream=True, timeout=600) as r:
        if not r.ok:
            raise RuntimeError(f"the server answered {r.status_code}: {r.text[:500]}")
        done = False
        # bytes split on \n: decoded first, Unicode line rules (str.splitlines) would also split on U+2028
        for line in (raw.decode() for raw in r.iter_lines()):
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"the server ended the stream with an error: {event['error']}")
            if event.get("usage"):
                result.usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("index", 0) == 0:
                    _collect(view, result, choice)
        if not done:
            raise RuntimeError("the server cut the stream before [DONE]")
    view.end()
    result.tokens = view.tokens
    return result


def error_line(e: Exception, base_url: str) -> str:
    """One line for a failed request: the server's own message where it sent one."""
    body = getattr(e, "body", None)
    status = getattr(e, "status_code", None)
    if isinstance(body, dict) and body.get("message"):
        return f"the server answered {status}: {body['message']}"
    if type(e).__name__ in ("APIConnectionError", "ConnectionError"):
        return f"cannot reach {base_url}: {e}"
    return f"{type(e).__name__}: {e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ext.launch.stream_client",
                                 description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    ap.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default %(default)s)")
    ap.add_argument("--model", default="default", help="the served model name (default %(default)s)")
    ap.add_argument("--label", default=DEFAULT_LABEL, help="colour tokens by this label's score (default %(default)s)")
    ap.add_argument("--mark", default=DEFAULT_MARK, help=f"mark {MARK} where this label is high (default %(default)s)")
    ap.add_argument("--mark-threshold", type=float, default=0.5)
    ap.add_argument("--stop", default=None, metavar="LABEL=P,...",
                    help="ask the guard to stop the answer when a label's score exceeds P "
                         "(custom_params.probe_stop), e.g. label_8=0.9")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reader", choices=("openai", "sse"), default="openai")
    ap.add_argument("--api-key", default=os.environ.get("SGLANG_API_KEY"),
                    help="bearer key, for a server started with --api-key (default $SGLANG_API_KEY)")
    ap.add_argument("--colour", "--color", choices=("auto", "always", "never"), default="auto")
    args = ap.parse_args(argv)
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    if not args.prompt.strip():
        ap.error("the prompt is empty")
    try:
        stop = parse_stop(args.stop) if args.stop is not None else None
    except ValueError as e:
        ap.error(f"--stop: {e}")

    out = sys.stdout
    view = TokenView(label=args.label, mark=args.mark, mark_threshold=args.mark_threshold,
                     colour=use_colour(args.colour, out), out=out)
    reader = stream_with_openai_sdk if args.reader == "openai" else stream_with_sse
    try:
        result = reader(args.base_url, args.model, args.prompt, args.max_tokens, view=view, stop=stop,
                        api_key=args.api_key)
    except LabelNotFound as e:
        view.end()
        print(f"error: --label/--mark: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the SDK's, requests' and our own errors: one line, no traceback
        view.end()
        print(f"error: {error_line(e, args.base_url)}", file=sys.stderr)
        return 1
    if not result.tokens:
        print("(no token scores in the stream: the server runs without a SingProbe, --probe-ckpt)")
    else:
        print(view.legend())
        print("per-label maxima:")
        for line in view.maxima_lines():
            print("  " + line)
    report = guard_stop_report(result)
    if report:
        print("guard: " + report)
    n = (result.usage or {}).get("completion_tokens", len(result.tokens))
    print(f"{n} tokens, {len(result)} scores, finish_reason {result.finish_reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
