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
_SPLICE_MARKER = "\u00a7sglang-ext-splice-{}-{}\u00a7"  # (this call's nonce, the text's index)
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
    message whose one content is text of SPLICE_MIN_CHARS or more is rendered with a marker instead (a
    random nonce in it, so that no client text can pose as one), and the marker's tokens are replaced by
    tiktoken's tokens of the text. Anything unexpected (a marker found twice, or missing from a message
    harmony does not drop; text that is not valid Unicode, which harmony refuses) falls back to harmony's
    own rendering."""
    import secrets

    from openai_harmony import Conversation, TextContent

    nonce = secrets.token_hex(8)
    markers, texts, owners, messages = [], [], [], []
    for message in conversation.messages:
        content = message.content
        if len(content) == 1 and isinstance(content[0], TextContent) and len(content[0].text) >= SPLICE_MIN_CHARS:
            markers.append(_SPLICE_MARKER.format(nonce, len(texts)))
            texts.append(content[0].text)
            owners.append(message)
            message = message.model_copy(update={"content": [TextContent(text=markers[-1])]})
        messages.append(message)
    if not texts:
        return list(encoding.render_conversation_for_completion(conversation, next_role))
    try:
        for text in texts:
            text.encode("utf-8")  # a lone surrogate: harmony raises its own error
        rendered = list(encoding.render_conversation_for_completion(Conversation.from_messages(messages), next_role))
        spliced = _splice(encoding, rendered, markers, texts, owners)
    except Exception:  # noqa: BLE001 - harmony decides (and raises where it would)
        spliced = None
    if spliced is None:
        return list(encoding.render_conversation_for_completion(conversation, next_role))
    return spliced


def _splice(encoding, rendered: list[int], markers: list[str], texts: list[str], owners) -> list[int] | None:
    """One pass over the rendered tokens: each ``<|message|>`` content whose tokens are a marker's."""
    message_id = encoding.encode(_MESSAGE_TOKEN, allowed_special="all")[0]
    index = {tuple(encoding.encode(m, disallowed_special=())): i for i, m in enumerate(markers)}
    found = {}  # marker index -> (start, end) of its tokens
    j, n = 0, len(rendered)
    while j < n:
        if rendered[j] != message_id:
            j += 1
            continue
        k = j + 1
        while k < n and not encoding.is_special_token(rendered[k]):
            k += 1
        i = index.get(tuple(rendered[j + 1:k]))
        if i is not None:
            if i in found:
                return None
            found[i] = (j + 1, k)
        j = k
    for i, owner in enumerate(owners):
        if i not in found and not (owner.author.role.value == "assistant" and owner.channel == "analysis"):
            return None  # only an analysis message may be dropped (harmony drops those before a final)
    o200k = _o200k()
    out, j = [], 0
    for i, (start, end) in sorted(found.items(), key=lambda item: item[1]):
        out += rendered[j:start] + o200k.encode(texts[i], allowed_special=set(), disallowed_special=())
        j = end
    return out + rendered[j:]
