"""Patch: vllm.v1.executor.abstract (Executor.sleep, Executor.wake_up).

vLLM symbols: Executor.sleep(level), which sends "sleep" to every worker through
collective_rpc and then records the engine asleep in Executor.is_sleeping and
Executor.sleeping_tags (what Executor.wake_up and EngineCore.wake_up read), and
Executor.wake_up(tags), which sends "wake_up" and takes the tags woken out of
them. No executor subclass overrides either. Verified against vLLM 0.26.0.

Why: with more than one rank, a sleep that fails on one rank after others slept
leaves the engine half asleep and recorded awake, and MultiprocExecutor reads
no reply after the first failed one, so later calls get out-of-step replies
(issue 34; vllm_graph_sleep.rank_sleep). This wrapper has every worker
sleep through rank_sleep.sleep_answering, which answers a failed sleep
instead of raising where graph offload is active, and reads every rank's
answer (rank_sleep.sleep_every_rank): all slept, it records the sleep as vLLM
does; otherwise every rank is woken back up and SleepError raised, with the
engine recorded asleep only if a rank could not be woken back up. A repeated
sleep gets vLLM's own answer ("Executor is already sleeping"). A wake that
fails on a rank (rank_sleep.wake_answering) is read on every rank and raised
as WakeUpError with the engine still recorded asleep with its tags
(rank_sleep.wake_every_rank); a wake with nothing to wake, or with a tag that
is not asleep, gets vLLM's own answer. The workers' own sleep and wake_up
raise as stock's, for every other caller (LLM.collective_rpc("sleep")).

Remove when: vLLM's executor reads every rank's reply and keeps the ranks of a
failed sleep in one state (not so in 0.33).
"""

from __future__ import annotations

import logging
import time

from vllm_graph_sleep import rank_sleep
from vllm_graph_sleep.allocator import KV_CACHE_TAG, WEIGHTS_TAG
from vllm_graph_sleep.patches._wrap import require, wrap_function

logger = logging.getLogger("vllm.graph_sleep")
WHERE = "vllm.v1.executor.abstract.Executor"


def _wrap_sleep(original):
    def sleep(self, level: int = 1):
        if self.is_sleeping:
            return original(self, level)
        started = time.perf_counter()

        def record_asleep() -> None:
            # What vLLM's Executor.sleep records after its collective_rpc.
            self.sleeping_tags = {WEIGHTS_TAG, KV_CACHE_TAG}
            self.is_sleeping = True

        rank_sleep.sleep_every_rank(self.collective_rpc, level, record_asleep)
        logger.info("It took %.6f seconds to fall asleep.", time.perf_counter() - started)
        return None

    return sleep


def _wrap_wake_up(original):
    def wake_up(self, tags: list[str] | None = None):
        if not self.is_sleeping or (tags and not set(tags) <= self.sleeping_tags):
            return original(self, tags)  # vLLM's warning: nothing is woken
        started = time.perf_counter()
        rank_sleep.wake_every_rank(self.collective_rpc, tags)
        woken = set(tags) if tags else set(self.sleeping_tags)
        # What vLLM's Executor.wake_up records after its collective_rpc.
        self.sleeping_tags -= woken
        self.is_sleeping = bool(self.sleeping_tags)
        logger.info(
            "It took %.6f seconds to wake up tags %s.",
            time.perf_counter() - started,
            tags if tags is not None else woken,
        )
        return None

    return wake_up


def apply() -> None:
    from vllm.v1.executor import abstract

    executor = require(abstract, "Executor", where="vllm.v1.executor.abstract")
    require(executor, "sleep", where=WHERE, parameters=("level",))
    wrap_function(executor, "sleep", _wrap_sleep, where=WHERE)
    require(executor, "wake_up", where=WHERE, parameters=("tags",))
    wrap_function(executor, "wake_up", _wrap_wake_up, where=WHERE)
