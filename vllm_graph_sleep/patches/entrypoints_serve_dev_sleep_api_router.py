"""Patch: vllm.entrypoints.serve.dev.sleep.api_router (attach_router).

vLLM symbols: the module function attach_router(app), which
vllm.entrypoints.serve.register_vllm_dev_api_routers imports at call time (only
with VLLM_SERVER_DEV_MODE=1), and the POST /sleep, POST /wake_up and GET
/is_sleeping routes of the module's router. Verified against vLLM 0.26.0.

Why: 0.26 passes the query of these endpoints to the engine unchecked, and
queues requests sent to a sleeping engine without a bound (see
vllm_graph_sleep.request_gate). attach_router is wrapped so that, before vLLM's
router is included, the app gets request_gate's two ASGI middlewares:
SleepRequestValidation (400 for a bad /sleep or /wake_up query, the engine not
called) and AsleepGate (inference requests held while the engine sleeps, 503
with Retry-After past the bound), and inside them deep_sleep_http's
DeepSleepEndpoints (the opt-in `/sleep?checkpoint=1`; without it every answer
is stock's). They are applied whenever the plugin is installed, independent of
--sleep-mode-offload-cudagraph: they only change what stock vLLM mishandles,
or what a client asks for by name.

Remove when: SleepRequestValidation, on vLLM 0.33+ (it validates level and
mode); AsleepGate, when vLLM bounds the wait of a request sent to a sleeping
engine (0.33 does not); DeepSleepEndpoints, when vLLM checkpoints a sleeping
engine itself (open PRs vllm-project/vllm #56373 and #58183).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_graph_sleep import deep_sleep_http, patches, request_gate
from vllm_graph_sleep.patches._wrap import (
    VERIFIED_VLLM,
    IncompatibleVllmError,
    require,
    vllm_version,
    wrap_function,
)

WHERE = "vllm.entrypoints.serve.dev.sleep.api_router"


def _wrap_attach_router(original: Callable[..., Any]) -> Callable[..., Any]:
    def attach_router(app: Any, *args: Any, **kwargs: Any) -> Any:
        # add_middleware must run before the app starts; vLLM's build_app calls
        # attach_router while building the app, so this holds.
        present = {m.cls for m in app.user_middleware}
        # Each added outside the ones before: AsleepGate sees every request first.
        middlewares = (
            deep_sleep_http.DeepSleepEndpoints,
            request_gate.SleepRequestValidation,
            request_gate.AsleepGate,
        )
        for middleware in middlewares:
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
    wanted = [
        (request_gate.SLEEP_PATH, "POST"),
        (request_gate.WAKE_UP_PATH, "POST"),
        (deep_sleep_http.IS_SLEEPING_PATH, "GET"),
    ]
    missing = [f"{method} {path}" for path, method in wanted if (path, method) not in present]
    if missing:
        raise IncompatibleVllmError(
            f"vllm-graph-sleep: {WHERE}.router lacks route(s) {missing} in vLLM "
            f"{vllm_version()} (verified against {VERIFIED_VLLM})"
        )


def apply() -> None:
    from vllm import envs

    if not envs.VLLM_SERVER_DEV_MODE:
        # The routes exist only in dev mode; elsewhere (engine core, workers, a
        # production server) importing FastAPI here would only slow start-up.
        return
    from vllm.entrypoints.serve.dev.sleep import api_router

    # A bad value fails at start-up, not at the first request.
    request_gate.asleep_wait_s()
    request_gate.max_held_requests()
    # AsleepGate holds requests at the point that patch adds.
    patches.apply("v1_engine_async_llm")
    require(api_router, "attach_router", where=WHERE, parameters=("app",))
    _require_post_routes(require(api_router, "router", where=WHERE))
    wrap_function(api_router, "attach_router", _wrap_attach_router, where=WHERE)
