"""Deep sleep (issue 39, step 2) on the CPU: the controller through the real
ctypes binding against tests/unit/fake_libcuda.py (the driver's states and
argument checks) for a live child process it counts as holding a CUDA
context, GPU memory from a stand-in for NVML; the HTTP side through vLLM's own
dev sleep router with the plugin's middlewares and a fake engine client. What
the real driver does on an H200, from a separate controller and through this
code in `vllm serve`, is on docs/results/checkpoint-h200.md."""

from __future__ import annotations

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


def test_a_server_shut_down_checkpointed_restores_the_engine_first(engine_pid, monkeypatch):
    client, engine, deep, lib = http(engine_pid, monkeypatch)
    with client:  # the server's lifespan: startup now, shutdown at the end
        assert client.post("/sleep?checkpoint=1").status_code == 200
        assert lib.states[engine_pid] == "checkpointed"
    assert lib.states[engine_pid] == "running" and deep.checkpointed is None


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
