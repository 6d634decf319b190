"""Offline gpt-oss (o200k_harmony) tokenizer: the o200k vocabulary and a Hugging Face tokenizer folder.

Module ``sglang_ext.launch.tokenizer``. Only stdlib, ``tokenizers``/``transformers`` and ``tiktoken`` are
used (nothing from sglang), so it can run before anything else is importable.

* :func:`ensure_o200k_vocab` finds or builds ``o200k_base.tiktoken`` (sha256 ``446a9538...1a2d``) without
  reaching openaipublic.blob.core.windows.net: ``$TIKTOKEN_ENCODINGS_BASE``, then the cache dir (and the
  tiktoken / tiktoken-rs caches), then a cached Hugging Face gpt-oss ``tokenizer.json``, else the PyPI wheel
  ``quicktok-v1==0.4.0`` (``quicktok/data/o200k.vocab``, converted as in
  shared/reference/cpu_recipes.md section 4). The result dir holds the file under both names that the
  loaders look for: ``o200k_base.tiktoken`` (openai-harmony: ``TIKTOKEN_ENCODINGS_BASE``) and
  ``fb374d419588a4632f3f557e76b4b70aebbca790`` (= sha1 of the blob URL; python tiktoken:
  ``TIKTOKEN_CACHE_DIR``, tiktoken-rs / harmony: ``TIKTOKEN_RS_CACHE_DIR``). :func:`harmony_env` gives those
  variables.
* :func:`build_harmony_tokenizer` writes the gpt-oss HF tokenizer folder (tokenizer.json,
  tokenizer_config.json, special_tokens_map.json, chat_template.jinja) the way the official
  openai/gpt-oss-{20b,120b} repos ship it (transformers' convert_gpt_oss_weights_to_hf.py, GptOssConverter):
  the o200k_base BPE (199,998 ranks) with the o200k_base split regex, plus the 21 special tokens
  199998..200018 (``<|startoftext|>`` .. ``<|endofprompt|>``; the named Harmony ones at their ids, the gaps
  as ``<|reserved_N|>``). Id 200018 has two names in tiktoken's o200k_harmony (``<|endofprompt|>`` from
  o200k_base and ``<|reserved_200018|>`` from the reserved range); the official tokenizer uses
  ``<|endofprompt|>``, so do we. The official tokenizer does NOT contain ids 200019..201087 (the model's
  vocab_size 201088 is larger than the tokenizer: len(tokenizer) == 200019). ``reserved="all"`` adds them
  as ``<|reserved_N|>`` specials (len 201088, matches tiktoken o200k_harmony on every id), for callers
  that want every model id decodable.

The chat template is the official gpt-oss one, vendored verbatim as ``gpt_oss_chat_template.jinja`` next
to this file. Source: ggml-org/llama.cpp ``models/templates/openai-gpt-oss-120b.jinja`` as added in commit
b204a5a234f4cf0b3f449476da639a5510c6d157 ("gpt-oss: implement harmony parsing (#15181)", 2025-08-14),
read from the fork ye-NX/llama.cpp at 1eeb523c3e0c7ffbd59469f5463dcbdecba3535e. 16,738 bytes, sha256
a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146 -- the hash that SillyTavern's template
table lists for the ggml-org gpt-oss GGUF (whose template came from the openai/gpt-oss HF repo; an
ask-openai.nvim note also states llama-server uses "the jinja unmodified from OpenAI's hf repo").
Not compared byte-for-byte with huggingface.co (unreachable here).

CLI: ``python -m sglang_ext.launch.tokenizer OUT_DIR [--cache-dir D] [--reserved official|all] [--check]``.
"""

import base64
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
O200K_SHA1_NAME = "fb374d419588a4632f3f557e76b4b70aebbca790"  # hashlib.sha1(O200K_URL).hexdigest()
O200K_FILE = "o200k_base.tiktoken"
O200K_N_RANKS = 199998
QUICKTOK_REQ = "quicktok-v1==0.4.0"
QUICKTOK_MEMBER = "quicktok/data/o200k.vocab"

