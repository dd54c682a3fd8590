"""What a sleeping engine still holds once the CUDA driver checkpoints it (issue 39, step 1).

After our level-1 or level-2 sleep, this script (the controller: a process of its
own that holds no CUDA context, only libcuda's checkpoint calls) locks and
checkpoints every process of a live `vllm serve` that holds a CUDA context, reads
NVML's used memory and the processes' host memory while they are checkpointed,
restores and unlocks them, wakes the engine and checks its greedy tokens against
those of before the first sleep, for --cycles cycles. With TP=1, vLLM 0.26 runs
the worker inside the engine core process (the uni executor), so the engine core
is the process to checkpoint; which processes hold a context is not assumed:
every process of the server's tree that NVML lists on the GPU is checkpointed
(where NVML's pids are of another pid namespace, every one the checkpoint API
knows as a CUDA process), the API server too if it held one. The controller has
to be another process than the one it checkpoints: the driver API acts on a
target pid, and the target's own CUDA calls block while it is locked; this
script is the small helper process of that design, kept running for the whole
run (the probe times what one started per call would add).

Configurations (--configs, in the order given; those on the same server share one
engine start, servers start in the order their first configuration appears):

- ours_l1, ours_l2: graph offload on, level-1 / level-2 sleep, then the checkpoint;
  the wake after the restore is the level's usual one (level 2 reloads the weights);
- checkpoint_only: the same server awake, checkpointed with no sleep first (what
  the checkpoint alone costs: it moves weights and KV cache; --checkpoint-only-cycles);
- stock_l1: stock vLLM (no graph offload), level-1 sleep, then the checkpoint.

First, in seconds: the idle GPU's NVML used memory, then a capability probe (the
driver's version and a child process holding a bare CUDA context locked,
checkpointed, restored, unlocked and its buffer checked), and the bench's floor
(a context with a cuBLAS handle, bench/floor.py). A call the driver refuses is
recorded (call, pid, CUresult, the driver's name and text for it, where) with the
process states after it; the run then tries to bring the processes back (restore,
unlock) and goes on with the next configuration only where that worked. A refused
probe stops the run before any engine starts.

--time-limit bounds the whole run: each configuration gets a share of what is left
(after the engine starts still to come) and stops between cycles when the next one
would pass it; at the limit itself, whatever is running is interrupted, the
processes are brought back and the server stopped. A driver call that has not
answered after --call-timeout-s is recorded as hung (NO_ANSWER) and the engine
given up. results.json is rewritten after every cycle, so a run cut short keeps
what it measured; run.log has the progress lines, server-*.log the servers' logs.

    python benchmarks/checkpoint_residue.py --out bench-results/checkpoint \\
        --configs ours_l1 checkpoint_only ours_l2 stock_l1 --cycles 10 --time-limit 240

Exit status: 0 when every configuration ran its cycles with exact tokens, 1 when
not (refusal, mismatch, time), 2 when there is nothing to run on (no GPU, no libcuda).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench import floor, live
from vllm_graph_sleep.bench.gpu import NoGpuError, settle
from vllm_graph_sleep.bench.server import ServerError, serve_command
from vllm_graph_sleep.cuda_checkpoint import (
    CUDA_ERROR_NOT_INITIALIZED,
    CheckpointDriver,
    DriverCallError,
)
from vllm_graph_sleep.testing import PROMPTS
from vllm_graph_sleep.units import MiB

SCHEMA = 1
RESULTS_JSON = "results.json"
RUN_LOG = "run.log"
#: Configuration: (server, sleep level before the checkpoint; None: no sleep).
CONFIGS: dict[str, tuple[str, int | None]] = {
    "ours_l1": ("ours", 1),
    "ours_l2": ("ours", 2),
    "checkpoint_only": ("ours", None),
    "stock_l1": ("stock", 1),
}
DEFAULT_CONFIGS = ("ours_l1", "checkpoint_only")
#: The bench's server configuration (bench/server.py CONFIG_ARGS) of each server.
SERVER_CONFIG = {"ours": "ours", "stock": "stock_graphs"}
#: Seconds set aside to stop a server, and a cycle's guess before one has run;
#: a short --time-limit scales both down (Budget).
STOP_RESERVE_S = 15.0
FIRST_CYCLE_GUESS_S = 10.0

HOLDING = "checkpoint-residue holder: holding"
HOLDER_INFO = "checkpoint-residue holder: info"  # then what the holder set up, as JSON
#: The probe's children: what each holds while it is checkpointed.
HOLDERS = {
    "bare": "the primary context and one 2 MiB buffer (cuMemAlloc), nothing else",
    "plugin": "torch with our allocator: graphs captured into our VMM graph pool, the pool "
    "asleep (backed up to registered host memory, unmapped); vLLM's pieces without vLLM",
}
PLUGIN_GRAPHS, PLUGIN_NODES = 16, 8
CHECK = "CHECK"
#: The probe's child holds one buffer of this size (the driver's allocation granularity).
HOLDER_BUFFER_BYTES = 2 * MiB
HOLDER_MAGIC = 0x5EED5EED

Progress = Callable[[str], None]
#: The server command for (server, port).
CommandFor = Callable[[str, int], list[str]]


def over_idle_mib(used: int | None, idle: int | None) -> float | None:
    if used is None or idle is None:
        return None
    return round((used - idle) / MiB, 3)


def mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's MemAvailable in bytes: memory the checkpoint holds shows here
    whichever process it is charged to."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def rss(pids: Sequence[int]) -> dict[str, int | None]:
    import psutil

    out: dict[str, int | None] = {}
    for pid in pids:
        try:
            out[str(pid)] = psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            out[str(pid)] = None
    return out


def tree_pids(pid: int) -> list[int]:
    import psutil

    try:
        root = psutil.Process(pid)
        return sorted([root.pid, *(child.pid for child in root.children(recursive=True))])
    except psutil.NoSuchProcess:
        return []


def gpu_processes(memory) -> list[dict[str, Any]]:
    """NVML's compute processes on the measured GPU (empty where the memory
    source cannot list them; one {"error"} entry where NVML refused)."""
    listing = getattr(memory, "compute_processes", None)
    if listing is None:
        return []
    try:
        return [{"pid": pid, "used_bytes": used} for pid, used in listing()[0]]
    except Exception as error:  # NVML's own errors; the run goes on without the list
        return [{"error": f"{type(error).__name__}: {error}"}]


def server_groups(configs: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(server, its configurations in the given order), servers in the order
    their first configuration appears: one engine start per server."""
    groups: dict[str, list[str]] = {}
    for name in configs:
        groups.setdefault(CONFIGS[name][0], []).append(name)
    return list(groups.items())


