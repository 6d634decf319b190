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
import re
import secrets

import tiktoken

from sglang_ext.launch.tokenizer import VOCAB_MISSING_HINT, find_o200k_vocab_offline, harmony_env

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
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding  # optional: harmony_available falls back

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


# Text at least this long is encoded by tiktoken's o200k_base rather than by openai-harmony, whose BPE is
# quadratic in one long pre-token piece (a run of one punctuation character is one piece: 80k "{" took
# 2.1 s, 300k "!" 36 s, holding the server's tokenizer); tiktoken's tokens are harmony's for ordinary text,
# in linear time.
LINEAR_MIN_CHARS = 2048


@functools.lru_cache(maxsize=1)
def _o200k():
    configure_offline_vocab()
    return tiktoken.get_encoding("o200k_base")


def _ordinary_tokens(text: str) -> list[int]:
    return _o200k().encode(text, allowed_special=set(), disallowed_special=())


@functools.lru_cache(maxsize=8)
def _special_split(enc, allowed: frozenset):
    """(the regex splitting text at these special tokens' text, their ids): built once per set; an encode
    with allowed_special={text} costs harmony ~3 ms a call (0.14 ms with "all")."""
    ordered = sorted(allowed, key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(t) for t in ordered) + ")"), {
        t: enc.encode(t, allowed_special="all")[0] for t in ordered}


def encode_bounded(enc, text: str, allowed_special: str | set = "all") -> list[int]:
    """``enc.encode(text, allowed_special=...)``, with ``disallowed_special=()`` (any other special token's
    text is ordinary text), the same tokens, in time linear in the text: from LINEAR_MIN_CHARS characters
    the text between the allowed special tokens is encoded by tiktoken (text that is not valid Unicode is
    left to harmony). What the text-only parsers encode (/parse_function_call, /separate_reasoning)."""
    allowed = enc.special_tokens_set if allowed_special == "all" else set(allowed_special)
    if len(text) < LINEAR_MIN_CHARS or not _valid_unicode(text):
        if allowed_special == "all":
            return enc.encode(text, allowed_special="all")
        return enc.encode(text, allowed_special=allowed, disallowed_special=())
    if not allowed:
        return _ordinary_tokens(text)
    pattern, ids = _special_split(enc, frozenset(allowed))
    tokens: list[int] = []
    for i, part in enumerate(pattern.split(text)):
        if i % 2:  # a special token's text (split puts the captured separators at odd positions)
            tokens.append(ids[part])
        elif part:
            tokens += _ordinary_tokens(part)
    return tokens


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate: harmony's behaviour, whatever it is
        return False


_SPLICE_MARKER = "\u00a7sglang-ext-splice-{}-{}\u00a7"  # (this call's nonce, the text's index)
_MESSAGE_TOKEN = "<|message|>"


def render_for_completion_linear(encoding, conversation, next_role) -> list[int]:
    """``encoding.render_conversation_for_completion(conversation, next_role)``, the same tokens, in time
    linear in the text (LINEAR_MIN_CHARS says why; a 300k-character tool result held the server's tokenizer
    36 s). A message's content sits between ``<|message|>``
    and a special token, so harmony encodes it alone, as ordinary text (special tokens' text included). So a
    message whose one content is text of LINEAR_MIN_CHARS or more is rendered with a marker instead (a
    random nonce in it, so that no client text can pose as one), and the marker's tokens are replaced by
    tiktoken's tokens of the text. Anything unexpected (a marker found twice, or missing from a message
    harmony does not drop; text that is not valid Unicode, which harmony refuses) falls back to harmony's
    own rendering."""
    from openai_harmony import Conversation, TextContent  # optional: harmony_available falls back without it

    nonce = secrets.token_hex(8)
    markers, texts, owners, messages = [], [], [], []
    for message in conversation.messages:
        content = message.content
        if len(content) == 1 and isinstance(content[0], TextContent) and len(content[0].text) >= LINEAR_MIN_CHARS:
            markers.append(_SPLICE_MARKER.format(nonce, len(texts)))
            texts.append(content[0].text)
            owners.append(message)
            message = message.model_copy(update={"content": [TextContent(text=markers[-1])]})
        messages.append(message)
    spliced = None
    # text that is not valid Unicode: harmony refuses it, where tiktoken would replace it
    if texts and all(_valid_unicode(text) for text in texts):
        try:
            rendered = list(encoding.render_conversation_for_completion(Conversation.from_messages(messages),
                                                                        next_role))
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
    out, j = [], 0
    for i, (start, end) in sorted(found.items(), key=lambda item: item[1]):
        out += rendered[j:start] + _ordinary_tokens(texts[i])
        j = end
    return out + rendered[j:]
