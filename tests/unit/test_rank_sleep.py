"""A sleep that fails on one rank of a two-rank engine leaves every rank in one
state and every later reply in step (issue 34, item 2).

vLLM's real EngineCore (sleep, wake_up, is_sleeping), Executor and
MultiprocExecutor.collective_rpc, WorkerProc.worker_busy_loop and Worker.sleep /
wake_up run here; each rank is a thread with its own GraphSleepAllocator on a
fake driver. Stand-ins: the message queues between processes (in-process
queues that pickle what they carry, as vLLM's shared-memory queues do), the
scheduler's pause state, the model runner's cache resets, and torch's device
queries that Worker.sleep makes (no GPU here)."""

from __future__ import annotations

import pickle
import queue
import threading
from collections import deque

import pytest
import torch
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc
from vllm.v1.worker.gpu_worker import Worker

from tests.unit.fake_vmm import DEFAULT_STACK, PAGE, FakeVmmDriver
from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GraphSleepAllocator, SleepError
from vllm_graph_sleep.backend import GraphSleepBackend
from vllm_graph_sleep.patches import v1_executor_abstract, v1_worker_gpu_worker


class _Closed(BaseException):
    """Ends a worker's busy loop (its dequeue raises it)."""


class _Queue:
    """One direction of a vLLM message queue between two processes."""

    def __init__(self):
        self._items: queue.Queue = queue.Queue()

    def enqueue(self, item):
        self._items.put(pickle.dumps(item))

    def dequeue(self, timeout=None, indefinite=False):
        item = self._items.get(timeout=None if indefinite else timeout)
        if item is None:
            raise _Closed
        return pickle.loads(item)

    def close(self):
        self._items.put(None)

    def pending(self) -> int:
        return self._items.qsize()


class _Broadcast:
    """The executor's broadcast queue: every worker reads every call."""

    def __init__(self, readers):
        self.readers = readers

    def enqueue(self, item):
        for reader in self.readers:
            reader.enqueue(item)


class _ModelRunner:
    model = torch.nn.Module()  # no buffers for a level-2 sleep to save

    def get_draft_model(self):
        return None

    def reset_mm_cache(self):
        pass

    def reset_encoder_cache(self):
        pass

    def post_kv_cache_wake_up(self):
        pass


class _Scheduler:
    """The scheduler's pause state, as EngineCore's pause and resume set it."""

    pause_state = PauseState.UNPAUSED

    def set_pause_state(self, state):
        self.pause_state = state

    def finish_requests(self, request_ids, status):
        pass

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        return True

    def reset_encoder_cache(self):
        pass

    def has_unfinished_requests(self):
        return False


def _rank_of(worker):
    return worker.rank


class Engine:
    """Two ranks, their allocators and drivers, vLLM's executor and engine core."""

    def __init__(self, install_allocator):
        self.drivers, self.allocators, self.weights, workers = [], [], [], []
        for rank in range(2):
            driver = FakeVmmDriver()
            allocator = GraphSleepAllocator(driver, settle_after_sleep=False)
            with allocator.allocation_tag("weights"):
                self.weights.append(driver.malloc(PAGE))
            driver.write(self.weights[-1], 10 + rank)
            with allocator.allocation_tag("kv_cache"):
                driver.malloc(2 * PAGE)
            install_allocator(allocator)
            worker = object.__new__(Worker)
            worker.rank = rank
            worker.model_runner = _ModelRunner()
            worker._sleep_mode_backend = GraphSleepBackend()
            worker._sleep_saved_buffers = {}
            worker._sleep_rebuild_draft_metadata_buffers = False
            self.drivers.append(driver)
            self.allocators.append(allocator)
            workers.append(worker)
        install_allocator(None)
        self.requests = [_Queue() for _ in workers]
        self.replies = [_Queue() for _ in workers]
        self._threads = []
        for worker, requests, replies in zip(workers, self.requests, self.replies, strict=True):
            proc = object.__new__(WorkerProc)
            proc.rank, proc.worker = worker.rank, worker
            proc.rpc_broadcast_mq, proc.worker_response_mq = requests, replies
            proc.use_async_scheduling = False
            thread = threading.Thread(target=self._serve, args=(proc,), daemon=True)
            thread.start()
            self._threads.append(thread)
        executor = object.__new__(MultiprocExecutor)
        executor.rpc_broadcast_mq = _Broadcast(self.requests)
        executor.response_mqs = self.replies
        executor.futures_queue = deque()
        executor.is_failed = False
        executor.is_sleeping = False
        executor.sleeping_tags = set()
        self.executor = executor
        self.core = object.__new__(EngineCore)
        self.core.model_executor = executor
        self.core.scheduler = _Scheduler()
        self.core.mm_receiver_cache = None

    @staticmethod
    def _serve(proc):
        try:
            proc.worker_busy_loop()
        except _Closed:
            pass

    def close(self):
        for requests in self.requests:
            requests.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def awake(self, rank) -> bool:
        allocator = self.allocators[rank]
        return allocator.mapped_bytes() == allocator.get_current_usage()

    def asleep(self, rank) -> bool:
        return self.allocators[rank].mapped_bytes() == 0