# o200k_base's pre-tokenizer regex (tiktoken_ext/openai_public.py); the official gpt-oss tokenizer.json uses it.
O200K_PAT_STR = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

HARMONY_VOCAB_SIZE = 201088  # the model's vocab_size / tiktoken o200k_harmony n_vocab
# Named special tokens of o200k_harmony (ids below 200019); all other ids in 199998..201087 are reserved.
NAMED_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",  # tiktoken o200k_harmony also maps <|reserved_200018|> here
}
OFFICIAL_LAST_SPECIAL = 200018

CHAT_TEMPLATE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt_oss_chat_template.jinja")
CHAT_TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"

TOKENIZER_BUILD_VERSION = "1"  # bump when the tokenizer.json recipe changes (invalidates the cache)


# ----------------------------------------------------------------------------------------------------------
# o200k vocabulary
# ----------------------------------------------------------------------------------------------------------


def default_cache_dir():
    """``$SGLANG_EXT_CACHE_DIR`` or ``~/.cache/sglang_ext`` (``$XDG_CACHE_HOME`` respected)."""
    d = os.environ.get("SGLANG_EXT_CACHE_DIR")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang_ext")


def _sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def _read_if_valid(path):
    """The bytes of ``path`` if it exists and has the o200k_base sha256, else None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data if _sha256_bytes(data) == O200K_SHA256 else None


def _atomic_write(path, data):
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _materialise(out_dir, data):
    """Write ``data`` under both loader names in ``out_dir`` (skips files that are already right)."""
    for name in (O200K_FILE, O200K_SHA1_NAME):
        p = os.path.join(out_dir, name)
        if _read_if_valid(p) is None:
            _atomic_write(p, data)
    return out_dir


def tiktoken_from_quicktok_vocab(raw):
    """quicktok's ``o200k.vocab`` (``<u32 n>`` then n x (``<u16 len>``, bytes, ``<u32 rank>``), little
    endian) -> the ``o200k_base.tiktoken`` text (``base64(token) rank`` per line, by rank)."""
    (n,) = struct.unpack_from("<I", raw, 0)
    off = 4
    recs = []
    for _ in range(n):
        (ln,) = struct.unpack_from("<H", raw, off)
        off += 2
        tok = raw[off : off + ln]
        off += ln
        (rank,) = struct.unpack_from("<I", raw, off)
        off += 4
        recs.append((rank, tok))
    if off != len(raw):
        raise ValueError(f"quicktok vocab: {len(raw) - off} trailing bytes")
    recs.sort()
    return b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n" for r, t in recs)


def _bytes_to_unicode():
    # GPT-2 byte <-> unicode table (same as transformers' bytes_to_unicode).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tiktoken_from_hf_tokenizer_json(path):
    """A gpt-oss ``tokenizer.json`` (byte-level BPE over o200k_base) -> ``o200k_base.tiktoken`` bytes."""
    with open(path, encoding="utf-8") as f:
        vocab = json.load(f)["model"]["vocab"]
    dec = {c: b for b, c in _bytes_to_unicode().items()}
    by_rank = {}
    for s, r in vocab.items():
        if r < O200K_N_RANKS:
            by_rank[r] = bytes(dec[c] for c in s)
    if len(by_rank) != O200K_N_RANKS:
        raise ValueError(f"{path}: {len(by_rank)} ranks below {O200K_N_RANKS}")
    return b"".join(base64.b64encode(by_rank[r]) + b" " + str(r).encode() + b"\n" for r in range(O200K_N_RANKS))


def _hf_hub_dirs():
    dirs = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            dirs.append(os.environ[var])
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    dirs.append(os.path.join(hf_home, "hub"))
    return dirs


def _hf_cache_candidates():
    """tokenizer.json files of gpt-oss models in the Hugging Face hub cache."""
    out = []
    for hub in _hf_hub_dirs():
        if not os.path.isdir(hub):
            continue
        for entry in sorted(os.listdir(hub)):
            if not (entry.startswith("models--") and "gpt-oss" in entry.lower()):
                continue
            snaps = os.path.join(hub, entry, "snapshots")
            if not os.path.isdir(snaps):
                continue
            for s in sorted(os.listdir(snaps)):
                p = os.path.join(snaps, s, "tokenizer.json")
                if os.path.isfile(p):
                    out.append(p)
    return out


def _tiktoken_cache_candidates():
    tmp = tempfile.gettempdir()
    dirs = [
        os.environ.get("TIKTOKEN_CACHE_DIR"),
        os.environ.get("DATA_GYM_CACHE_DIR"),
        os.path.join(tmp, "data-gym-cache"),
        os.environ.get("TIKTOKEN_RS_CACHE_DIR"),
        os.path.join(tmp, "tiktoken-rs-cache"),
    ]
    return [os.path.join(d, n) for d in dirs if d for n in (O200K_SHA1_NAME, O200K_FILE)]


def _download_quicktok(dest_dir):
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", QUICKTOK_REQ, "-d", dest_dir]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = [f for f in os.listdir(dest_dir) if f.startswith("quicktok_v1-0.4.0") and f.endswith(".whl")]
    if proc.returncode != 0 or not wheels:
        tail = " | ".join(proc.stdout.strip().splitlines()[-3:])
        raise RuntimeError(f"pip download {QUICKTOK_REQ} failed (rc {proc.returncode}): {tail}")
    return os.path.join(dest_dir, wheels[0])


# One line for a server log: where the o200k vocabulary may come from when none was found offline.
VOCAB_MISSING_HINT = (
    "o200k_base.tiktoken (sha256 446a9538...1a2d) not found offline: set TIKTOKEN_ENCODINGS_BASE to a "
    "directory holding it, or keep a gpt-oss tokenizer.json in the Hugging Face cache (hf download "
    f"openai/gpt-oss-20b tokenizer.json), or `pip install {QUICKTOK_REQ}`, or run "
    "`python -m sglang_ext.launch.tokenizer DIR` once with PyPI reachable"
)


def _installed_quicktok_vocab():
    """``quicktok/data/o200k.vocab`` of an installed ``quicktok-v1`` distribution, or None."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("quicktok-v1")
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != QUICKTOK_REQ.split("==")[1]:
        return None
    path = dist.locate_file(QUICKTOK_MEMBER)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _find_offline(cache_dir, tried):
    env_base = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if env_base and "://" not in env_base:
        data = _read_if_valid(os.path.join(env_base, O200K_FILE))
        if data is not None:
            try:
                return _materialise(cache_dir, data)
            except OSError:
                return env_base
        tried.append(f"TIKTOKEN_ENCODINGS_BASE={env_base}")

    for p in [os.path.join(cache_dir, O200K_FILE), os.path.join(cache_dir, O200K_SHA1_NAME)] + _tiktoken_cache_candidates():
        data = _read_if_valid(p)
        if data is not None:
            return _materialise(cache_dir, data)

    for p in _hf_cache_candidates():
        try:
            data = tiktoken_from_hf_tokenizer_json(p)
        except (OSError, ValueError, KeyError):
            continue
        if _sha256_bytes(data) == O200K_SHA256:
            return _materialise(cache_dir, data)
        tried.append(f"HF cache {p} (sha256 mismatch)")

    raw = _installed_quicktok_vocab()
    if raw is not None:
        try:
            data = tiktoken_from_quicktok_vocab(raw)
        except (ValueError, struct.error):
            data = None
        if data is not None and _sha256_bytes(data) == O200K_SHA256:
            return _materialise(cache_dir, data)
        tried.append(f"installed {QUICKTOK_REQ} (sha256 mismatch)")
    return None


