"""Deep sleep (issue 39): after a level-1 or level-2 sleep, the CUDA driver
checkpoints the engine core's process, so that what no allocator can give back
(the CUDA context, cuBLAS handles, loaded kernels, instantiated graphs) leaves
the GPU too; a wake restores it first and then wakes as usual.

The checkpoint API is called by a controller for another process: here the
process that holds the engine client (vLLM's API server, or the process of an
offline `vllm.LLM`), for the engine core process it started, where a TP=1
engine's worker runs. What the driver does with a sleeping engine, measured
from a separate controller process: docs/results/checkpoint-h200.md.

Refused, with the reason, where the driver cannot do it or we have not
measured it: ROCm (no such API), a driver without it (before 570), an engine
in this very process, TP or PP > 1 (NCCL and CUDA IPC memory are not
supported by the checkpoint, NVIDIA/cuda-checkpoint #30 and #27), several
engine core processes, several API server processes (only the one that
checkpointed could restore). A wake first checks that the GPU has room for
what the process held: a restore that runs out of memory can leave the
process stuck (NVIDIA/cuda-checkpoint #44), so without room the wake fails
with a clear error and the engine stays asleep and checkpointed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from typing import Any, Protocol

from vllm_graph_sleep.cuda_checkpoint import (
    CUDA_ERROR_NOT_INITIALIZED,
    CheckpointDriver,
    DriverCallError,
)
from vllm_graph_sleep.units import MiB, format_bytes

logger = logging.getLogger("vllm.graph_sleep")

#: How long the lock waits for the engine's CUDA work in flight.
LOCK_TIMEOUT_MS = 10_000
#: Free memory a restore needs beyond what the process held when checkpointed:
#: the driver's own bookkeeping for the restore (a margin, not a measured figure).
RESTORE_HEADROOM = 256 * MiB


class DeepSleepRefused(RuntimeError):
    """A deep sleep this engine, driver or platform cannot do; nothing was checkpointed."""


class DeepSleepError(RuntimeError):
    """A checkpoint that failed; the engine is asleep as the sleep left it."""


_RETRY_NOTE = "; the driver still holds the engine: wake it again to retry"


class DeepWakeError(RuntimeError):
    """A restore that did not start (no room) or failed; `checkpointed` says
    whether the driver still holds the engine (checkpointed, or restored and
    still locked), so that a retry can finish the wake."""

    def __init__(self, message: str, checkpointed: bool) -> None:
        super().__init__(message)
        self.checkpointed = checkpointed


class GpuMemory(Protocol):
    def process_bytes(self, pid: int) -> dict[int, int | None]:
        """NVML index -> device bytes `pid` uses there (GPUs where it has a
        context; None where NVML says the figure is not available)."""
        ...

    def free_bytes(self, device: int) -> int: ...


class NvmlMemory:
    """GPU memory as NVML reports it, for every GPU of the machine."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml

    def _handles(self) -> list[Any]:
        count = self._nvml.nvmlDeviceGetCount()
        return [self._nvml.nvmlDeviceGetHandleByIndex(index) for index in range(count)]

    def process_bytes(self, pid: int) -> dict[int, int | None]:
        used: dict[int, int | None] = {}
        for index, handle in enumerate(self._handles()):
            for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid:
                    # pynvml gives None for NVML_VALUE_NOT_AVAILABLE: unknown, not 0.
                    bytes_used = process.usedGpuMemory
                    used[index] = None if bytes_used is None else int(bytes_used)
        return used

    def free_bytes(self, device: int) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handles()[device]).free)


@dataclasses.dataclass(frozen=True)
class Checkpointed:
    """A checkpointed engine core: its pid, the GPU it ran on and the device
    bytes it held there just before the checkpoint (what a restore needs)."""

    pid: int
    device: int
    held: int
    #: The lock (the engine's CUDA work in flight finishing) and the
    #: checkpoint itself, in seconds.
    lock_s: float
    checkpoint_s: float


def engine_core_pids(engine_client: Any) -> list[int] | None:
    """Pids of the engine core processes an engine client (AsyncLLM, or an
    LLM's LLMEngine) started; None for an engine in this process or one
    whose processes this client does not own (a Ray or external launcher)."""
    core = getattr(engine_client, "engine_core", None)
    manager = getattr(getattr(core, "resources", None), "engine_manager", None)
    processes = getattr(manager, "processes", None)
    if not processes:
        return None
    return [process.pid for process in processes]