@pytest.fixture
def engine(monkeypatch, install_allocator):
    v1_worker_gpu_worker.apply()
    v1_executor_abstract.apply()
    monkeypatch.setattr(config, "_active_in_this_process", True)
    # Worker.sleep's device queries (a GPU's free memory does not matter here).
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda *args: (1 << 30, 2 << 30))
    engine = Engine(install_allocator)
    yield engine
    engine.close()


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_sleep_failing_on_one_rank_wakes_every_rank_back_up(engine, failing_rank):
    engine.drivers[failing_rank].fail("host_buffer")  # its pinned backup
    with pytest.raises(Exception) as raised:
        engine.core.sleep(level=1)
    # Every reply was read: the next call gets its own answers, in rank order.
    assert all(replies.pending() == 0 for replies in engine.replies)
    assert engine.executor.collective_rpc(_rank_of) == [0, 1]
    for rank in range(2):
        assert engine.awake(rank), rank
        assert engine.drivers[rank].stack_limits.get(0, DEFAULT_STACK) == DEFAULT_STACK
        assert bool((engine.drivers[rank].read(engine.weights[rank]) == 10 + rank).all())
    assert not engine.executor.is_sleeping
    assert engine.core.is_sleeping()  # paused: vLLM's own state until a wake
    assert raised.type is SleepError
    message = str(raised.value)
    assert f"rank {failing_rank}" in message and "pinned host allocation" in message
    assert "Every rank was woken back up: the engine is awake" in message
    assert "scheduling paused until POST /wake_up" in message
    engine.core.wake_up()
    assert not engine.core.is_sleeping()
    # And the engine sleeps and wakes on every rank afterwards.
    engine.core.sleep(level=1)
    assert engine.executor.is_sleeping and engine.asleep(0) and engine.asleep(1)
    engine.core.wake_up()
    assert not engine.core.is_sleeping() and engine.awake(0) and engine.awake(1)
    for rank in range(2):
        assert bool((engine.drivers[rank].read(engine.weights[rank]) == 10 + rank).all())


def test_a_rank_that_cannot_be_woken_back_up_leaves_the_engine_recorded_asleep(engine):
    engine.drivers[1].fail("host_buffer")
    engine.drivers[0].fail("create_and_map")  # rank 0's first map: the wake back
    with pytest.raises(Exception) as raised:
        engine.core.sleep(level=1)
    assert engine.executor.collective_rpc(_rank_of) == [0, 1]
    assert engine.asleep(0) and engine.awake(1)
    assert engine.executor.is_sleeping and engine.core.is_sleeping()
    assert raised.type is SleepError and "The engine is recorded asleep" in str(raised.value)
    engine.core.wake_up()  # reaches every rank: rank 0 wakes, rank 1 has nothing asleep
    assert engine.awake(0) and engine.awake(1)
    assert not engine.executor.is_sleeping and not engine.core.is_sleeping()
    assert bool((engine.drivers[0].read(engine.weights[0]) == 10).all())


def test_a_sleep_on_every_rank_is_recorded_as_vllm_does(engine):
    engine.core.sleep(level=1)
    assert engine.executor.is_sleeping
    assert engine.executor.sleeping_tags == {"weights", "kv_cache"}
    engine.core.sleep(level=1)  # vLLM's "already sleeping": nothing sent
    assert engine.executor.collective_rpc(_rank_of) == [0, 1]
    engine.core.wake_up(["kv_cache"])
    assert engine.executor.sleeping_tags == {"weights"} and engine.core.is_sleeping()
    engine.core.wake_up(["weights"])
    assert not engine.core.is_sleeping() and engine.awake(0) and engine.awake(1)


