"""Loading a SingProbe checkpoint folder without trusting it, and binding it to a base model.

The released probe folders ship ``modeling_sing_probe.py`` / ``configuration_sing_probe.py`` for
``trust_remote_code``. A serving process must never run them: the tensors are read through ``safetensors``
and the config through ``json`` only, and the key set is checked exactly, because a checkpoint of another
head design (MLP, the removed cross-layer pooling ``attn_layer.*``) or of another base model would
otherwise load half-way and serve wrong scores silently.

Every error is one line that says everything wrong at once (missing, unexpected and mis-shaped tensors
together), so a user fixes a broken export in one round trip.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from .config import FLOAT_DTYPE_NAMES, ProbeConfig, ProbeConfigError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# Dtypes a probe checkpoint may be stored in and a model may run in; casts between them are lossless
# enough for a sigmoid head (bf16 is the release format).
SERVABLE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# Where a server process finds the folder `--probe-ckpt` resolved to: this ServerArgs attribute (pickled with the
# struct into every scheduler / TP process), else this environment variable (inherited by spawned children).
SERVER_ARGS_ATTR = "_probe_ckpt"
ENV_VAR = "SGLANG_EXT_PROBE_CKPT"

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ProbeCheckpointError(ValueError):
    """A probe folder/hub id that cannot be loaded; one line, naming the folder and what is wrong."""


class ProbeBindingError(ValueError):
    """A valid probe that does not fit the base model being served (hidden size, layers, dtype)."""


def EXPECTED_SHAPES(cfg: ProbeConfig) -> dict[str, tuple[int, ...]]:  # noqa: N802 (a table, named like one)
    """The exact tensor set of an attention probe, in the release's key order."""
    hd, d, n_in, n_lab = cfg.q_size, cfg.head_dim, cfg.input_size, cfg.num_labels
    return {
        "proj_q.weight": (hd, n_in),
        "proj_k.weight": (d, n_in),
        "proj_v.weight": (d, n_in),
        "o_proj.weight": (hd, hd),
        "norm.weight": (hd,),
        "classifier.weight": (n_lab, hd),
        "classifier.bias": (n_lab,),
    }


def count_parameters(cfg: ProbeConfig) -> int:
    """Parameter count implied by the config; matches the HF catalog's ``parameterCount`` of the release."""
    total = 0
    for shape in EXPECTED_SHAPES(cfg).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def check_tensor_set(cfg: ProbeConfig, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str] | None = None,
                     where: str = "probe checkpoint") -> None:
    """Raise one ProbeCheckpointError listing every missing, unexpected, mis-shaped (and non-float) tensor.

    Split from loading so the check runs on the safetensors header before any tensor is read."""
    expected = EXPECTED_SHAPES(cfg)
    missing = [k for k in expected if k not in shapes]
    unexpected = sorted(k for k in shapes if k not in expected)
    misshaped = [
        f"{k}: {_fmt_shape(expected[k])} expected, {_fmt_shape(shapes[k])} found"
        for k in expected
        if k in shapes and tuple(shapes[k]) != expected[k]
    ]
    bad_dtype = []
    for k in expected:
        if dtypes and k in dtypes and dtypes[k] not in ("BF16", "F16", "F32", "F64"):
            bad_dtype.append(f"{k}: {dtypes[k]}")
    parts = []
    if missing:
        parts.append(f"missing [{', '.join(missing)}]")
    if unexpected:
        parts.append(f"unexpected [{', '.join(unexpected)}]")
    if misshaped:
        parts.append(f"mis-shaped [{'; '.join(misshaped)}]")
    if bad_dtype:
        parts.append(f"not floating point [{', '.join(bad_dtype)}]")
    if parts:
        raise ProbeCheckpointError(f"{where}: " + "; ".join(parts))


def check_finite(tensors: dict[str, torch.Tensor], where: str = "probe checkpoint") -> None:
    """Raise one ProbeCheckpointError naming every tensor that holds NaN or +-inf (and how many values).

    Such a probe scores NaN for every token: each request would fail closed with an error while the server
    looked healthy, so it stops the launch instead."""
    bad = []
    for name, tensor in tensors.items():
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            bad.append(f"{name} ({int((~finite).sum())} of {tensor.numel()} values)")
    if bad:
        raise ProbeCheckpointError(f"{where}: non-finite weights (NaN or inf) in [{', '.join(bad)}]")


