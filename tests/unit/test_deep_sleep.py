"""Deep sleep (issue 39, step 2) on the CPU: the controller through the real
ctypes binding against tests/unit/fake_libcuda.py (the driver's states and
argument checks) for a live child process it counts as holding a CUDA
context, GPU memory from a stand-in for NVML; the HTTP side through vLLM's own
dev sleep router with the plugin's middlewares and a fake engine client. What
the real driver does on an H200, from a separate controller and through this
code in `vllm serve`, is on docs/results/checkpoint-h200.md."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.entrypoints.serve.dev.sleep import api_router

from tests.unit.fake_libcuda import FakeLibcuda
from tests.unit.test_sleep_endpoints import FakeEngineClient, serve
from vllm_graph_sleep import deep_sleep
from vllm_graph_sleep.cuda_checkpoint import CHECKPOINT_CALLS, CheckpointDriver
from vllm_graph_sleep.deep_sleep import (
    RESTORE_HEADROOM,
    DeepSleep,
    DeepSleepError,
    DeepSleepRefused,
    DeepWakeError,
    refusal,
)
from vllm_graph_sleep.patches import entrypoints_serve_dev_sleep_api_router as patch
from vllm_graph_sleep.units import MiB

HOLDER = Path(__file__).parent / "fake_context_holder.py"
HELD = 600 * MiB


@pytest.fixture
def engine_pid():
    """A live child the fake driver counts as holding a CUDA context: the engine core."""
    child = subprocess.Popen(
        [sys.executable, str(HOLDER), "holding", "check", "info", "bare"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child.stdout.readline()
    child.stdout.readline()
    yield child.pid
    child.stdin.close()
    child.wait(timeout=10)


class FakeMemory:
    """NVML as the controller asks it: what each pid holds, what is free."""

    def __init__(self, used: dict[int, dict[int, int]], free: int) -> None:
        self.used = used
        self.free = free

    def process_bytes(self, pid: int) -> dict[int, int]:
        return dict(self.used.get(pid, {}))

    def free_bytes(self, device: int) -> int:
        return self.free


def controller(pid: int, lib: FakeLibcuda | None = None, free: int = 10 << 30):
    lib = lib or FakeLibcuda()
    return DeepSleep(CheckpointDriver(lib), FakeMemory({pid: {0: HELD}}, free)), lib


def test_a_checkpoint_and_a_restore_go_through_the_driver_states(engine_pid):
    deep, lib = controller(engine_pid)
    done = deep.checkpoint(engine_pid)
    assert (done.pid, done.device, done.held) == (engine_pid, 0, HELD)
    assert lib.states[engine_pid] == "checkpointed"
    assert deep.restore() >= 0
    assert lib.states[engine_pid] == "running" and deep.checkpointed is None
    calls = [call for call, _ in lib.calls if call != "cuCheckpointProcessGetState"]
    assert calls == [
        "cuCheckpointProcessLock",
        "cuCheckpointProcessCheckpoint",
        "cuCheckpointProcessRestore",
        "cuCheckpointProcessUnlock",
    ]
    # The lock waits LOCK_TIMEOUT_MS for the engine's work in flight.
    assert int.from_bytes(lib.lock_args[0][:4], "little") == deep_sleep.LOCK_TIMEOUT_MS


def test_each_checkpoint_and_restore_logs_where_its_time_went(engine_pid, caplog):
    deep, _ = controller(engine_pid)
    with caplog.at_level("INFO", logger="vllm.graph_sleep"):
        done = deep.checkpoint(engine_pid)
        seconds = deep.restore()
    lines = [r.getMessage() for r in caplog.records if "graph-sleep deep sleep" in r.getMessage()]
    assert len(lines) == 2, lines
    assert f"pid {engine_pid} checkpointed, 600.00 MiB it held on GPU 0" in lines[0]
    assert "(lock " in lines[0] and " ms, checkpoint " in lines[0]
    assert f"pid {engine_pid} restored on GPU 0" in lines[1]
    assert "(restore " in lines[1] and " ms, unlock " in lines[1]
    assert done.lock_s >= 0 and done.checkpoint_s >= 0 and seconds >= 0


def test_a_driver_that_wants_cuinit_in_the_controller_gets_it_first(engine_pid):
    lib = FakeLibcuda(needs_init=True)
    deep, _ = controller(engine_pid, lib)
    deep.checkpoint(engine_pid)
    assert ("cuInit", None) in lib.calls and lib.states[engine_pid] == "checkpointed"
    deep.restore()
    assert lib.states[engine_pid] == "running"


def test_a_wake_without_room_starts_no_restore_and_a_retry_with_room_succeeds(engine_pid):
    deep, lib = controller(engine_pid, free=HELD + RESTORE_HEADROOM - 1)
    deep.checkpoint(engine_pid)
    with pytest.raises(DeepWakeError, match="no restore was started") as refused:
        deep.restore()
    assert refused.value.checkpointed is True
    assert "cuCheckpointProcessRestore" not in [call for call, _ in lib.calls]
    assert lib.states[engine_pid] == "checkpointed" and deep.checkpointed is not None
    deep._memory.free = HELD + RESTORE_HEADROOM
    deep.restore()
    assert lib.states[engine_pid] == "running"


def test_a_refused_checkpoint_unlocks_and_leaves_the_engine_as_the_sleep_did(engine_pid):
    deep, lib = controller(engine_pid, FakeLibcuda(refuse={"cuCheckpointProcessCheckpoint": 801}))
    with pytest.raises(DeepSleepError, match="CUDA_ERROR_NOT_SUPPORTED"):
        deep.checkpoint(engine_pid)
    assert lib.states[engine_pid] == "running" and deep.checkpointed is None
    assert deep.restore() == 0.0  # nothing to restore


def test_a_failed_restore_that_leaves_the_checkpoint_can_be_retried(engine_pid):
    lib = FakeLibcuda()
    deep, _ = controller(engine_pid, lib)
    deep.checkpoint(engine_pid)
    lib.refuse["cuCheckpointProcessRestore"] = 1
    with pytest.raises(DeepWakeError, match="could not restore") as failed:
        deep.restore()
    assert failed.value.checkpointed is True and deep.checkpointed is not None
    del lib.refuse["cuCheckpointProcessRestore"]
    deep.restore()
    assert lib.states[engine_pid] == "running"


def test_a_failed_restore_whose_state_the_driver_will_not_tell_keeps_the_checkpoint(engine_pid):
    """Forgotten, the checkpoint would be skipped by the next wake, whose
    engine calls would then wait on a process still checkpointed."""
    lib = FakeLibcuda()
    deep, _ = controller(engine_pid, lib)
    deep.checkpoint(engine_pid)
    lib.refuse["cuCheckpointProcessRestore"] = 1
    lib.refuse["cuCheckpointProcessGetState"] = 1
    with pytest.raises(DeepWakeError, match=r"it is now unknown") as failed:
        deep.restore()
    assert failed.value.checkpointed is True and deep.holds_engine
    assert lib.states[engine_pid] == "checkpointed"
    del lib.refuse["cuCheckpointProcessRestore"], lib.refuse["cuCheckpointProcessGetState"]
    deep.restore()
    assert lib.states[engine_pid] == "running" and not deep.holds_engine


def test_a_refused_checkpoint_whose_unlock_fails_in_an_unknown_state_stays_held(engine_pid):
    lib = FakeLibcuda(refuse={"cuCheckpointProcessCheckpoint": 801})
    checkpoint = lib.cuCheckpointProcessCheckpoint

    def checkpoint_then_no_state(pid, args):  # the state query works until then
        lib.refuse["cuCheckpointProcessGetState"] = 1
        return checkpoint(pid, args)

    lib.cuCheckpointProcessCheckpoint = checkpoint_then_no_state
    deep, _ = controller(engine_pid, lib)
    lib.refuse["cuCheckpointProcessUnlock"] = 999
    with pytest.raises(DeepSleepError, match="unlocking it failed too") as failed:
        deep.checkpoint(engine_pid)
    assert "wake it again" in str(failed.value)
    assert lib.states[engine_pid] == "locked" and deep.holds_engine
    del lib.refuse["cuCheckpointProcessUnlock"], lib.refuse["cuCheckpointProcessGetState"]
    deep.restore()  # the wake's part: the unlock
    assert lib.states[engine_pid] == "running" and not deep.holds_engine


def test_a_restore_whose_unlock_fails_keeps_the_engine_held_and_a_retry_unlocks_it(engine_pid):
    lib = FakeLibcuda()
    deep, _ = controller(engine_pid, lib)
    deep.checkpoint(engine_pid)
    lib.refuse["cuCheckpointProcessUnlock"] = 999
    with pytest.raises(DeepWakeError, match="restored but not unlocked") as failed:
        deep.restore()
    assert failed.value.checkpointed is True and "wake it again" in str(failed.value)
    assert lib.states[engine_pid] == "locked" and deep.holds_engine
    with pytest.raises(DeepSleepError, match="already checkpointed"):
        deep.checkpoint(engine_pid)
    del lib.refuse["cuCheckpointProcessUnlock"]
    deep.restore()
    assert lib.states[engine_pid] == "running" and not deep.holds_engine
    restores = [call for call, _ in lib.calls if call == "cuCheckpointProcessRestore"]
    assert len(restores) == 1  # the retry only unlocked


def test_a_process_nvml_does_not_list_is_refused_before_any_driver_call(engine_pid):
    deep = DeepSleep(CheckpointDriver(FakeLibcuda()), FakeMemory({}, 0))
    with pytest.raises(DeepSleepRefused, match="NVML lists no GPU memory"):
        deep.checkpoint(engine_pid)
    assert deep._driver._lib.calls == []


def test_a_process_on_two_gpus_is_refused_before_any_driver_call(engine_pid):
    deep = DeepSleep(CheckpointDriver(FakeLibcuda()), FakeMemory({engine_pid: {0: 1, 1: 1}}, 0))
    with pytest.raises(DeepSleepRefused, match="2 GPUs"):
        deep.checkpoint(engine_pid)
    assert deep._driver._lib.calls == []


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        (dict(pids=[10**6], world_size=1, is_rocm=True, missing_calls=[]), "ROCm has none"),
        (dict(pids=[10**6], world_size=1, missing_calls=None), "could not be loaded"),
        (
            dict(pids=[10**6], world_size=1, missing_calls=list(CHECKPOINT_CALLS[:1])),
            "lacks cuCheckpointProcessGetState",
        ),
        (dict(pids=None, world_size=1, missing_calls=[]), "runs in this process"),
        (dict(pids=[10**6, 10**6 + 1], world_size=1, missing_calls=[]), "2 engine core"),
        (dict(pids=[10**6], world_size=2, missing_calls=[]), "NCCL or CUDA IPC"),
        (dict(pids=[10**6], world_size=1, api_servers=2, missing_calls=[]), "2 API server"),
    ],
)
def test_what_the_driver_cannot_do_is_refused_with_the_reason(arguments, reason):
    assert reason in refusal(**arguments)


def test_an_engine_in_this_process_is_refused():
    import os

    assert "runs in this process" in refusal([os.getpid()], 1, missing_calls=[])
    assert refusal([10**6], 1, missing_calls=[]) is None


# -- through the HTTP server ---------------------------------------------------


class EngineWithCore(FakeEngineClient):
    """The fake engine client, with the engine core process vLLM's client keeps."""

    def __init__(self, pid: int, world_size: int = 1) -> None:
        super().__init__()
        manager = SimpleNamespace(processes=[SimpleNamespace(pid=pid)])
        self.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_manager=manager))
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=world_size))


