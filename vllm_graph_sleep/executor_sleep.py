"""What vLLM's executor holds asleep, as the /sleep and /wake_up calls of one
API server left it: AsleepGate asks it whether a level-2 /sleep discarded the
weights.

vLLM 0.26's Executor.sleep does nothing while the executor sleeps ("Executor
is already sleeping"), so a level-2 /sleep after a level-1 one, or after a
wake of the weights alone, keeps the weights' level-1 backup; only one that
finds nothing asleep discards them. Executor.wake_up takes the tags it woke
out of Executor.sleeping_tags (all of them when given none) and wakes nothing
when one of them is not asleep; EngineCore.wake_up drops the "scheduling"
pseudo-tag first and skips the executor when no tag is left. A level-0 sleep
and /pause only pause the scheduler. The engine cannot be asked: is_sleeping
answers true for a paused scheduler too.

So the calls' answers are followed: one refused with a 4xx changed nothing
(the engine was not called, or refused it first); after any other failure the
state is unknown until a wake of every tag succeeds, and while it is unknown
every level-2 sleep counts as discarding the weights (the safe side: requests
then wait for a reload). So does a level-2 sleep that failed that way: with
several ranks, those that slept lost their weights before the others failed
and all were woken back up (rank_sleep).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_graph_sleep.memory.records import KV_CACHE_TAG, WEIGHTS_TAG

#: EngineCore's pseudo-tag that ends a level-0 sleep (not an executor tag).
SCHEDULING_TAG = "scheduling"


class ExecutorSleep:
    """Executor.sleeping_tags as this server's calls left them (None: unknown)."""

    def __init__(self) -> None:
        self.asleep: set[str] | None = set()

    def sleep_answered(self, level: int, succeeded: bool, status: int | None) -> bool:
        """Records a /sleep of `level` and its answer; True when that sleep
        discarded the weights (or may have: the state was unknown)."""
        if not succeeded:
            self._failed(status)
            return level == 2 and self.asleep is None
        if level < 1:
            return False
        if self.asleep is None:
            return level == 2
        if self.asleep:
            return False  # the executor was asleep: vLLM did nothing
        self.asleep = {WEIGHTS_TAG, KV_CACHE_TAG}
        return level == 2

    def wake_answered(self, tags: Sequence[str], succeeded: bool, status: int | None) -> None:
        """Records a /wake_up with the `tags` of its query (none: every tag)."""
        if not succeeded:
            self._failed(status)
            return
        if not tags:
            self.asleep = set()
            return
        woken = {tag for tag in tags if tag != SCHEDULING_TAG}
        if self.asleep is not None and woken <= self.asleep:
            self.asleep -= woken

    def _failed(self, status: int | None) -> None:
        if not refused_before_the_engine(status):
            self.asleep = None


def refused_before_the_engine(status: int | None) -> bool:
    """Whether a failed call's answer says it changed nothing: a 4xx (the
    engine was not called, or refused the call first). A 5xx, or an error
    raised before any answer (None), may come after the engine acted."""
    return status is not None and 400 <= status < 500
