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
request that found the engine awake but was overtaken by a /sleep or /pause
forwarded by this server is bounded the same way: cancelled (vLLM aborts it)
and answered 503 if the engine stays asleep for the whole bound before it
answers, except while a /sleep or /pause with mode=wait drains: the engine
counts as paused then, and finishes the requests in flight, as that mode
promises. One overtaken by another API server's sleep is not bounded (as in
stock): this process cannot tell that sleep's drain from a sleep. It asks the engine
(is_sleeping) only after this API server forwarded a /sleep or /pause, or on
every inference request when several API server processes share the engine
(--api-server-count > 1), where another process may have put it to sleep; one
EngineWatch per server asks, one question at a time, and every bound holds
whether or not the engine answers. At most VLLM_GRAPH_SLEEP_MAX_HELD_REQUESTS
requests (default 1024) are held at once; one more gets 503 at once.

A level-2 sleep discards the weights, and a wake maps them back without a
backup (vLLM's Worker.sleep): after a level-2 sleep through this server,
requests are held, even once the engine is awake, until a reload or update of
the weights through this server has succeeded (a /collective_rpc call other
than NOT_WEIGHT_LOADS, or the dev/rlhf weight-transfer routes; an update of
the draft model alone does not count); past the bound they get 503 saying so.
Stock vLLM serves them on whatever the fresh pages hold.
A level-2 sleep that vLLM turns into nothing, because its executor already
sleeps (after a level-1 sleep, or a wake of the weights alone), discards
nothing and holds nothing (executor_sleep says when). A middleware inside the
gate that answers a /sleep itself after vLLM's sleep ran (deep sleep, whose
checkpoint can fail after the sleep succeeded) says in the scope whether the
sleep succeeded (ENGINE_SLEPT): the gate goes by that, not by its answer; and
one that answers before passing the sleep on (SLEEP_NOT_FORWARDED) changed
nothing, whatever its status.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import QueryParams
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_graph_sleep import settings
from vllm_graph_sleep.engine_watch import EngineWatch
from vllm_graph_sleep.executor_sleep import (
    SCHEDULING_TAG,
    ExecutorSleep,
    refused_before_the_engine,
)
from vllm_graph_sleep.memory.records import KV_CACHE_TAG, WEIGHTS_TAG

#: The hold of the HTTP request being served (set by AsleepGate for the tasks
#: that serve one HTTP request): an object whose `async until_awake(engine)`
#: returns once the request may go to the engine.
REQUEST_HOLD: ContextVar[Any] = ContextVar("vllm_graph_sleep_request_hold", default=None)