class Budget:
    """The run's time: the limit, and each configuration's share of what is left."""

    def __init__(
        self,
        limit_s: float,
        clock: Callable[[], float] = time.monotonic,
        started: float | None = None,
    ):
        """`started`: when the limit began, on `clock` (default: now)."""
        self.limit_s = limit_s
        self._clock = clock
        self.deadline = (clock() if started is None else started) + limit_s
        self.stop_reserve_s = min(STOP_RESERVE_S, limit_s / 10)
        self.cycle_guess_s = min(FIRST_CYCLE_GUESS_S, limit_s / 20)

    def left(self) -> float:
        return self.deadline - self._clock()

    def share_deadline(self, configs_left: int, reserved_s: float) -> float:
        """When the next configuration should stop: an equal share, among the
        `configs_left` (it included), of the time left after `reserved_s`."""
        usable = max(0.0, self.left() - reserved_s - self.stop_reserve_s)
        return self._clock() + usable / max(1, configs_left)

    def allows(self, seconds: float, until: float | None = None) -> bool:
        """Whether `seconds` more fit before `until` (default: the limit, less a
        server stop)."""
        end = self.deadline - self.stop_reserve_s if until is None else until
        return self._clock() + seconds <= end


class DriverCallHung(DriverCallError):
    """A driver call that had not returned after the call timeout."""

    def __init__(self, call: str, pid: int, seconds: float):
        super().__init__(call, pid, -2, "NO_ANSWER", f"no answer after {seconds:.0f} s")


class Targets:
    """The processes checkpointed together: all locked before any is
    checkpointed, all restored before any is unlocked.

    Every driver call runs in a thread of its own and is given up on after
    `call_timeout_s` (DriverCallHung): a call that never returns must not keep
    this process from writing what it found, nor from stopping the server.
    After one hung, the driver is not called again."""

    def __init__(
        self,
        driver: CheckpointDriver,
        pids: Sequence[int],
        lock_timeout_ms: int,
        call_timeout_s: float,
    ):
        self.driver = driver
        self.pids = list(pids)
        self.lock_timeout_ms = lock_timeout_ms
        self.call_timeout_s = call_timeout_s
        self.step = "not started"
        self.hung = False

    def call(self, name: str, function: Callable[[int], Any], pid: int) -> Any:
        if self.hung:
            raise DriverCallHung(name, pid, self.call_timeout_s)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = function(pid)
            except BaseException as error:  # handed to the caller's thread
                box["error"] = error

        thread = threading.Thread(target=target, name=f"driver {name}", daemon=True)
        thread.start()
        thread.join(self.call_timeout_s)
        if thread.is_alive():
            self.hung = True
            raise DriverCallHung(name, pid, self.call_timeout_s)
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _each(self, step: str, name: str, function: Callable[[int], float]) -> float:
        total = 0.0
        for pid in self.pids:
            self.step = f"{step} pid {pid}"
            total += self.call(name, function, pid)
        return total

    def checkpoint(self) -> dict[str, float]:
        lock_s = self._each(
            "lock",
            "cuCheckpointProcessLock",
            lambda pid: self.driver.lock(pid, self.lock_timeout_ms),
        )
        checkpoint_s = self._each(
            "checkpoint", "cuCheckpointProcessCheckpoint", self.driver.checkpoint
        )
        return {"lock_s": round(lock_s, 4), "checkpoint_s": round(checkpoint_s, 4)}

    def restore(self) -> dict[str, float]:
        restore_s = self._each("restore", "cuCheckpointProcessRestore", self.driver.restore)
        unlock_s = self._each("unlock", "cuCheckpointProcessUnlock", self.driver.unlock)
        return {"restore_s": round(restore_s, 4), "unlock_s": round(unlock_s, 4)}

    def state(self, pid: int) -> str:
        return self.call("cuCheckpointProcessGetState", self.driver.state, pid)

    def restore_thread_ids(self) -> dict[str, Any]:
        """Informative only: a refusal here is recorded, not raised."""
        out: dict[str, Any] = {}
        for pid in self.pids:
            try:
                out[str(pid)] = self.call(
                    "cuCheckpointProcessGetRestoreThreadId", self.driver.restore_thread_id, pid
                )
            except DriverCallError as error:
                out[str(pid)] = error.evidence()
        return out

    def states(self) -> dict[str, str]:
        out = {}
        for pid in self.pids:
            try:
                out[str(pid)] = self.state(pid)
            except DriverCallError as error:
                out[str(pid)] = f"unknown: {error}"
        return out

    def running(self) -> bool:
        return all(state == "running" for state in self.states().values())

    def recover(self) -> list[dict[str, Any]]:
        """Brings every process back to running where the driver lets it:
        restore what is checkpointed, unlock what is locked. What it did."""
        actions: list[dict[str, Any]] = []
        for pid in self.pids:
            for want, name, function in (
                ("checkpointed", "cuCheckpointProcessRestore", self.driver.restore),
                ("locked", "cuCheckpointProcessUnlock", self.driver.unlock),
            ):
                try:
                    if self.state(pid) != want:
                        continue
                    self.call(name, function, pid)
                    actions.append({"pid": pid, "from": want, "ok": True})
                except DriverCallError as error:
                    actions.append({"pid": pid, "from": want, "ok": False, **error.evidence()})
                    break
        return actions


