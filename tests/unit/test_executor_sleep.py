"""executor_sleep follows vLLM 0.26's own Executor and EngineCore: every
sequence of sleeps and wakes is run through vLLM's EngineCore.sleep/wake_up
and Executor.sleep/wake_up (with a stand-in for the workers) and through our
record of it, which must agree on what is asleep and on which sleep
discarded the weights."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.abstract import Executor

from vllm_graph_sleep.executor_sleep import ExecutorSleep
from vllm_graph_sleep.patches._wrap import original_of

SLEEPS = [("sleep", level) for level in (0, 1, 2)]
WAKE_TAGS = ([], ["weights"], ["kv_cache"], ["weights", "kv_cache"], ["scheduling"])
WAKES = [("wake", tags) for tags in (*WAKE_TAGS, ["weights", "scheduling"])]


class RecordingExecutor(Executor):
    """vLLM's Executor with its abstract methods filled in: the workers only
    record what reaches them."""

    def _init_executor(self) -> None:
        raise NotImplementedError

    def check_health(self) -> None:
        pass

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, **_):
        self.worker_calls.append((method, kwargs))


class VllmEngine:
    """vLLM's EngineCore.sleep/wake_up over vLLM's Executor.sleep/wake_up; the
    workers only record what reaches them."""

    def __init__(self) -> None:
        self.executor = object.__new__(RecordingExecutor)
        self.executor.is_sleeping = False
        self.executor.sleeping_tags = set()
        self.worker_calls = self.executor.worker_calls = []
        # vLLM's own, unpatched (our wrappers keep these rules; other tests
        # may have applied them).
        self.executor.sleep = original_of(Executor.sleep).__get__(self.executor)
        self.executor.wake_up = original_of(Executor.wake_up).__get__(self.executor)
        self.core = SimpleNamespace(
            model_executor=self.executor,
            pause_scheduler=lambda mode, clear_cache: None,
            resume_scheduler=lambda: None,
        )

    def sleep(self, level: int) -> bool:
        """True when the workers were told to discard the weights."""
        before = len(self.worker_calls)
        EngineCore.sleep(self.core, level)
        return ("sleep", {"level": 2}) in self.worker_calls[before:]

    def wake(self, tags: list[str]) -> None:
        # vLLM's /wake_up handler passes None for no tags.
        EngineCore.wake_up(self.core, list(tags) or None)


def run(steps) -> None:
    vllm, ours = VllmEngine(), ExecutorSleep()
    for kind, argument in steps:
        if kind == "sleep":
            discarded = vllm.sleep(argument)
            assert ours.sleep_answered(argument, True, 200) == discarded, steps
        else:
            vllm.wake(argument)
            ours.wake_answered(argument, True, 200)
        assert ours.asleep == vllm.executor.sleeping_tags, steps


@pytest.mark.parametrize("steps", list(itertools.product(SLEEPS + WAKES, repeat=3)))
def test_every_three_calls_agree_with_vllm(steps):
    run(steps)


def test_long_random_sequences_agree_with_vllm():
    generator = random.Random(38)
    for _ in range(200):
        run([generator.choice(SLEEPS + WAKES) for _ in range(12)])


def test_a_level_2_sleep_after_a_level_1_discards_nothing():
    ours = ExecutorSleep()
    assert ours.sleep_answered(1, True, 200) is False
    assert ours.sleep_answered(2, True, 200) is False
    ours.wake_answered(["weights"], True, 200)
    assert ours.sleep_answered(2, True, 200) is False  # the KV cache still sleeps
    ours.wake_answered(["kv_cache"], True, 200)
    assert ours.sleep_answered(2, True, 200) is True


@pytest.mark.parametrize("status", [None, 500, 503])
def test_after_a_failed_call_every_level_2_sleep_counts_as_discarding(status):
    ours = ExecutorSleep()
    ours.sleep_answered(1, True, 200)
    ours.wake_answered([], False, status)  # the wake may have happened
    assert ours.asleep is None
    assert ours.sleep_answered(2, True, 200) is True
    ours.wake_answered(["weights"], True, 200)  # a staged wake tells nothing
    assert ours.sleep_answered(2, True, 200) is True
    ours.wake_answered([], True, 200)  # a wake of every tag: all awake
    assert ours.asleep == set()


def test_a_call_refused_with_a_4xx_changed_nothing():
    ours = ExecutorSleep()
    ours.sleep_answered(1, True, 200)
    ours.wake_answered(["bogus"], False, 400)
    ours.sleep_answered(2, False, 409)
    assert ours.asleep == {"weights", "kv_cache"}
    assert ours.sleep_answered(2, True, 200) is False


@pytest.mark.parametrize("status", [None, 500])
def test_a_level_2_sleep_that_failed_counts_as_discarding_the_weights(status):
    """With several ranks, those that slept dropped their weights before the
    others failed, and every rank was woken back up (rank_sleep)."""
    ours = ExecutorSleep()
    assert ours.sleep_answered(2, False, status) is True
    assert ours.sleep_answered(1, False, status) is False


def test_a_level_2_sleep_refused_with_a_4xx_discarded_nothing():
    assert ExecutorSleep().sleep_answered(2, False, 409) is False