SLEEP_PATH = "/sleep"
WAKE_UP_PATH = "/wake_up"
#: Scope key: whether vLLM's sleep succeeded, set by a middleware inside the
#: gate whose answer to a /sleep is not vLLM's own (deep_sleep_http).
ENGINE_SLEPT = "vllm_graph_sleep.engine_slept"
#: Scope key, set (true) by such a middleware while it has not passed the
#: /sleep on to vLLM: an answer then (a refusal, an error) changed nothing.
SLEEP_NOT_FORWARDED = "vllm_graph_sleep.sleep_not_forwarded"
PAUSE_PATH = "/pause"  # dev/rlhf router
#: Requests that put the engine to sleep or pause it.
SLEEP_PATHS = (SLEEP_PATH, PAUSE_PATH)
RPC_PATH = "/collective_rpc"
#: The dev/rlhf router's weight-transfer routes, by the worker method each calls.
WEIGHT_ROUTES = {
    "/start_weight_update": "start_weight_update",
    "/start_draft_weight_update": "start_draft_weight_update",
    "/update_weights": "update_weights",
    "/finish_weight_update": "finish_weight_update",
}
#: POST routes that can load or update the weights.
WEIGHT_PATHS = (RPC_PATH, *WEIGHT_ROUTES)
#: Worker methods that start a weight update (finish_weight_update ends it).
WEIGHT_UPDATE_STARTS = ("start_weight_update", "start_draft_weight_update")
#: The one of them whose update loads the draft model only: its end does not
#: bring back the target model's weights that a level-2 sleep discarded.
DRAFT_UPDATE_START = "start_draft_weight_update"
#: Worker methods known to leave the weights as they are. Any other method
#: that succeeds through /collective_rpc counts as loading them: vLLM's
#: reload_weights, load_model and update_weights, and the loaders of worker
#: extensions (RL frameworks name their own), which the gate cannot list.
NOT_WEIGHT_LOADS = (
    "check_health",
    "graph_sleep_memory_report",  # vllm_graph_sleep.probe
    "init_weight_transfer_engine",
    "get_model",
)
#: A /collective_rpc body read to see its method; a longer one is not a reload.
MAX_WEIGHTS_CALL_BODY = 1 << 20
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
ASLEEP_WAIT_ENV = settings.ASLEEP_WAIT_S.name
#: Requests held at once while the engine sleeps; one more gets 503 at once.
MAX_HELD_ENV = settings.MAX_HELD_REQUESTS.name
#: How often a request in flight checks whether the engine went to sleep
#: (EngineWatch's last answers: no engine call of its own).
POLL_S = 0.1
RETRY_AFTER_S = 1
#: How long a refused request's handler gets to stop on its own (see _watch).
DISCONNECT_GRACE_S = 1.0
SLEEP_LEVELS = (0, 1, 2)
# What EngineCore.pause_scheduler accepts (vllm/v1/engine/core.py); stock lets
# any other value travel to the engine core before it fails there.
SLEEP_MODES = ("abort", "keep", "wait")
WAKE_UP_TAGS = (WEIGHTS_TAG, KV_CACHE_TAG, SCHEDULING_TAG)


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
    tags = params.getlist("tags")
    for tag in tags:
        if tag not in WAKE_UP_TAGS:
            return (
                f"invalid wake_up tag {tag!r}: allowed tags are {_listed(WAKE_UP_TAGS)} "
                "(repeat tags=...; no tags wakes everything)"
            )
    for tag in tags:
        if tags.count(tag) > 1:
            # vLLM's executor would wake the workers, then raise KeyError
            # removing the tag a second time (a 500, scheduling left paused).
            return f"wake_up tag {tag!r} given {tags.count(tag)} times: give it once"
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
    return settings.ASLEEP_WAIT_S.read(environ)


def max_held_requests(environ: Mapping[str, str] | None = None) -> int:
    return settings.MAX_HELD_REQUESTS.read(environ)


#: How FastAPI reads a bool query parameter (pydantic's lax bool: true, 1,
#: yes, on, y, t in any case), as vLLM's /pause reads wait_for_inflight_requests.
_QUERY_BOOL = TypeAdapter(bool)


def _drains(path: str, params: QueryParams) -> bool:
    """Whether this /sleep or /pause lets the requests in flight finish first:
    mode=wait, or /pause's deprecated wait_for_inflight_requests, read as vLLM
    reads it (a value it refuses is answered 422 and drains nothing)."""
    if params.get("mode") == "wait":
        return True
    if path != PAUSE_PATH or "wait_for_inflight_requests" not in params:
        return False
    try:
        return _QUERY_BOOL.validate_python(params["wait_for_inflight_requests"])
    except ValidationError:
        return False


def _weights_method(path: str, body: bytes) -> str | None:
    """The worker method that this weight-route or /collective_rpc call ran."""
    if path != RPC_PATH:
        return WEIGHT_ROUTES.get(path)
    try:
        method = json.loads(body).get("method")
    except (ValueError, AttributeError):
        return None
    return method if isinstance(method, str) else None


def several_api_servers(state: Any) -> bool:
    """Whether other API server processes share the engine (--api-server-count)."""
    args = getattr(state, "args", None)
    return (getattr(args, "api_server_count", None) or 1) > 1


def sleep_level(params: QueryParams) -> int | None:
    """The level of a /sleep query as vLLM's handler reads it (None: not a number)."""
    try:
        return int(params.get("level", "1"))
    except ValueError:
        return None


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
        self.refused = asyncio.get_running_loop().create_future()  # its result: the reason
        self.over = asyncio.Event()  # AsleepGate is done with the HTTP exchange

    def refuse(self, reason: str) -> None:
        """Cuts the request off: vLLM sees its client go (it stops the request
        and aborts it in the engine, as on a real disconnect), and what vLLM
        still sends is dropped, since AsleepGate answers 503 instead."""
        if not self.refused.done():
            self.refused.set_result(reason)
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
        """Returns when the request may go to the engine (AsleepGate.admit)."""
        async with self._admitting:
            # A started response can no longer become a 503, and work that
            # outlives the exchange (a background response) is no longer ours:
            # both go on as stock vLLM sends them.
            free = self.submitted or self.started or self.over.is_set()
            if not free and self.gate.may_be_asleep(self.state):
                refusal = await self.gate.admit(engine)
                if refusal is not None:
                    self.refuse(refusal)
                    # vLLM cancels the request now; only work that outlives the
                    # exchange gets past this, and goes to the engine as stock.
                    await self.over.wait()
            self.submitted = True
        await self.release()