def refusal(
    pids: list[int] | None,
    world_size: int,
    api_servers: int = 1,
    is_rocm: bool = False,
    missing_calls: list[str] | None = None,
) -> str | None:
    """Why a deep sleep cannot be done here, or None. `missing_calls`: the
    checkpoint calls the loaded driver lacks (None: the driver could not be
    loaded at all)."""
    if is_rocm:
        return "deep sleep uses the CUDA driver's checkpoint API; ROCm has none"
    if missing_calls is None:
        return "libcuda.so.1 could not be loaded in this process"
    if missing_calls:
        return (
            f"this NVIDIA driver lacks {', '.join(missing_calls)} (the checkpoint API "
            "came with driver 570)"
        )
    if pids is None or os.getpid() in pids:
        return (
            "the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, or an "
            "external launcher): the driver checkpoints another process"
        )
    if len(pids) != 1:
        return f"{len(pids)} engine core processes (data parallel): one is supported"
    if world_size > 1:
        return (
            f"world size {world_size} (TP x PP): the driver's checkpoint does not support "
            "NCCL or CUDA IPC memory (NVIDIA/cuda-checkpoint #30, #27)"
        )
    if api_servers > 1:
        return (
            f"{api_servers} API server processes: only the one that checkpointed the engine "
            "could restore it"
        )
    return None


def _is_rocm() -> bool:
    import torch

    return torch.version.hip is not None


def controller_for(
    engine_client: Any, api_servers: int = 1, controller: DeepSleep | None = None
) -> tuple[DeepSleep | None, str | None]:
    """The controller for `engine_client` (`controller` if given, else one made
    now) and why deep sleep cannot be done for it (None: it can)."""
    parallel = getattr(getattr(engine_client, "vllm_config", None), "parallel_config", None)
    world_size = getattr(parallel, "world_size", 1)
    pids = engine_core_pids(engine_client)
    if _is_rocm():
        return controller, refusal(pids, world_size, api_servers, is_rocm=True)
    load_error = None
    if controller is None:
        try:
            controller = DeepSleep.load()
        except Exception as error:  # no libcuda or no NVML: said in the refusal
            load_error = f"{type(error).__name__}: {error}"
    missing = None if controller is None else controller.missing_calls
    why = refusal(pids, world_size, api_servers, missing_calls=missing)
    if why is not None and load_error is not None:
        why = f"{why} ({load_error})"
    return controller, why


