"""The SingProbe attention head's config.json, parsed strictly.

A probe is bound to one base model (hidden size, tapped layers) and to one head architecture. Serving a
config that was written for another architecture (the MLP head, the weight-less identity head used for
feature dumps, or the removed cross-layer pooling design) would load without error in a lenient parser
and then produce meaningless scores, so every field is checked here and every failure is a single line
that names the field and the value found.

Nothing here imports sglang or touches tensors: the config must be readable by tools that only inspect a
checkpoint folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

SUPPORTED_ARCHITECTURE = "SingProbeAttnModel"
SUPPORTED_MODEL_TYPE = "sing_probe_attn"

# Other heads of the SingProbe family: named in the error so the user knows why their checkpoint is refused.
KNOWN_UNSUPPORTED_MODEL_TYPES = {
    "sing_probe_mlp": "the MLP probe head (fc1/fc2)",
    "sing_probe_identity": "the weight-less identity head used only to dump training features",
}

# Released checkpoints are saved in bf16; fp16/fp32 exports are cast to the model dtype at load.
FLOAT_DTYPE_NAMES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "torch.float16": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "torch.float32": "float32",
}


class ProbeConfigError(ValueError):
    """A probe config.json that cannot be served; the message is one line naming the field."""


def _is_int(v: Any) -> bool:
    # bool is an int subclass; `true` as a head count is a broken config, not 1.
    return isinstance(v, int) and not isinstance(v, bool)


def default_label_names(num_labels: int) -> list[str]:
    """Released configs carry only ``num_labels``; the serving API still needs a name per score."""
    return [f"label_{i}" for i in range(num_labels)]


def check_head_kind(model_type: Any, architectures: Any) -> None:
    """Refuse every head but the attention one before looking at dims, so that an MLP config fails with
    "MLP head not supported" rather than a misleading "missing num_attention_heads"."""
    if not isinstance(model_type, str):
        raise ProbeConfigError(f"model_type must be a string, got {model_type!r}")
    if model_type != SUPPORTED_MODEL_TYPE:
        what = KNOWN_UNSUPPORTED_MODEL_TYPES.get(model_type, "not a SingProbe attention head")
        raise ProbeConfigError(
            f"model_type {model_type!r} ({what}) is not supported; only {SUPPORTED_MODEL_TYPE!r} "
            f"({SUPPORTED_ARCHITECTURE}) probes can be served"
        )
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ProbeConfigError(f"architectures must be a list of strings, got {architectures!r}")
    if SUPPORTED_ARCHITECTURE not in architectures:
        raise ProbeConfigError(
            f"architectures {architectures!r} do not include {SUPPORTED_ARCHITECTURE!r}; only SingProbe "
            "attention heads can be served"
        )


@dataclass
class ProbeConfig:
    """What the serving runtime needs to know about a SingProbe attention head.

    ``labels`` left empty is filled with ``label_0..label_{n-1}`` (the released configs' implicit names).
    ``sliding_window`` None means full causal attention over the whole request.
    """

    hidden_size: int
    base_model_layer_ids: list[int]
    num_attention_heads: int = 8
    head_dim: int = 64
    sliding_window: Optional[int] = None
    num_labels: int = 10
    labels: list[str] = field(default_factory=list)
    base_model_name: str = ""
    torch_dtype: str = "bfloat16"
    architectures: list[str] = field(default_factory=lambda: [SUPPORTED_ARCHITECTURE])
    model_type: str = SUPPORTED_MODEL_TYPE

    def __post_init__(self) -> None:
        check_head_kind(self.model_type, self.architectures)
        self._check_dims()
        self._check_labels()
        self._check_dtype()

    # -- validation -------------------------------------------------------------------------------------

    def _check_dims(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "head_dim", "num_labels"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ProbeConfigError(f"{name} must be a positive integer, got {v!r}")
        ids = self.base_model_layer_ids
        if not isinstance(ids, list) or not ids:
            raise ProbeConfigError(f"base_model_layer_ids must be a non-empty list of layer indices, got {ids!r}")
        for i in ids:
            if not _is_int(i) or i < 0:
                raise ProbeConfigError(f"base_model_layer_ids must hold non-negative integers, got {ids!r}")
        if len(set(ids)) != len(ids):
            raise ProbeConfigError(f"base_model_layer_ids has duplicates: {ids!r}")
        w = self.sliding_window
        if w is not None and (not _is_int(w) or w <= 0):
            raise ProbeConfigError(f"sliding_window must be a positive integer or null (full causal), got {w!r}")
        if not isinstance(self.base_model_name, str):
            raise ProbeConfigError(f"base_model_name must be a string, got {self.base_model_name!r}")

    def _check_labels(self) -> None:
        labels = self.labels
        if labels is None or (isinstance(labels, list) and not labels):
            self.labels = default_label_names(self.num_labels)
            return
        if not isinstance(labels, list) or not all(isinstance(x, str) and x for x in labels):
            raise ProbeConfigError(f"labels must be a list of non-empty strings, got {labels!r}")
        if len(labels) != self.num_labels:
            raise ProbeConfigError(f"labels has {len(labels)} names but num_labels is {self.num_labels}")
        if len(set(labels)) != len(labels):
            raise ProbeConfigError(f"labels has duplicate names: {labels!r}")

    def _check_dtype(self) -> None:
        # Unknown dtype names are kept verbatim: whether they can be served is decided against the base
        # model (checkpoint.validate_against_base), where the model dtype is known.
        if not isinstance(self.torch_dtype, str) or not self.torch_dtype:
            raise ProbeConfigError(f"torch_dtype must be a dtype name such as 'bfloat16', got {self.torch_dtype!r}")
        self.torch_dtype = FLOAT_DTYPE_NAMES.get(self.torch_dtype, self.torch_dtype)

    # -- derived ------------------------------------------------------------------------------------------

    @property
    def input_size(self) -> int:
        """Width of one feature row: the tapped hidden states side by side (derived, never stored)."""
        return self.hidden_size * len(self.base_model_layer_ids)

    @property
    def q_size(self) -> int:
        """Width of the query projection (all heads), which is also the residual/norm width."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Values stored per token in the probe's own KV pool: one shared K head, then one V head."""
        return 2 * self.head_dim

    # -- (de)serialisation --------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict) -> "ProbeConfig":
        """Parse a config.json dict; unknown keys (auto_map, transformers_version, ...) are ignored."""
        if not isinstance(d, dict):
            raise ProbeConfigError(f"probe config must be a JSON object, got {type(d).__name__}")
        if "model_type" not in d and "architectures" not in d:
            raise ProbeConfigError(
                f"probe config has neither model_type nor architectures; expected model_type "
                f"{SUPPORTED_MODEL_TYPE!r} / architectures [{SUPPORTED_ARCHITECTURE!r}]"
            )
        model_type = d.get("model_type", SUPPORTED_MODEL_TYPE)
        check_head_kind(model_type, d.get("architectures", [SUPPORTED_ARCHITECTURE]))
        for required in ("hidden_size", "base_model_layer_ids"):
            if required not in d:
                raise ProbeConfigError(f"probe config lacks the required key {required!r}")
        dtype = d.get("torch_dtype", d.get("dtype", "bfloat16"))  # transformers 5 writes "dtype"
        kwargs = dict(
            hidden_size=d["hidden_size"],
            base_model_layer_ids=d["base_model_layer_ids"],
            num_attention_heads=d.get("num_attention_heads", 8),
            head_dim=d.get("head_dim", 64),
            sliding_window=d.get("sliding_window"),
            num_labels=d.get("num_labels", 10),
            labels=d.get("labels") or [],
            base_model_name=d.get("base_model_name") or "",
            torch_dtype=dtype,
            architectures=d.get("architectures", [SUPPORTED_ARCHITECTURE]),
            model_type=model_type,
        )
        if isinstance(kwargs["base_model_layer_ids"], tuple):
            kwargs["base_model_layer_ids"] = list(kwargs["base_model_layer_ids"])
        return cls(**kwargs)

    @classmethod
    def from_json_file(cls, path: "str | os.PathLike") -> "ProbeConfig":
        """Read a config.json; errors are prefixed with the file so a user can tell which probe is broken."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ProbeConfigError(f"probe config {path}: file not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ProbeConfigError(f"probe config {path}: unreadable ({msg})") from None
        try:
            return cls.from_dict(d)
        except ProbeConfigError as e:
            raise ProbeConfigError(f"probe config {path}: {e}") from None

    def to_dict(self) -> dict:
        """The config.json form (as released: no ``input_size``; ``labels`` only if not the defaults)."""
        d = asdict(self)
        if d["labels"] == default_label_names(self.num_labels):
            del d["labels"]
        return d