def load_probe_checkpoint(folder: "str | os.PathLike") -> tuple[ProbeConfig, dict[str, torch.Tensor]]:
    """Read ``config.json`` + ``model.safetensors`` (and nothing else) from a probe folder.

    Tensors come back in their stored dtype on CPU; the caller casts them to the model dtype."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    where = f"probe checkpoint {folder}"
    if not os.path.isdir(folder):
        raise ProbeCheckpointError(f"{where}: not a folder")
    cfg_path = os.path.join(folder, CONFIG_FILE)
    weights_path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(cfg_path):
        raise ProbeCheckpointError(f"{where}: {CONFIG_FILE} not found")
    if not os.path.isfile(weights_path):
        extra = ""
        if os.path.isfile(os.path.join(folder, WEIGHTS_FILE + ".index.json")):
            extra = " (sharded probe checkpoints are not supported; the release is one file)"
        raise ProbeCheckpointError(f"{where}: {WEIGHTS_FILE} not found{extra}")
    try:
        cfg = ProbeConfig.from_json_file(cfg_path)
    except ProbeConfigError as e:
        raise ProbeCheckpointError(str(e)) from None
    try:
        with safe_open(weights_path, framework="pt", device="cpu") as f:
            keys = list(f.keys())
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
            dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
            check_tensor_set(cfg, shapes, dtypes, where)
            tensors = {k: f.get_tensor(k) for k in EXPECTED_SHAPES(cfg)}
        check_finite(tensors, where)
    except ProbeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own (non-ValueError) types
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ProbeCheckpointError(f"{where}: {WEIGHTS_FILE} unreadable ({type(e).__name__}: {msg})") from None
    return cfg, tensors


def _hub_cache_dir() -> str:
    """The HF hub cache as the environment says *now*; huggingface_hub freezes it at import time, which
    would ignore an HF_HOME/HF_HUB_CACHE set by a launcher or test after that."""
    env = os.environ
    if env.get("HF_HUB_CACHE"):
        return env["HF_HUB_CACHE"]
    if env.get("HUGGINGFACE_HUB_CACHE"):
        return env["HUGGINGFACE_HUB_CACHE"]
    if env.get("HF_HOME"):
        return os.path.join(env["HF_HOME"], "hub")
    xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


def resolve_probe_path(spec: "str | os.PathLike") -> str:
    """``--probe-ckpt`` value -> a local folder: the folder itself, or a hub id's snapshot in the local cache.

    Never downloads: a serving process should not reach the network at startup, and the probe is small
    enough to fetch beforehand with ``hf download``."""
    spec = os.fspath(spec)
    if os.path.isdir(spec):
        return os.path.abspath(spec)
    cache = _hub_cache_dir()
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(spec, local_files_only=True, cache_dir=cache)
        except Exception:  # noqa: BLE001 -- any miss (not cached, bad refs) means "not available offline"
            path = None
        if path and os.path.isdir(path):
            return path
        reason = f"looked in {cache}; fetch it first with `hf download {spec}`"
    else:
        reason = f"{spec!r} is not a hub id of the form org/name"
    raise ProbeCheckpointError(
        f"--probe-ckpt {spec}: not a folder and not in the local Hugging Face cache ({reason})"
    )


def _get(cfg_obj: Any, name: str) -> Any:
    if isinstance(cfg_obj, dict):
        v = cfg_obj.get(name)
        sub = cfg_obj.get("text_config")
    else:
        v = getattr(cfg_obj, name, None)
        sub = getattr(cfg_obj, "text_config", None)
    if v is None and sub is not None and sub is not cfg_obj:
        return _get(sub, name)
    return v


def _dtype_name(dtype: Any) -> str | None:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype)
    if not isinstance(dtype, str):
        return None
    return FLOAT_DTYPE_NAMES.get(dtype)


def validate_against_base(cfg: ProbeConfig, base_config: Any, model_dtype: Any) -> None:
    """Refuse a probe that was trained on another base model, since its scores would be noise.

    ``base_config`` is the base model's HF config (or a dict); ``model_dtype`` the dtype the model runs in."""
    hidden = _get(base_config, "hidden_size")
    n_layers = _get(base_config, "num_hidden_layers")
    name = cfg.base_model_name or "its base model"
    if hidden is None or n_layers is None:
        raise ProbeBindingError(
            f"probe binding: base model config lacks hidden_size/num_hidden_layers (got {hidden!r}, {n_layers!r})"
        )
    if int(hidden) != cfg.hidden_size:
        raise ProbeBindingError(
            f"probe binding: probe hidden_size {cfg.hidden_size} (trained on {name}) differs from the base "
            f"model's hidden_size {hidden}"
        )
    bad = [i for i in cfg.base_model_layer_ids if i < 0 or i >= int(n_layers)]
    if bad:
        raise ProbeBindingError(
            f"probe binding: base_model_layer_ids {cfg.base_model_layer_ids} has {bad} outside the base model's "
            f"layers 0..{int(n_layers) - 1} (num_hidden_layers {n_layers}; a tap reads a layer's input)"
        )
    probe_dt = _dtype_name(cfg.torch_dtype)
    model_dt = _dtype_name(model_dtype)
    accepted = ", ".join(SERVABLE_DTYPES)
    if probe_dt not in SERVABLE_DTYPES or model_dt not in SERVABLE_DTYPES:
        raise ProbeBindingError(
            f"probe binding: probe torch_dtype {cfg.torch_dtype!r} cannot be cast to model dtype {model_dtype} "
            f"(accepted for both: {accepted})"
        )


def probe_ckpt_of(server_args) -> str | None:
    """The served probe's folder as this process received it (None: the server runs without a probe)."""
    value = getattr(server_args, SERVER_ARGS_ATTR, None)
    return value if value is not None else os.environ.get(ENV_VAR) or None