class DeepSleep:
    """The controller of one engine core process: checkpoints it after a sleep
    and restores it before a wake. One per engine client; its calls block
    (run them off an event loop) and one runs at a time."""

    def __init__(self, driver: Any, memory: GpuMemory, headroom: int = RESTORE_HEADROOM) -> None:
        self._driver = driver  # cuda_checkpoint.CheckpointDriver or a stand-in
        self._memory = memory
        self._headroom = headroom
        self._lock = threading.Lock()
        self.checkpointed: Checkpointed | None = None
        # Locked by us and not unlocked (the unlock after a restore, or after a
        # refused checkpoint, failed): a wake retries the unlock.
        self.locked_pid: int | None = None
        self._closed = False  # the engine is being stopped: no checkpoint any more

    @property
    def holds_engine(self) -> bool:
        """Whether the driver holds the engine: checkpointed, or still locked
        (its CUDA calls wait until a wake unlocks it)."""
        return self.checkpointed is not None or self.locked_pid is not None

    @classmethod
    def load(cls) -> DeepSleep:
        return cls(CheckpointDriver.load(), NvmlMemory())

    @property
    def missing_calls(self) -> list[str]:
        return list(self._driver.missing)

    def held_on_one_gpu(self, pid: int) -> tuple[int, int]:
        """(GPU, device bytes) `pid` holds, as NVML reports it; DeepSleepRefused
        where a restore's room could not be known. Asked before the sleep too,
        so that a refusal comes before anything is done."""
        try:
            used = self._memory.process_bytes(pid)
        except Exception as error:
            raise DeepSleepRefused(
                f"NVML could not say how much GPU memory pid {pid} holds ({error}): the room a "
                "restore needs cannot be known, so nothing is checkpointed"
            ) from error
        if not used:
            raise DeepSleepRefused(
                f"NVML lists no GPU memory of pid {pid} (is NVML's pid namespace another "
                "one?): the room a restore needs cannot be known, so nothing is checkpointed"
            )
        if len(used) != 1:
            raise DeepSleepRefused(
                f"pid {pid} holds a context on {len(used)} GPUs ({sorted(used)}); one is supported"
            )
        ((device, held),) = used.items()
        if held is None:
            raise DeepSleepRefused(
                f"NVML does not report how much GPU memory pid {pid} uses (not available on "
                "this system): the room a restore needs cannot be known, so nothing is "
                "checkpointed"
            )
        return device, held

    def checkpoint(self, pid: int) -> Checkpointed:
        """Locks `pid` (its CUDA work in flight finishes) and checkpoints it."""
        with self._lock:
            if self._closed:
                raise DeepSleepRefused("the engine is shutting down")
            if self.holds_engine:
                raise DeepSleepError("the engine is already checkpointed: wake it first")
            device, held = self.held_on_one_gpu(pid)
            started = time.perf_counter()
            try:
                self._answering(pid)
                self._driver.lock(pid, LOCK_TIMEOUT_MS)
            except Exception as error:
                raise DeepSleepError(f"the driver would not lock pid {pid}: {error}") from error
            locked = time.perf_counter()
            try:
                self._driver.checkpoint(pid)
            except Exception as error:
                failed = Checkpointed(pid, device, held, locked - started, 0.0)
                raise DeepSleepError(
                    f"the driver would not checkpoint pid {pid}: {error}; "
                    f"{self._unlock_after(failed)}"
                ) from error
            done = time.perf_counter()
            self.checkpointed = Checkpointed(pid, device, held, locked - started, done - locked)
            # Where a deep sleep's time goes beyond the sleep's own log line (issue 39).
            logger.info(
                "graph-sleep deep sleep: pid %d checkpointed, %s it held on GPU %d moved to the "
                "host; %.3f s (lock %.1f ms, checkpoint %.1f ms)",
                pid,
                format_bytes(held),
                device,
                done - started,
                1000 * (locked - started),
                1000 * (done - locked),
            )
            return self.checkpointed

    def _answering(self, pid: int) -> None:
        """Makes the checkpoint calls answer about `pid`: a driver may want
        cuInit in the controller first (it makes no context here)."""
        try:
            self._driver.state(pid)
        except DriverCallError as error:
            if error.result != CUDA_ERROR_NOT_INITIALIZED:
                raise
            self._driver.init()

    def _unlock_after(self, failed: Checkpointed) -> str:
        """Unlocks the process of a refused checkpoint; says how that went.
        Unless the driver then says it runs, the process is held, as the
        driver left it (a wake restores or unlocks it): locked, or, where the
        driver would not say, locked as far as anyone knows."""
        pid = failed.pid
        try:
            self._driver.unlock(pid)
        except Exception as error:
            state = self._state(pid)
            if state == "running":
                return f"unlocking it failed ({error}), but it runs, asleep as the sleep left it"
            if state == "checkpointed":
                self.checkpointed = failed
            else:
                self.locked_pid = pid
            return f"unlocking it failed too ({error}): it stays {state}{_RETRY_NOTE}"
        return "it was unlocked and stays asleep as the sleep left it"

    def restore(self) -> float:
        """Restores and unlocks the checkpointed process; seconds it took.
        Starts no restore without room for what the process held. A process
        left locked (an unlock that failed) is unlocked again."""
        with self._lock:
            if self.locked_pid is not None:
                started = time.perf_counter()
                self._unlock_held(self.locked_pid, "is still locked, and unlocking it failed")
                return time.perf_counter() - started
            target = self.checkpointed
            if target is None:
                return 0.0
            need = target.held + self._headroom
            try:
                free = self._memory.free_bytes(target.device)
            except Exception as error:
                raise DeepWakeError(
                    f"NVML could not say how much memory is free on GPU {target.device} "
                    f"({error}): no restore was started. The engine stays asleep and "
                    "checkpointed; wake it again.",
                    checkpointed=True,
                ) from error
            if free < need:
                raise DeepWakeError(
                    f"the engine's checkpoint needs {format_bytes(need)} free on GPU "
                    f"{target.device} ({format_bytes(target.held)} it held and "
                    f"{format_bytes(self._headroom)} of headroom), and {format_bytes(free)} "
                    "is free: no restore was started (one that runs out of memory can leave "
                    "the process stuck). The engine stays asleep and checkpointed; free memory "
                    "on that GPU and wake it again.",
                    checkpointed=True,
                )
            started = time.perf_counter()
            try:
                self._driver.restore(target.pid)
            except Exception as error:
                # Forgotten only where the driver says it is no longer
                # checkpointed: a wake that skipped the restore of a process
                # still checkpointed would wait on the driver's lock for ever.
                state = self._state(target.pid)
                if state in ("running", "locked"):
                    self.checkpointed = None
                if state == "locked":  # restored: the unlock is what is left
                    self.locked_pid = target.pid
                raise DeepWakeError(
                    f"the driver could not restore pid {target.pid}: {error} (it is now "
                    f"{state}){_RETRY_NOTE if self.holds_engine else ''}",
                    checkpointed=self.holds_engine,
                ) from error
            self.checkpointed = None
            self.locked_pid = target.pid
            restored = time.perf_counter()
            self._unlock_held(target.pid, "was restored but not unlocked")
            done = time.perf_counter()
            logger.info(
                "graph-sleep deep sleep: pid %d restored on GPU %d (%s free for %s); %.3f s "
                "(restore %.1f ms, unlock %.1f ms)",
                target.pid,
                target.device,
                format_bytes(free),
                format_bytes(need),
                done - started,
                1000 * (restored - started),
                1000 * (done - restored),
            )
            return done - started

    def close(self) -> float:
        """For the engine's shutdown: waits for a checkpoint under way, restores
        what the driver holds (restore) and refuses every later checkpoint."""
        with self._lock:
            self._closed = True
        return self.restore()

    def _unlock_held(self, pid: int, failure: str) -> None:
        try:
            self._driver.unlock(pid)
        except Exception as error:
            if self._state(pid) == "running":  # unlocked after all
                self.locked_pid = None
                return
            raise DeepWakeError(
                f"pid {pid} {failure}: {error}{_RETRY_NOTE}", checkpointed=True
            ) from error
        self.locked_pid = None

    def _state(self, pid: int) -> str:
        try:
            return self._driver.state(pid)
        except Exception as error:  # the driver's own error; the caller reports it
            return f"unknown ({error})"