def find_o200k_vocab_offline(cache_dir=None):
    """Like :func:`ensure_o200k_vocab` without any download: the directory, or None.

    Also accepts an installed ``quicktok-v1==0.4.0`` wheel (``pip install quicktok-v1==0.4.0``):
    its vocabulary is converted and checked against the o200k_base sha256 like the downloaded one.
    For servers, which must start without a network (see ``sglang_ext.harmony.encoding``).
    """
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    return _find_offline(cache_dir, [])


def ensure_o200k_vocab(cache_dir=None):
    """Return a directory holding ``o200k_base.tiktoken`` (sha256-verified) and its sha1-named copy.

    Search order: ``$TIKTOKEN_ENCODINGS_BASE`` (a local dir), ``cache_dir``, the tiktoken / tiktoken-rs
    caches, a gpt-oss ``tokenizer.json`` in the Hugging Face hub cache, an installed ``quicktok-v1``,
    and finally the PyPI wheel ``quicktok-v1==0.4.0`` (``pip download`` into ``cache_dir``, converted,
    verified). Whatever is found is copied into ``cache_dir`` under both names (when ``cache_dir`` is
    writable; a valid ``$TIKTOKEN_ENCODINGS_BASE`` dir is returned as is if not). Raises RuntimeError
    if nothing works.
    """
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    from sglang_ext.launch.filelock import exclusive

    with exclusive(cache_dir.rstrip(os.sep) + ".o200k.lock"):
        return _ensure_o200k_vocab(cache_dir)


