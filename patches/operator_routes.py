"""Patch: tenants cannot read the keys or reach the operator's routes (SGLang 0.5.23).

SGLang 0.5.23 has two keys: `--api-key` (tenants: generation routes) and `--admin-api-key` (the
operator). Three upstream behaviours let any tenant undo the operator:

  * `/server_info` and `/get_server_info` return the resolved server arguments, `api_key` and
    `admin_api_key` among them, and `launch_command` with both keys in clear; the launch log's
    `server_args=...` line and the crash dumps hold them too. Upstream redacts only the
    watermark secrets (`redact_watermark_secrets`, `redact_watermark_command_line`).
  * The operator routes (`@auth_level(ADMIN_OPTIONAL)`: weight updates and process groups,
    profiling, logging, cache flush, `/abort_request`, pause/continue, memory release, LoRA
    loading, internal state) take the tenant key when no admin key is set
    (`utils/auth.decide_request_auth`), so with `--api-key` alone every tenant is an operator.
  * `/init_weights_update_group` joins a torch process group through a TCP rendezvous inside
    the scheduler, whose default timeout is 30 minutes: a `master_port` nobody listens on, or
    `rank_offset` 0 (the server's first rank then hosts the rendezvous and waits for peers),
    blocked the scheduler for that long (`/health` 503, every request timed out).

Targets
  - `sampling.watermarking.core.redact_watermark_secrets` (AROUND): also replaces the values of
    `api_key`, `admin_api_key` and `ssl_keyfile_password` with "<redacted>", at any depth
    (`/server_info` with its schedulers' `internal_states`, the launch log's `server_args=`, the
    crash dumps, the gRPC server info all pass through it).
  - `sampling.watermarking.core.redact_watermark_command_line` (AROUND): the values of
    `--api-key`, `--admin-api-key`, `--ssl-keyfile-password` (also `--flag=value` and argparse's
    abbreviations) are "<redacted>" in `launch_command`.
  - `ServerArgs.__repr__` (AROUND): the same fields are "<redacted>" wherever a ServerArgs is
    printed (upstream hides only the watermark fields there).
  - `utils.auth.decide_request_auth` (AROUND): with `--api-key` and no `--admin-api-key`, the
    operator routes answer 403 unless the server was started with
    `--operator-routes-with-api-key` (then the tenant key opens them, upstream's rule). With an
    admin key they need it (upstream's rule, kept); with no key at all the server is open
    (upstream's rule, kept: nothing to tell an operator from a tenant).
  - `TokenizerControlMixin.init_weights_update_group` (AROUND), in the HTTP process before the
    scheduler sees the request: HTTP 400 within `RENDEZVOUS_CONNECT_TIMEOUT_S` seconds when the
    server's ranks (`rank_offset` .. `rank_offset + tp - 1`) do not fit in `world_size`, when
    `rank_offset` is 0 while peers are expected (the server would host the rendezvous and wait
    for them), or when nothing accepts a TCP connection at `master_address:master_port`.
    `TokenizerControlMixin.init_weights_send_group_for_remote_instance` gets the same TCP check
    for each rank's port when the server is not the group's rank 0.
    What remains: a peer that accepts the connection but never completes the rendezvous (not a
    torch TCPStore, or the other ranks never join), or a remote-instance send group the server
    hosts (group_rank 0) whose receiver never comes, still holds the scheduler for torch's
    process-group timeout (30 min). Only a holder of the admin key (or anyone, on a server
    started with no key) can send those requests.
"""

from __future__ import annotations

import asyncio
import logging

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.utils.auth import AuthDecision, AuthLevel

from sglang_ext.patches.server_switch import ServerSwitch

logger = logging.getLogger(__name__)

FLAG = "--operator-routes-with-api-key"
ENV_VAR = "SGLANG_EXT_OPERATOR_ROUTES_WITH_API_KEY"
REDACTED = "<redacted>"
SECRET_FIELDS = frozenset({"api_key", "admin_api_key", "ssl_keyfile_password"})
SECRET_FLAGS = ("--api-key", "--admin-api-key", "--ssl-keyfile-password")
RENDEZVOUS_CONNECT_TIMEOUT_S = 3.0


# -- secrets ---------------------------------------------------------------------------------