def test_a_failed_level_2_sleep_says_the_ranks_that_slept_need_their_weights_reloaded(engine):
    engine.drivers[1].fail("host_buffer")  # rank 1's graph-pool or runtime backup
    with engine.allocators[1].allocation_tag("cudagraph"):
        engine.drivers[1].malloc(PAGE)
    with pytest.raises(SleepError) as raised:
        engine.core.sleep(level=2)
    assert engine.awake(0) and engine.awake(1) and not engine.executor.is_sleeping
    assert bool((engine.drivers[1].read(engine.weights[1]) == 11).all())  # it never slept
    message = str(raised.value)
    assert "rank 1" in message and "dropped their weights (level 2): reload them" in message


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_wake_failing_on_one_rank_keeps_replies_in_step_and_the_engine_asleep(
    engine, failing_rank
):
    """Review, 2026-12-06: the failed rank raised, the executor read no later
    reply, and a later failed sleep was then read as a success."""
    from vllm_graph_sleep.allocator import WakeUpError

    engine.core.sleep(level=1)
    engine.drivers[failing_rank].fail("create_and_map")  # no room to map back
    with pytest.raises(WakeUpError) as raised:
        engine.core.wake_up()
    assert f"rank {failing_rank}" in str(raised.value) and "1 of 2 rank(s)" in str(raised.value)
    assert all(replies.pending() == 0 for replies in engine.replies)
    assert engine.executor.collective_rpc(_rank_of) == [0, 1]
    assert engine.executor.is_sleeping and engine.core.is_sleeping()
    assert engine.executor.sleeping_tags == {"weights", "kv_cache"}
    assert engine.asleep(failing_rank) and engine.awake(1 - failing_rank)
    engine.core.wake_up()  # the retry reaches every rank
    assert not engine.core.is_sleeping() and engine.awake(0) and engine.awake(1)
    for rank in range(2):
        assert bool((engine.drivers[rank].read(engine.weights[rank]) == 10 + rank).all())
    # A sleep that then fails on a rank is read as the failure it is.
    with engine.allocators[1].allocation_tag("cudagraph"):
        engine.drivers[1].malloc(PAGE)  # a backup that needs a new pinned buffer
    engine.drivers[1].fail("host_buffer")
    with pytest.raises(SleepError, match="rank 1"):
        engine.core.sleep(level=1)
    assert engine.awake(0) and engine.awake(1) and not engine.executor.is_sleeping


def test_a_staged_wake_failing_on_a_rank_keeps_the_tags_asleep(engine):
    from vllm_graph_sleep.allocator import WakeUpError

    engine.core.sleep(level=1)
    engine.drivers[0].fail("create_and_map")
    with pytest.raises(WakeUpError):
        engine.core.wake_up(["weights"])
    assert engine.executor.sleeping_tags == {"weights", "kv_cache"}
    engine.core.wake_up(["weights"])
    assert engine.executor.sleeping_tags == {"kv_cache"} and engine.core.is_sleeping()
    engine.core.wake_up(["kv_cache"])
    assert not engine.core.is_sleeping() and engine.awake(0) and engine.awake(1)


@pytest.mark.parametrize("method", ["sleep", "wake_up"])
def test_a_workers_own_sleep_or_wake_raises_for_other_callers_as_stock(engine, method):
    """Only the executor's sleep and wake read a failure as an answer; the
    worker methods themselves raise, so that LLM.collective_rpc("sleep") or
    POST /collective_rpc see the failure as they do with stock vLLM."""
    if method == "wake_up":
        engine.core.sleep(level=1)
        engine.drivers[1].fail("create_and_map")
        kwargs = {"tags": None}
    else:
        engine.drivers[1].fail("host_buffer")
        kwargs = {"level": 1}
    with pytest.raises(RuntimeError, match="Worker failed"):
        engine.core.collective_rpc(method, kwargs=kwargs)
    # The last rank failed, so vLLM read every reply: the next call is in step.
    assert engine.executor.collective_rpc(_rank_of) == [0, 1]
