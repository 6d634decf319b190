"""A tiny SingProbe checkpoint in exactly the released format, bound to the tiny gpt-oss of ``make_tiny``.

Module ``sglang_ext.launch.make_tiny_probe``::

    python -m sglang_ext.launch.make_tiny_probe OUT_DIR [--base BASE_CKPT_DIR] [--labels [NAME ...]] [--force]

The real probes are 5.8M-parameter heads for 2880-wide models; CPU tests and the demo need one that fits
the 64-wide, 6-layer tiny gpt-oss while exercising every path the real one does: the same config keys
(``architectures`` ["SingProbeAttnModel"], ``model_type`` "sing_probe_attn", no ``labels`` key unless
asked, so default label names are exercised), the same safetensors keys in bf16 with ``{"format": "pt"}``
metadata, 8 heads x 64, 10 labels, and a sliding window of 64 so that the 300-token test prompts cross it.

Taps default to layers ``[n//6, n//2, n-1]`` of an n-layer base (``[1, 3, 5]`` for the tiny model): every
id is < n because a tap reads the *input* of that layer.

The random init is scaled so the head is not degenerate: features are RMS-normalised (elements ~1), so
q/k/v weights of std 1/sqrt(input) give O(1) per-dim projections, the query/key scale is raised so the
softmax is peaked enough that the window edge changes scores, and the classifier gives logits of std ~1.3
around a non-zero bias: sigmoid outputs spread over (0.05, 0.95). :func:`output_spread` checks this on
random RMS-normalised inputs each time a checkpoint is written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile

import torch

GENERATOR_VERSION = "1"
SEED = 20250904
MARKER = "sglang_ext_tiny_probe.json"
DEFAULT_BASE_MODEL_NAME = "sglang-ext/tiny-gpt-oss"
SLIDING_WINDOW = 64
NUM_HEADS = 8
HEAD_DIM = 64
NUM_LABELS = 10

# The SingProbe label contract (reference/singprobe.md), as names for ``--labels`` without values.
SINGPROBE_LABEL_NAMES = [
    "sexual_content",
    "crimes_public_safety",
    "unethical_behavior",
    "cyber_info_manipulation",
    "agent_safety",
    "politically_sensitive",
    "animal_abuse",
    "query_safe",
    "response_unsafe",
    "hallucination",
]

INIT_STD = {
    "qk_gain": 2.0,  # x 1/sqrt(input): scores of std ~4 after the 1/8 scale -> peaked softmax
    "v_gain": 1.0,
    "o_gain": 2.0,  # x 1/sqrt(H*D): attention output comparable to the query residual
    "norm": 0.1,  # 1 + N(0, 0.1)
    "cls_gain": 1.2,  # x 1/sqrt(H*D): logits std ~1.2 on a unit-RMS normed h
    "cls_bias": 0.5,
}


def default_layer_ids(num_hidden_layers: int) -> list[int]:
    """Early, middle and last-layer-input taps (the release taps 3 layers spread over depth)."""
    n = num_hidden_layers
    if n < 3:
        return list(range(n))
    return sorted({n // 6, n // 2, n - 1})


def base_dims(base_dir: "str | None") -> tuple[int, int, str]:
    """(hidden_size, num_hidden_layers, base model name) of ``--base``, else of make_tiny's model."""
    if base_dir is None:
        from sglang_ext.launch.make_tiny import TINY_DIMS

        return TINY_DIMS["hidden_size"], TINY_DIMS["num_hidden_layers"], DEFAULT_BASE_MODEL_NAME
    path = os.path.join(base_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"make_tiny_probe: cannot read base config {path}: {e}") from None
    c = c.get("text_config", c) if "hidden_size" not in c else c
    try:
        return int(c["hidden_size"]), int(c["num_hidden_layers"]), DEFAULT_BASE_MODEL_NAME
    except KeyError as e:
        raise SystemExit(f"make_tiny_probe: base config {path} lacks {e}") from None


def probe_config_dict(hidden_size: int, layer_ids: list[int], labels: "list[str] | None" = None,
                      base_model_name: str = DEFAULT_BASE_MODEL_NAME) -> dict:
    """config.json of the released format (keys in the release's order; ``labels`` only if given)."""
    d = {
        "architectures": ["SingProbeAttnModel"],
        "model_type": "sing_probe_attn",
        "hidden_size": hidden_size,
        "base_model_layer_ids": list(layer_ids),
        "num_attention_heads": NUM_HEADS,
        "head_dim": HEAD_DIM,
        "sliding_window": SLIDING_WINDOW,
        "num_labels": NUM_LABELS,
        "base_model_name": base_model_name,
        "torch_dtype": "bfloat16",
    }
    if labels is not None:
        d["labels"] = list(labels)
    return d


