"""The shape check of a POST /collective_rpc body, as an ASGI middleware.

vLLM 0.26's handler checks only that the body is JSON and has a "method"; the
patch of vllm.entrypoints.serve.dev.rpc.api_router (its header says what goes
wrong without this) adds RpcRequestValidation to the app, which answers a body
of the wrong shape with 400 and {"error": ...} before vLLM's handler runs and
passes a valid body on byte for byte.
"""

from __future__ import annotations

import json

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

RPC_PATH = "/collective_rpc"


MAX_TIMEOUT_S = 2**63


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
    kwargs = body.get("kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):  # vLLM's executors take null as {}
        return '"kwargs" must be an object'
    timeout = body.get("timeout")
    valid_timeout = isinstance(timeout, int | float) and not isinstance(timeout, bool)
    # vLLM's msgpack encoder refuses an int of 2**64 or more (after the request is queued).
    if timeout is not None and not (valid_timeout and 0 < timeout < MAX_TIMEOUT_S):
        return f'"timeout" must be a number of seconds > 0 and < 2**63, not {timeout!r}'
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
