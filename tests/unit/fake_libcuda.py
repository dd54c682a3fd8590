"""A stand-in for libcuda's checkpoint API, for CPU tests of
vllm_graph_sleep.cuda_checkpoint and benchmarks/checkpoint_residue.py.

It is called as ctypes calls a CDLL's functions from the binding: a pid and a
`ctypes.byref` of the argument struct or of the output value. It checks what a
driver would (the struct's type and size, reserved bytes zero), keeps each
process's state as the driver does (running -> locked -> checkpointed -> locked
-> running; any other order answers CUDA_ERROR_ILLEGAL_STATE, 401) and refuses
calls on request with a given CUresult. The processes it knows as CUDA processes
are this test process's live children started from the fake server or the fake
holder (by their command lines); any other pid answers CUDA_ERROR_NOT_INITIALIZED,
as the checkpoint API answers for a process without CUDA.
"""

from __future__ import annotations

import ctypes
import time

import psutil

from vllm_graph_sleep.cuda_checkpoint import (
    ARGS_BYTES,
    CheckpointArgs,
    LockArgs,
    RestoreArgs,
    UnlockArgs,
)

SUCCESS, INVALID_VALUE, NOT_INITIALIZED, ILLEGAL_STATE, NOT_SUPPORTED = 0, 1, 3, 401, 801
NAMES = {
    SUCCESS: ("CUDA_SUCCESS", "no error"),
    INVALID_VALUE: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    NOT_INITIALIZED: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
    ILLEGAL_STATE: ("CUDA_ERROR_ILLEGAL_STATE", "the operation is not permitted in this state"),
    NOT_SUPPORTED: ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
}
STATE_VALUES = {"running": 0, "locked": 1, "checkpointed": 2, "failed": 3}
#: Command-line markers of the processes that "hold a CUDA context".
CUDA_MARKERS = ("fake_vllm_server.py", "fake_context_holder.py")
#: (call, state it needs, state it leaves).
TRANSITIONS = {
    "cuCheckpointProcessLock": (LockArgs, "running", "locked"),
    "cuCheckpointProcessCheckpoint": (CheckpointArgs, "locked", "checkpointed"),
    "cuCheckpointProcessRestore": (RestoreArgs, "checkpointed", "locked"),
    "cuCheckpointProcessUnlock": (UnlockArgs, "locked", "running"),
}


def cuda_pids() -> set[int]:
    pids = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if any(marker in " ".join(child.cmdline()) for marker in CUDA_MARKERS):
                pids.add(child.pid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return pids


def _entry(method):
    def function(*args):
        return method(*args)

    return function


class FakeLibcuda:
    def __init__(
        self,
        refuse: dict[str, int] | None = None,
        refuse_pids: set[int] | None = None,
        needs_init: bool = False,
        without: tuple[str, ...] = (),
        version: int = 13000,
        hang_s: dict[str, float] | None = None,
    ):
        """`refuse`: call name -> CUresult it answers (for `refuse_pids` only, when
        given); `needs_init`: the checkpoint calls answer NOT_INITIALIZED until
        cuInit; `without`: entry points the library lacks (an old driver);
        `hang_s`: call name -> seconds it takes before answering (for the pids
        `refuse_pids` names, when given)."""
        self.refuse = refuse or {}
        self.refuse_pids = refuse_pids
        self.initialized = not needs_init
        self.version = version
        self.states: dict[int, str] = {}
        self.calls: list[tuple[str, int | None]] = []
        self.lock_args: list[bytes] = []
        self.without = set(without)
        self.hang_s = hang_s or {}
        for name, (struct, need, leave) in TRANSITIONS.items():
            setattr(self, name, self._transition(name, struct, need, leave))
        # Plain functions, as a CDLL's are: the binding sets argtypes on them.
        for name, method in (
            ("cuCheckpointProcessGetState", self._get_state),
            ("cuCheckpointProcessGetRestoreThreadId", self._get_restore_thread_id),
            ("cuInit", self._init),
            ("cuDriverGetVersion", self._driver_get_version),
            ("cuGetErrorName", self._error_name),
            ("cuGetErrorString", self._error_string),
        ):
            setattr(self, name, _entry(method))

    def __getattribute__(self, name):
        if name in object.__getattribute__(self, "without"):
            raise AttributeError(name)  # as a CDLL without the symbol
        return object.__getattribute__(self, name)

    def state_of(self, pid: int) -> str | None:
        if pid not in cuda_pids():
            return None
        return self.states.get(pid, "running")

    def _refused(self, call: str, pid: int) -> int | None:
        targeted = self.refuse_pids is None or pid in self.refuse_pids
        if call in self.hang_s and targeted:
            time.sleep(self.hang_s[call])
        if call in self.refuse and (self.refuse_pids is None or pid in self.refuse_pids):
            return self.refuse[call]
        if not self.initialized:
            return NOT_INITIALIZED
        return None

    def _transition(self, call: str, struct: type, need: str, leave: str):
        def function(pid, args):
            self.calls.append((call, pid))
            obj = args._obj
            assert type(obj) is struct and ctypes.sizeof(obj) == ARGS_BYTES, (call, type(obj))
            raw = bytes(obj)
            if struct is LockArgs:
                self.lock_args.append(raw)
                raw = raw[4:]  # timeoutMs, then the reserved fields
            if any(raw):
                return INVALID_VALUE  # reserved fields must be zero
            refused = self._refused(call, pid)
            if refused is not None:
                return refused
            state = self.state_of(pid)
            if state is None:
                return NOT_INITIALIZED
            if state != need:
                return ILLEGAL_STATE
            self.states[pid] = leave
            return SUCCESS

        return function

    def _get_state(self, pid, out):
        self.calls.append(("cuCheckpointProcessGetState", pid))
        refused = self._refused("cuCheckpointProcessGetState", pid)
        if refused is not None:
            return refused
        state = self.state_of(pid)
        if state is None:
            return NOT_INITIALIZED
        out._obj.value = STATE_VALUES[state]
        return SUCCESS

    def _get_restore_thread_id(self, pid, out):
        if self.state_of(pid) is None:
            return NOT_INITIALIZED
        out._obj.value = pid + 1
        return SUCCESS

    def _init(self, flags):
        self.calls.append(("cuInit", None))
        self.initialized = True
        return SUCCESS

    def _driver_get_version(self, out):
        out._obj.value = self.version
        return SUCCESS

    def _error_name(self, result, out):
        if result not in NAMES:
            return INVALID_VALUE
        out._obj.value = NAMES[result][0].encode()
        return SUCCESS

    def _error_string(self, result, out):
        if result not in NAMES:
            return INVALID_VALUE
        out._obj.value = NAMES[result][1].encode()
        return SUCCESS
