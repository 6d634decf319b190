"""Patch: the SingProbe guard, `--probe-stop label=threshold,...` (SGLang 0.5.23).

When a request's probe score for a label exceeds its threshold, the request stops
with finish reason `content_filter` (the OpenAI convention); `meta_info.finish_reason`
names the label, the score and the threshold. Thresholds come from the server flag
and per request from `custom_params.probe_stop` (OpenAI extra body `custom_params`,
native `sampling_params.custom_params`), as a dict `{label: threshold}`, the flag's
string form, or a JSON object (for labels that hold `,` or `=`). The guard is the operator's:
a request's threshold only tightens it, the lower of the two wins per label, unless the server
was started with `--probe-stop-clients-may-loosen`: a request's value replacing the server's would let
any client switch the operator's guard off (`{"label_8": 1.0}`, or `true`, which Python's `float()`
reads as 1.0). A threshold that is not a JSON number (`true`, a string in the dict form) is refused
with HTTP 400 naming the field, as is a label the probe lacks.

Targets
  - `ServerArgs.add_cli_args` / `ServerArgs.from_cli_args` (AFTER): the flags, parsed
    and checked at launch (labels of the probe, thresholds in [0, 1]); carried as
    `_probe_stop` and the environment variables `SGLANG_EXT_PROBE_STOP` and
    `SGLANG_EXT_PROBE_STOP_LOOSEN`.
  - `SchedulerBatchResultProcessor.process_batch_result_prefill` / `..._decode` (BEFORE): for
    each request of the batch, the score row of the token just sampled is checked and
    a crossing sets `req.to_finish`, which SGLang's own `update_finish_state` turns
    into the finish reason in the same step, so the KV cache is released on the usual
    path. Only that request stops; a bad per-request spec finishes only that request.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os

import torch

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.patches.server_switch import ServerSwitch
from sglang_ext.probe import SCORES_KEY
from sglang_ext.probe.checkpoint import ENV_VAR as PROBE_ENV
from sglang_ext.probe.checkpoint import SERVER_ARGS_ATTR as PROBE_ATTR
from sglang_ext.probe.config import ProbeConfig

logger = logging.getLogger(__name__)

FLAG = "--probe-stop"
ENV_VAR = "SGLANG_EXT_PROBE_STOP"
LOOSEN_FLAG = "--probe-stop-clients-may-loosen"
LOOSEN_ENV_VAR = "SGLANG_EXT_PROBE_STOP_LOOSEN"
LOOSEN = ServerSwitch(LOOSEN_FLAG, LOOSEN_ENV_VAR, help="Let a request's custom_params.probe_stop raise the "
                      "--probe-stop thresholds too (by default it may only lower them: the lower of the two wins "
                      "per label; sglang-ext).")


class ProbeStopSpecError(ValueError):
    pass


def parse_probe_stop(spec) -> dict[str, float]:
    """'label_8=0.9,label_1=0.8', '{"label_8": 0.9}' or {'label_8': 0.9} -> {label: threshold}.

    The string form cannot name a label holding `,` or `=`; the JSON object form can."""
    if spec is None or spec == "" or spec == {}:
        return {}
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ProbeStopSpecError(f"probe_stop: not a JSON object: {e}") from None
        if not isinstance(spec, dict):
            raise ProbeStopSpecError("probe_stop: not a JSON object")
        items = [(name, _strict_number(name, value)) for name, value in spec.items()]
    elif isinstance(spec, str):
        items = []
        for part in spec.split(","):
            if "=" not in part:
                raise ProbeStopSpecError(f"probe_stop: expected label=threshold, got {part.strip()!r}")
            name, value = part.split("=", 1)
            items.append((name.strip(), value.strip()))
    elif isinstance(spec, dict):
        items = [(name, _strict_number(name, value)) for name, value in spec.items()]
    else:
        raise ProbeStopSpecError(f"probe_stop: expected a dict or 'label=threshold,...', got {type(spec).__name__}")
    out = {}
    for name, value in items:
        try:
            threshold = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an integer past float's range
            raise ProbeStopSpecError(f"probe_stop: threshold of {name!r} is not a number: {value!r}") from None
        if not 0.0 <= threshold <= 1.0:
            raise ProbeStopSpecError(f"probe_stop: threshold of {name!r} must lie in [0, 1], got {threshold}")
        out[str(name)] = threshold
    return out


def _strict_number(name, value):
    # In the object form a threshold is a JSON number: `true` (float(True) is 1.0) and strings are refused.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProbeStopSpecError(f"probe_stop: threshold of {name!r} is not a number: {value!r}")
    return value


def effective_thresholds(server: dict[str, float], request: dict[str, float],
                         clients_may_loosen: bool = False) -> dict[str, float]:
    """The thresholds a request runs under: the operator's, tightened (never loosened) by the request's
    own per label, the lower winning; with `clients_may_loosen` a request's value replaces the operator's."""
    merged = dict(server)
    for label, threshold in request.items():
        merged[label] = threshold if clients_may_loosen or label not in server else min(server[label], threshold)
    return merged


def _add_flag(result, parser):
    if FLAG in parser._option_string_actions:
        return
    parser.add_argument(
        FLAG, type=str, default=None, metavar="LABEL=P,...",
        help="Stop a request with finish_reason content_filter when its SingProbe score for a "
        "label exceeds the threshold, e.g. label_8=0.9,label_1=0.8, or a JSON object (needs --probe-ckpt; "
        "sglang-ext). A request's own custom_params.probe_stop may only lower these thresholds (unless "
        "--probe-stop-clients-may-loosen).")


def _carry_flag(server_args, cls, args):
    spec = getattr(args, "probe_stop", None)
    if spec is None:
        os.environ.pop(ENV_VAR, None)
        server_args._probe_stop = {}
        return server_args
    try:
        thresholds = parse_probe_stop(spec)
    except ProbeStopSpecError as e:  # its messages start "probe_stop: ", the request field's name
        raise SystemExit(f"{FLAG}: {str(e).removeprefix('probe_stop: ')}") from None
    probe = getattr(server_args, PROBE_ATTR, None)
    if probe is None:
        raise SystemExit(f"{FLAG} needs --probe-ckpt")
    labels = ProbeConfig.from_json_file(os.path.join(probe, "config.json")).labels
    unknown = sorted(set(thresholds) - set(labels))
    if unknown:
        raise SystemExit(f"{FLAG}: unknown label(s) {unknown}; the probe's labels are {labels}")
    server_args._probe_stop = thresholds
    os.environ[ENV_VAR] = json.dumps(thresholds)
    return server_args


@functools.lru_cache(maxsize=1)
def _server_thresholds_of(raw: str | None) -> dict[str, float]:
    # The flag writes a checked JSON object here; a value set by other means is checked the same way.
    try:
        return parse_probe_stop(raw)
    except ProbeStopSpecError as e:
        raise ProbeStopSpecError(f"{ENV_VAR}={raw!r}: {e}") from None


def _server_thresholds() -> dict[str, float]:
    # Parsed once per value: this runs on every scheduler step.
    return _server_thresholds_of(os.environ.get(ENV_VAR))


def _clients_may_loosen() -> bool:
    return LOOSEN.is_on()


class FINISH_CONTENT_FILTER:  # noqa: N801 (SGLang's naming for finish reasons)
    def __init__(self, label: str, score: float, threshold: float):
        self.label, self.score, self.threshold = label, score, threshold

    def to_json(self):
        return {"type": "content_filter", "label": self.label, "score": self.score,
                "threshold": self.threshold,
                "message": f"probe score {self.label}={self.score:.4f} exceeded {self.threshold}"}


def _bad_spec_finish(message: str):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT  # heavy: ~2700 modules

    return FINISH_ABORT(message=message, status_code=None, err_type="BadRequestError")


# (a batch result, its agreed rows): the two hooks that read one result (the NaN finish, the guard) share one
# exchange; a scheduler processes one result at a time
_agreed: tuple = (None, None)


def _request_group():
    """SGLang's group of schedulers that run the same requests (the TP group, or one DP group's attention-TP
    ranks), where it has more than one rank and the probe is on; else None."""
    if not os.environ.get(PROBE_ENV):
        return None
    try:
        from sglang.srt.layers.dp_attention import get_dp_tp_group  # heavy: ~100 modules

        group = get_dp_tp_group()
    except Exception:  # noqa: BLE001 - no groups (one process, tests)
        return None
    return group if group.world_size > 1 else None


def row_unscored(row) -> bool:
    """A score row the probe failed to fill (NaN): its request is finished with an error, fail-closed."""
    return any(isinstance(v, float) and math.isnan(v) for v in row.values())


def _batch_guarded(batch) -> bool:
    """Whether a request of the batch has guard thresholds (the server's or its own `probe_stop`, even a bad
    one): known to every scheduler of the group alike."""
    return bool(_server_thresholds()) or any(
        "probe_stop" in (getattr(req.sampling_params, "custom_params", None) or {}) for req in batch.reqs)


def agreed_score_rows(result, batch):
    """This batch result's probe score rows, the same on every scheduler of the request group.

    Only the group's first rank runs the probe (models/gpt_oss.py), but every rank's scheduler decides for
    itself which requests finish. A guard stop or a fail-closed NaN finish taken on the first rank alone left
    the others running the request, their batches diverged, and the server hung at the next collective
    (--tp 2, seen on this CPU). So the first rank broadcasts its rows over the group's CPU group, once per
    result, and every rank decides on the same rows. The rows travel only where they can finish a request: a
    guarded batch (every rank knows), or a NaN row (the first rank says so in one int: 0.2-0.3 ms a step on
    this project's CPU, against 0.6-1.0 ms for the rows as an object)."""
    global _agreed
    logits_output = getattr(result, "logits_output", None)
    info = getattr(logits_output, "customized_info", None) if logits_output is not None else None
    rows = info.get(SCORES_KEY) if info else None
    group = _request_group()
    if group is None or logits_output is None:
        return rows
    if _agreed[0] is result:
        return _agreed[1]
    first = group.rank_in_group == 0
    needed = _batch_guarded(batch)
    if not needed:
        flag = torch.tensor([int(first and bool(rows) and any(row_unscored(row) for row in rows))], dtype=torch.int32)
        torch.distributed.broadcast(flag, src=group.ranks[0], group=group.cpu_group)
        needed = bool(flag.item())
    if needed:
        rows = group.broadcast_object(list(rows) if rows and first else None, src=0)
    elif not first:
        rows = None  # nothing here can finish a request: no rank acts on the rows
    _agreed = (result, rows)
    return rows


def _check_batch(processor, batch, result, *args, **kwargs):
    rows = agreed_score_rows(result, batch)
    if not rows:
        return
    server, loosen = _server_thresholds(), _clients_may_loosen()
    for i, req in enumerate(batch.reqs):
        if i >= len(rows) or req.finished() or getattr(req, "to_finish", None) is not None:
            continue
        if getattr(req, "is_chunked", 0) > 0:  # a prefill chunk, not a sampled token
            continue
        custom = getattr(req.sampling_params, "custom_params", None) or {}
        try:
            thresholds = effective_thresholds(server, parse_probe_stop(custom.get("probe_stop")), loosen)
        except Exception as e:  # a bad spec, or a bug here, ends only this request
            req.to_finish = _bad_spec_finish(
                str(e) if isinstance(e, ProbeStopSpecError) else f"probe_stop: {type(e).__name__}: {e}")
            continue
        for label, threshold in thresholds.items():
            score = rows[i].get(label)
            if score is not None and score > threshold:
                req.to_finish = FINISH_CONTENT_FILTER(label, float(score), threshold)
                break


def register() -> None:
    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _add_flag, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _carry_flag, HookType.AFTER)
    LOOSEN.register()
    processor = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
    for step in ("process_batch_result_prefill", "process_batch_result_decode"):
        HookRegistry.register(f"{processor}.{step}", _check_batch, HookType.BEFORE)
