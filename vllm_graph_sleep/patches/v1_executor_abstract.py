"""Patch: vllm.v1.executor.abstract (Executor.sleep).

vLLM symbols: Executor.sleep(level), which sends "sleep" to every worker through
collective_rpc and then records the engine asleep in Executor.is_sleeping and
Executor.sleeping_tags (what Executor.wake_up and EngineCore.wake_up read).
No executor subclass overrides it. Verified against vLLM 0.26.0.

Why: with more than one rank, a sleep that fails on one rank after others slept
leaves the engine half asleep and recorded awake, and MultiprocExecutor reads
no reply after the first failed one, so later calls get out-of-step replies
(issue 34; vllm_graph_sleep.rank_sleep). Our workers answer a failed sleep
instead of raising (v1_worker_gpu_worker); this wrapper reads every rank's
answer (rank_sleep.sleep_every_rank): all slept, it records the sleep as vLLM
does; otherwise every rank is woken back up and SleepError raised, with the
engine recorded asleep only if a rank could not be woken back up. A repeated
sleep gets vLLM's own answer ("Executor is already sleeping").

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


def apply() -> None:
    from vllm.v1.executor import abstract

    executor = require(abstract, "Executor", where="vllm.v1.executor.abstract")
    require(executor, "sleep", where=WHERE, parameters=("level",))
    wrap_function(executor, "sleep", _wrap_sleep, where=WHERE)
