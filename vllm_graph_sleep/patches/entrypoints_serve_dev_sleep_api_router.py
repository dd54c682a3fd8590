"""Patch: vllm.entrypoints.serve.dev.sleep.api_router (attach_router).

vLLM symbols: the module function attach_router(app), which
vllm.entrypoints.serve.register_vllm_dev_api_routers imports at call time (only
with VLLM_SERVER_DEV_MODE=1), and the POST /sleep and POST /wake_up routes of
the module's router. Verified against vLLM 0.26.0.

Why: 0.26 passes the query of these endpoints to the engine unchecked.
`/sleep?level=3` reaches the sleep backend, which discards the weights, while
Worker.sleep saves the model buffers only at level 2, so they are lost; an
unknown `/wake_up` tag is ignored and answered 200; a repeated `level` or `mode`
is silently resolved to one of its values. attach_router is wrapped so
that, before vLLM's router is included, the app gets an ASGI middleware that
answers such requests with 400 and a JSON body {"error": ...} without calling
the engine; valid requests pass through untouched. The middleware is applied
whenever the plugin is installed, independent of --sleep-mode-offload-cudagraph:
it only rejects requests that stock vLLM mishandles.

Requests while asleep: vLLM 0.26 queues a request that reaches a sleeping or
paused engine and serves it once the engine is fully awake (EngineCore.sleep:
"Requests are still accepted but not processed"; pause_scheduler: "All pause
modes queue new adds"), with no bound: a completion sent to a sleeping server
waited as long as the sleep did. We keep upstream's choice, held and served
after the wake, and add the bound: a second middleware, AsleepGate, holds an
inference request (INFERENCE_PATHS) in the API server while the engine sleeps
or is paused and lets it through unchanged once the engine is awake; if the
engine is still asleep after VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S seconds (default
30; 0 refuses at once) the request gets 503 with Retry-After and a JSON error,
and the engine never sees it. A request that found the engine awake but was
overtaken by a /sleep is bounded the same way: cancelled (vLLM aborts it) and
answered 503 if the engine stays asleep for the whole bound before it answers.
It asks the engine (is_sleeping) only after this API server forwarded a /sleep
or /pause, or on every inference request when several API server processes
share the engine (--api-server-count > 1),
where another process may have put it to sleep.

Remove when: SleepRequestValidation, on vLLM 0.33+ (it validates level and
mode); AsleepGate, when vLLM bounds the wait of a request sent to a sleeping
engine (0.33 does not).
"""

from __future__ import annotations

import asyncio
import os
import time
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
#: Requests that put the engine to sleep or pause it (the latter: dev/rlhf router).
SLEEP_PATHS = (SLEEP_PATH, "/pause")
#: POST routes that submit work to the engine; these wait while it sleeps.
INFERENCE_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/responses",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v2/embed",
    "/v2/rerank",
    "/inference/v1/generate",
    "/invocations",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
    "/generative_scoring",
)
ASLEEP_WAIT_ENV = "VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S"
DEFAULT_ASLEEP_WAIT_S = 30.0
#: How often a held request asks the engine whether it is awake.
POLL_S = 0.1
RETRY_AFTER_S = 1
SLEEP_LEVELS = (0, 1, 2)
# What EngineCore.pause_scheduler accepts (vllm/v1/engine/core.py); stock lets
# any other value travel to the engine core before it fails there.
SLEEP_MODES = ("abort", "keep", "wait")
# "scheduling" is EngineCore's pseudo-tag that ends a level-0 pause.
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")


def _listed(values: tuple) -> str:
    return ", ".join(map(repr, values))


def _sleep_error(params: QueryParams) -> str | None:
    for name in ("level", "mode"):
        if len(params.getlist(name)) > 1:
            # vLLM's handler would silently take one of them.
            return f"sleep {name} given {len(params.getlist(name))} times: give it once"
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


