"""Patch: vllm.entrypoints.serve.dev.sleep.api_router (attach_router).

vLLM symbols: the module function attach_router(app), which
vllm.entrypoints.serve.register_vllm_dev_api_routers imports at call time (only
with VLLM_SERVER_DEV_MODE=1), and the POST /sleep and POST /wake_up routes of
the module's router. Verified against vLLM 0.26.0.

Why: 0.26 passes the query of these endpoints to the engine unchecked.
`/sleep?level=3` reaches the sleep backend, which discards the weights, while
Worker.sleep saves the model buffers only at level 2, so they are lost; an
unknown `/wake_up` tag is ignored and answered 200. attach_router is wrapped so
that, before vLLM's router is included, the app gets an ASGI middleware that
answers such requests with 400 and a JSON body {"error": ...} without calling
the engine; valid requests pass through untouched. The middleware is applied
whenever the plugin is installed, independent of --sleep-mode-offload-cudagraph:
it only rejects requests that stock vLLM mishandles.

Remove when: vLLM 0.33+ (its sleep endpoints validate level and mode).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.datastructures import QueryParams
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_graph_sleep.patches._wrap import (
    VERIFIED_VLLM,
    IncompatibleVllmError,
    require,
    vllm_version,
    wrap_function,
)

WHERE = "vllm.entrypoints.serve.dev.sleep.api_router"
SLEEP_PATH = "/sleep"
WAKE_UP_PATH = "/wake_up"
SLEEP_LEVELS = (0, 1, 2)
# What EngineCore.pause_scheduler accepts (vllm/v1/engine/core.py); stock lets
# any other value travel to the engine core before it fails there.
SLEEP_MODES = ("abort", "keep", "wait")
# "scheduling" is EngineCore's pseudo-tag that ends a level-0 pause.
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")


def _listed(values: tuple) -> str:
    return ", ".join(map(repr, values))


def _sleep_error(params: QueryParams) -> str | None:
    # Same reads and defaults as vLLM's handler, so both judge the same values.
    level = params.get("level", "1")
    try:
        valid_level = int(level) in SLEEP_LEVELS
    except ValueError:
        valid_level = False
    if not valid_level:
        allowed = _listed(SLEEP_LEVELS)
        return f"invalid sleep level {level!r}: allowed levels are {allowed} (default 1)"
    mode = params.get("mode", "abort")
    if mode not in SLEEP_MODES:
        allowed = _listed(SLEEP_MODES)
        return f"invalid sleep mode {mode!r}: allowed modes are {allowed} (default 'abort')"
    return None


def _wake_up_error(params: QueryParams) -> str | None:
    for tag in params.getlist("tags"):
        if tag not in WAKE_UP_TAGS:
            return (
                f"invalid wake_up tag {tag!r}: allowed tags are {_listed(WAKE_UP_TAGS)} "
                "(repeat tags=...; no tags wakes everything)"
            )
    return None


class SleepRequestValidation:
    """Answers 400 to POST /sleep and /wake_up requests with a bad query."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            # Path relative to --root-path, as vLLM's AuthenticationMiddleware reads it.
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            check = {SLEEP_PATH: _sleep_error, WAKE_UP_PATH: _wake_up_error}.get(path)
            error = check(QueryParams(scope["query_string"])) if check else None
            if error is not None:
                await JSONResponse({"error": error}, status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _wrap_attach_router(original: Callable[..., Any]) -> Callable[..., Any]:
    def attach_router(app: Any, *args: Any, **kwargs: Any) -> Any:
        # add_middleware must run before the app starts; vLLM's build_app calls
        # attach_router while building the app, so this holds.
        if not any(m.cls is SleepRequestValidation for m in app.user_middleware):
            app.add_middleware(SleepRequestValidation)
        return original(app, *args, **kwargs)

    return attach_router


def _require_post_routes(router: Any) -> None:
    """The middleware matches by path: fail loudly if vLLM moved the routes."""
    present = {
        (route.path, method)
        for route in router.routes
        for method in (getattr(route, "methods", None) or ())
    }
    missing = [p for p in (SLEEP_PATH, WAKE_UP_PATH) if (p, "POST") not in present]
    if missing:
        raise IncompatibleVllmError(
            f"vllm-graph-sleep: {WHERE}.router lacks POST route(s) {missing} in vLLM "
            f"{vllm_version()} (verified against {VERIFIED_VLLM})"
        )


def apply() -> None:
    from vllm import envs

    if not envs.VLLM_SERVER_DEV_MODE:
        # The routes exist only in dev mode; elsewhere (engine core, workers, a
        # production server) importing FastAPI here would only slow start-up.
        return
    from vllm.entrypoints.serve.dev.sleep import api_router

    require(api_router, "attach_router", where=WHERE, parameters=("app",))
    _require_post_routes(require(api_router, "router", where=WHERE))
    wrap_function(api_router, "attach_router", _wrap_attach_router, where=WHERE)
