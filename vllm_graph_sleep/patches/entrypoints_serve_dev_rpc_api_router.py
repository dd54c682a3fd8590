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

import json
import math
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_graph_sleep.patches._wrap import (
    VERIFIED_VLLM,
    IncompatibleVllmError,
    require,
    vllm_version,
    wrap_function,
)

WHERE = "vllm.entrypoints.serve.dev.rpc.api_router"
RPC_PATH = "/collective_rpc"


def body_error(raw: bytes) -> str | None:
    """Why vLLM's handler should not get this body, or None. A body that is not
    JSON at all is left to the handler, which answers it with 400 itself."""
    try:
        body = json.loads(raw)
    except ValueError:  # not JSON, or not UTF-8: vLLM's own 400
        return None
    if not isinstance(body, dict):
        return f"the body must be a JSON object, not {type(body).__name__}"
    method = body.get("method")
    if method is not None and not (isinstance(method, str) and method):
        return f'"method" must be a non-empty string (a worker method name), not {method!r}'
    if not isinstance(body.get("args", []), list):
        return '"args" must be a list'
    if not isinstance(body.get("kwargs", {}), dict):
        return '"kwargs" must be an object'
    timeout = body.get("timeout")
    valid_timeout = isinstance(timeout, int | float) and not isinstance(timeout, bool)
    if timeout is not None and not (valid_timeout and 0 < timeout < math.inf):
        return f'"timeout" must be a number of seconds > 0, not {timeout!r}'
    return None


class RpcRequestValidation:
    """Answers 400 to a POST /collective_rpc whose JSON body has the wrong shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or scope["method"] != "POST" or path != RPC_PATH:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        error = body_error(raw)
        if error is not None:
            await JSONResponse({"error": error}, status_code=400)(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # disconnect notices, as the handler expects
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send)


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
