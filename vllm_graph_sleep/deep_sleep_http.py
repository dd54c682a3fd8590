"""Deep sleep through the dev-mode HTTP server (issue 39), as an ASGI middleware.

- `POST /sleep?level=N&checkpoint=1`: refused with 409 and the reason (the
  engine not called) where `deep_sleep.refusal` says the driver cannot do it;
  else vLLM's sleep runs as it would, and once it answered 200 this API server
  checkpoints the engine core process. A checkpoint that fails answers 500
  with the driver's error; the engine is then asleep at level N, not deeper.
- `POST /wake_up` while checkpointed: the restore first (no restore is started
  without room for it: 503 with Retry-After, the engine still asleep and
  checkpointed), then vLLM's wake as usual, staged tags included.
- `GET /is_sleeping` while checkpointed: `{"is_sleeping": true,
  "checkpointed": true}`, answered here without asking the engine; otherwise
  vLLM's answer as stock gives it.
- Inference requests pass while checkpointed: AsleepGate, outside this
  middleware, holds them before they reach the engine, as in any sleep.
  Any other POST while checkpointed gets 409: what reaches the engine's GPU
  would wait on the driver's lock until the wake.
- One transition at a time, once a deep sleep was asked of this server: a
  deep sleep (vLLM's sleep, then the checkpoint) and every /wake_up run one
  after the other, and a /sleep or another POST that arrives during one waits
  for it to end, then is judged by the state it left (a wake sent during a
  checkpoint restores the engine it finds checkpointed; a second deep sleep
  gets 409). A deep sleep also waits for the other POSTs admitted before it
  to be answered, so that none reaches the engine once it is checkpointed;
  after OTHERS_WAIT_S it answers 503 with Retry-After, nothing done.
  Before the first deep sleep, every request takes stock's path.
- When the engine client shuts down (the server's shutdown), a checkpointed
  engine is restored first, so that vLLM stops an engine core that runs again
  (deep_sleep.restore_before_shutdown).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.datastructures import QueryParams
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_graph_sleep.deep_sleep import (
    DeepSleep,
    DeepSleepError,
    DeepSleepRefused,
    DeepWakeError,
    controller_for,
    engine_core_pids,
    serve_deep_sleep,
)
from vllm_graph_sleep.request_gate import (
    ENGINE_SLEPT,
    INFERENCE_PATHS,
    SLEEP_NOT_FORWARDED,
    SLEEP_PATH,
    WAKE_UP_PATH,
    sleep_level,
)
from vllm_graph_sleep.settings import parse_yes_no

logger = logging.getLogger("vllm.graph_sleep")

IS_SLEEPING_PATH = "/is_sleeping"
CHECKPOINT_PARAM = "checkpoint"
#: Seconds a client is told to wait before it retries a wake refused for room,
#: or a deep sleep refused for other POSTs still unanswered.
RETRY_AFTER_S = 5
#: Seconds a deep sleep waits for the other POSTs admitted before it (a client
#: that never finishes its request's body would hold it, and every wake behind it).
OTHERS_WAIT_S = 30.0


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


class _Buffered:
    """An inner app's response, kept until the middleware decides what goes out."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def send(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def status(self) -> int | None:
        starts = [m for m in self.messages if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    async def replay(self, send: Send) -> None:
        for message in self.messages:
            await send(message)


def _checkpoint_asked(params: QueryParams) -> tuple[bool, str | None]:
    """Whether a /sleep query asks for a deep sleep, or why it is a bad one."""
    values = params.getlist(CHECKPOINT_PARAM)
    if len(values) > 1:
        return False, f"{CHECKPOINT_PARAM} given {len(values)} times: give it once"
    deep = parse_yes_no(values[0]) if values else False
    if deep is None:
        return False, f"invalid {CHECKPOINT_PARAM} {values[0]!r}: 1/true/yes or 0/false/no"
    if deep and sleep_level(params) == 0:
        # Level 0 keeps everything on the GPU: the checkpoint would move it all.
        return False, f"{CHECKPOINT_PARAM}=1 needs a sleep level of 1 or 2"
    return deep, None


class DeepSleepEndpoints:
    """The middleware; one per API server process, owner of its controller."""

    def __init__(self, app: ASGIApp, controller: DeepSleep | None = None) -> None:
        self.app = app
        self._controller = controller  # made at the first deep sleep asked for
        self._transition: asyncio.Lock | None = None
        # From the first deep sleep asked on: one transition at a time.
        self._deep_asked = controller is not None
        # Other POSTs admitted and not yet answered: a deep sleep waits for them,
        # or one could reach the engine after its checkpoint and hang until the wake.
        self._others = 0
        self._no_others: asyncio.Event | None = None

    @property
    def checkpointed(self) -> bool:
        """Whether the driver holds the engine (checkpointed, or restored but
        not yet unlocked): only a wake may reach it."""
        return self._controller is not None and self._controller.holds_engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        method = scope["method"]
        if method == "GET" and path == IS_SLEEPING_PATH:
            await self._is_sleeping(scope, receive, send)
            return
        if method != "POST" or path in INFERENCE_PATHS:
            await self.app(scope, receive, send)
            return
        if self._transition is None:
            self._transition, self._no_others = asyncio.Lock(), asyncio.Event()
            self._no_others.set()
        deep = False
        if path == SLEEP_PATH:
            params = QueryParams(scope["query_string"])
            deep, error = _checkpoint_asked(params)
            if error is not None:
                await _error(400, error)(scope, receive, send)
                return
        self._deep_asked = self._deep_asked or deep
        if not self._deep_asked:
            # No deep sleep was ever asked of this server: stock's path, no waiting.
            self._admit()
            await self._answer_admitted(scope, receive, send)
            return
        if path == WAKE_UP_PATH:
            async with self._transition:
                if self.checkpointed:
                    await self._deep_wake(scope, receive, send)
                else:
                    await self.app(scope, receive, send)
            return
        if deep:
            # An answer before vLLM's sleep is asked (a refusal, a wait given
            # up, an error) leaves the engine as it was, whatever its status.
            scope[SLEEP_NOT_FORWARDED] = True
            async with self._transition:
                if self.checkpointed:
                    await self._refuse_while_checkpointed(scope, receive, send)
                elif not await self._others_answered():
                    await _error(
                        503,
                        f"deep sleep not started: {self._others} other request(s) to this "
                        f"server still unanswered after {OTHERS_WAIT_S:g} s; the engine is "
                        "as it was",
                        **{"Retry-After": str(RETRY_AFTER_S)},
                    )(scope, receive, send)
                else:
                    await self._deep_sleep(scope, receive, send)
            return
        async with self._transition:  # a transition under way ends first
            refused = self.checkpointed
            if not refused:
                self._admit()
        if refused:
            await self._refuse_while_checkpointed(scope, receive, send)
            return
        await self._answer_admitted(scope, receive, send)

    async def _others_answered(self) -> bool:
        """Waits, up to OTHERS_WAIT_S, for the other POSTs admitted before a
        deep sleep (none is admitted while it holds the transition)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + OTHERS_WAIT_S
        while self._others:
            try:
                await asyncio.wait_for(self._no_others.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return False
        return True

    def _admit(self) -> None:
        self._others += 1
        self._no_others.clear()

    async def _answer_admitted(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            self._others -= 1
            if not self._others:
                self._no_others.set()

    async def _refuse_while_checkpointed(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _error(
            409,
            "the engine is asleep and checkpointed by the CUDA driver: POST /wake_up first",
        )(scope, receive, send)

    async def _deep_sleep(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = scope["app"].state
        args = getattr(state, "args", None)
        self._controller, why = controller_for(
            state.engine_client, getattr(args, "api_server_count", None) or 1, self._controller
        )
        if why is None:
            (pid,) = engine_core_pids(state.engine_client)
            try:  # NVML's view of the engine, before anything is done
                await asyncio.to_thread(self._controller.held_on_one_gpu, pid)
            except DeepSleepRefused as error:
                why = str(error)
        if why is not None:
            await _error(409, f"deep sleep refused: {why}")(scope, receive, send)
            return
        serve_deep_sleep(state.engine_client, self._controller)
        scope[SLEEP_NOT_FORWARDED] = False
        inner = _Buffered()
        await self.app(scope, receive, inner.send)
        if inner.status != 200:
            await inner.replay(send)  # vLLM's own answer: no sleep, no checkpoint
            return
        scope[ENGINE_SLEPT] = True  # for AsleepGate, whatever the checkpoint answers
        try:
            await asyncio.to_thread(self._controller.checkpoint, pid)
        except (DeepSleepError, DeepSleepRefused) as error:
            await _error(500, f"asleep as asked, but not checkpointed: {error}")(
                scope, receive, send
            )
            return
        await inner.replay(send)

    async def _deep_wake(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await asyncio.to_thread(self._controller.restore)
        except DeepWakeError as error:
            if error.checkpointed:
                response = _error(503, str(error), **{"Retry-After": str(RETRY_AFTER_S)})
            else:
                response = _error(500, str(error))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _is_sleeping(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.checkpointed:
            await self.app(scope, receive, send)  # vLLM's answer, as stock gives it
            return
        await JSONResponse({"is_sleeping": True, "checkpointed": True})(scope, receive, send)