def asleep_wait_s() -> float:
    raw = os.environ.get(ASLEEP_WAIT_ENV, "")
    if not raw:
        return DEFAULT_ASLEEP_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(
            f"{ASLEEP_WAIT_ENV}={raw!r}: expected seconds >= 0 (0 refuses requests at once "
            f"while the engine sleeps; unset: {DEFAULT_ASLEEP_WAIT_S:g})"
        )
    return value


class AsleepGate:
    """Holds inference requests while the engine sleeps or is paused; 503 with
    Retry-After once the wait bound has passed (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.wait_s = asleep_wait_s()
        # Set when this server forwards a /sleep or /pause; cleared once the
        # engine says it is awake and no such request is still in flight (one
        # may not have reached the engine yet). Without it no request pays an
        # engine round trip.
        self.maybe_asleep = False
        self.sleeps_in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in SLEEP_PATHS:
            self.maybe_asleep = True
            self.sleeps_in_flight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.sleeps_in_flight -= 1
            return
        if path not in INFERENCE_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        if not await self._awake_in_time(state):
            await self._refuse(scope, receive, send)
            return
        await self._bounded(scope, receive, send, state)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the engine is asleep (not woken within {self.wait_s:g} s); "
            "wake it with POST /wake_up, then retry"
        )
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        await JSONResponse({"error": message}, 503, headers)(scope, receive, send)

    async def _bounded(self, scope: Scope, receive: Receive, send: Send, state: Any) -> None:
        """Forwards a request that found the engine awake. A /sleep may still
        reach the engine before it: vLLM then queues the request until the wake
        (3 of 575 requests waited past 120 s in the H200 fuzz). If the engine
        has been asleep for the whole bound and no answer has started, the
        request is cancelled (vLLM aborts it in the engine) and answered 503."""
        started = False

        async def send_and_note(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        task = asyncio.ensure_future(self.app(scope, receive, send_and_note))
        asleep_since: float | None = None
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                task.result()
                return
            if started or not self.maybe_asleep:
                asleep_since = None
                continue
            engine = getattr(state, "engine_client", None)
            if engine is None or not await self._is_sleeping(engine):
                asleep_since = None
                continue
            asleep_since = asleep_since or time.monotonic()
            if time.monotonic() - asleep_since >= self.wait_s:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                if not started:
                    await self._refuse(scope, receive, send)
                return

    async def _awake_in_time(self, state: Any) -> bool:
        args = getattr(state, "args", None)
        if not (self.maybe_asleep or (getattr(args, "api_server_count", None) or 1) > 1):
            return True
        engine = getattr(state, "engine_client", None)
        if engine is None:  # not serving yet: vLLM answers as it would
            return True
        deadline = time.monotonic() + self.wait_s
        while await self._is_sleeping(engine):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        if self.sleeps_in_flight == 0:
            self.maybe_asleep = False
        return True

    @staticmethod
    async def _is_sleeping(engine: Any) -> bool:
        try:
            return await engine.is_sleeping()
        except Exception:
            # A dead or failing engine: let the request through, so vLLM's own
            # handlers answer it (and shut a dead server down) as they would.
            return False


def _wrap_attach_router(original: Callable[..., Any]) -> Callable[..., Any]:
    def attach_router(app: Any, *args: Any, **kwargs: Any) -> Any:
        # add_middleware must run before the app starts; vLLM's build_app calls
        # attach_router while building the app, so this holds.
        present = {m.cls for m in app.user_middleware}
        for middleware in (SleepRequestValidation, AsleepGate):
            if middleware not in present:
                app.add_middleware(middleware)
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

    asleep_wait_s()  # a bad value fails at start-up, not at the first request
    require(api_router, "attach_router", where=WHERE, parameters=("app",))
    _require_post_routes(require(api_router, "router", where=WHERE))
    wrap_function(api_router, "attach_router", _wrap_attach_router, where=WHERE)