def refusal(error: DriverCallError, where: str, targets: Targets | None) -> dict[str, Any]:
    record = {**error.evidence(), "where": where}
    if targets is not None:
        record["states_after"] = targets.states()
    return record


def prepare_controller(driver: CheckpointDriver, pid: int) -> bool:
    """Whether the controller had to cuInit itself for the checkpoint calls to
    answer about `pid` (a process known to hold a context); cuInit makes no
    context. DriverCallError when they still do not answer."""
    try:
        driver.state(pid)
        return False
    except DriverCallError as error:
        if error.result != CUDA_ERROR_NOT_INITIALIZED:
            raise
    driver.init()
    driver.state(pid)
    return True


class LineReader:
    """A child's output lines, read without blocking past a timeout."""

    def __init__(self, process: subprocess.Popen):
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._process = process
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for(self, prefix: str, timeout: float) -> str:
        """The first line starting with `prefix`; RuntimeError with the child's
        last line when it exits first or `timeout` passes."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"no {prefix!r} after {timeout:.0f} s; last line {last!r}"
                ) from None
            if line is None:
                raise RuntimeError(f"exited with {self._process.wait()}; last line {last!r}")
            if line.startswith(prefix):
                return line
            last = line or last


def probe(
    variant: str,
    driver: CheckpointDriver,
    memory,
    holder_command: list[str],
    idle: int,
    lock_timeout_ms: int,
    call_timeout_s: float,
    progress: Progress,
) -> dict[str, Any]:
    """A child holding `variant`'s CUDA state (HOLDERS), through one checkpoint,
    restore and a check that its state survived."""
    result: dict[str, Any] = {"variant": variant, "what": HOLDERS[variant], "ok": False}
    child = subprocess.Popen(
        holder_command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    targets = Targets(driver, [child.pid], lock_timeout_ms, call_timeout_s)
    step = "start the holder"
    try:
        reader = LineReader(child)
        info = reader.wait_for(HOLDER_INFO, timeout=120)
        result["holder"] = json.loads(info[len(HOLDER_INFO) :])
        reader.wait_for(HOLDING, timeout=60)
        result["pid"] = child.pid
        result["used_bytes"] = settle(memory)[0]
        result["over_idle_mib"] = over_idle_mib(result["used_bytes"], idle)
        result["gpu_processes"] = gpu_processes(memory)
        # False in a container whose pid namespace is not the driver's.
        result["nvml_lists_the_pid"] = child.pid in [p.get("pid") for p in result["gpu_processes"]]
        step = "first checkpoint call about the holder"
        result["controller_cuinit"] = prepare_controller(driver, child.pid)
        result["state_before"] = targets.state(child.pid)
        result["rss_before_bytes"] = rss([child.pid])[str(child.pid)]
        result["helper"] = helper_round_trip(child.pid)
        step = "lock and checkpoint"
        result.update(targets.checkpoint())
        result["state_checkpointed"] = targets.state(child.pid)
        result["restore_thread_id"] = targets.restore_thread_ids()[str(child.pid)]
        result["checkpointed_used_bytes"] = settle(memory)[0]
        result["checkpointed_over_idle_mib"] = over_idle_mib(
            result["checkpointed_used_bytes"], idle
        )
        result["gpu_processes_checkpointed"] = gpu_processes(memory)
        result["rss_checkpointed_bytes"] = rss([child.pid])[str(child.pid)]
        step = "restore and unlock"
        result.update(targets.restore())
        result["state_after"] = targets.state(child.pid)
        result["restored_used_bytes"] = settle(memory)[0]
        step = "check the holder's buffer"
        assert child.stdin is not None
        child.stdin.write(CHECK + "\n")
        child.stdin.flush()
        answer = reader.wait_for(CHECK, timeout=30)
        result["buffer_intact"] = answer == f"{CHECK} ok"
        result["ok"] = result["buffer_intact"]
        progress(
            f"probe {variant}: {result['over_idle_mib']:.1f} MiB over idle, checkpointed "
            f"{result['checkpointed_over_idle_mib']:.1f} MiB; lock+checkpoint "
            f"{result['lock_s'] + result['checkpoint_s']:.3f} s, restore+unlock "
            f"{result['restore_s'] + result['unlock_s']:.3f} s, buffer "
            + ("intact" if result["buffer_intact"] else "WRONG")
        )
    except DriverCallError as error:
        result["refusal"] = refusal(error, f"probe {variant}: {step} ({targets.step})", targets)
        result["recovery"] = targets.recover()
        progress(f"probe {variant}: the driver refused: {error}")
    except (RuntimeError, ValueError) as error:
        result["error"] = f"probe {variant}: {step}: the holder {error}"
        progress(result["error"])
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return result


#: A short-lived helper's whole job for one call: start Python, load libcuda, ask.
HELPER_CODE = """
import ctypes, sys
lib = ctypes.CDLL("libcuda.so.1")
state = ctypes.c_int()
result = lib.cuCheckpointProcessGetState(int(sys.argv[1]), ctypes.byref(state))
print(result, state.value)
"""


def helper_round_trip(pid: int) -> dict[str, Any]:
    """What a controller started per call (as vllm-project/vllm#56373's helper is)
    costs over one kept running: a new Python that loads libcuda and asks one
    checkpoint call, start to answer."""
    started = time.perf_counter()
    answer = subprocess.run(
        [sys.executable, "-c", HELPER_CODE, str(pid)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = (answer.stdout or answer.stderr).strip().splitlines()
    return {
        "seconds": round(time.perf_counter() - started, 4),
        "exit_code": answer.returncode,
        "answer": lines[-1] if lines else "",
    }


def find_targets(memory, server_pid: int, driver: CheckpointDriver) -> dict[str, Any]:
    """The server's processes that hold a CUDA context: NVML's list within the
    server's process tree; where NVML's pids are of another pid namespace (none
    in the tree), the tree's processes the checkpoint API knows as CUDA processes."""
    tree = tree_pids(server_pid)
    listed = gpu_processes(memory)
    in_tree = sorted({p["pid"] for p in listed if "pid" in p} & set(tree))
    found: dict[str, Any] = {"tree": tree, "gpu_processes": listed}
    if in_tree:
        found.update(pids=in_tree, source="nvml")
        return found
    states = {}
    for pid in tree:
        try:
            states[str(pid)] = driver.state(pid)
        except DriverCallError as error:
            states[str(pid)] = error.name
    found.update(
        pids=[int(pid) for pid, state in states.items() if state == "running"],
        source="checkpoint API state",
        states=states,
    )
    return found


def worker_report(client) -> dict[str, Any]:
    """The worker's memory report (vllm_graph_sleep.probe), or why there is none."""
    try:
        return client.memory_report()[0]
    except (ServerError, IndexError) as error:
        return {"error": str(error)}


def wake(client, level: int | None) -> None:
    if level is None:
        return
    client.wake_up()
    if level == 2:
        client.reload_weights()


def cycle(
    number: int,
    level: int | None,
    server: live.LiveServer,
    memory,
    targets: Targets,
    reference: list[list[int]],
    idle: int,
    max_tokens: int,
) -> dict[str, Any]:
    client = server.client
    record: dict[str, Any] = {"cycle": number}
    started = time.perf_counter()
    targets.step = "sleep"
    if level is not None:
        record["sleep_s"] = round(client.sleep(level), 4)
    record["before_used_bytes"] = settle(memory)[0]
    record["before_over_idle_mib"] = over_idle_mib(record["before_used_bytes"], idle)
    if number == 1:
        # The worker's own account of what it holds (tags, ledger), before any lock.
        record["worker_report"] = worker_report(client)
    record["rss_before_bytes"] = rss(targets.pids)
    available_before = mem_available()
    record.update(targets.checkpoint())
    targets.step = "read while checkpointed"
    record["states_checkpointed"] = targets.states()
    if number == 1:
        record["restore_thread_ids"] = targets.restore_thread_ids()
    record["checkpointed_used_bytes"] = settle(memory)[0]
    record["checkpointed_over_idle_mib"] = over_idle_mib(record["checkpointed_used_bytes"], idle)
    # What the restore will need free on the GPU (step 2 checks for it first).
    record["released_mib"] = over_idle_mib(
        record["before_used_bytes"], record["checkpointed_used_bytes"]
    )
    record["gpu_processes_checkpointed"] = gpu_processes(memory)
    record["rss_checkpointed_bytes"] = rss(targets.pids)
    before = sum(v or 0 for v in record["rss_before_bytes"].values())
    held = sum(v or 0 for v in record["rss_checkpointed_bytes"].values()) - before
    record["host_rss_held_mib"] = round(held / MiB, 3)
    available = mem_available()
    if available is not None and available_before is not None:
        record["mem_available_drop_mib"] = round((available_before - available) / MiB, 3)
    begin = time.perf_counter()
    record.update(targets.restore())
    targets.step = "wake"
    wake_begin = time.perf_counter()
    wake(client, level)
    record["wake_s"] = round(time.perf_counter() - wake_begin, 4)
    record["restore_to_awake_s"] = round(time.perf_counter() - begin, 4)
    targets.step = "completion after the wake"
    record.update(live.compare(reference, client.complete(PROMPTS, max_tokens).token_ids))
    record["awake_used_bytes"] = settle(memory)[0]
    record["cycle_s"] = round(time.perf_counter() - started, 3)
    return record


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians (and the worst) over the cycles done; cycle 1 on its own too."""

    def series(key: str, of: Callable[[dict], float | None] | None = None) -> list[float]:
        values = [of(r) if of else r.get(key) for r in records]
        return [v for v in values if v is not None]

    summary: dict[str, Any] = {
        "cycles_done": len(records),
        "all_exact": bool(records) and all(r.get("exact") is True for r in records),
        "inexact_cycles": [r["cycle"] for r in records if r.get("exact") is not True],
    }
    figures = {
        "before_over_idle_mib": None,
        "checkpointed_over_idle_mib": None,
        "lock_and_checkpoint_s": lambda r: r["lock_s"] + r["checkpoint_s"],
        "restore_and_unlock_s": lambda r: r["restore_s"] + r["unlock_s"],
        "wake_s": None,
        "restore_to_awake_s": None,
        "released_mib": None,
        "host_rss_held_mib": None,
        "mem_available_drop_mib": None,
    }
    for key, of in figures.items():
        values = series(key, of)
        summary[key] = {
            "median": _median(values),
            "max": round(max(values), 4) if values else None,
            "cycle1": round(values[0], 4) if values else None,
        }
    return summary


class Run:
    """One run's state: the results it writes and what cleanup must undo."""

    def __init__(self, args: argparse.Namespace, memory, progress: Progress):
        self.args = args
        self.memory = memory
        self.progress = progress
        self.out = args.out / RESULTS_JSON
        self.server: live.LiveServer | None = None
        self.targets: Targets | None = None
        self.results: dict[str, Any] = {}

    def write(self) -> None:
        live.write_json(self.results, self.out)

    def cleanup(self) -> None:
        """Processes back to running (a checkpointed engine cannot shut down),
        then the server stopped, quickly when they could not be brought back."""
        engine = self.results["engines"][-1] if self.results.get("engines") else None
        if self.targets is not None:
            recovery = self.targets.recover()
            if recovery and engine is not None:
                engine.setdefault("recovery", []).extend(recovery)
            running = self.targets.running()
            self.targets = None
        else:
            running = True
        if self.server is not None:
            code = self.server.server.stop(timeout=60.0 if running else 5.0)
            if engine is not None:
                engine["exit_code"] = code
            self.server = None


def run_engine(
    run: Run,
    kind: str,
    names: list[str],
    later: list[tuple[str, list[str]]],
    budget: Budget,
    driver: CheckpointDriver,
    command_for: CommandFor,
    idle: int,
    start_estimate: list[float],
    env: dict[str, str] | None,
) -> None:
    args, memory, progress = run.args, run.memory, run.progress
    engine: dict[str, Any] = {"server": kind, "configs": names}
    run.results["engines"].append(engine)
    per_start = start_estimate[0] + budget.stop_reserve_s + budget.cycle_guess_s
    later_reserve = per_start * len(later)
    if not budget.allows(start_estimate[0] + budget.cycle_guess_s + later_reserve):
        engine["skipped"] = (
            f"time: {budget.left():.0f} s left, a start takes ~{start_estimate[0]:.0f} s"
        )
        for name in names:
            run.results["configs"][name]["stopped"] = engine["skipped"]
        progress(f"{kind}: skipped ({engine['skipped']})")
        return
    server = live.LiveServer(
        lambda port: command_for(kind, port),
        args.out / f"server-{kind}.log",
        args.request_timeout,
        env,
    )
    run.server = server
    engine["log"] = str(server.server.log_path)
    server.start(max(1.0, budget.left()), progress)
    engine["start_s"] = round(server.start_s or 0.0, 3)
    engine["engine_init"] = server.server.engine_init()
    start_estimate[0] = server.start_s or start_estimate[0]
    reference, repeat = live.reference_tokens(server.client, PROMPTS, args.max_tokens)
    engine["reference"] = reference
    engine["stable_without_sleep"] = repeat["exact"]
    engine["awake_used_bytes"] = settle(memory)[0]
    engine["awake_worker_report"] = worker_report(server.client)
    found = find_targets(memory, server.server.process.pid, driver)
    engine["targets"] = found
    progress(f"{kind}: checkpointing pids {found['pids']} (from {found['source']})")
    if not found["pids"]:
        engine["error"] = "no process of the server holds a CUDA context"
        for name in names:
            run.results["configs"][name]["stopped"] = engine["error"]
        return
    targets = Targets(driver, found["pids"], args.lock_timeout_ms, args.call_timeout_s)
    run.targets = targets
    run.write()
    later_configs = sum(len(group) for _, group in later)
    for index, name in enumerate(names):
        config = run.results["configs"][name]
        level = CONFIGS[name][1]
        cycles = args.cycles if level is not None else min(args.cycles, args.checkpoint_only_cycles)
        until = budget.share_deadline(len(names) - index + later_configs, later_reserve)
        config["planned_cycles"] = cycles
        config["share_until_s"] = round(until - budget.deadline + budget.limit_s, 1)
        records = config["cycles"]
        estimate = budget.cycle_guess_s
        for number in range(1, cycles + 1):
            if not budget.allows(estimate) or (number > 1 and not budget.allows(estimate, until)):
                config["stopped"] = f"time: its share ended after {number - 1} cycle(s)"
                break
            try:
                record = cycle(
                    number, level, server, memory, targets, reference, idle, args.max_tokens
                )
            except ServerError as error:
                config["error"] = engine["error"] = str(error)
                progress(f"{name}: {error}")
                break
            except DriverCallError as error:
                config["refusal"] = refusal(
                    error, f"{name} cycle {number}: {targets.step}", targets
                )
                run.results["refusals"].append(config["refusal"])
                config["recovery"] = targets.recover()
                progress(f"{name}: the driver refused: {error}; recovery {config['recovery']}")
                break
            records.append(record)
            estimate = 1.2 * max(r["cycle_s"] for r in records)
            config["summary"] = summarize(records)
            run.write()
            progress(
                f"{name} {number}/{cycles}: before {record['before_over_idle_mib']:.1f} MiB over "
                f"idle, checkpointed {record['checkpointed_over_idle_mib']:.1f} MiB; "
                f"checkpoint {record['lock_s'] + record['checkpoint_s']:.3f} s, restore "
                f"{record['restore_s'] + record['unlock_s']:.3f} s, wake {record['wake_s']:.3f} s; "
                f"host +{record['host_rss_held_mib']:.0f} MiB; "
                + ("exact" if record["exact"] else f"DIFFERS {record.get('mismatch')}")
            )
        config["summary"] = summarize(records)
        if "error" in config or ("refusal" in config and not targets.running()):
            engine.setdefault("error", "the processes could not be brought back after a refusal")
            for rest in names[index + 1 :]:
                run.results["configs"][rest]["stopped"] = engine["error"]
            break
    run.cleanup()
    run.write()


def run(
    args: argparse.Namespace,
    memory,
    load_driver: Callable[[], CheckpointDriver],
    command_for: CommandFor,
    holder_command: Callable[[str], list[str]],
    progress: Progress,
    env: dict[str, str] | None = None,
    started: float | None = None,
) -> dict[str, Any]:
    """The whole run; `started` (time.monotonic) is when --time-limit began
    (default: now)."""
    budget = Budget(args.time_limit, started=started)
    state = Run(args, memory, progress)
    results = state.results
    results.update(live.header("CUDA checkpoint of a sleeping engine", memory, sys.argv))
    results.update(
        schema=SCHEMA,
        settings=live.settings(args, args.model),
        prompts=list(PROMPTS),
        controller={
            "pid": os.getpid(),
            "uid": os.getuid(),
            "what": "this script, a process outside the server's tree holding no CUDA context",
            # Conditions a refusal may come from: who may act on another process,
            # and whether the driver stays loaded without a client.
            "ptrace_scope": read_text(Path("/proc/sys/kernel/yama/ptrace_scope")),
            "persistence_mode": (
                memory.persistence_modes() if hasattr(memory, "persistence_modes") else None
            ),
        },
        configs={
            name: {"server": CONFIGS[name][0], "level": CONFIGS[name][1], "cycles": []}
            for name in args.configs
        },
        engines=[],
        refusals=[],
        stopped_early=None,
    )
    try:
        with live.time_limit(max(1.0, budget.left())):
            idle = settle(memory)[0]
            results["idle"] = {"used_bytes": idle, "gpu_processes": gpu_processes(memory)}
            begin = time.perf_counter()
            driver = load_driver()
            results["controller"]["driver_load_s"] = round(time.perf_counter() - begin, 4)
            results["driver"] = {
                "version": driver.driver_version(),
                "missing_calls": driver.missing,
            }
            if driver.missing:
                results["stopped_early"] = f"libcuda lacks {driver.missing} (driver before 570?)"
                return results
            results["probe"] = probe(
                "bare",
                driver,
                memory,
                holder_command("bare"),
                idle,
                args.lock_timeout_ms,
                args.call_timeout_s,
                progress,
            )
            results["controller"]["cuinit"] = results["probe"].get("controller_cuinit")
            if results["probe"].get("refusal"):
                # The driver refused a bare context: an engine would be refused too.
                results["refusals"].append(results["probe"]["refusal"])
                results["stopped_early"] = "the driver refused the probe: no engine started"
                return results
            if results["probe"].get("error"):
                # The holder itself failed (not the driver): the engines still tell.
                progress("the probe's holder failed; going on with the engines")
            if args.plugin_probe:
                # Our allocator's pieces alone: a refusal here names VMM memory,
                # registered host memory or graphs without vLLM around them.
                results["plugin_probe"] = plugin = probe(
                    "plugin",
                    driver,
                    memory,
                    holder_command("plugin"),
                    idle,
                    args.lock_timeout_ms,
                    args.call_timeout_s,
                    progress,
                )
                if plugin.get("refusal"):
                    results["refusals"].append(plugin["refusal"])
                    if plugin["refusal"]["name"] == "NO_ANSWER":
                        # A driver that stopped answering would hang the engines too.
                        results["stopped_early"] = "a probe's driver call hung: no engine started"
                        return results
            state.write()
            if args.floor:
                results["floor"] = floor.measure(memory, timeout=60)
                if "used_bytes" in results["floor"]:
                    results["floor"]["over_idle_mib"] = over_idle_mib(
                        results["floor"]["used_bytes"][0], idle
                    )
            start_estimate = [args.start_estimate]
            groups = server_groups(args.configs)
            for index, (kind, names) in enumerate(groups):
                run_engine(
                    state,
                    kind,
                    names,
                    groups[index + 1 :],
                    budget,
                    driver,
                    command_for,
                    idle,
                    start_estimate,
                    env,
                )
    except (live.Overtime, live.Interrupted) as error:
        results["stopped_early"] = str(error)
        progress(str(error))
    except (ServerError, DriverCallError, RuntimeError) as error:
        results["error"] = str(error)
        if isinstance(error, DriverCallError):
            results["refusals"].append(refusal(error, "outside a cycle", state.targets))
        progress(f"run failed: {error}")
    finally:
        state.cleanup()
        results["elapsed_s"] = round(budget.limit_s - budget.left(), 2)
        results["ok"] = ok(results)
        state.write()
    return results


def ok(results: dict[str, Any]) -> bool:
    configs = results.get("configs", {}).values()
    return (
        results.get("stopped_early") is None
        and "error" not in results
        and (results.get("probe") or {}).get("ok") is True
        and not results.get("refusals")
        and all(
            c.get("summary", {}).get("all_exact") and "stopped" not in c and "refusal" not in c
            for c in configs
        )
    )


def table_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    idle = results.get("idle", {}).get("used_bytes")
    if idle is not None:
        lines.append(f"idle GPU: {idle / MiB:.0f} MiB used (NVML)")
    for key in ("probe", "plugin_probe"):
        found = results.get(key) or {}
        if "checkpointed_over_idle_mib" in found:
            lines.append(
                f"probe {found['variant']}: {found['over_idle_mib']:.1f} MiB over idle, "
                f"checkpointed {found['checkpointed_over_idle_mib']:.1f} MiB, "
                + ("intact after restore" if found.get("buffer_intact") else "NOT intact")
            )
        elif found.get("error"):
            lines.append(found["error"])
    floor_result = results.get("floor") or {}
    if floor_result.get("over_idle_mib") is not None:
        lines.append(f"floor (context + cuBLAS): {floor_result['over_idle_mib']:.1f} MiB over idle")
    header = (
        "config",
        "cycles",
        "before",
        "ckpt'd",
        "ckpt s",
        "restore s",
        "wake s",
        "rest+wake s",
        "host MiB",
        "exact",
    )
    rows = [header]
    for name, config in results.get("configs", {}).items():
        s = config.get("summary")
        if not s:
            status = config.get("stopped") or ("refused" if config.get("refusal") else "-")
            rows.append((name, "0", *["-"] * 7, status))
            continue

        def med(key: str, s: dict[str, Any] = s) -> str:
            value = s[key]["median"]
            if value is None:
                return "-"
            return f"{value:.3f}" if key.endswith("_s") else f"{value:.1f}"

        rows.append(
            (
                name,
                str(s["cycles_done"]),
                med("before_over_idle_mib"),
                med("checkpointed_over_idle_mib"),
                med("lock_and_checkpoint_s"),
                med("restore_and_unlock_s"),
                med("wake_s"),
                med("restore_to_awake_s"),
                med("host_rss_held_mib"),
                "yes" if s["all_exact"] else f"NO {s['inexact_cycles']}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines.append(
        "medians; MiB over the idle GPU (NVML); host MiB: the checkpointed processes' RSS gain"
    )
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    for item in results.get("refusals", []):
        lines.append(
            f"REFUSED at {item['where']}: {item['call']} -> {item['result']} "
            f"{item['name']}: {item['string']}"
        )
    if results.get("stopped_early"):
        lines.append(f"stopped early: {results['stopped_early']}")
    if results.get("error"):
        lines.append(f"error: {results['error']}")
    return lines


def hold_context(variant: str) -> int:
    """The probe's child (HOLDERS[variant]): prints HOLDER_INFO and HOLDING once
    set up, answers CHECK with "CHECK ok" when its state survived, exits when
    its input closes."""
    check = hold_bare() if variant == "bare" else hold_plugin_pieces()
    print(HOLDING, flush=True)
    for line in sys.stdin:
        if line.strip() == CHECK:
            print(f"{CHECK} {'ok' if check() else 'bad'}", flush=True)
    return 0


def hold_bare() -> Callable[[], bool]:
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")

    def call(name: str, *args) -> None:
        result = getattr(lib, name)(*args)
        if result != 0:
            print(f"holder: {name} returned {result}", flush=True)
            raise SystemExit(1)

    device, context, pointer = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    words = HOLDER_BUFFER_BYTES // 4
    call("cuInit", 0)
    call("cuDeviceGet", ctypes.byref(device), 0)
    call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
    call("cuCtxSetCurrent", context)
    call("cuMemAlloc_v2", ctypes.byref(pointer), ctypes.c_size_t(HOLDER_BUFFER_BYTES))
    # The memset may still run when HOLDING is printed: the lock waits for it, and
    # the check's copy (same stream) comes after it.
    call("cuMemsetD32_v2", pointer, ctypes.c_uint(HOLDER_MAGIC), ctypes.c_size_t(words))
    print(f"{HOLDER_INFO} {json.dumps({'buffer_bytes': HOLDER_BUFFER_BYTES})}", flush=True)

    def check() -> bool:
        host = (ctypes.c_uint32 * words)()
        call("cuMemcpyDtoH_v2", host, pointer, ctypes.c_size_t(HOLDER_BUFFER_BYTES))
        return all(word == HOLDER_MAGIC for word in host)

    return check


def hold_plugin_pieces() -> Callable[[], bool]:
    """Graphs whose private memory sits in our graph pool, the pool asleep; the
    check wakes it and replays every graph (benchmarks/graph_residue.py's case,
    with allocations inside the graphs so that the pool has pages to back up)."""
    import torch

    from vllm_graph_sleep.allocator import GRAPH_TAG, GraphSleepAllocator

    allocator = GraphSleepAllocator.get_instance()
    buffers = [torch.zeros(1 << 16, device="cuda") for _ in range(PLUGIN_GRAPHS)]
    (buffers[0] + 1).sum().item()  # kernels loaded before the capture
    graphs = []
    with allocator.cudagraph_pool() as pool:
        for buffer in buffers:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool.id):
                for _ in range(PLUGIN_NODES):
                    buffer.copy_(buffer + 1)  # `buffer + 1` lives in the pool
            graphs.append(graph)
    mapped = allocator.mapped_bytes(GRAPH_TAG)
    allocator.sleep(offload_tags=(GRAPH_TAG,))
    torch.cuda.synchronize()
    info = {
        "graphs": PLUGIN_GRAPHS,
        "kernels_per_graph": 2 * PLUGIN_NODES,
        "pool_mapped_bytes_awake": mapped,
        "pool_mapped_bytes_asleep": allocator.mapped_bytes(GRAPH_TAG),
        "host_backup_bytes": allocator.host_bytes(),
    }
    print(f"{HOLDER_INFO} {json.dumps(info)}", flush=True)

    def check() -> bool:
        allocator.wake_up()
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        # Capture runs nothing: one replay adds PLUGIN_NODES to every buffer.
        return all(bool((buffer == PLUGIN_NODES).all()) for buffer in buffers)

    return check


def holder_command(variant: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--hold-context", variant]


def real_command(args: argparse.Namespace, model: str) -> CommandFor:
    return lambda kind, port: serve_command(
        SERVER_CONFIG[kind],
        model,
        port,
        tp=1,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        extra=shlex.split(args.serve_args),
    )


class TeeProgress:
    """Timestamped progress lines on stderr and in the run's log."""

    def __init__(self, log: Path):
        self.started = time.monotonic()
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "a", buffering=1)  # open for the whole run

    def __call__(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f}s] {text}"
        print(line, file=sys.stderr, flush=True)
        self._log.write(line + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="directory for results.json, run.log, server logs")
    parser.add_argument(
        "--configs", nargs="+", default=list(DEFAULT_CONFIGS), choices=list(CONFIGS)
    )
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument(
        "--checkpoint-only-cycles",
        type=int,
        default=3,
        help="at most this many cycles of checkpoint_only (it moves the whole KV cache)",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=270.0,
        help="seconds for the whole run from the script's start, model making included",
    )
    parser.add_argument(
        "--start-estimate",
        type=float,
        default=75.0,
        help="seconds an engine start is planned at until one was measured",
    )
    parser.add_argument("--lock-timeout-ms", type=int, default=10000)
    parser.add_argument(
        "--call-timeout-s",
        type=float,
        default=60.0,
        help="a driver call not back after this long is recorded as hung (NO_ANSWER)",
    )
    parser.add_argument("--model", help="a local model directory (default: make --model-kind)")
    parser.add_argument("--model-kind", default="llama")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--serve-args", default="", help="more vllm serve arguments, one string")
    parser.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the bench's floor (context + cuBLAS, ~10 s)",
    )
    parser.add_argument(
        "--no-plugin-probe",
        dest="plugin_probe",
        action="store_false",
        help="skip the probe of our allocator's pieces without vLLM (~10 s)",
    )
    parser.add_argument("--hold-context", choices=list(HOLDERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.hold_context and args.out is None:
        parser.error("--out is required")
    if len(set(args.configs)) != len(args.configs):
        parser.error(f"--configs names a configuration twice: {args.configs}")
    if args.cycles < 1 or args.time_limit <= 0:
        parser.error("--cycles must be at least 1 and --time-limit positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.hold_context:
        return hold_context(args.hold_context)
    from vllm_graph_sleep.bench.gpu import NvmlMemory
    from vllm_graph_sleep.bench.runner import resolve_model
    from vllm_graph_sleep.bench.settings import BenchSettings

    try:
        memory = NvmlMemory(1)
    except NoGpuError as error:
        print(f"checkpoint_residue: {error}; nothing to run", file=sys.stderr)
        return 2
    try:
        CheckpointDriver.load()
    except OSError as error:
        print(f"checkpoint_residue: cannot load libcuda: {error}", file=sys.stderr)
        return 2
    progress = TeeProgress(args.out / RUN_LOG)
    # The limit counts from the script's start: making the model is part of it.
    args.model = resolve_model(
        BenchSettings(model=args.model, model_kind=args.model_kind), progress
    )
    results = run(
        args,
        memory,
        CheckpointDriver.load,
        real_command(args, args.model),
        holder_command,
        progress,
        started=started,
    )
    for line in table_lines(results):
        print(line)
    print(f"results: {args.out / RESULTS_JSON}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
