"""Patch: `GET /playground`, a page to watch the SingProbe's scores token by token (SGLang 0.5.23).

People calibrating a guard want to see where the scores rise in a text, not read JSON. With
`--enable-playground` the server also serves a static page (HTML + JS + CSS in
`sglang_ext/playground/`, no build step, nothing fetched from elsewhere) that streams a chat
completion from the same server and colours each token by a chosen label's score, shows all
labels of a token on hover or tap, keeps reasoning, final text and tool calls apart, sends a
per-request `custom_params.probe_stop` from a threshold slider and marks where the guard stopped.
Without the flag nothing is added: the routes answer 404, as upstream.

The page is served by the server's own app, so it is reachable exactly where the server binds
(`--host`/`--port`), and it talks only to that origin.

Targets
  - `ServerArgs.add_cli_args` / `ServerArgs.from_cli_args` (AFTER): the flag `--enable-playground`,
    carried as the environment variable `SGLANG_EXT_PLAYGROUND` (read in the HTTP process).
  - `http_server.launch_server` (BEFORE): adds `GET /playground` (the page), `GET /playground/{file}`
    for the page's own files (a fixed list: no path reaches outside the folder) and
    `GET /playground/info` (whether a probe is loaded, its label names, the operator's
    `--probe-stop` thresholds) to the FastAPI app before it starts serving.
  - `utils.auth.decide_request_auth` (AFTER): with `--api-key`, a browser cannot send a bearer
    token when it loads a page, so a GET of the page and its static files is allowed without one;
    they hold no data. `/playground/info` and every generation the page makes need the key as any
    client does (the page has a field for it).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from fastapi.responses import JSONResponse, Response

from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.utils.auth import AuthDecision

import sglang_ext
from sglang_ext.patches.probe_stop import ENV_VAR as STOP_ENV
from sglang_ext.patches.request_isolation import probe_labels
from sglang_ext.patches.server_switch import ServerSwitch

logger = logging.getLogger(__name__)

FLAG = "--enable-playground"
ENV_VAR = "SGLANG_EXT_PLAYGROUND"
ROUTE = "/playground"
# file name -> media type; the page's whole set, nothing else under the folder is served
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
}
PUBLIC_PATHS = frozenset({ROUTE, ROUTE + "/"} | {f"{ROUTE}/{name}" for name in STATIC_FILES})


def static_dir() -> Path:
    """The page's folder: inside the installed package (package-data), or the checkout's."""
    return Path(sglang_ext.__file__).resolve().parent / "playground"


SWITCH = ServerSwitch(FLAG, ENV_VAR, help="Serve GET /playground: a page that streams a chat and colours each token "
                      "by its SingProbe score, with a threshold slider for the guard (sglang-ext).")


def playground_enabled() -> bool:
    return SWITCH.is_on()


def playground_info() -> dict:
    """What the page needs before its first request: the probe's labels and the operator's guard."""
    try:
        labels = probe_labels()
    except Exception as e:  # noqa: BLE001 - an unreadable config: the page still works, uncoloured
        logger.warning("sglang-ext: playground cannot read the probe's labels: %s", e)
        labels = None
    raw = os.environ.get(STOP_ENV)
    try:
        guard = json.loads(raw) if raw else {}
    except ValueError:
        guard = {}
    return {"probe": labels is not None, "labels": labels or [], "operator_probe_stop": guard}


def _page_file(name: str):
    media_type = STATIC_FILES.get(name)
    if media_type is None:
        return Response(status_code=404, content=f"no such playground file: {name}", media_type="text/plain")
    try:
        body = (static_dir() / name).read_bytes()
    except OSError as e:
        logger.error("sglang-ext: playground file %s unreadable: %s", name, e)
        return Response(status_code=500, content=f"playground file {name} is missing from the install",
                        media_type="text/plain")
    # no-store: a page from an older install must not outlive the server that served it
    return Response(content=body, media_type=media_type, headers={"Cache-Control": "no-store"})


def add_routes(app) -> None:
    """The page's routes on `app` (once)."""
    if any(getattr(route, "path", None) == ROUTE for route in app.router.routes):
        return

    async def playground_page():
        return _page_file("index.html")

    async def playground_info_route():
        return JSONResponse(playground_info())

    async def playground_file(name: str):
        return _page_file(name)

    app.add_api_route(ROUTE, playground_page, methods=["GET"], include_in_schema=False)
    app.add_api_route(ROUTE + "/", playground_page, methods=["GET"], include_in_schema=False)
    # before the {name} route, which would take "info" as a file name
    app.add_api_route(ROUTE + "/info", playground_info_route, methods=["GET"], include_in_schema=False)
    app.add_api_route(ROUTE + "/{name}", playground_file, methods=["GET"], include_in_schema=False)


def _install_routes(*args, **kwargs):
    if not playground_enabled():
        return
    from sglang.srt.entrypoints.http_server import app  # builds the HTTP app on import: ~3700 modules

    add_routes(app)
    logger.info("sglang-ext: playground at %s", ROUTE)


def _page_without_key(decision, *args, **kwargs):
    if (not decision.allowed and playground_enabled() and kwargs.get("method") in ("GET", "HEAD")
            and kwargs.get("path") in PUBLIC_PATHS):
        return AuthDecision(allowed=True)
    return decision


def register() -> None:
    SWITCH.register()
    HookRegistry.register("sglang.srt.entrypoints.http_server.launch_server", _install_routes, HookType.BEFORE)
    HookRegistry.register("sglang.srt.utils.auth.decide_request_auth", _page_without_key, HookType.AFTER)
