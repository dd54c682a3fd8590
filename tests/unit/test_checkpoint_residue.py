"""The checkpoint API's ctypes binding (vllm_graph_sleep.cuda_checkpoint) and
benchmarks/checkpoint_residue.py on the CPU.

The binding runs against tests/unit/fake_libcuda.py, called as ctypes calls a
CDLL: the struct layouts the driver reads, the arguments built, the states and
the errors decoded. The benchmark's whole run goes against
tests/unit/fake_vllm_server.py (the engine), tests/unit/fake_context_holder.py
(the probe's child) and a fake NVML whose used memory drops by what a process
holds while the fake driver has it checkpointed: the figures, the refusals'
evidence, the time limit, the JSON.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import checkpoint_residue as bench
from tests.unit import fake_libcuda
from tests.unit.fake_libcuda import FakeLibcuda, cuda_pids
from tests.unit.fake_vllm_server import IDLE
from vllm_graph_sleep.cuda_checkpoint import (
    CHECKPOINT_CALLS,
    CheckpointArgs,
    CheckpointDriver,
    DriverCallError,
    LockArgs,
    RestoreArgs,
    UnlockArgs,
)
from vllm_graph_sleep.units import MiB

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
FAKE_SERVER = HERE / "fake_vllm_server.py"
FAKE_HOLDER = HERE / "fake_context_holder.py"
HOLDER_BYTES = 300 * MiB
NVML_PID_OFFSET = 100000  # a driver whose pid namespace is not ours


# -- the binding -------------------------------------------------------------


def test_argument_structs_have_the_driver_layout():
    for struct in (LockArgs, CheckpointArgs, RestoreArgs, UnlockArgs):
        assert ctypes.sizeof(struct) == 64, struct
    assert (LockArgs.timeoutMs.offset, LockArgs.reserved0.offset) == (0, 4)
    assert (LockArgs.reserved1.offset, LockArgs.reserved1.size) == (8, 56)
    assert (RestoreArgs.gpuPairs.offset, RestoreArgs.gpuPairsCount.offset) == (0, 8)
    assert (RestoreArgs.reserved.offset, RestoreArgs.reserved1.offset) == (12, 56)


def fake_holder(variant: str) -> list[str]:
    return [
        sys.executable,
        str(FAKE_HOLDER),
        bench.HOLDING,
        bench.CHECK,
        bench.HOLDER_INFO,
        variant,
    ]


@pytest.fixture
def holder():
    """A live process the fake driver counts as holding a CUDA context."""
    child = subprocess.Popen(
        fake_holder("bare"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().startswith(bench.HOLDER_INFO)
    assert child.stdout.readline().strip() == bench.HOLDING
    yield child.pid
    child.stdin.close()
    child.wait(timeout=10)


def test_a_full_cycle_goes_through_the_driver_states_with_the_arguments_built(holder):
    lib = FakeLibcuda()
    driver = CheckpointDriver(lib)
    assert driver.missing == [] and driver.driver_version() == 13000
    assert driver.state(holder) == "running"
    for call, after in (
        (lambda: driver.lock(holder, 2500), "locked"),
        (lambda: driver.checkpoint(holder), "checkpointed"),
        (lambda: driver.restore(holder), "locked"),
        (lambda: driver.unlock(holder), "running"),
    ):
        assert call() >= 0.0
        assert driver.state(holder) == after
    # The lock's timeout is the struct's first word, everything after it zero.
    assert lib.lock_args == [(2500).to_bytes(4, sys.byteorder) + bytes(60)]
    assert driver.restore_thread_id(holder) == holder + 1


def test_a_refused_call_raises_with_the_drivers_name_and_text(holder):
    driver = CheckpointDriver(FakeLibcuda(refuse={"cuCheckpointProcessCheckpoint": 801}))
    driver.lock(holder, 1000)
    with pytest.raises(DriverCallError) as caught:
        driver.checkpoint(holder)
    assert caught.value.evidence() == {
        "call": "cuCheckpointProcessCheckpoint",
        "pid": holder,
        "result": 801,
        "name": "CUDA_ERROR_NOT_SUPPORTED",
        "string": "operation not supported",
    }
    assert f"pid {holder} returned 801" in str(caught.value)
    # Out of order: the driver's ILLEGAL_STATE, decoded the same way.
    with pytest.raises(DriverCallError) as caught:
        driver.restore(holder)
    assert (caught.value.result, caught.value.name) == (401, "CUDA_ERROR_ILLEGAL_STATE")
    # A result the driver has no name for still says which it was.
    assert driver.error_name(12345) == "unknown"


def test_a_process_without_cuda_and_an_old_driver():
    driver = CheckpointDriver(FakeLibcuda())
    with pytest.raises(DriverCallError) as caught:
        driver.state(os.getpid())  # this process holds no (fake) context
    assert caught.value.name == "CUDA_ERROR_NOT_INITIALIZED"
    old = CheckpointDriver(FakeLibcuda(without=CHECKPOINT_CALLS))
    assert old.missing == list(CHECKPOINT_CALLS)
    with pytest.raises(DriverCallError) as caught:
        old.lock(1, 10)
    assert (caught.value.result, caught.value.name) == (-1, "MISSING")


def test_the_controller_calls_cuinit_only_when_the_driver_asks(holder):
    lib = FakeLibcuda(needs_init=True)
    assert bench.prepare_controller(CheckpointDriver(lib), holder) is True
    assert ("cuInit", None) in lib.calls
    ready = FakeLibcuda()
    assert bench.prepare_controller(CheckpointDriver(ready), holder) is False
    assert ("cuInit", None) not in ready.calls


def test_recovery_unlocks_a_process_whose_checkpoint_was_refused(holder):
    lib = FakeLibcuda(refuse={"cuCheckpointProcessCheckpoint": 801})
    targets = bench.Targets(CheckpointDriver(lib), [holder], 1000, call_timeout_s=10)
    with pytest.raises(DriverCallError):
        targets.checkpoint()
    assert targets.step == f"checkpoint pid {holder}"
    assert targets.states() == {str(holder): "locked"}
    assert targets.recover() == [{"pid": holder, "from": "locked", "ok": True}]
    assert targets.running()


# -- pure parts of the benchmark ---------------------------------------------------


def test_servers_start_once_each_in_the_order_their_first_config_appears():
    assert bench.server_groups(["stock_l1", "ours_l1", "checkpoint_only", "ours_l2"]) == [
        ("stock", ["stock_l1"]),
        ("ours", ["ours_l1", "checkpoint_only", "ours_l2"]),
    ]


def test_a_config_named_twice_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path), "--configs", "ours_l1", "ours_l1"])
    assert "twice" in capsys.readouterr().err


def test_budget_shares_what_is_left_after_the_reserved_starts():
    now = [100.0]
    budget = bench.Budget(200.0, clock=lambda: now[0])
    now[0] = 150.0  # 150 s left
    assert budget.stop_reserve_s == bench.STOP_RESERVE_S  # a long limit keeps the full reserve
    until = budget.share_deadline(configs_left=2, reserved_s=35.0)
    assert until == pytest.approx(150.0 + (150.0 - 35.0 - bench.STOP_RESERVE_S) / 2)
    assert budget.allows(10.0, until) and not budget.allows(60.0, until)
    assert budget.allows(150.0 - bench.STOP_RESERVE_S)
    assert not budget.allows(150.0 - bench.STOP_RESERVE_S + 1)
    short = bench.Budget(20.0)
    assert (short.stop_reserve_s, short.cycle_guess_s) == (2.0, 1.0)
    # Counted from the script's start: what came before the run is spent.
    assert bench.Budget(100.0, clock=lambda: now[0], started=120.0).left() == 70.0


def test_summary_figures_and_exactness():
    def record(n, checkpointed, exact=True):
        return {
            "cycle": n,
            "exact": exact,
            "before_over_idle_mib": 580.0,
            "checkpointed_over_idle_mib": checkpointed,
            "lock_s": 0.01,
            "checkpoint_s": 0.2 * n,
            "restore_s": 0.3,
            "unlock_s": 0.01,
            "wake_s": 0.4,
            "restore_to_awake_s": 0.71,
            "host_rss_held_mib": 500.0,
        }

    summary = bench.summarize([record(1, 4.0), record(2, 2.0), record(3, 0.0, exact=False)])
    assert summary["cycles_done"] == 3 and summary["all_exact"] is False
    assert summary["inexact_cycles"] == [3]
    assert summary["checkpointed_over_idle_mib"] == {"median": 2.0, "max": 4.0, "cycle1": 4.0}
    assert summary["lock_and_checkpoint_s"]["median"] == pytest.approx(0.41)
    assert summary["restore_and_unlock_s"]["cycle1"] == pytest.approx(0.31)
    assert summary["mem_available_drop_mib"]["median"] is None  # not recorded


# -- the whole run against fakes ----------------------------------------------------


class FakeMemory:
    """NVML stand-in: the fake server's bytes (its used file) and the holder's,
    less those of processes the fake driver has checkpointed."""

    gpus = ["Fake GPU"]

    def __init__(self, used_file: Path, lib: FakeLibcuda, pid_offset: int = 0):
        self.used_file = used_file
        self.lib = lib
        self.pid_offset = pid_offset

    def _holding(self) -> dict[int, int]:
        import psutil

        held = {}
        for pid in cuda_pids():
            if self.lib.states.get(pid) == "checkpointed":
                continue
            cmdline = " ".join(psutil.Process(pid).cmdline())
            if "fake_context_holder.py" in cmdline:
                held[pid] = HOLDER_BYTES
            else:
                try:
                    held[pid] = int(self.used_file.read_text()) - IDLE
                except (OSError, ValueError):
                    held[pid] = 0
        return held

    def used(self) -> list[int]:
        return [IDLE + sum(self._holding().values())]

    def compute_processes(self) -> list[list[tuple[int, int]]]:
        return [[(pid + self.pid_offset, used) for pid, used in self._holding().items()]]


class Harness:
    def __init__(self, tmp_path: Path, lib: FakeLibcuda, pid_offset: int = 0):
        self.tmp = tmp_path
        self.used = tmp_path / "used"
        self.lib = lib
        self.memory = FakeMemory(self.used, lib, pid_offset)
        self.lines: list[str] = []

    def command_for(self, kind: str, port: int) -> list[str]:
        config = "ours" if kind == "ours" else "stock_graphs"
        command = [sys.executable, str(FAKE_SERVER), "--port", str(port), "--config", config]
        return command + ["--used-file", str(self.used)]

    def run(self, *argv: str, env: dict[str, str] | None = None) -> dict:
        args = bench.parse_args(
            ["--out", str(self.tmp / "out"), "--model", "fake-model", "--no-floor"]
            + ["--start-estimate", "1", "--max-tokens", "4", *argv]
        )
        return bench.run(
            args,
            self.memory,
            lambda: CheckpointDriver(self.lib),
            self.command_for,
            fake_holder,
            self.lines.append,
            env={**os.environ, **(env or {})},
        )

    def written(self) -> dict:
        return json.loads((self.tmp / "out" / bench.RESULTS_JSON).read_text())


def test_every_config_runs_its_cycles_and_the_json_holds_the_figures(tmp_path):
    harness = Harness(tmp_path, FakeLibcuda())
    results = harness.run("--configs", "ours_l1", "checkpoint_only", "stock_l1", "--cycles", "2")
    assert results == harness.written() and results["schema"] == bench.SCHEMA
    assert results["ok"] is True, results
    assert results["idle"]["used_bytes"] == IDLE
    probe = results["probe"]
    assert probe["ok"] and probe["buffer_intact"] and probe["nvml_lists_the_pid"]
    assert probe["over_idle_mib"] == 300.0 and probe["checkpointed_over_idle_mib"] == 0.0
    assert probe["state_checkpointed"] == "checkpointed" and probe["state_after"] == "running"
    assert probe["controller_cuinit"] is False
    # A helper started per call: timed from start to answer (here without libcuda).
    assert probe["helper"]["seconds"] > 0 and probe["helper"]["exit_code"] is not None
    assert probe["variant"] == "bare" and probe["holder"] == {"fake": "bare"}
    # The second probe, our allocator's pieces, ran through the same steps.
    plugin = results["plugin_probe"]
    assert plugin["ok"] and plugin["holder"] == {"fake": "plugin"}
    assert plugin["checkpointed_over_idle_mib"] == 0.0
    # One engine per server, in order; each checkpointed the server's process.
    assert [e["server"] for e in results["engines"]] == ["ours", "stock"]
    for engine in results["engines"]:
        assert engine["targets"]["source"] == "nvml"
        assert engine["targets"]["pids"] == [engine["targets"]["tree"][0]]
        assert engine["stable_without_sleep"] is True and engine["exit_code"] == 0
    configs = results["configs"]
    assert [len(configs[name]["cycles"]) for name in configs] == [2, 2, 2]
    for name, before_mib in (("ours_l1", 400.0), ("checkpoint_only", 3100.0), ("stock_l1", 900.0)):
        # The fake server holds its context (400 MiB); awake, its tags (2200 MiB) and
        # graphs (500 MiB); asleep, stock still its graphs.
        for record in configs[name]["cycles"]:
            assert record["before_over_idle_mib"] == before_mib, (name, record)
            assert record["checkpointed_over_idle_mib"] == 0.0
            assert record["released_mib"] == before_mib
            assert record["gpu_processes_checkpointed"] == []
            assert record["exact"] is True
            assert set(record["states_checkpointed"].values()) == {"checkpointed"}
        assert configs[name]["summary"]["all_exact"] is True
    assert "sleep_s" in configs["ours_l1"]["cycles"][0]
    assert "sleep_s" not in configs["checkpoint_only"]["cycles"][0]
    assert configs["ours_l1"]["cycles"][0]["restore_thread_ids"]
    # The worker's report, awake and before the first checkpoint of each config.
    assert results["engines"][0]["awake_worker_report"]["tags"]["kv_cache"]["mapped"] > 0
    asleep = configs["ours_l1"]["cycles"][0]["worker_report"]
    assert asleep["tags"]["kv_cache"]["mapped"] == 0
    assert "worker_report" not in configs["ours_l1"]["cycles"][1]
    table = "\n".join(bench.table_lines(results))
    assert "ours_l1" in table and "stock_l1" in table and "REFUSED" not in table
    assert "probe bare: 300.0 MiB over idle, checkpointed 0.0 MiB, intact" in table
    assert "probe plugin: 300.0 MiB over idle" in table


def test_a_refusal_is_recorded_with_where_and_the_run_goes_on_where_it_can(tmp_path, monkeypatch):
    # The holder is checkpointed fine; only the engine's process is refused.
    lib = FakeLibcuda(refuse={"cuCheckpointProcessCheckpoint": 801}, refuse_pids=set())
    harness = Harness(tmp_path, lib)
    original = bench.find_targets

    def targets_refused(memory, server_pid, driver):
        found = original(memory, server_pid, driver)
        lib.refuse_pids.update(found["pids"])
        return found

    monkeypatch.setattr(bench, "find_targets", targets_refused)
    results = harness.run("--configs", "ours_l1", "checkpoint_only", "--cycles", "2")
    assert results["ok"] is False and results["probe"]["ok"] is True
    first = results["configs"]["ours_l1"]
    assert first["cycles"] == []
    pid = results["engines"][0]["targets"]["pids"][0]
    assert first["refusal"] == {
        "call": "cuCheckpointProcessCheckpoint",
        "pid": pid,
        "result": 801,
        "name": "CUDA_ERROR_NOT_SUPPORTED",
        "string": "operation not supported",
        "where": f"ours_l1 cycle 1: checkpoint pid {pid}",
        "states_after": {str(pid): "locked"},
    }
    assert first["recovery"] == [{"pid": pid, "from": "locked", "ok": True}]
    # Brought back, the same engine went on to the next configuration (refused too).
    assert results["configs"]["checkpoint_only"]["refusal"]["where"].startswith(
        "checkpoint_only cycle 1"
    )
    assert len(results["refusals"]) == 2
    assert "REFUSED at ours_l1 cycle 1" in "\n".join(bench.table_lines(results))


def test_a_refused_probe_stops_before_any_engine_starts(tmp_path):
    harness = Harness(tmp_path, FakeLibcuda(refuse={"cuCheckpointProcessLock": 801}))
    results = harness.run("--configs", "ours_l1")
    assert results["ok"] is False and results["engines"] == []
    assert results["probe"]["refusal"]["call"] == "cuCheckpointProcessLock"
    assert results["probe"]["refusal"]["where"].startswith(
        "probe bare: lock and checkpoint (lock pid"
    )
    assert results["stopped_early"] == "the driver refused the probe: no engine started"
    assert harness.written()["refusals"] == [results["probe"]["refusal"]]


def test_a_refused_plugin_probe_is_recorded_and_the_engines_still_run(tmp_path):
    lib = FakeLibcuda(refuse={"cuCheckpointProcessCheckpoint": 801}, refuse_pids=set())
    original = lib.cuCheckpointProcessLock

    def lock(pid, args):  # refuse the checkpoint of the plugin holder alone
        import psutil

        if "plugin" in psutil.Process(pid).cmdline():
            lib.refuse_pids.add(pid)
        return original(pid, args)

    lib.cuCheckpointProcessLock = lock
    harness = Harness(tmp_path, lib)
    results = harness.run("--configs", "ours_l1", "--cycles", "1")
    assert results["probe"]["ok"] is True
    refused = results["plugin_probe"]["refusal"]
    assert refused["where"].startswith("probe plugin: lock and checkpoint")
    assert refused["name"] == "CUDA_ERROR_NOT_SUPPORTED"
    assert results["refusals"] == [refused]
    assert results["configs"]["ours_l1"]["summary"]["all_exact"] is True
    assert results["ok"] is False


def test_a_holder_that_fails_does_not_keep_the_engines_from_running(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_HOLDER_BAD", "1")
    harness = Harness(tmp_path, FakeLibcuda())
    results = harness.run("--configs", "ours_l1", "--cycles", "1")
    assert results["probe"]["buffer_intact"] is False and results["probe"]["ok"] is False
    assert results["configs"]["ours_l1"]["summary"]["all_exact"] is True
    assert results["ok"] is False  # the probe's buffer did not survive


def test_a_driver_call_that_never_answers_is_recorded_and_the_server_still_stops(
    tmp_path, monkeypatch
):
    lib = FakeLibcuda(hang_s={"cuCheckpointProcessCheckpoint": 4.0}, refuse_pids=set())
    harness = Harness(tmp_path, lib)
    original = bench.find_targets

    def targets_hang(memory, server_pid, driver):
        found = original(memory, server_pid, driver)
        lib.refuse_pids.update(found["pids"])
        return found

    monkeypatch.setattr(bench, "find_targets", targets_hang)
    started = time.monotonic()
    results = harness.run(
        "--configs", "ours_l1", "checkpoint_only", "--cycles", "2", "--call-timeout-s", "1"
    )
    assert time.monotonic() - started < 30
    refused = results["configs"]["ours_l1"]["refusal"]
    assert (refused["call"], refused["result"], refused["name"]) == (
        "cuCheckpointProcessCheckpoint",
        -2,
        "NO_ANSWER",
    )
    # The driver is not called again: the engine is given up and stopped.
    assert results["engines"][0]["error"].startswith("the processes could not be brought back")
    assert results["configs"]["checkpoint_only"]["stopped"] == results["engines"][0]["error"]
    assert results["engines"][0]["exit_code"] is not None
    assert results["ok"] is False


def test_cycles_stop_at_the_configs_share_of_the_time_limit(tmp_path):
    harness = Harness(tmp_path, FakeLibcuda())
    started = time.monotonic()
    results = harness.run(
        "--configs", "ours_l1", "checkpoint_only", "--cycles", "500", "--time-limit", "16"
    )
    elapsed = time.monotonic() - started
    assert elapsed < 16 + 5
    first, second = (results["configs"][name] for name in ("ours_l1", "checkpoint_only"))
    assert 1 <= len(first["cycles"]) < 500
    assert first["stopped"].startswith("time: its share ended")
    # checkpoint_only is capped (it moves the whole KV cache) and still got its turn.
    assert len(second["cycles"]) == second["planned_cycles"] == 3
    assert results["ok"] is False and results["stopped_early"] is None
    assert harness.written()["configs"]["ours_l1"]["summary"]["cycles_done"] == len(first["cycles"])


def test_the_hard_limit_interrupts_a_start_and_still_writes_and_stops(tmp_path):
    harness = Harness(tmp_path, FakeLibcuda())
    started = time.monotonic()
    results = harness.run(
        "--configs", "ours_l1", "--time-limit", "8", env={"FAKE_START_DELAY": "60"}
    )
    assert time.monotonic() - started < 8 + 10
    assert "time limit" in results["stopped_early"]
    assert results["engines"][0]["exit_code"] is not None  # the server was stopped
    assert harness.written()["stopped_early"] == results["stopped_early"]
    assert cuda_pids() == set()


def test_targets_found_through_the_driver_when_nvml_pids_are_of_another_namespace(tmp_path):
    harness = Harness(tmp_path, FakeLibcuda(), pid_offset=NVML_PID_OFFSET)
    results = harness.run("--configs", "ours_l1", "--cycles", "1")
    assert results["probe"]["nvml_lists_the_pid"] is False
    found = results["engines"][0]["targets"]
    assert found["source"] == "checkpoint API state"
    assert found["pids"] == [found["tree"][0]]
    assert results["configs"]["ours_l1"]["summary"]["all_exact"] is True


def test_the_fake_driver_is_strict_about_reserved_bytes(holder):
    """The fake refuses what a driver would, so the tests above mean something."""
    lib = FakeLibcuda()
    args = LockArgs(timeoutMs=10)
    args.reserved1[3] = 1
    assert lib.cuCheckpointProcessLock(holder, ctypes.byref(args)) == fake_libcuda.INVALID_VALUE
    with pytest.raises(AssertionError):
        lib.cuCheckpointProcessLock(holder, ctypes.byref(UnlockArgs()))


def test_without_gpu_exit_2_with_one_line(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on a GPU machine too.
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "checkpoint_residue.py"),
            "--out",
            str(tmp_path),
        ],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing to run" in lines[0], result.stderr
    assert not (tmp_path / bench.RESULTS_JSON).exists()


def test_nvml_lists_context_holders_and_persistence_mode(monkeypatch):
    """NvmlMemory's two queries the benchmark reads, against a stand-in pynvml
    module with NVML's calls and errors."""
    import types

    from vllm_graph_sleep.bench import gpu

    class NVMLError(Exception):
        pass

    handles = {0: "gpu0", 1: "gpu1"}
    nvml = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_FEATURE_ENABLED=1,
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=handles.__getitem__,
        nvmlDeviceGetName=lambda handle: b"Fake H200",
        nvmlDeviceGetComputeRunningProcesses=lambda handle: (
            [types.SimpleNamespace(pid=41, usedGpuMemory=500 * MiB)]
            + [types.SimpleNamespace(pid=42, usedGpuMemory=None)]
            if handle == "gpu1"
            else []
        ),
        nvmlDeviceGetPersistenceMode=lambda handle: (
            1 if handle == "gpu1" else (_ for _ in ()).throw(NVMLError("Not Supported"))
        ),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    memory = gpu.NvmlMemory(2)
    assert memory.compute_processes() == [[(41, 500 * MiB), (42, None)], []]
    assert memory.persistence_modes() == [True, None]


def test_main_wires_the_real_pieces_and_prints_the_table(tmp_path, monkeypatch, capsys):
    """main() as the lead runs it, with NVML, libcuda and vllm serve replaced by
    the fakes: model directory check, run.log, the table, the exit status."""
    from vllm_graph_sleep.bench import gpu

    lib = FakeLibcuda()
    harness = Harness(tmp_path, lib)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(gpu, "NvmlMemory", lambda count: harness.memory)
    monkeypatch.setattr(CheckpointDriver, "load", classmethod(lambda cls: cls(lib)))
    monkeypatch.setattr(bench, "real_command", lambda args, model: harness.command_for)
    monkeypatch.setattr(bench, "holder_command", fake_holder)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--model", str(model), "--no-floor", "--cycles", "1"]
    assert bench.main([*argv, "--start-estimate", "1"]) == 0
    printed = capsys.readouterr().out
    assert "ours_l1" in printed and "checkpoint_only" in printed
    assert f"results: {out / bench.RESULTS_JSON}" in printed
    assert "ours_l1 1/1" in (out / bench.RUN_LOG).read_text()
    assert json.loads((out / bench.RESULTS_JSON).read_text())["settings"]["model"] == str(model)
