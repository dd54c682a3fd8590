"""Patch: vllm.entrypoints.serve.dev.rpc.api_router (attach_router).

vLLM symbols: the module function attach_router(app), which
vllm.entrypoints.serve.register_vllm_dev_api_routers imports at call time (only
with VLLM_SERVER_DEV_MODE=1), and the POST /collective_rpc route of the
module's router. Verified against vLLM 0.26.0.

Why: 0.26's handler checks only that the body is JSON and has a "method". A
body that is JSON but not an object (`[1, 2]`, `null`, `"s"`) fails in the
handler and is answered 500; a "method" that is not a string, "args" that are
not a list, "kwargs" that are not an object or a "timeout" that is not a
number travel to the engine core and the workers before they fail there (or
are silently iterated: `"args": "ab"` calls method("a", "b")). attach_router is
wrapped so that the app gets an ASGI middleware that answers such bodies with
400 and a JSON body {"error": ...} before vLLM's handler runs; valid bodies
reach it byte for byte. What a valid call does (any worker method by name) is
the API key's business: see entrypoints_serve_utils_server_utils.

Remove when: vLLM validates the /collective_rpc body (not so in 0.33).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_graph_sleep.patches._wrap import (
    VERIFIED_VLLM,
    IncompatibleVllmError,
    require,
    vllm_version,
    wrap_function,
)
from vllm_graph_sleep.rpc_request_validation import RPC_PATH, RpcRequestValidation

WHERE = "vllm.entrypoints.serve.dev.rpc.api_router"


def _wrap_attach_router(original: Callable[..., Any]) -> Callable[..., Any]:
    def attach_router(app: Any, *args: Any, **kwargs: Any) -> Any:
        # build_app calls attach_router while building the app, before it starts.
        if not any(m.cls is RpcRequestValidation for m in app.user_middleware):
            app.add_middleware(RpcRequestValidation)
        return original(app, *args, **kwargs)

    return attach_router


def apply() -> None:
    from vllm import envs

    if not envs.VLLM_SERVER_DEV_MODE:
        return  # the route exists only in dev mode
    from vllm.entrypoints.serve.dev.rpc import api_router

    require(api_router, "attach_router", where=WHERE, parameters=("app",))
    router = require(api_router, "router", where=WHERE)
    if not any(
        getattr(r, "path", None) == RPC_PATH and "POST" in (getattr(r, "methods", None) or ())
        for r in router.routes
    ):
        raise IncompatibleVllmError(
            f"vllm-graph-sleep: {WHERE}.router lacks POST {RPC_PATH} in vLLM {vllm_version()} "
            f"(verified against {VERIFIED_VLLM})"
        )
    wrap_function(api_router, "attach_router", _wrap_attach_router, where=WHERE)
