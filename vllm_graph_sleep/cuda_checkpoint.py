"""The CUDA driver's process checkpoint API through ctypes (driver 570 and later).

A controller process calls these for a target pid: lock (the target's CUDA calls
block, submitted work finishes), checkpoint (the target's device memory goes to
host memory the driver manages and its GPU resources, context included, are
released), restore (the GPUs are taken again and the memory comes back at the
same addresses), unlock. Each call takes an optional 64-byte argument struct whose
reserved fields must be zero; the lock's carries a timeout in milliseconds.

Layouts follow the driver API reference of CUDA 13.1
(docs.nvidia.com/cuda/cuda-driver-api, group CUDA_CHECKPOINT); 13.4 renames part
of the restore and checkpoint structs' reserved bytes (custom storage pointers)
without moving a field, and zero keeps the default (memory backed up to host).

Every failing call raises DriverCallError with the call, the pid, the CUresult
and the driver's own name and text for it (cuGetErrorName, cuGetErrorString).
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

LIBCUDA = "libcuda.so.1"
ARGS_BYTES = 64  # every CUcheckpoint*Args struct
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3

#: CUprocessState values.
PROCESS_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}

#: The checkpoint API's entry points; a driver older than 570 has none of them.
CHECKPOINT_CALLS = (
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
)


class LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),  # 0: wait for the lock without a limit
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class RestoreArgs(ctypes.Structure):
    _fields_ = [
        ("gpuPairs", ctypes.c_void_p),  # NULL: restore onto the GPUs it ran on
        ("gpuPairsCount", ctypes.c_uint),
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


class UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class DriverCallError(RuntimeError):
    """A driver call that did not return CUDA_SUCCESS."""

    def __init__(self, call: str, pid: int | None, result: int, name: str, text: str):
        target = "" if pid is None else f" for pid {pid}"
        super().__init__(f"{call}{target} returned {result} ({name}: {text})")
        self.call = call
        self.pid = pid
        self.result = result
        self.name = name
        self.text = text

    def evidence(self) -> dict[str, Any]:
        return {
            "call": self.call,
            "pid": self.pid,
            "result": self.result,
            "name": self.name,
            "string": self.text,
        }


class CheckpointDriver:
    """The checkpoint calls of one loaded libcuda (or a test's stand-in for it)."""

    def __init__(self, lib: Any):
        self._lib = lib
        self.missing = [name for name in CHECKPOINT_CALLS if not hasattr(lib, name)]
        pid_out = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        self._declare("cuGetErrorName", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._declare("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._declare("cuDriverGetVersion", [ctypes.POINTER(ctypes.c_int)])
        self._declare("cuInit", [ctypes.c_uint])
        self._declare("cuCheckpointProcessGetState", pid_out)
        self._declare("cuCheckpointProcessGetRestoreThreadId", pid_out)
        self._declare("cuCheckpointProcessLock", [ctypes.c_int, ctypes.POINTER(LockArgs)])
        self._declare(
            "cuCheckpointProcessCheckpoint", [ctypes.c_int, ctypes.POINTER(CheckpointArgs)]
        )
        self._declare("cuCheckpointProcessRestore", [ctypes.c_int, ctypes.POINTER(RestoreArgs)])
        self._declare("cuCheckpointProcessUnlock", [ctypes.c_int, ctypes.POINTER(UnlockArgs)])

    @classmethod
    def load(cls, path: str = LIBCUDA) -> CheckpointDriver:
        """OSError when the library is not there."""
        return cls(ctypes.CDLL(path))

    def _declare(self, name: str, argtypes: list) -> None:
        function = getattr(self._lib, name, None)
        if function is not None:
            function.argtypes = argtypes
            function.restype = ctypes.c_int

    def _text(self, call: str, result: int) -> str:
        out = ctypes.c_char_p()
        function = getattr(self._lib, call, None)
        if function is None or function(result, ctypes.byref(out)) != CUDA_SUCCESS:
            return "unknown"
        return (out.value or b"").decode(errors="replace") or "unknown"

    def error_name(self, result: int) -> str:
        return self._text("cuGetErrorName", result)

    def error_string(self, result: int) -> str:
        return self._text("cuGetErrorString", result)

    def _call(self, call: str, pid: int | None, *args: Any) -> None:
        function = getattr(self._lib, call, None)
        if function is None:
            raise DriverCallError(call, pid, -1, "MISSING", f"{LIBCUDA} has no {call}")
        result = function(*args) if pid is None else function(pid, *args)
        if result != CUDA_SUCCESS:
            raise DriverCallError(
                call, pid, result, self.error_name(result), self.error_string(result)
            )

    def driver_version(self) -> int:
        """CUDA version the driver supports, as 1000 * major + 10 * minor."""
        version = ctypes.c_int()
        self._call("cuDriverGetVersion", None, ctypes.byref(version))
        return version.value

    def init(self) -> None:
        self._call("cuInit", None, 0)

    def state(self, pid: int) -> str:
        value = ctypes.c_int()
        self._call("cuCheckpointProcessGetState", pid, ctypes.byref(value))
        return PROCESS_STATES.get(value.value, f"unknown({value.value})")

    def restore_thread_id(self, pid: int) -> int:
        tid = ctypes.c_int()
        self._call("cuCheckpointProcessGetRestoreThreadId", pid, ctypes.byref(tid))
        return tid.value

    def lock(self, pid: int, timeout_ms: int) -> float:
        """Seconds the lock took; DriverCallError if it was refused or timed out."""
        return self._timed("cuCheckpointProcessLock", pid, LockArgs(timeoutMs=timeout_ms))

    def checkpoint(self, pid: int) -> float:
        return self._timed("cuCheckpointProcessCheckpoint", pid, CheckpointArgs())

    def restore(self, pid: int) -> float:
        return self._timed("cuCheckpointProcessRestore", pid, RestoreArgs())

    def unlock(self, pid: int) -> float:
        return self._timed("cuCheckpointProcessUnlock", pid, UnlockArgs())

    def _timed(self, call: str, pid: int, args: ctypes.Structure) -> float:
        started = time.perf_counter()
        self._call(call, pid, ctypes.byref(args))
        return time.perf_counter() - started
