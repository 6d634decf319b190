"""The gpt-oss Harmony encoding (openai-harmony) and its o200k vocabulary, resolved offline.

openai-harmony loads ``o200k_base.tiktoken`` from ``$TIKTOKEN_ENCODINGS_BASE`` or downloads it
from openaipublic.blob.core.windows.net on first use; a server without that network then fails
on its first chat request (a known complaint). :func:`configure_offline_vocab` points
openai-harmony at a local copy before anything loads it, and says in one line what to do when
none is found.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger(__name__)

# Harmony's special tokens in o200k_harmony (SPEC.md section 3).
RETURN = 200002
CONSTRAIN = 200003
CHANNEL = 200005
START = 200006
END = 200007
MESSAGE = 200008
CALL = 200012

# Set by the first process that resolved (or failed to resolve) the vocabulary, so the
# spawned SGLang processes, which inherit the environment, neither search again nor repeat
# the startup line.
_RESOLVED_ENV = "SGLANG_EXT_HARMONY_VOCAB"
_MISSING = "missing"


def configure_offline_vocab() -> str | None:
    """Make openai-harmony find o200k_base offline; return the directory, or None (one line logged).

    Order: ``$TIKTOKEN_ENCODINGS_BASE``, our cache, the tiktoken caches, a gpt-oss
    ``tokenizer.json`` in the Hugging Face cache, an installed ``quicktok-v1`` wheel (all in
    ``sglang_ext.launch.tokenizer.find_o200k_vocab_offline``). Nothing is downloaded here.
    """
    done = os.environ.get(_RESOLVED_ENV)
    if done:
        return None if done == _MISSING else done
    from sglang_ext.launch.tokenizer import VOCAB_MISSING_HINT, find_o200k_vocab_offline, harmony_env

    try:
        vocab_dir = find_o200k_vocab_offline()
    except Exception as e:  # noqa: BLE001 - a broken cache must not stop the server
        logger.debug("o200k vocabulary search failed: %s", e)
        vocab_dir = None
    if vocab_dir is None:
        os.environ[_RESOLVED_ENV] = _MISSING
        logger.warning("sglang-ext: %s; until then the gpt-oss parsers fall back to SGLang's text "
                       "parsers if openai-harmony cannot download it", VOCAB_MISSING_HINT)
        return None
    for key, value in harmony_env(vocab_dir).items():
        os.environ.setdefault(key, value)
    os.environ[_RESOLVED_ENV] = vocab_dir
    return vocab_dir


@functools.lru_cache(maxsize=1)
def harmony_encoding():
    """The HARMONY_GPT_OSS encoding (loaded once per process; raises if the vocabulary is unavailable)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    configure_offline_vocab()
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@functools.lru_cache(maxsize=1)
def harmony_available() -> bool:
    try:
        harmony_encoding()
        return True
    except Exception as e:  # noqa: BLE001
        logger.warning("sglang-ext: openai-harmony encoding unavailable (%s); using SGLang's text parsers", e)
        return False


# openai-harmony's BPE takes time quadratic in the length of one pre-tokenizer piece, and a run of one
# punctuation character is one piece: 80k "{" took 2.1 s, 150k held a server's every endpoint for 21.6 s
# (session 24's fuzz round). Text longer than this is encoded in pieces of at most this many characters.
BOUNDED_PIECE_CHARS = 2048


def encode_bounded(enc, text: str, allowed_special: str | set = "all") -> list[int]:
    """``enc.encode(text, allowed_special=...)`` in time linear in the text: the special tokens it allows
    are encoded as themselves (any other special token's text as ordinary text, as with
    ``disallowed_special=()``), the text between them in pieces of at most BOUNDED_PIECE_CHARS characters
    (never splitting a surrogate pair, so every piece is valid text). Decoding the result gives ``text``
    back, and the special tokens are the same; only the ordinary tokens of runs longer than a piece may
    differ (BPE merges do not cross a cut). For parsers, which read structure from the special tokens and
    content as decoded text; never for a prompt the model reads."""
    if len(text) <= BOUNDED_PIECE_CHARS:
        if allowed_special == "all":
            return enc.encode(text, allowed_special="all")
        return enc.encode(text, allowed_special=set(allowed_special), disallowed_special=())
    import re

    specials = enc.special_tokens_set if allowed_special == "all" else set(allowed_special)
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")" if specials else None
    tokens: list[int] = []
    for i, part in enumerate(re.split(pattern, text) if pattern else [text]):
        if i % 2:  # a special token's text (re.split puts the captured separators at odd positions)
            tokens += enc.encode(part, allowed_special={part})
            continue
        start = 0
        while start < len(part):
            end = min(start + BOUNDED_PIECE_CHARS, len(part))
            if end < len(part) and "\ud800" <= part[end - 1] <= "\udbff":
                end -= 1  # keep a surrogate pair together
            tokens += enc.encode(part[start:end], disallowed_special=())
            start = end
    return tokens