# -- an API server's engine client ---------------------------------------------

#: The controller an API server deep-sleeps each engine client's engine with.
_server_controllers: weakref.WeakKeyDictionary[Any, DeepSleep] = weakref.WeakKeyDictionary()


def serve_deep_sleep(engine_client: Any, controller: DeepSleep) -> None:
    """Notes that `controller` may checkpoint the engine of `engine_client`
    (an AsyncLLM), for `restore_before_shutdown`."""
    _server_controllers[engine_client] = controller


def restore_before_shutdown(engine_client: Any) -> None:
    """Restores the engine of `engine_client` if its controller holds it
    checkpointed, before the client stops it (patch vllm.v1.engine.async_llm):
    vLLM's shutdown would otherwise stop an engine core whose CUDA calls wait
    on the driver's lock. vLLM's launcher stops the engine client on SIGINT
    or SIGTERM before the HTTP server's lifespan ends, so the server's own
    shutdown comes too late for this. A restore that fails is logged, and the
    shutdown goes on. A checkpoint under way is waited for, and none starts
    afterwards (DeepSleep.close)."""
    controller = _server_controllers.get(engine_client)
    if controller is None:
        return
    try:
        controller.close()
    except Exception as error:  # NVML's errors too: vLLM's shutdown must still run
        logger.error("graph-sleep: at shutdown, the engine was not restored: %s", error)


# -- offline: vllm.LLM ---------------------------------------------------------

#: One controller per LLM, made at its first deep sleep.
_controllers: weakref.WeakKeyDictionary[Any, DeepSleep] = weakref.WeakKeyDictionary()


def sleep(llm: Any, level: int = 1, controller: DeepSleep | None = None) -> Checkpointed:
    """`llm.sleep(level)`, then the engine core process checkpointed by this
    one. Raises DeepSleepRefused (nothing done) where that cannot be done,
    DeepSleepError (asleep at `level`, not checkpointed) where the driver
    refused. `controller`: the one to use (default: this LLM's, made now)."""
    if level not in (1, 2):
        raise DeepSleepRefused(f"deep sleep needs a sleep level of 1 or 2, not {level!r}")
    current = _controllers.get(llm)
    if current is not None and current.holds_engine:  # whichever controller is given
        raise DeepSleepError("the engine is already checkpointed: wake_up first")
    controller, why = controller_for(llm.llm_engine, controller=controller or current)
    if why is not None:
        raise DeepSleepRefused(f"deep sleep refused: {why}")
    if controller.holds_engine:
        raise DeepSleepError("the engine is already checkpointed: wake_up first")
    _controllers[llm] = controller
    (pid,) = engine_core_pids(llm.llm_engine)
    controller.held_on_one_gpu(pid)  # a refusal before the sleep: nothing done
    llm.sleep(level=level)
    return controller.checkpoint(pid)


def wake_up(llm: Any, tags: list[str] | None = None) -> None:
    """Restores a checkpointed engine core (DeepWakeError, the engine still
    asleep, where the GPU has no room), then `llm.wake_up(tags)`."""
    controller = _controllers.get(llm)
    if controller is not None:
        controller.restore()
    llm.wake_up(tags=tags)


def is_checkpointed(llm: Any) -> bool:
    controller = _controllers.get(llm)
    return controller is not None and controller.holds_engine
