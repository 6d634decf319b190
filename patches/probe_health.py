"""Patch: `/health_generate` fails while the SingProbe fails (SGLang 0.5.23).

With `--probe-ckpt`, a request whose probe scores are NaN is finished with an error (fail closed:
`request_isolation._finish_unscored`, HTTP 500 "SingProbe scores are NaN for this request"). A
probe whose weights are finite but overflow at run time (or that breaks later) made every
request fail that way while SGLang's `/health_generate` answered 200: it counts any answer
from the scheduler as healthy, an error included, so a load balancer kept sending traffic to a
server that could serve none of it. (Non-finite weights stop the launch: `probe/checkpoint.py`.)

Targets
  - `TokenizerManager._handle_batch_output` (AROUND): the HTTP process notes when a request
    finishes with the probe's error (`err_type` ProbeError) and when one finishes normally
    (`stop`, `length`, `content_filter`: every token of it was scored, NaN rows end a request).
  - `http_server.launch_server` (BEFORE): an ASGI middleware on `/health_generate` and `/health`
    turns upstream's 200 into 503 while the last request that met the probe failed in it. The
    health check's own one-token request runs through the probe, so a probe that has gone NaN
    fails the first check after it does; a later request that is scored normally ends it.
Without `--probe-ckpt` nothing is noted and the routes answer as upstream.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_ext.probe.checkpoint import ENV_VAR as PROBE_ENV

logger = logging.getLogger(__name__)

HEALTH_PATHS = ("/health_generate", "/health")
NORMAL_FINISHES = ("stop", "length", "content_filter")


class ProbeHealth:
    """The HTTP process's view of the probe: failing from a ProbeError finish until a normal one."""

    failing = False
    message = ""


def note_finishes(finished_reasons) -> None:
    for reason in finished_reasons or ():
        if not isinstance(reason, dict):
            continue
        if reason.get("err_type") == "ProbeError":
            if not ProbeHealth.failing:
                logger.error("sglang-ext: the SingProbe failed a request (%s); /health_generate answers 503 until "
                             "a request is scored again", reason.get("message"))
            ProbeHealth.failing, ProbeHealth.message = True, str(reason.get("message") or "")
        elif reason.get("type") in NORMAL_FINISHES:
            ProbeHealth.failing = False


def _probe_on() -> bool:
    return bool(os.environ.get(PROBE_ENV))


async def _note_probe_failures(original, tokenizer_manager, recv_obj, *args, **kwargs):
    # Noted first: the health route, which waits for any answer, resumes once the original yields.
    if _probe_on():
        note_finishes(getattr(recv_obj, "finished_reasons", None))
    return await original(tokenizer_manager, recv_obj, *args, **kwargs)


class ProbeHealthMiddleware:
    """503 instead of the health route's 200 while ProbeHealth.failing."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return

        async def send_checked(message):
            if message["type"] == "http.response.start" and message.get("status") == 200 and ProbeHealth.failing:
                message = {**message, "status": 503}
            await send(message)

        await self.app(scope, receive, send_checked)


def _install_middleware(*args, **kwargs):
    from sglang.srt.entrypoints.http_server import app  # builds the HTTP app on import: ~3700 modules

    if _probe_on() and not any(m.cls is ProbeHealthMiddleware for m in app.user_middleware):
        app.add_middleware(ProbeHealthMiddleware)


def register() -> None:
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_batch_output",
                          _note_probe_failures, HookType.AROUND)
    HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", _install_middleware, HookType.BEFORE)
