"""Whether the engine sleeps, asked once for every request of one API server
that waits on the answer.

AsleepGate (request_gate) holds requests while the engine sleeps. Each held
request asking the engine itself (is_sleeping, ten times a second) put one
call per request into the engine core's single input queue, in front of the
/wake_up that would release them (issue 34: 200 held requests made 2,200 calls
in 1.3 s), and each request's bound lasted as long as the engine took to
answer, which it does only between whatever it is busy with (reload_weights, a
long wake, a stuck collective). Here one task per server asks, with at most one
question in flight and a timeout on it, and only while a request waits on the
answer; a waiter waits for an answer with its own deadline, never for the
engine. Questions start at least POLL_S apart, however many requests arrive
meanwhile, so the engine is asked at most about ten times a second whatever
the load (a request that arrives between two questions waits for the next).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

#: How often the engine is asked while requests wait on the answer.
POLL_S = 0.1
#: How long one question may stay unanswered before it is given up (and asked
#: again); until then, and after, the engine counts as asleep.
ANSWER_TIMEOUT_S = 5.0


class EngineWatch:
    """Asks an engine client (EngineClient.is_sleeping) whether it sleeps while
    anyone waits on the answer. One per API server (AsleepGate owns it)."""

    def __init__(self, poll_s: float = POLL_S, answer_timeout_s: float = ANSWER_TIMEOUT_S):
        self.poll_s = poll_s
        self.answer_timeout_s = answer_timeout_s
        self._engine: Any = None
        self._interested = 0  # waiters and watchers
        self._asked = 0  # questions started
        self._awake_answer = 0  # the number of the latest question answered "awake"
        self._asleep_since: float | None = None  # every answer since: asleep, or none
        self._question_since: float | None = None  # when the question in flight was asked
        self._awake_asked_at: float | None = None  # when the latest "awake" question was asked
        self._answered = asyncio.Event()  # replaced after each answer
        self._task: asyncio.Task | None = None

    async def until_awake(self, engine: Any, deadline: float) -> bool:
        """True once a question asked after this call began finds the engine
        awake (or the engine check fails: vLLM's own handlers then answer the
        request); False at the deadline, whatever the engine does."""
        needed = self._asked + 1
        self._interest(engine, +1)
        try:
            while self._awake_answer < needed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._answered.wait(), remaining)
                except asyncio.TimeoutError:
                    return False
            return True
        finally:
            self._interest(engine, -1)

    def one_question_s(self) -> float:
        """How long a waiter gives the engine to answer one question asked
        after it came: that question starts within a poll interval (another
        may be in flight) and gets one more for its answer; an engine slower
        than that counts as asleep."""
        return 2 * self.poll_s

    def watch(self, engine: Any) -> None:
        """Keeps the engine asked (asleep_since) until unwatch."""
        self._interest(engine, +1)

    def unwatch(self, engine: Any) -> None:
        self._interest(engine, -1)

    def asleep_since(self) -> float | None:
        """Since when no answer said awake: since the first question answered
        asleep (or not answered) after the last awake answer; None while it is
        awake. Current only while watched."""
        return self._asleep_since or self._question_since

    def awake_asked_at(self) -> float | None:
        """When the latest question that found the engine awake was asked."""
        return self._awake_asked_at

    def _interest(self, engine: Any, change: int) -> None:
        self._engine = engine
        self._interested += change
        if self._interested and self._task is None:
            self._task = asyncio.ensure_future(self._ask_while_wanted())

    async def _ask_while_wanted(self) -> None:
        try:
            while self._interested:
                self._asked += 1
                number = self._asked
                self._question_since = asked_at = time.monotonic()
                asleep = await self._ask()
                self._question_since = None
                if asleep:
                    self._asleep_since = self._asleep_since or asked_at
                else:
                    self._awake_answer = number
                    self._asleep_since = None
                    self._awake_asked_at = asked_at
                answered, self._answered = self._answered, asyncio.Event()
                answered.set()
                if self._interested:
                    await asyncio.sleep(max(0.0, asked_at + self.poll_s - time.monotonic()))
        finally:
            # Nobody watches: what it said goes stale, the next watcher starts afresh.
            self._task = None
            self._asleep_since = self._question_since = None

    async def _ask(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self._engine.is_sleeping(), self.answer_timeout_s))
        except asyncio.TimeoutError:
            return True  # no answer: held requests stay held, their bound runs
        except Exception:
            # A dead or failing engine: let requests through, so vLLM's own
            # handlers answer them (and shut a dead server down) as they would.
            return False