def _ensure_o200k_vocab(cache_dir):
    tried = []
    found = _find_offline(cache_dir, tried)
    if found is not None:
        return found

    err = None
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".quicktok-") as tmp:
            wheel = _download_quicktok(tmp)
            with zipfile.ZipFile(wheel) as z:
                raw = z.read(QUICKTOK_MEMBER)
        data = tiktoken_from_quicktok_vocab(raw)
        got = _sha256_bytes(data)
        if got != O200K_SHA256:
            raise RuntimeError(f"converted quicktok vocab has sha256 {got}, expected {O200K_SHA256}")
        return _materialise(cache_dir, data)
    except Exception as e:  # noqa: BLE001 - reported below as one line
        err = f"{type(e).__name__}: {e}"
    raise RuntimeError(
        "o200k_base.tiktoken (sha256 446a9538...1a2d) not found offline: set TIKTOKEN_ENCODINGS_BASE to a dir "
        f"holding o200k_base.tiktoken, or put it in {cache_dir}, or have a gpt-oss tokenizer.json in the "
        f"Hugging Face cache, or allow `pip download {QUICKTOK_REQ}` from PyPI"
        + (f" (tried: {'; '.join(tried)})" if tried else "")
        + f"; last error: {err}"
    )


def harmony_env(vocab_dir):
    """Environment variables that make openai-harmony, tiktoken-rs and python tiktoken load o200k offline."""
    vocab_dir = os.path.abspath(vocab_dir)
    return {
        "TIKTOKEN_ENCODINGS_BASE": vocab_dir,
        "TIKTOKEN_RS_CACHE_DIR": vocab_dir,
        "TIKTOKEN_CACHE_DIR": vocab_dir,
    }


# ----------------------------------------------------------------------------------------------------------
# Hugging Face tokenizer folder
# ----------------------------------------------------------------------------------------------------------


def special_tokens(reserved="official"):
    """``[(id, content)]`` of the added special tokens, by id. ``official``: 199998..200018 (21 tokens, as
    the openai/gpt-oss repos); ``all``: 199998..201087 (1090 tokens, every id of o200k_harmony)."""
    if reserved not in ("official", "all"):
        raise ValueError(f"reserved must be 'official' or 'all', not {reserved!r}")
    last = OFFICIAL_LAST_SPECIAL if reserved == "official" else HARMONY_VOCAB_SIZE - 1
    return [(i, NAMED_SPECIALS.get(i, f"<|reserved_{i}|>")) for i in range(O200K_N_RANKS, last + 1)]