def redact_secrets(value):
    """`value` with every SECRET_FIELDS entry of a dict (at any depth) replaced by REDACTED."""
    if isinstance(value, dict):
        return {k: (REDACTED if k in SECRET_FIELDS and v is not None else redact_secrets(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact_secrets(v) for v in value)
    return value


def _redact_watermark_and_keys(original, value, *args, **kwargs):
    return redact_secrets(original(value, *args, **kwargs))


def _is_secret_flag(option: str) -> bool:
    # argparse takes any unambiguous prefix of a long option (SGLang's parser keeps allow_abbrev)
    return len(option) > 4 and any(flag.startswith(option) for flag in SECRET_FLAGS)


def redact_argv(argv) -> list[str]:
    out, redact_next = [], False
    for argument in argv:
        argument = str(argument)
        if redact_next:
            out.append(REDACTED)
            redact_next = False
        elif argument.startswith("--") and "=" in argument and _is_secret_flag(argument.split("=", 1)[0]):
            out.append(argument.split("=", 1)[0] + "=" + REDACTED)
        elif argument.startswith("--") and _is_secret_flag(argument):
            out.append(argument)
            redact_next = True
        else:
            out.append(argument)
    return out


def _redact_command_line(original, argv, *args, **kwargs):
    return original(redact_argv(argv), *args, **kwargs)


def _repr_without_secrets(original, server_args, *args, **kwargs):
    text = original(server_args, *args, **kwargs)
    for field in SECRET_FIELDS:
        value = getattr(server_args, field, None)
        if isinstance(value, str) and value:
            text = text.replace(f"{field}={value!r}", f"{field}={REDACTED!r}")
    return text


# -- operator routes -------------------------------------------------------------------------


SWITCH = ServerSwitch(FLAG, ENV_VAR, help="With --api-key and no --admin-api-key, let the API key open the operator "
                      "routes (weight updates, profiling, logging, cache flush, /abort_request, ...); by default "
                      "they answer 403 (sglang-ext).")


def _operator_routes_open_to_api_key() -> bool:
    return SWITCH.is_on()


def _decide_request_auth(original, *args, **kwargs):
    decision = original(*args, **kwargs)
    if (kwargs.get("auth_level") == AuthLevel.ADMIN_OPTIONAL and kwargs.get("api_key")
            and not kwargs.get("admin_api_key") and kwargs.get("method") != "OPTIONS"
            and not _operator_routes_open_to_api_key()):
        return AuthDecision(allowed=False, error_status_code=403)
    return decision


# -- process-group rendezvous ----------------------------------------------------------------


async def _reachable(host: str, port, timeout: float = RENDEZVOUS_CONNECT_TIMEOUT_S) -> str | None:
    """None if something accepts a TCP connection at host:port within `timeout` s, else why not."""
    try:
        port = int(port)
    except (TypeError, ValueError):
        return f"port {port!r} is not a number"
    if not 0 < port < 65536:
        return f"port {port} is outside 1..65535"
    try:
        _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        return f"no answer from {host}:{port} within {timeout:g} s"
    except OSError as e:
        return f"cannot connect to {host}:{port}: {e.strerror or e}"
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return None


def _tp_size(tokenizer_manager) -> int:
    return int(getattr(getattr(tokenizer_manager, "server_args", None), "tp_size", 1) or 1)


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


async def update_group_refusal(obj, tp_size: int) -> str | None:
    """Why the process group of `/init_weights_update_group` cannot form, or None."""
    rank_offset, world_size = getattr(obj, "rank_offset", None), getattr(obj, "world_size", None)
    if not (_int(rank_offset) and _int(world_size)):
        return "rank_offset and world_size must be integers"
    if rank_offset < 0 or rank_offset + tp_size > world_size:
        return (f"the server's {tp_size} rank(s) take ranks rank_offset .. rank_offset + {tp_size - 1}, which must "
                f"lie in 0 .. world_size - 1: rank_offset {rank_offset}, world_size {world_size}")
    if rank_offset == 0:
        if world_size > tp_size:
            return ("rank_offset 0 makes the server's first rank the group's rank 0, which hosts the rendezvous and "
                    f"waits for {world_size - tp_size} peer(s) that may never come: give the trainer rank 0 "
                    "(rank_offset >= 1)")
        return None  # every rank is the server's own
    problem = await _reachable(getattr(obj, "master_address", None), getattr(obj, "master_port", None))
    return None if problem is None else f"the rendezvous cannot start: {problem}"


async def _init_update_group_checked(original, tokenizer_manager, obj, *args, **kwargs):
    problem = await update_group_refusal(obj, _tp_size(tokenizer_manager))
    if problem is not None:
        logger.warning("sglang-ext: init_weights_update_group refused: %s", problem)
        return False, problem
    return await original(tokenizer_manager, obj, *args, **kwargs)


async def _init_send_group_checked(original, tokenizer_manager, obj, *args, **kwargs):
    group_rank = getattr(obj, "group_rank", None)
    ports = str(getattr(obj, "ports", "") or "").split(",")
    if _int(group_rank) and group_rank > 0:
        for port in ports:
            problem = await _reachable(getattr(obj, "master_address", None), port.strip())
            if problem is not None:
                logger.warning("sglang-ext: init_weights_send_group_for_remote_instance refused: %s", problem)
                return False, f"the rendezvous cannot start: {problem}"
    return await original(tokenizer_manager, obj, *args, **kwargs)


def register() -> None:
    core = "sglang.srt.sampling.watermarking.core"
    HookRegistry.register(f"{core}.redact_watermark_secrets", _redact_watermark_and_keys, HookType.AROUND)
    HookRegistry.register(f"{core}.redact_watermark_command_line", _redact_command_line, HookType.AROUND)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.__repr__", _repr_without_secrets, HookType.AROUND)
    HookRegistry.register("sglang.srt.utils.auth.decide_request_auth", _decide_request_auth, HookType.AROUND)
    SWITCH.register()
    mixin = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
    HookRegistry.register(f"{mixin}.init_weights_update_group", _init_update_group_checked, HookType.AROUND)
    HookRegistry.register(f"{mixin}.init_weights_send_group_for_remote_instance", _init_send_group_checked,
                          HookType.AROUND)