class AsleepGate:
    """Holds valid inference requests while the engine sleeps or is paused, or
    woke from a level-2 sleep without its weights; 503 with Retry-After once
    the wait bound has passed, or at once beyond the bound of held requests
    (see the module docstring)."""

    def __init__(self, app: ASGIApp, gate_settings: settings.GateSettings | None = None) -> None:
        """`gate_settings`: the switches as the server read them (default: read now)."""
        self.app = app
        if gate_settings is None:
            gate_settings = settings.GateSettings.from_environ()
        self.wait_s = gate_settings.asleep_wait_s
        self.max_held = gate_settings.max_held_requests
        self.watch = EngineWatch()
        self.held = 0  # requests waiting in admit
        # Set when this server forwards a /sleep or /pause; cleared once the
        # engine says it is awake and no such request is still in flight (one
        # may not have reached the engine yet). Without it no request pays an
        # engine round trip.
        self.maybe_asleep = False
        self.sleeps_in_flight = 0
        self.slept_at = 0.0  # when the last /sleep or /pause was done
        # /sleep or /pause with mode=wait in flight: the engine counts as
        # paused while it finishes the requests in flight, which it promised.
        self.drains_in_flight = 0
        # A level-2 sleep through this server discarded the weights; a wake
        # maps them back without a backup, so requests wait for a reload or
        # an update (weights_back is set then).
        self.weights_missing = False
        # The worker method that started the weight update in progress, if any.
        self.weight_update_open: str | None = None
        self.weights_back = asyncio.Event()
        self.executor = ExecutorSleep()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in SLEEP_PATHS:
            await self._forward_sleep(path, scope, receive, send)
            return
        if path == WAKE_UP_PATH:
            status = _Status(send)
            try:
                await self.app(scope, receive, status.send)
            finally:  # an engine error reaches here raised, answered 500 outside
                tags = QueryParams(scope["query_string"]).getlist("tags")
                self.executor.wake_answered(tags, status.succeeded(), status.status)
            return
        if path in WEIGHT_PATHS:
            await self._forward_weights_call(path, scope, receive, send)
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
                await self._refuse(scope, receive, send, hold.refused.result())
            return
        await hold.release()  # answered without the engine: a 4xx goes out now
        task.result()

    def may_be_asleep(self, state: Any) -> bool:
        """Whether a request must ask the engine before it goes in: after this
        server forwarded a /sleep or /pause, while a level-2 sleep's weights
        wait for a reload, or always when several API server processes share
        the engine (another one may have put it to sleep)."""
        if getattr(state, "engine_client", None) is None:  # not serving yet
            return False
        return self.maybe_asleep or self.weights_missing or several_api_servers(state)

    async def admit(self, engine: Any) -> str | None:
        """Waits, within the bound, until the engine is awake with its weights;
        None then, else why the request is refused."""
        # Even a zero bound, or a full gate, gives the engine one question to
        # say it is awake.
        soon = time.monotonic() + self.watch.one_question_s()
        if self.held >= self.max_held:
            if await self.watch.until_awake(engine, soon) and not self.weights_missing:
                return None
            return (
                f"the engine is asleep and {self.held} requests already wait for its wake "
                f"(the bound {MAX_HELD_ENV}={self.max_held}); retry after the wake"
            )
        self.held += 1
        try:
            deadline = max(soon, time.monotonic() + self.wait_s)
            while True:
                if not await self.watch.until_awake(engine, deadline):
                    return self._asleep_reason()
                self._note_awake()
                if not self.weights_missing:
                    return None
                remaining = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(self.weights_back.wait(), max(0.0, remaining))
                except asyncio.TimeoutError:
                    return (
                        f"the engine woke from a level-2 sleep without its weights, and they "
                        f"were not reloaded within {self.wait_s:g} s: reload them (POST "
                        '/collective_rpc with {"method": "reload_weights"}) or update them, '
                        "then retry"
                    )
                # Reloaded: the engine may have gone back to sleep meanwhile.
        finally:
            self.held -= 1

    def _note_awake(self) -> None:
        """The engine said it is awake: requests stop asking, unless a /sleep
        or /pause is still on its way to the engine or the question was asked
        before the last one was done."""
        awake_at = self.watch.awake_asked_at()
        if self.sleeps_in_flight == 0 and awake_at is not None and awake_at >= self.slept_at:
            self.maybe_asleep = False

    def _asleep_reason(self) -> str:
        return (
            f"the engine is asleep (not woken within {self.wait_s:g} s); "
            "wake it with POST /wake_up, then retry"
        )

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, reason: str) -> None:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        await JSONResponse({"error": reason}, 503, headers)(scope, receive, send)

    async def _forward_sleep(self, path: str, scope: Scope, receive: Receive, send: Send) -> None:
        params = QueryParams(scope["query_string"])
        drains = _drains(path, params)
        self.maybe_asleep = True
        self.sleeps_in_flight += 1
        self.drains_in_flight += drains
        status = _Status(send)
        try:
            await self.app(scope, receive, status.send)
        finally:  # an engine error reaches here raised, answered 500 outside
            self.sleeps_in_flight -= 1
            self.drains_in_flight -= drains
            self.slept_at = time.monotonic()
            if path == SLEEP_PATH:
                self._sleep_answered(scope, params, status)

    def _sleep_answered(self, scope: Scope, params: QueryParams, status: _Status) -> None:
        if scope.get(SLEEP_NOT_FORWARDED):
            return
        slept = scope.get(ENGINE_SLEPT, status.succeeded())
        level = sleep_level(params) or 0
        discarded = self.executor.sleep_answered(level, slept, status.status)
        if several_api_servers(scope["app"].state):  # another server's calls are not seen here
            discarded = level == 2 and (slept or not refused_before_the_engine(status.status))
        if discarded:
            self.weights_missing = True
            # Requests waiting for the weights since an earlier level-2 sleep
            # wait on the new event from now on (admit asks again).
            self.weights_back.set()
            self.weights_back = asyncio.Event()

    async def _forward_weights_call(
        self, path: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        body = bytearray()

        async def receive_and_keep() -> Any:
            message = await receive()
            if message["type"] == "http.request" and len(body) <= MAX_WEIGHTS_CALL_BODY:
                body.extend(message.get("body", b""))
            return message

        status = _Status(send)
        await self.app(scope, receive_and_keep, status.send)
        method = _weights_method(path, bytes(body)) if status.succeeded() else None
        if method is None or method in NOT_WEIGHT_LOADS:
            return
        if method in WEIGHT_UPDATE_STARTS:
            self.weight_update_open = method
        elif method == "update_weights" and self.weight_update_open:
            pass  # one part of an update that finish_weight_update ends
        elif method == "finish_weight_update" and self.weight_update_open == DRAFT_UPDATE_START:
            self.weight_update_open = None  # the draft model's weights: the target's still wait
        else:
            self.weight_update_open = None
            self.weights_missing = False
            self.weights_back.set()

    async def _watch(self, task: asyncio.Future, hold: _Hold, state: Any) -> None:
        """Returns once vLLM is done with the request, or has been cut off.

        A request is refused when held at the engine's door for the whole bound
        (_Hold), or when it was passed on to an awake engine that a /sleep then
        reached first: vLLM queues it until the wake (3 of 575 requests waited
        past 120 s in the H200 fuzz), so once the engine has been asleep for the
        whole bound and no answer has started, it is refused too. Not while a
        mode=wait sleep or pause drains: the engine counts as paused then, and
        finishes the requests in flight, as it promised."""
        engine = None  # watched while not None
        watched_since = 0.0
        try:
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
                bounded = hold.submitted and not hold.started and self.maybe_asleep
                bounded = bounded and not self.drains_in_flight
                current = getattr(state, "engine_client", None) if bounded else None
                if current is not engine:
                    if engine is not None:
                        self.watch.unwatch(engine)
                    engine, watched_since = current, time.monotonic()
                    if engine is not None:
                        self.watch.watch(engine)
                    continue
                if engine is None:
                    continue
                self._note_awake()
                since = self.watch.asleep_since()
                if (
                    since is not None
                    and time.monotonic() - max(since, watched_since) >= self.wait_s
                ):
                    hold.refuse(self._asleep_reason())
        finally:
            if engine is not None:
                self.watch.unwatch(engine)


class _Status:
    """Passes a response on and keeps its status."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status: int | None = None

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)

    def succeeded(self) -> bool:
        return self.status is not None and 200 <= self.status < 300