def _build_tokenizer_json(vocab_dir, reserved):
    """Build the tokenizers.Tokenizer (slow part: extracting ~200k merges, ~10-20 s)."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = special_tokens(reserved)
    conv = TikTokenConverter(vocab_file=os.path.join(vocab_dir, O200K_FILE), pattern=O200K_PAT_STR)
    tok = conv.converted()
    assert tok.get_vocab_size(with_added_tokens=False) == O200K_N_RANKS, tok.get_vocab_size(with_added_tokens=False)
    # Added in id order right after the 199,998 ranks, so each lands on its id (checked below).
    tok.add_special_tokens([AddedToken(c, normalized=False, special=True) for _, c in specials])
    for i, c in specials:
        got = tok.token_to_id(c)
        if got != i:
            raise RuntimeError(f"special {c} got id {got}, expected {i}")
    return tok


def _tokenizer_config(reserved):
    added = {
        str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, c in special_tokens(reserved)
    }
    # As in openai/gpt-oss-20b: bos/eos/pad, model_max_length = transformers' VERY_LARGE_INTEGER
    # (converter passed model_max_length=None); the chat template lives in chat_template.jinja.
    return {
        "added_tokens_decoder": added,
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|return|>",
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": int(1e30),
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


SPECIAL_TOKENS_MAP = {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"}


def build_harmony_tokenizer(out_dir, vocab_dir=None, cache_dir=None, reserved="official"):
    """Write the gpt-oss HF tokenizer folder into ``out_dir`` and return ``out_dir``.

    Files: ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``.
    ``vocab_dir`` defaults to :func:`ensure_o200k_vocab` (``cache_dir``). The built tokenizer.json is cached
    under ``cache_dir/hf_tokenizer/<vocab sha256[:16]>-<reserved>-v<version>/`` and copied from there.
    """
    cache_dir = os.path.abspath(cache_dir or default_cache_dir())
    if vocab_dir is None:
        vocab_dir = ensure_o200k_vocab(cache_dir)
    if _read_if_valid(os.path.join(vocab_dir, O200K_FILE)) is None:
        raise RuntimeError(f"{vocab_dir}/{O200K_FILE} missing or not sha256 {O200K_SHA256}")
    with open(CHAT_TEMPLATE_FILE, "rb") as f:
        template = f.read()
    if _sha256_bytes(template) != CHAT_TEMPLATE_SHA256:
        raise RuntimeError(f"{CHAT_TEMPLATE_FILE} was modified (sha256 != {CHAT_TEMPLATE_SHA256})")

    key = f"{O200K_SHA256[:16]}-{reserved}-v{TOKENIZER_BUILD_VERSION}"
    cached = os.path.join(cache_dir, "hf_tokenizer", key, "tokenizer.json")
    if not os.path.isfile(cached):
        tok = _build_tokenizer_json(vocab_dir, reserved)
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(cached), prefix=".tmp-tokenizer-")
        os.close(fd)
        try:
            tok.save(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, cached)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(cached, os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(_tokenizer_config(reserved), f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(SPECIAL_TOKENS_MAP, f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "chat_template.jinja"), "wb") as f:
        f.write(template)
    return out_dir


# ----------------------------------------------------------------------------------------------------------
# Self-check (python -m sglang_ext.launch.tokenizer OUT --check)
# ----------------------------------------------------------------------------------------------------------


def self_check(tok_dir, vocab_dir, verbose=True):
    """Compare the HF tokenizer with tiktoken o200k_harmony and openai-harmony. Returns a report dict;
    raises AssertionError on a real mismatch. Sets the tiktoken env vars for this process."""
    os.environ.update(harmony_env(vocab_dir))
    import tiktoken
    from transformers import AutoTokenizer

    rep = {}
    hf = AutoTokenizer.from_pretrained(tok_dir)
    enc = tiktoken.get_encoding("o200k_harmony")
    assert enc.n_vocab == HARMONY_VOCAB_SIZE, enc.n_vocab
    assert enc._pat_str == O200K_PAT_STR
    rep["len_hf"] = len(hf)
    for i, c in NAMED_SPECIALS.items():
        assert hf.convert_tokens_to_ids(c) == i, (c, i)
        assert hf.decode([i]) == c, (i, hf.decode([i]))
        assert enc.encode(c, allowed_special="all") == [i], c
    assert hf.eos_token_id == 200002 and hf.pad_token_id == 199999 and hf.bos_token_id == 199998
    texts = [
        "Hello world!",
        "The quick brown fox jumps over the lazy dog. 1234567 çé日本語 🤖\n\n  tabs\tand  spaces",
        "def f(x):\n    return x**2  # comment\r\n",
        "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>",
        "I'm sure they'll've DONE it, WE'RE",
    ]
    for t in texts:
        a = hf.encode(t, add_special_tokens=False)
        b = enc.encode(t, allowed_special="all")
        assert a == b, (t, a, b)
        assert hf.decode(a) == t, (t, hf.decode(a))
    rep["texts_equal"] = len(texts)

    from openai_harmony import (
        Conversation,
        DeveloperContent,
        HarmonyEncodingName,
        Message,
        Role,
        SystemContent,
        load_harmony_encoding,
    )

    henc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    sysc = SystemContent.new().with_conversation_start_date("2025-08-05")
    conv = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, sysc),
            Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Be terse.")),
            Message.from_role_and_content(Role.USER, "What is 2+2?"),
        ]
    )
    h_ids = henc.render_conversation_for_completion(conv, Role.ASSISTANT)
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}]
    hf_text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    hf_ids = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys"):
        hf_ids = hf_ids["input_ids"]
    rep["harmony_text"] = hf.decode(h_ids)
    rep["hf_text"] = hf_text
    rep["ids_equal"] = list(h_ids) == list(hf_ids)
    # the HF template puts today's date in; harmony's renderer the date given above
    import re

    norm = lambda s: re.sub(r"Current date: \d{4}-\d{2}-\d{2}", "Current date: D", s)  # noqa: E731
    rep["text_equal_modulo_date"] = norm(rep["harmony_text"]) == norm(hf_text)
    # Known difference of the official template: it appends "\n\n" after the developer instructions
    # (openai-harmony does not).
    rep["text_equal_modulo_date_and_dev_newlines"] = norm(rep["harmony_text"]) == norm(hf_text).replace(
        "\n\n<|end|><|start|>user", "<|end|><|start|>user"
    )
    assert rep["text_equal_modulo_date_and_dev_newlines"], (rep["harmony_text"], hf_text)
    # and without a system/developer message: the template still renders the default system message
    conv2 = Conversation.from_messages(
        [Message.from_role_and_content(Role.SYSTEM, sysc), Message.from_role_and_content(Role.USER, "Hi")]
    )
    h2 = henc.render_conversation_for_completion(conv2, Role.ASSISTANT)
    t2 = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    rep["no_dev_text_equal_modulo_date"] = norm(hf.decode(h2)) == norm(t2)
    h2_ids, t2_ids = list(h2), hf.encode(norm(t2).replace("D", sysc.conversation_start_date, 1), add_special_tokens=False)
    rep["no_dev_ids_equal_same_date"] = h2_ids == t2_ids
    assert rep["no_dev_text_equal_modulo_date"] and rep["no_dev_ids_equal_same_date"]
    if verbose:
        print(json.dumps(rep, indent=1, ensure_ascii=False))
    return rep


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--reserved", choices=("official", "all"), default="official")
    ap.add_argument("--check", action="store_true", help="compare with tiktoken and openai-harmony")
    a = ap.parse_args(argv)
    vocab = ensure_o200k_vocab(a.cache_dir)
    build_harmony_tokenizer(a.out_dir, vocab, a.cache_dir, a.reserved)
    print(f"vocab: {vocab}\ntokenizer: {a.out_dir}")
    if a.check:
        self_check(a.out_dir, vocab)


if __name__ == "__main__":
    main()