@pytest.fixture(autouse=True)
def dev_mode(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")


def http(engine_pid, monkeypatch, world_size: int = 1, free: int = 10 << 30):
    deep, lib = controller(engine_pid, free=free)
    monkeypatch.setattr(DeepSleep, "load", classmethod(lambda cls: deep))
    patch.apply()
    engine = EngineWithCore(engine_pid, world_size)
    return serve(api_router.attach_router, engine)[1], engine, deep, lib


def test_sleep_with_checkpoint_then_wake_through_http(engine_pid, monkeypatch):
    client, engine, deep, lib = http(engine_pid, monkeypatch)
    response = client.post("/sleep?level=1&checkpoint=1")
    assert response.status_code == 200, response.text
    assert lib.states[engine_pid] == "checkpointed"
    assert client.get("/is_sleeping").json() == {"is_sleeping": True, "checkpointed": True}
    # Anything else that would reach the engine's GPU waits for the wake.
    assert client.post("/sleep?level=2").status_code == 409
    assert client.post("/collective_rpc", json={"method": "x"}).status_code == 409
    # A staged wake: the first restores, the second wakes as now.
    assert client.post("/wake_up?tags=weights").status_code == 200
    assert lib.states[engine_pid] == "running"
    assert client.post("/wake_up?tags=kv_cache").status_code == 200
    assert engine.calls == [
        ("sleep", 1, "abort"),
        ("wake_up", ["weights"]),
        ("wake_up", ["kv_cache"]),
    ]
    assert client.get("/is_sleeping").json() == {"is_sleeping": False}


def test_a_wake_without_room_answers_503_and_the_engine_stays_asleep(engine_pid, monkeypatch):
    client, engine, deep, lib = http(engine_pid, monkeypatch, free=HELD)
    assert client.post("/sleep?checkpoint=true").status_code == 200
    response = client.post("/wake_up")
    assert response.status_code == 503 and response.headers["Retry-After"]
    assert "stays asleep and checkpointed" in response.json()["error"]
    assert lib.states[engine_pid] == "checkpointed"
    assert ("wake_up", None) not in engine.calls
    deep._memory.free = HELD + RESTORE_HEADROOM
    assert client.post("/wake_up").status_code == 200
    assert engine.calls[-1] == ("wake_up", None) and lib.states[engine_pid] == "running"


@pytest.mark.parametrize("refused", [None, "no_room", "nvml_error"])
def test_an_engine_client_shut_down_checkpointed_restores_the_engine_first(
    engine_pid, monkeypatch, caplog, refused
):
    """vLLM's launcher stops the engine client (AsyncLLM.shutdown) on SIGINT
    or SIGTERM before the HTTP server's lifespan ends: the restore must come
    at the client's shutdown, ahead of vLLM's own. One that fails is logged,
    and the shutdown goes on."""
    from vllm_graph_sleep.patches import v1_engine_async_llm

    client, engine, deep, lib = http(engine_pid, monkeypatch)
    assert client.post("/sleep?checkpoint=1").status_code == 200
    if refused == "no_room":
        deep._memory.free = 0
    elif refused == "nvml_error":

        def lost(device):
            raise RuntimeError("NVML: GPU is lost")

        monkeypatch.setattr(deep._memory, "free_bytes", lost)
    seen_by_vllm = []
    shutdown = v1_engine_async_llm._wrap_shutdown(
        lambda engine_client, timeout=None: seen_by_vllm.append(lib.states[engine_pid])
    )
    with caplog.at_level(logging.ERROR, logger="vllm.graph_sleep"):
        shutdown(engine, timeout=5)
    if refused:
        assert seen_by_vllm == ["checkpointed"]
        assert "at shutdown, the engine was not restored" in caplog.text
    else:
        assert seen_by_vllm == ["running"] and not deep.holds_engine
    shutdown(engine)  # a second shutdown (vLLM's __del__) finds nothing more to do


def test_a_shutdown_during_a_checkpoint_waits_for_it_and_restores(engine_pid):
    """vLLM's launcher stops the engine client on a thread while the HTTP
    server still serves: a checkpoint under way then must not leave vLLM
    stopping a checkpointed engine, and none may start after the shutdown."""
    import threading
    import time

    lib = FakeLibcuda(hang_s={"cuCheckpointProcessCheckpoint": 0.5})
    deep, _ = controller(engine_pid, lib)
    engine = EngineWithCore(engine_pid)
    deep_sleep.serve_deep_sleep(engine, deep)
    checkpointing = threading.Thread(target=deep.checkpoint, args=(engine_pid,))
    checkpointing.start()
    time.sleep(0.1)  # the checkpoint is under way
    deep_sleep.restore_before_shutdown(engine)
    assert lib.states[engine_pid] == "running"
    checkpointing.join()
    with pytest.raises(DeepSleepRefused, match="shutting down"):
        deep.checkpoint(engine_pid)
    assert lib.states[engine_pid] == "running" and not deep.holds_engine


def test_a_refused_deep_sleep_does_not_sleep(engine_pid, monkeypatch):
    client, engine, _, lib = http(engine_pid, monkeypatch, world_size=2)
    response = client.post("/sleep?level=1&checkpoint=1")
    assert response.status_code == 409
    assert "NCCL or CUDA IPC" in response.json()["error"]
    assert engine.calls == [] and lib.calls == []


@pytest.mark.parametrize(
    "query",
    [
        "checkpoint=maybe",
        "checkpoint=1&checkpoint=1",
        "level=0&checkpoint=1",
        "level=00&checkpoint=1",
    ],
)
def test_a_bad_checkpoint_value_is_rejected_before_the_engine(engine_pid, monkeypatch, query):
    client, engine, _, _ = http(engine_pid, monkeypatch)
    assert client.post(f"/sleep?{query}").status_code == 400
    assert engine.calls == []


def test_a_bad_level_with_checkpoint_is_rejected_and_nothing_is_checkpointed(
    engine_pid, monkeypatch
):
    client, engine, _, lib = http(engine_pid, monkeypatch)
    assert client.post("/sleep?level=3&checkpoint=1").status_code == 400
    assert engine.calls == [] and lib.calls == []


def test_a_checkpoint_the_driver_refuses_answers_500_asleep_at_the_level(engine_pid, monkeypatch):
    client, engine, _, lib = http(engine_pid, monkeypatch)
    lib.refuse["cuCheckpointProcessLock"] = 801
    response = client.post("/sleep?level=2&checkpoint=1")
    assert response.status_code == 500
    assert "asleep as asked, but not checkpointed" in response.json()["error"]
    assert engine.calls == [("sleep", 2, "abort")]
    assert client.post("/wake_up").status_code == 200  # an ordinary wake


def test_a_wake_whose_unlock_fails_answers_503_and_the_next_wake_unlocks(engine_pid, monkeypatch):
    client, engine, deep, lib = http(engine_pid, monkeypatch)
    assert client.post("/sleep?level=1&checkpoint=1").status_code == 200
    lib.refuse["cuCheckpointProcessUnlock"] = 999
    response = client.post("/wake_up")
    assert response.status_code == 503 and "restored but not unlocked" in response.text
    # Still held by the driver: nothing else may reach the engine.
    assert client.get("/is_sleeping").json() == {"is_sleeping": True, "checkpointed": True}
    assert client.post("/collective_rpc", json={"method": "x"}).status_code == 409
    assert engine.calls == [("sleep", 1, "abort")]
    del lib.refuse["cuCheckpointProcessUnlock"]
    assert client.post("/wake_up").status_code == 200
    assert lib.states[engine_pid] == "running"
    assert engine.calls == [("sleep", 1, "abort"), ("wake_up", None)]


class EngineServing(EngineWithCore):
    """EngineWithCore, with what the patched AsyncLLM._add_request needs, and
    vLLM's executor rule: a sleep while asleep does nothing (Executor.sleep),
    so it discards no weights."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self.added: list = []
        self.weights_lost = False

        async def add_request_async(request):
            self.added.append(request)

        self.engine_core.add_request_async = add_request_async
        self.output_processor = SimpleNamespace(add_request=lambda *args: None)
        self.log_requests = False

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level, mode))
        if not self.sleeping:
            self.sleeping, self.weights_lost = True, level == 2


def serve_async(engine_pid, monkeypatch, scenario, lib=None, wait_s="5"):
    """Runs `await scenario(post)` against vLLM's dev sleep router with our
    middlewares and a completions route that goes through the patched
    AsyncLLM._add_request (held while asleep); `post(path, delay)` answers
    with `.seconds` set. Returns (scenario's result, engine, lib)."""
    import asyncio
    import time

    import httpx
    from fastapi import FastAPI
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm_graph_sleep import request_gate

    monkeypatch.setenv(request_gate.ASLEEP_WAIT_ENV, wait_s)
    deep, lib = controller(engine_pid, lib=lib)
    monkeypatch.setattr(DeepSleep, "load", classmethod(lambda cls: deep))
    patch.apply()
    engine = EngineServing(engine_pid)
    app = FastAPI()
    api_router.attach_router(app)
    app.state.engine_client = engine

    @app.post("/reset_prefix_cache")  # any other POST that reaches the engine
    async def reset_prefix_cache() -> dict:
        await engine.reset_prefix_cache()
        return {}

    @app.post("/v1/completions")
    async def completions() -> dict:
        await AsyncLLM._add_request(engine, "request", None, None, 0, None)
        return {"weights_lost_when_served": engine.weights_lost}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:

            async def post(path: str, delay: float = 0.0):
                await asyncio.sleep(delay)
                started = time.monotonic()
                response = await client.post(path)
                response.seconds = time.monotonic() - started
                return response

            return await scenario(post, client)

    return asyncio.run(main()), engine, lib


def test_a_wake_sent_during_the_checkpoint_waits_for_it_then_restores(engine_pid, monkeypatch):
    import asyncio

    async def scenario(post, client):
        sleep, wake = await asyncio.gather(
            post("/sleep?level=1&checkpoint=1"), post("/wake_up", delay=0.2)
        )
        return sleep, wake, (await client.get("/is_sleeping")).json()

    lib = FakeLibcuda(hang_s={"cuCheckpointProcessCheckpoint": 0.5})
    (sleep, wake, asleep), engine, lib = serve_async(engine_pid, monkeypatch, scenario, lib)
    assert sleep.status_code == 200 and wake.status_code == 200
    assert wake.seconds >= 0.25  # it waited for the checkpoint to end
    assert lib.states[engine_pid] == "running" and asleep == {"is_sleeping": False}
    assert [call for call in engine.calls if call[0] != "is_sleeping"] == [
        ("sleep", 1, "abort"),
        ("wake_up", None),
    ]


def test_without_a_deep_sleep_nothing_waits_for_a_wake(engine_pid, monkeypatch):
    """Stock's path until a deep sleep is asked: a slow wake holds no lock."""
    import asyncio

    async def slow_wake(tags=None):
        await asyncio.sleep(0.5)

    async def scenario(post, client):
        return await asyncio.gather(post("/wake_up"), post("/sleep?level=1", delay=0.1))

    monkeypatch.setattr(EngineServing, "wake_up", lambda self, tags=None: slow_wake(tags))
    (wake, sleep), engine, lib = serve_async(engine_pid, monkeypatch, scenario)
    assert wake.status_code == 200 and sleep.status_code == 200
    assert sleep.seconds < 0.3 and lib.calls == []


@pytest.mark.parametrize("deep_before", [False, True], ids=["first", "after_a_deep_cycle"])
def test_a_deep_sleep_waits_for_the_other_posts_admitted_before_it(
    engine_pid, monkeypatch, deep_before
):
    """A POST admitted before a deep sleep reaches the engine before its
    checkpoint, not after it (where its GPU work would wait for the wake)."""
    import asyncio

    lib = FakeLibcuda()
    found = []

    async def slow_reset(self):
        await asyncio.sleep(0.4)
        self.calls.append(("reset_prefix_cache",))
        found.append(lib.states.get(engine_pid, "running"))

    async def scenario(post, client):
        if deep_before:
            await post("/sleep?level=1&checkpoint=1")
            await post("/wake_up")
        return await asyncio.gather(
            post("/reset_prefix_cache"), post("/sleep?level=1&checkpoint=1", delay=0.1)
        )

    monkeypatch.setattr(EngineServing, "reset_prefix_cache", slow_reset, raising=False)
    (reset, sleep), engine, lib = serve_async(engine_pid, monkeypatch, scenario, lib)
    assert reset.status_code == 200 and sleep.status_code == 200, sleep.text
    assert found == ["running"]
    assert sleep.seconds >= 0.25  # it waited for the reset to be answered
    calls = [call[0] for call in engine.calls if call[0] != "is_sleeping"]
    assert calls[-2:] == ["reset_prefix_cache", "sleep"]
    assert lib.states[engine_pid] == "checkpointed"


@pytest.mark.parametrize("deep_before", [False, True], ids=["first", "after_a_deep_cycle"])
def test_a_wake_sent_during_a_deep_sleep_that_waits_runs_after_it(
    engine_pid, monkeypatch, deep_before
):
    """The first deep sleep too: a /wake_up sent while it waits for an earlier
    POST runs after it, and wakes the engine it checkpointed."""
    import asyncio

    async def slow_reset(self):
        await asyncio.sleep(0.4)

    async def scenario(post, client):
        if deep_before:
            await post("/sleep?level=1&checkpoint=1")
            await post("/wake_up")
        answers = await asyncio.gather(
            post("/reset_prefix_cache"),
            post("/sleep?level=1&checkpoint=1", delay=0.1),
            post("/wake_up", delay=0.2),
        )
        return answers, (await client.get("/is_sleeping")).json()

    monkeypatch.setattr(EngineServing, "reset_prefix_cache", slow_reset, raising=False)
    (answers, asleep), engine, lib = serve_async(engine_pid, monkeypatch, scenario)
    assert [answer.status_code for answer in answers] == [200, 200, 200]
    calls = [call[0] for call in engine.calls if call[0] in ("sleep", "wake_up")]
    assert calls[-2:] == ["sleep", "wake_up"]
    assert lib.states[engine_pid] == "running" and asleep == {"is_sleeping": False}


class AsgiPosts:
    """DeepSleepEndpoints over a stand-in for vLLM's app, driven as ASGI with no
    HTTP in between (a request can be held at any step): `post(path)` starts
    one and returns its task; the inner app waits for `gates[path]` (an
    asyncio.Event) where there is one, and a /sleep puts the engine to sleep.
    A request whose path is in `stalled_bodies` never finishes sending its body."""

    def __init__(self, engine) -> None:
        import asyncio

        from vllm_graph_sleep.deep_sleep_http import DeepSleepEndpoints

        self.engine = engine
        self.gates: dict[str, asyncio.Event] = {}
        self.stalled_bodies: set[str] = set()
        self.answers: dict[str, int] = {}
        self.headers: dict[str, dict[str, str]] = {}
        self.on_answer = lambda path: None
        self.middleware = DeepSleepEndpoints(self._vllm)
        self._app = SimpleNamespace(state=SimpleNamespace(engine_client=engine, args=None))

    async def _vllm(self, scope, receive, send):
        await receive()
        path = scope["path"]
        if path in self.gates:
            await self.gates[path].wait()
        if path == "/sleep":
            await self.engine.sleep(1, "abort")
        self.on_answer(path)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def post(self, path: str, query: bytes = b""):
        import asyncio

        scope = {"type": "http", "method": "POST", "path": path, "root_path": "",
                 "query_string": query, "app": self._app, "headers": []}  # fmt: skip

        async def receive():
            if path in self.stalled_bodies:
                await asyncio.Event().wait()  # never set
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            if message["type"] == "http.response.start":
                self.answers[path] = message["status"]
                self.headers[path] = {k.decode(): v.decode() for k, v in message["headers"]}

        return asyncio.ensure_future(self.middleware(scope, receive, send))


def test_a_post_admitted_as_the_first_deep_sleep_stops_waiting_is_waited_for(
    engine_pid, monkeypatch
):
    """A POST that arrives in the event loop's turn where the last earlier one
    is answered is not let past the deep sleep: it waits for it (409 once
    checkpointed), and reaches no checkpointed engine."""
    import asyncio

    deep, lib = controller(engine_pid)
    monkeypatch.setattr(DeepSleep, "load", classmethod(lambda cls: deep))
    posts = AsgiPosts(EngineWithCore(engine_pid))
    reached = []
    posts.on_answer = lambda path: (
        path == "/later" and reached.append(lib.states.get(engine_pid, "running"))
    )

    async def main():
        posts.gates = {"/earlier": asyncio.Event(), "/later": asyncio.Event()}
        earlier = posts.post("/earlier")
        await asyncio.sleep(0.01)
        sleep = posts.post("/sleep", b"level=1&checkpoint=1")
        await asyncio.sleep(0.01)
        assert not sleep.done()  # it waits for /earlier
        posts.gates["/earlier"].set()
        later = posts.post("/later")  # in the same turn as /earlier's answer
        posts.gates["/later"].set()
        await asyncio.gather(earlier, sleep, later)

    asyncio.run(main())
    assert posts.answers == {"/earlier": 200, "/sleep": 200, "/later": 409}
    assert reached == [] and lib.states[engine_pid] == "checkpointed"


def test_a_deep_sleep_behind_a_post_that_never_ends_answers_503_and_the_wake_still_runs(
    engine_pid, monkeypatch
):
    """A client that never finishes its request's body holds that POST: the
    deep sleep waits for it only so long (deep_sleep_http.OTHERS_WAIT_S), then
    answers 503 with Retry-After, nothing done, and a wake behind it runs."""
    import asyncio

    from vllm_graph_sleep import deep_sleep_http

    monkeypatch.setattr(deep_sleep_http, "OTHERS_WAIT_S", 0.3)
    deep, lib = controller(engine_pid)
    monkeypatch.setattr(DeepSleep, "load", classmethod(lambda cls: deep))
    engine = EngineWithCore(engine_pid)
    posts = AsgiPosts(engine)
    posts.stalled_bodies = {"/tokenize"}

    async def main():
        stalled = posts.post("/tokenize")
        await asyncio.sleep(0.01)
        sleep = posts.post("/sleep", b"level=1&checkpoint=1")
        await asyncio.sleep(0.01)
        wake = posts.post("/wake_up")
        done, _ = await asyncio.wait([sleep, wake], timeout=5)
        stalled.cancel()
        return len(done)

    assert asyncio.run(main()) == 2
    assert posts.answers == {"/sleep": 503, "/wake_up": 200}
    assert posts.headers["/sleep"].get("retry-after") == str(deep_sleep_http.RETRY_AFTER_S)
    assert ("sleep", 1, "abort") not in engine.calls and engine_pid not in lib.states


def test_a_level_2_deep_sleep_that_gave_up_waiting_leaves_inference_served(engine_pid, monkeypatch):
    """Its 503 says the engine is as it was: the gate must not count the
    weights as discarded (it held every inference request until a reload of
    weights the engine never lost, then refused them)."""
    import asyncio

    from vllm_graph_sleep import deep_sleep_http

    monkeypatch.setattr(deep_sleep_http, "OTHERS_WAIT_S", 0.2)

    async def slow_reset(self):
        await asyncio.sleep(0.6)

    async def scenario(post, client):
        reset, sleep = await asyncio.gather(
            post("/reset_prefix_cache"), post("/sleep?level=2&checkpoint=1", delay=0.05)
        )
        return reset, sleep, await post("/v1/completions")

    monkeypatch.setattr(EngineServing, "reset_prefix_cache", slow_reset, raising=False)
    (reset, sleep, answer), engine, _ = serve_async(engine_pid, monkeypatch, scenario, wait_s="0.5")
    assert sleep.status_code == 503, sleep.text
    assert not engine.sleeping and not engine.weights_lost
    assert answer.status_code == 200, answer.text


def test_nvml_failing_before_a_level_2_deep_sleep_is_a_409_and_inference_goes_on(
    engine_pid, monkeypatch
):
    def lost(self, pid):
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    async def scenario(post, client):
        return await post("/sleep?level=2&checkpoint=1"), await post("/v1/completions")

    monkeypatch.setattr(FakeMemory, "process_bytes", lost)
    (sleep, answer), engine, lib = serve_async(engine_pid, monkeypatch, scenario, wait_s="0.5")
    assert sleep.status_code == 409, sleep.text
    assert "NVML could not say" in sleep.json()["error"]
    assert "NVML_ERROR_GPU_IS_LOST" in sleep.json()["error"]
    assert not engine.sleeping and engine_pid not in lib.states
    assert answer.status_code == 200, answer.text


def test_nvml_failing_at_the_wake_is_a_503_and_the_engine_stays_checkpointed(
    engine_pid, monkeypatch
):
    client, engine, deep, lib = http(engine_pid, monkeypatch)
    assert client.post("/sleep?level=1&checkpoint=1").status_code == 200

    def lost(device):
        raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    deep._memory.free_bytes = lost
    response = client.post("/wake_up")
    assert response.status_code == 503 and response.headers["Retry-After"]
    assert "stays asleep and checkpointed" in response.json()["error"]
    assert lib.states[engine_pid] == "checkpointed"
    del deep._memory.free_bytes
    assert client.post("/wake_up").status_code == 200
    assert lib.states[engine_pid] == "running"


def test_a_second_deep_sleep_during_the_first_gets_409(engine_pid, monkeypatch):
    import asyncio

    async def scenario(post, client):
        return await asyncio.gather(
            post("/sleep?level=1&checkpoint=1"), post("/sleep?level=1&checkpoint=1", delay=0.1)
        )

    lib = FakeLibcuda(hang_s={"cuCheckpointProcessCheckpoint": 0.3})
    (first, second), engine, lib = serve_async(engine_pid, monkeypatch, scenario, lib)
    assert first.status_code == 200 and second.status_code == 409
    assert engine.calls == [("sleep", 1, "abort")] and lib.states[engine_pid] == "checkpointed"


def test_an_inference_request_while_checkpointed_is_held_until_the_wake(engine_pid, monkeypatch):
    import asyncio

    async def scenario(post, client):
        await post("/sleep?level=1&checkpoint=1")
        return await asyncio.gather(post("/v1/completions"), post("/wake_up", delay=0.5))

    (answer, wake), engine, lib = serve_async(engine_pid, monkeypatch, scenario)
    assert wake.status_code == 200 and lib.states[engine_pid] == "running"
    assert answer.status_code == 200 and answer.seconds >= 0.4, answer.text
    assert len(engine.added) == 1


def test_a_level_2_deep_sleep_whose_checkpoint_fails_still_holds_requests_for_the_weights(
    engine_pid, monkeypatch
):
    async def scenario(post, client):
        sleep = await post("/sleep?level=2&checkpoint=1")
        await post("/wake_up")
        return sleep, await post("/v1/completions")

    lib = FakeLibcuda(refuse={"cuCheckpointProcessLock": 801})
    (sleep, answer), engine, _ = serve_async(engine_pid, monkeypatch, scenario, lib, wait_s="0.3")
    assert sleep.status_code == 500 and engine.weights_lost
    assert answer.status_code == 503 and "reload" in answer.json()["error"]
    assert engine.added == []


def test_a_refused_checkpoint_whose_unlock_fails_keeps_the_engine_held(engine_pid):
    """Review, 2026-12-06: it said "unlocked" and let a wake reach a locked engine."""
    lib = FakeLibcuda(
        refuse={"cuCheckpointProcessCheckpoint": 801, "cuCheckpointProcessUnlock": 801}
    )
    deep, _ = controller(engine_pid, lib)
    llm = FakeLLM(EngineWithCore(engine_pid))
    with pytest.raises(DeepSleepError, match="stays locked") as raised:
        deep_sleep.sleep(llm, level=1, controller=deep)
    assert "it was unlocked" not in str(raised.value)
    assert lib.states[engine_pid] == "locked" and deep_sleep.is_checkpointed(llm)
    del lib.refuse["cuCheckpointProcessUnlock"]
    deep_sleep.wake_up(llm)
    assert lib.states[engine_pid] == "running" and not deep_sleep.is_checkpointed(llm)
    assert llm.calls == [("sleep", 1), ("wake_up", None)]


def test_nvml_without_the_processs_figure_is_refused_before_the_sleep(engine_pid):
    """pynvml gives None for NVML_VALUE_NOT_AVAILABLE: the room a restore needs
    is unknown, not 0 (review, 2026-12-06)."""
    process = SimpleNamespace(pid=engine_pid, usedGpuMemory=None)
    memory = object.__new__(deep_sleep.NvmlMemory)
    memory._nvml = SimpleNamespace(
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [process],
    )
    assert memory.process_bytes(engine_pid) == {0: None}
    lib = FakeLibcuda()
    for used in ({0: None}, {}):
        deep = DeepSleep(CheckpointDriver(lib), FakeMemory({engine_pid: used}, 10 << 30))
        llm = FakeLLM(EngineWithCore(engine_pid))
        with pytest.raises(DeepSleepRefused, match="cannot be known"):
            deep_sleep.sleep(llm, level=1, controller=deep)
        assert llm.calls == [] and lib.calls == []  # refused before anything was done


def test_a_deep_sleep_nvml_cannot_measure_is_refused_over_http_before_the_sleep(
    engine_pid, monkeypatch
):
    client, engine, deep, lib = http(engine_pid, monkeypatch)
    deep._memory.used = {}
    response = client.post("/sleep?level=1&checkpoint=1")
    assert response.status_code == 409 and "cannot be known" in response.json()["error"]
    assert engine.calls == [] and lib.calls == []


def test_another_controller_cannot_take_an_engine_one_holds(engine_pid):
    lib = FakeLibcuda()
    first, _ = controller(engine_pid, lib)
    llm = FakeLLM(EngineWithCore(engine_pid))
    deep_sleep.sleep(llm, level=1, controller=first)
    second, _ = controller(engine_pid, lib)
    with pytest.raises(DeepSleepError, match="already checkpointed"):
        deep_sleep.sleep(llm, level=1, controller=second)
    assert deep_sleep.is_checkpointed(llm)
    deep_sleep.wake_up(llm)
    assert lib.states[engine_pid] == "running"


# -- offline: vllm.LLM, and doctor ---------------------------------------------


class FakeLLM:
    """The part of vllm.LLM deep sleep uses: its engine and sleep/wake."""

    def __init__(self, engine) -> None:
        self.llm_engine = engine
        self.calls: list[tuple] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))


