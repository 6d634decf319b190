"""Stream a chat completion and print each token with its highest SingProbe labels.

The code a user copies. Two readers of the same stream:
  - the official `openai` SDK: the scores ride each chunk's choice as the extra field
    `token_probe_probs` (pydantic keeps unknown fields in `model_extra`);
  - a plain SSE reader with `requests`, for clients without the SDK.

Each chunk carries one `{label: probability}` dict per token it covers, in order; the
score that arrives with a token was computed from the context before it (the forward
that produced the token). Documented threshold: p > 0.5.

    python -m sglang_ext.launch.stream_client --base-url http://127.0.0.1:30000 "Hello"
"""

from __future__ import annotations

import argparse
import json
import sys

SCORES = "token_probe_probs"


def top_labels(scores: dict, k: int = 2) -> str:
    best = sorted(scores.items(), key=lambda kv: -kv[1])[:k]
    return " ".join(f"{name}={p:.2f}" for name, p in best)


def stream_with_openai_sdk(base_url: str, model: str, prompt: str, max_tokens: int, out=sys.stdout) -> list:
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none")
    received = []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.model_extra or {}
            scores = extra.get(SCORES) or []
            received.extend(scores)
            delta = choice.delta
            text = (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
            note = "; ".join(top_labels(s) for s in scores)
            if text or scores:
                print(f"{text!r:>24}  {note}", file=out)
    return received


def stream_with_sse(base_url: str, model: str, prompt: str, max_tokens: int, out=sys.stdout) -> list:
    import requests

    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    received = []
    with requests.post(base_url.rstrip("/") + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        # bytes split on \n: decoded first, Unicode line rules (str.splitlines) would also split on U+2028
        for line in (raw.decode() for raw in r.iter_lines()):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: "):]).get("choices", []):
                scores = choice.get(SCORES) or []
                received.extend(scores)
                delta = choice.get("delta") or {}
                text = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if text or scores:
                    print(f"{text!r:>24}  {'; '.join(top_labels(s) for s in scores)}", file=out)
    return received


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--model", default="default")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reader", choices=("openai", "sse"), default="openai")
    args = ap.parse_args(argv)
    reader = stream_with_openai_sdk if args.reader == "openai" else stream_with_sse
    scores = reader(args.base_url, args.model, args.prompt, args.max_tokens)
    print(f"{len(scores)} token scores received", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
