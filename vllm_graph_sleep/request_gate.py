"""Request validation and the asleep gate of the dev-mode HTTP server.

SleepRequestValidation answers 400 (a JSON body {"error": ...}, the engine not
called) to the POST /sleep and /wake_up queries that vLLM 0.26 passes to the
engine unchecked: `/sleep?level=3` reaches the sleep backend, which discards
the weights, while Worker.sleep saves the model buffers only at level 2, so
they are lost; an unknown `/wake_up` tag is ignored and answered 200; a
repeated `level` or `mode` is silently resolved to one of its values. Valid
requests pass through untouched.

Requests while asleep: vLLM 0.26 queues a request that reaches a sleeping or
paused engine and serves it once the engine is fully awake (EngineCore.sleep:
"Requests are still accepted but not processed"; pause_scheduler: "All pause
modes queue new adds"), with no bound: a completion sent to a sleeping server
waited as long as the sleep did. We keep upstream's choice, held and served
after the wake, and add the bound: AsleepGate watches each inference request
(INFERENCE_PATHS). vLLM reads, validates and tokenizes it as it would awake, so
a request it rejects (not JSON or not UTF-8, a prompt longer than
max_model_len, an unknown model, bad sampling parameters) gets vLLM's own 4xx
at once, while asleep too, and never reaches the engine. A valid one is held
where vLLM hands it to the engine (AsyncLLM._add_request, patch
vllm.v1.engine.async_llm, through REQUEST_HOLD) while the engine sleeps or is
paused, and goes on unchanged once it is awake; if the engine is still asleep
after VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S seconds there (default 30; 0 refuses at
once) the request is cancelled and gets 503 with Retry-After and a JSON error,
and the engine never sees it. A streaming response starts (200) before vLLM
asks the engine, so for a request that arrives while the engine may be asleep
the gate holds back what vLLM sends until the request has passed that point. A
request that found the engine awake but was overtaken by a /sleep is bounded
the same way: cancelled (vLLM aborts it) and answered 503 if the engine stays
asleep for the whole bound before it answers. It asks the engine
(is_sleeping) only after this API server forwarded a /sleep or /pause, or on
every inference request when several API server processes share the engine
(--api-server-count > 1), where another process may have put it to sleep.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from starlette.datastructures import QueryParams
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

#: The hold of the HTTP request being served (set by AsleepGate for the tasks
#: that serve one HTTP request): an object whose `async until_awake(engine)`
#: returns once the request may go to the engine.
REQUEST_HOLD: ContextVar[Any] = ContextVar("vllm_graph_sleep_request_hold", default=None)

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
#: How long a refused request's handler gets to stop on its own (see _watch).
DISCONNECT_GRACE_S = 1.0
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


def asleep_wait_s(environ: Mapping[str, str] | None = None) -> float:
    raw = (os.environ if environ is None else environ).get(ASLEEP_WAIT_ENV, "")
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


class _Hold:
    """One inference request on its way through AsleepGate.

    vLLM reads, validates and tokenizes the request as it would awake; the
    patched AsyncLLM._add_request calls until_awake before the request reaches
    the engine. A streaming response starts (200) before vLLM asks the engine,
    so when the engine may be asleep as the request arrives, what vLLM sends is
    held back until the request has passed that point or vLLM has answered it
    without the engine (a 4xx): a request refused there still gets its 503."""

    def __init__(
        self, gate: AsleepGate, state: Any, receive: Receive, send: Send, hold_back: bool
    ) -> None:
        self.gate = gate
        self.state = state
        self._receive = receive
        self._send = send
        self._held_back: list | None = [] if hold_back else None
        self._sending = asyncio.Lock()  # held-back messages go out before later ones
        self._admitting = asyncio.Lock()  # n > 1 or several prompts: one waits, all pass
        self.started = False  # the client has the response's start
        self.submitted = False  # passed on to the engine
        self.refused = asyncio.get_running_loop().create_future()
        self.over = asyncio.Event()  # AsleepGate is done with the HTTP exchange

    def refuse(self) -> None:
        """Cuts the request off: vLLM sees its client go (it stops the request
        and aborts it in the engine, as on a real disconnect), and what vLLM
        still sends is dropped, since AsleepGate answers 503 instead."""
        if not self.refused.done():
            self.refused.set_result(None)
            self._held_back = []

    async def receive(self) -> Any:
        if not self.refused.done():
            message = asyncio.ensure_future(self._receive())
            try:
                await asyncio.wait({message, self.refused}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                message.cancel()
                raise
            if message.done():
                return message.result()
            message.cancel()
        return {"type": "http.disconnect"}

    async def send(self, message: Any) -> None:
        async with self._sending:
            if self.refused.done():
                return
            if self._held_back is None:
                await self._forward(message)
            else:
                self._held_back.append(message)

    async def release(self) -> None:
        async with self._sending:
            held_back, self._held_back = self._held_back or [], None
            for message in held_back:
                await self._forward(message)

    async def _forward(self, message: Any) -> None:
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)

    async def until_awake(self, engine: Any) -> None:
        """Returns when the request may go to the engine (see _wait_awake)."""
        async with self._admitting:
            # A started response can no longer become a 503, and work that
            # outlives the exchange (a background response) is no longer ours:
            # both go on as stock vLLM sends them.
            free = self.submitted or self.started or self.over.is_set()
            if not free and self.gate.may_be_asleep(self.state):
                await self._wait_awake(engine)
            self.submitted = True
        await self.release()

    async def _wait_awake(self, engine: Any) -> None:
        deadline = time.monotonic() + self.gate.wait_s
        while await AsleepGate._is_sleeping(engine):
            if time.monotonic() >= deadline:
                self.refuse()
                # vLLM cancels the request now; only work that outlives the
                # exchange gets past this, and goes to the engine as stock.
                await self.over.wait()
                return
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        self.gate.note_awake()


class AsleepGate:
    """Holds valid inference requests while the engine sleeps or is paused; 503
    with Retry-After once the wait bound has passed (see the module docstring)."""

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
        hold = _Hold(self, state, receive, send, hold_back=self.may_be_asleep(state))
        # The task copies the context: vLLM's handler, and the tasks it starts,
        # find the hold at AsyncLLM._add_request.
        token = REQUEST_HOLD.set(hold)
        try:
            task = asyncio.ensure_future(self.app(scope, hold.receive, hold.send))
        finally:
            REQUEST_HOLD.reset(token)
        try:
            await self._watch(task, hold, state)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            hold.over.set()  # only once no task serves the exchange any more
        if hold.refused.done():
            if not hold.started:
                await self._refuse(scope, receive, send)
            return
        await hold.release()  # answered without the engine: a 4xx goes out now
        task.result()

    def may_be_asleep(self, state: Any) -> bool:
        """Whether a request must ask the engine before it goes in: after this
        server forwarded a /sleep or /pause, or always when several API server
        processes share the engine (another one may have put it to sleep)."""
        if getattr(state, "engine_client", None) is None:  # not serving yet
            return False
        args = getattr(state, "args", None)
        return self.maybe_asleep or (getattr(args, "api_server_count", None) or 1) > 1

    def note_awake(self) -> None:
        if self.sleeps_in_flight == 0:
            self.maybe_asleep = False

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the engine is asleep (not woken within {self.wait_s:g} s); "
            "wake it with POST /wake_up, then retry"
        )
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        await JSONResponse({"error": message}, 503, headers)(scope, receive, send)

    async def _watch(self, task: asyncio.Future, hold: _Hold, state: Any) -> None:
        """Returns once vLLM is done with the request, or has been cut off.

        A request is refused when held at the engine's door for the whole bound
        (_Hold), or when it was passed on to an awake engine that a /sleep then
        reached first: vLLM queues it until the wake (3 of 575 requests waited
        past 120 s in the H200 fuzz), so once the engine has been asleep for the
        whole bound and no answer has started, it is refused too."""
        asleep_since: float | None = None
        while True:
            done, _ = await asyncio.wait(
                {task, hold.refused}, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED
            )
            if task in done:
                return
            if hold.refused in done:
                # vLLM's handlers stop at once on a disconnect; the caller
                # cancels one that does not listen for it.
                await asyncio.wait({task}, timeout=DISCONNECT_GRACE_S)
                return
            if hold.started or not hold.submitted or not self.maybe_asleep:
                asleep_since = None
                continue
            engine = getattr(state, "engine_client", None)
            if engine is None or not await self._is_sleeping(engine):
                asleep_since = None
                continue
            asleep_since = asleep_since or time.monotonic()
            if time.monotonic() - asleep_since >= self.wait_s:
                hold.refuse()

    @staticmethod
    async def _is_sleeping(engine: Any) -> bool:
        try:
            return await engine.is_sleeping()
        except Exception:
            # A dead or failing engine: let the request through, so vLLM's own
            # handlers answer it (and shut a dead server down) as they would.
            return False