def test_an_llm_sleeps_deep_and_wakes_staged(engine_pid):
    deep, lib = controller(engine_pid)
    llm = FakeLLM(EngineWithCore(engine_pid))
    deep_sleep.sleep(llm, level=2, controller=deep)
    assert deep_sleep.is_checkpointed(llm) and lib.states[engine_pid] == "checkpointed"
    with pytest.raises(DeepSleepError, match="already checkpointed"):
        deep_sleep.sleep(llm, level=1)
    deep_sleep.wake_up(llm, tags=["weights"])
    assert not deep_sleep.is_checkpointed(llm) and lib.states[engine_pid] == "running"
    deep_sleep.wake_up(llm, tags=["kv_cache"])
    assert llm.calls == [("sleep", 2), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]


def test_an_llm_at_level_0_is_refused_before_it_sleeps(engine_pid):
    deep, lib = controller(engine_pid)
    llm = FakeLLM(EngineWithCore(engine_pid))
    with pytest.raises(DeepSleepRefused, match="level of 1 or 2"):
        deep_sleep.sleep(llm, level=0, controller=deep)
    assert llm.calls == [] and lib.calls == []


def test_an_llm_whose_engine_runs_in_this_process_is_refused_before_it_sleeps(engine_pid):
    deep, lib = controller(engine_pid)
    engine = EngineWithCore(engine_pid)
    engine.engine_core = SimpleNamespace()  # vLLM's in-process client keeps no processes
    llm = FakeLLM(engine)
    with pytest.raises(DeepSleepRefused, match="runs in this process"):
        deep_sleep.sleep(llm, controller=deep)
    assert llm.calls == [] and lib.calls == []


