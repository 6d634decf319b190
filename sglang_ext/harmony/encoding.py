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
