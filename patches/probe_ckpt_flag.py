"""Patch: the `--probe-ckpt PATH` server flag (SGLang 0.5.23).

Targets
  - `sglang.srt.server_args.ServerArgs.add_cli_args` (AFTER): adds the flag, so it is
    parsed and listed by `python -m sglang.launch_server --help`.
  - `sglang.srt.server_args.ServerArgs.from_cli_args` (AFTER): `ServerArgs` is a sealed
    msgspec struct that copies only declared fields from the namespace, so the value
    would be dropped silently. We carry it as the underscore attribute `_probe_ckpt`
    (pickled with the struct's `__dict__` into every scheduler/TP process) and as the
    environment variable `SGLANG_EXT_PROBE_CKPT` (inherited by spawned children).
    A path that does not exist, a checkpoint that is not a SingProbe in the real format
    (exact tensor keys and shapes), a probe with NaN or infinite weights (as stored, or once
    cast to the served dtype) or a probe bound to another base model (hidden size, tapped
    layer ids, dtype) stops the launch here, with one line, before any model loads.
  - `sglang.srt.managers.scheduler.Scheduler.__init__` (AFTER): logs the value each
    scheduler process received.

Without the flag nothing changes: `_probe_ckpt` is None and no hook alters behaviour.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import AutoConfig

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.probe.checkpoint import (ENV_VAR, SERVER_ARGS_ATTR, ProbeCheckpointError, check_finite,
                                         load_probe_checkpoint, probe_ckpt_of, resolve_probe_path,
                                         validate_against_base)

logger = logging.getLogger(__name__)

FLAG = "--probe-ckpt"


class ProbeCkptRejected(SystemExit):
    """One-line launch failure; SystemExit so that no caller turns it into a traceback."""


def resolve_probe_ckpt(spec: str | None) -> str | None:
    """Return the probe checkpoint folder for `spec` (a folder, or a hub id already in the
    local Hugging Face cache), or stop with one line naming it."""
    if spec is None or spec == "":
        return None
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ProbeCkptRejected(f"{FLAG}: not a folder: {spec}")
    looks_like_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ProbeCkptRejected(f"{FLAG}: no such file or directory: {spec}")
    try:
        return resolve_probe_path(spec)
    except ProbeCheckpointError as e:
        raise ProbeCkptRejected(str(e)) from None


def validate_probe_for_model(folder: str, args) -> None:
    """Load the probe's config and tensors and check them against the base model's config."""
    model = str(args.model_path)
    if not os.path.isdir(os.path.expanduser(model)) and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise ProbeCkptRejected(f"--model-path: no such folder: {model}")
    try:
        # Read before SGLang checks its own arguments: a bad --model-path is named here, in one line.
        base = AutoConfig.from_pretrained(args.model_path, revision=getattr(args, "revision", None),
                                          trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    except Exception as e:  # OSError (no such folder or hub id), ValueError (an unknown model type), ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ProbeCkptRejected(f"--model-path {model}: cannot read its config ({first})") from None
    try:
        cfg, tensors = load_probe_checkpoint(folder)
        dtype_name = getattr(args, "dtype", "auto")
        if dtype_name in (None, "auto"):
            dtype_name = str(getattr(base, "dtype", None) or "bfloat16")
        dtype = getattr(torch, dtype_name.replace("torch.", ""), torch.bfloat16)
        validate_against_base(cfg, base, dtype)
        # finite as stored (checked on load) but past the served dtype's range, e.g. 1e5 in float16
        check_finite({k: t.to(dtype) for k, t in tensors.items()}, f"probe checkpoint {folder} cast to {dtype}")
    except ValueError as e:
        raise ProbeCkptRejected(f"{FLAG}: {e}") from None


def _add_flag(result, parser):
    if FLAG in parser._option_string_actions:  # add_cli_args may run twice on one parser
        return
    parser.add_argument(
        FLAG,
        type=str,
        default=None,
        metavar="PATH",
        help="SingProbe checkpoint folder (config.json + model.safetensors), or a hub id already in the "
        "local Hugging Face cache, whose per-token safety scores are returned with every generated token "
        "(sglang-ext). Omit it to serve without the probe.",
    )


def _carry_flag(server_args, cls, args):
    probe_ckpt = resolve_probe_ckpt(getattr(args, "probe_ckpt", None))
    if probe_ckpt is not None:
        validate_probe_for_model(probe_ckpt, args)
    setattr(server_args, SERVER_ARGS_ATTR, probe_ckpt)
    if probe_ckpt is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = probe_ckpt
    return server_args


def _log_in_scheduler(result, scheduler, server_args, *args, **kwargs):
    probe_ckpt = probe_ckpt_of(server_args)
    if probe_ckpt is not None:
        logger.info("sglang-ext: scheduler received %s %s", FLAG, probe_ckpt)


def register() -> None:

    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.add_cli_args", _add_flag, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.from_cli_args", _carry_flag, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.__init__",
        _log_in_scheduler,
        HookType.AFTER,
    )