def test_doctor_says_when_deep_sleep_is_not_available(monkeypatch):
    from vllm_graph_sleep import doctor

    monkeypatch.setattr(
        CheckpointDriver, "load", classmethod(lambda cls: CheckpointDriver(FakeLibcuda()))
    )
    args = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1)
    cuda = SimpleNamespace(is_rocm=lambda: False)
    assert doctor.deep_sleep_state(args, cuda, {}).startswith("available, opt-in")
    tp2 = SimpleNamespace(**{**vars(args), "tensor_parallel_size": 2})
    assert "NCCL or CUDA IPC" in doctor.deep_sleep_state(tp2, cuda, {})
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert "runs in this process" in doctor.deep_sleep_state(args, cuda, in_process)
    rocm = SimpleNamespace(is_rocm=lambda: True)
    assert "ROCm has none" in doctor.deep_sleep_state(args, rocm, {})
    old = classmethod(lambda cls: CheckpointDriver(FakeLibcuda(without=CHECKPOINT_CALLS)))
    monkeypatch.setattr(CheckpointDriver, "load", old)
    assert "driver 570" in doctor.deep_sleep_state(args, cuda, {})


def test_a_zero_wait_lets_a_request_to_an_awake_engine_through_while_a_question_is_in_flight(
    engine_pid, monkeypatch
):
    """The request gate with VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S=0 (served here by
    this file's harness): a request that comes while the engine's answer to an
    earlier request's question is on its way waits for a question asked after
    it, which starts a poll interval after the one in flight. Its bound was
    one poll interval, shorter than that plus the answer: it was refused."""
    import asyncio

    async def slow_is_sleeping(self):
        self.calls.append(("is_sleeping",))
        await asyncio.sleep(0.03)
        return self.sleeping

    async def scenario(post, client):
        await post("/sleep?level=1")
        await post("/wake_up")  # awake from here on
        return await asyncio.gather(post("/v1/completions"), post("/v1/completions", delay=0.01))

    monkeypatch.setattr(EngineServing, "is_sleeping", slow_is_sleeping)
    (first, second), engine, _ = serve_async(engine_pid, monkeypatch, scenario, wait_s="0")
    assert first.status_code == 200, first.text
    assert second.status_code == 200, second.text