def build_probe_tensors(cfg, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Random bf16 weights for ``cfg`` (a ProbeConfig), deterministic in ``seed``; see the module docstring."""
    from sglang_ext.probe.checkpoint import EXPECTED_SHAPES

    g = torch.Generator().manual_seed(seed)
    s = INIT_STD
    n_in, hd = cfg.input_size, cfg.q_size
    std = {
        "proj_q.weight": s["qk_gain"] / math.sqrt(n_in),
        "proj_k.weight": s["qk_gain"] / math.sqrt(n_in),
        "proj_v.weight": s["v_gain"] / math.sqrt(n_in),
        "o_proj.weight": s["o_gain"] / math.sqrt(hd),
        "norm.weight": s["norm"],
        "classifier.weight": s["cls_gain"] / math.sqrt(hd),
        "classifier.bias": s["cls_bias"],
    }
    out = {}
    for name, shape in EXPECTED_SHAPES(cfg).items():
        v = torch.randn(shape, generator=g, dtype=torch.float32) * std[name]
        if name == "norm.weight":
            v = v + 1.0
        out[name] = v.to(torch.bfloat16).contiguous()
    return out


def output_spread(folder: str, rows: int = 300, seed: int = 0) -> dict:
    """Probability quantiles of the written head on random RMS-normalised feature rows (one sequence of
    ``rows`` tokens), and how much the sliding window moves them (vs. full causal attention)."""
    from sglang_ext.probe.model import SingProbeHead, tap_features

    head = SingProbeHead.from_checkpoint(folder, dtype=torch.bfloat16)
    cfg = head.config
    g = torch.Generator().manual_seed(seed)
    taps = [torch.randn(1, rows, cfg.hidden_size, generator=g) * 3.0 for _ in cfg.base_model_layer_ids]
    x = tap_features(taps, torch.bfloat16)
    with torch.no_grad():
        p = head.probs(head(x)).flatten()
        head.window = None
        p_full = head.probs(head(x)).flatten()
    q = torch.quantile(p, torch.tensor([0.05, 0.5, 0.95]))
    return {
        "p05": float(q[0]),
        "p50": float(q[1]),
        "p95": float(q[2]),
        "frac_in_05_95": float(((p > 0.05) & (p < 0.95)).float().mean()),
        "window_effect": float((p - p_full).abs().mean()),
    }


def _spread_ok(st: dict) -> bool:
    return st["p05"] < 0.3 and st["p95"] > 0.7 and st["frac_in_05_95"] > 0.85 and st["window_effect"] > 0.01


def _marker(cfg_dict: dict) -> dict:
    return {"generator_version": GENERATOR_VERSION, "seed": SEED, "init_std": INIT_STD, "config": cfg_dict}


def is_current(out_dir: str, cfg_dict: dict) -> bool:
    """True if ``out_dir`` was completely written by this generator version with the same config."""
    try:
        with open(os.path.join(out_dir, MARKER), encoding="utf-8") as f:
            m = json.load(f)
    except (OSError, ValueError):
        return False
    return m == _marker(cfg_dict) and all(
        os.path.isfile(os.path.join(out_dir, f)) for f in ("config.json", "model.safetensors")
    )


def generate(out_dir: str, base_dir: "str | None" = None, labels: "list[str] | None" = None,
             layer_ids: "list[int] | None" = None, force: bool = False, log=print) -> str:
    """Write the tiny probe into ``out_dir`` (skipped when current); returns its absolute path.
    One writer at a time per ``out_dir`` (a file lock beside it)."""
    from sglang_ext.launch.filelock import exclusive

    with exclusive(os.path.abspath(out_dir).rstrip(os.sep) + ".lock"):
        return _generate(out_dir, base_dir, labels, layer_ids, force, log)


def _generate(out_dir, base_dir, labels, layer_ids, force, log) -> str:
    from safetensors.torch import save_file

    from sglang_ext.probe.config import ProbeConfig

    out_dir = os.path.abspath(out_dir)
    hidden, n_layers, base_name = base_dims(base_dir)
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(n_layers)
    if any(i < 0 or i >= n_layers for i in ids):
        raise SystemExit(f"make_tiny_probe: layer ids {ids} must lie in 0..{n_layers - 1}")
    if labels is not None and len(labels) != NUM_LABELS:
        raise SystemExit(f"make_tiny_probe: --labels needs {NUM_LABELS} names, got {len(labels)}")
    cfg_dict = probe_config_dict(hidden, ids, labels, base_name)
    if not force and is_current(out_dir, cfg_dict):
        log(f"make_tiny_probe: {out_dir} up to date")
        return out_dir
    cfg = ProbeConfig.from_dict(cfg_dict)
    tensors = build_probe_tensors(cfg)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent, prefix=".tmp-make_tiny_probe-") as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg_dict, f, indent=2)
            f.write("\n")
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        st = output_spread(tmp)
        if not _spread_ok(st):
            raise RuntimeError(f"make_tiny_probe: degenerate init, probability spread {st}")
        os.makedirs(out_dir, exist_ok=True)
        marker_path = os.path.join(out_dir, MARKER)
        if os.path.exists(marker_path):
            os.remove(marker_path)  # an interrupted rewrite must not look current
        for name in ("config.json", "model.safetensors"):
            shutil.move(os.path.join(tmp, name), os.path.join(out_dir, name))
        with open(marker_path, "w", encoding="utf-8") as f:
            json.dump(_marker(cfg_dict), f, indent=2)
            f.write("\n")
    log(
        f"make_tiny_probe: wrote {out_dir} (hidden {hidden}, layers {ids}, window {SLIDING_WINDOW}; "
        f"p05/p50/p95 {st['p05']:.2f}/{st['p50']:.2f}/{st['p95']:.2f})"
    )
    return out_dir


def main(argv: "list[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ext.launch.make_tiny_probe", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--base", default=None, help="base checkpoint folder whose config.json fixes hidden size/layers")
    ap.add_argument(
        "--labels",
        nargs="*",
        default=None,
        help=f"write an explicit labels list: the {NUM_LABELS} given names, or the SingProbe contract's names if none",
    )
    ap.add_argument("--layer-ids", type=int, nargs="+", default=None, help="tap layers (default n//6, n//2, n-1)")
    ap.add_argument("--force", action="store_true", help="rewrite even if up to date")
    a = ap.parse_args(argv)
    labels = None if a.labels is None else (a.labels or list(SINGPROBE_LABEL_NAMES))
    generate(a.out_dir, a.base, labels, a.layer_ids, a.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