# Text contents at least this long are encoded by tiktoken and spliced into openai-harmony's rendering.
SPLICE_MIN_CHARS = 2048
_SPLICE_MARKER = "\u00a7sglang-ext-splice-{}\u00a7"
_MESSAGE_TOKEN = "<|message|>"


@functools.lru_cache(maxsize=1)
def _o200k():
    import tiktoken

    configure_offline_vocab()
    return tiktoken.get_encoding("o200k_base")


def render_for_completion_linear(encoding, conversation, next_role) -> list[int]:
    """``encoding.render_conversation_for_completion(conversation, next_role)``, the same tokens, in time
    linear in the text. openai-harmony's BPE is quadratic in one long pre-token piece (a run of punctuation:
    36 s for a 300k-character tool result, the server's tokenizer held all that time); tiktoken's is linear
    and its o200k tokens are harmony's for ordinary text. A message's content sits between ``<|message|>``
    and a special token, so harmony encodes it alone, as ordinary text (special tokens' text included). So a
    message whose one content is text of SPLICE_MIN_CHARS or more is rendered with a marker instead, and the
    marker's tokens are replaced by tiktoken's tokens of the text. Anything unexpected (a marker found other
    than once right after ``<|message|>`` and before a special token, or missing from a message harmony does
    not drop) falls back to harmony's own rendering."""
    from openai_harmony import Conversation, TextContent

    texts, messages = [], []
    for message in conversation.messages:
        content = message.content
        if len(content) == 1 and isinstance(content[0], TextContent) and len(content[0].text) >= SPLICE_MIN_CHARS:
            texts.append(content[0].text)
            message = message.model_copy(update={"content": [TextContent(text=_SPLICE_MARKER.format(len(texts) - 1))]})
        messages.append(message)
    if not texts:
        return list(encoding.render_conversation_for_completion(conversation, next_role))
    try:
        rendered = list(encoding.render_conversation_for_completion(Conversation.from_messages(messages), next_role))
        spliced = _splice(encoding, rendered, messages, texts)
    except Exception:  # noqa: BLE001 - e.g. text tiktoken cannot encode: harmony decides
        spliced = None
    if spliced is None:
        return list(encoding.render_conversation_for_completion(conversation, next_role))
    return spliced


def _splice(encoding, rendered: list[int], messages, texts: list[str]) -> list[int] | None:
    message_id = encoding.encode(_MESSAGE_TOKEN, allowed_special="all")[0]
    o200k = _o200k()
    replacements = {}  # start index of a marker's tokens -> (its length, the text's tokens)
    for i, text in enumerate(texts):
        marker = encoding.encode(_SPLICE_MARKER.format(i), disallowed_special=())
        n = len(marker)
        found = [j for j in range(1, len(rendered) - n) if rendered[j:j + n] == marker]
        if len(found) > 1 or not all(rendered[j - 1] == message_id and encoding.is_special_token(rendered[j + n])
                                     for j in found):
            return None
        if not found:
            owner = next(m for m in messages if m.content[0].text == _SPLICE_MARKER.format(i))
            if not (owner.author.role.value == "assistant" and owner.channel == "analysis"):
                return None  # only an analysis message may be dropped (harmony drops those before a final)
            continue
        replacements[found[0]] = (n, o200k.encode(text, allowed_special=set(), disallowed_special=()))
    out, j = [], 0
    for start in sorted(replacements):
        n, tokens = replacements[start]
        out += rendered[j:start] + tokens
        j = start + n
    return out + rendered[j:]

