"""The flag, the gate that decides whether graph offload is active, the NCCL
policy that comes with it, and the FlashInfer all-reduce backend that suits a
host without NVLink multicast."""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import logging
import os
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from vllm_graph_sleep.settings import parse_yes_no

logger = logging.getLogger("vllm.graph_sleep")

FLAG = "sleep_mode_offload_cudagraph"
BACKEND_NAME = "graph_sleep"
NCCL_GRAPH_REGISTER = "NCCL_GRAPH_REGISTER"
FLASHINFER_ALLREDUCE_BACKEND = "VLLM_FLASHINFER_ALLREDUCE_BACKEND"

_active_in_this_process = False
# Set while vLLM measures memory with throwaway allocations (V1's graph-memory
# profiling): those must use the memory stock vLLM would use, not our pools.
_outside_pools: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "graph_sleep_outside_pools", default=False
)


@dataclasses.dataclass(frozen=True)
class Gate:
    active: bool
    requested: bool
    reason: str = ""  # why it is off although requested


def flag_value(value: Any) -> bool:
    """The graph-offload flag of additional_config as a bool: JSON true or false
    (or null: not set), 1 or 0, or a yes/no spelling. Anything else is refused,
    so that a typo does not quietly leave graph offload off."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    parsed = parse_yes_no(value) if isinstance(value, str) else None
    if parsed is not None:
        return parsed
    raise ValueError(
        f'additional_config {{"{FLAG}": {value!r}}} is not a yes/no value: use true or false'
    )


def flag_requested(vllm_config: Any) -> bool:
    additional = getattr(vllm_config, "additional_config", None) or {}
    return flag_value(additional.get(FLAG))


def hashed_as(vllm_config: Any) -> Any:
    """The config that vLLM's config hash should see: `vllm_config` itself, or,
    where additional_config carries our flag, a shallow copy without it and
    without the sleep-mode backend the flag makes the worker choose.

    vLLM keys its torch.compile and AOT caches (and the FlashInfer autotune
    cache) by VllmConfig.compute_hash, which hashes all of additional_config, so
    the flag alone sent a server with it on to a fresh compile of code that does
    not depend on it: the flag decides which pool CUDA graphs are captured into
    and what sleep and wake do with it, all at run time after compilation, while
    what the compiled code depends on (model, shapes, compilation config with its
    cudagraph mode, capture sizes and passes) is hashed in its own right. Other
    keys of additional_config still count.

    The same holds for ModelConfig.sleep_mode_backend, which vLLM hashes too (it
    is not among ModelConfig.compute_hash's ignored factors): with the gate on,
    the worker's init_device sets it to ours, before the model is compiled
    (patch vllm.v1.worker.gpu_worker). A backend only decides where memory goes
    at sleep and wake; vLLM reads the field at the first sleep, and no compiled
    code does. So where it names ours, the hash takes vLLM's default there, what
    a stock server on the same arguments has."""
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict) or FLAG not in additional:
        return vllm_config
    view = copy.copy(vllm_config)  # the sub-configs are shared, not copied
    view.additional_config = {k: v for k, v in additional.items() if k != FLAG}
    model_config = getattr(view, "model_config", None)
    if getattr(model_config, "sleep_mode_backend", None) == BACKEND_NAME:
        view.model_config = copy.copy(model_config)
        view.model_config.sleep_mode_backend = _stock_backend(model_config)
    return view


def _stock_backend(model_config: Any) -> str:
    """The sleep-mode backend ModelConfig declares as its default ("cumem" in 0.26)."""
    fields = {field.name: field for field in dataclasses.fields(model_config)}
    return fields["sleep_mode_backend"].default


def _cudagraphs_off(vllm_config: Any) -> bool:
    model_config = vllm_config.model_config
    if getattr(model_config, "enforce_eager", False):
        return True
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    return mode is not None and getattr(mode, "name", str(mode)) == "NONE"


def platform_name(platform: Any) -> str:
    """The one name we print for a platform: cuda, rocm, or vLLM's class name for
    the others (cpu, xpu, ...), and "none" where vLLM detected no platform."""
    if platform.is_cuda_alike():
        return "rocm" if platform.is_rocm() else "cuda"
    name = type(platform).__name__.removesuffix("Platform").lower()
    return "none" if name == "unspecified" else name


def evaluate_gate(vllm_config: Any, platform: Any = None) -> Gate:
    """Active iff the flag, sleep mode, CUDA graphs and a CUDA or ROCm platform."""
    requested = flag_requested(vllm_config)
    if not requested:
        return Gate(active=False, requested=False)
    if platform is None:
        from vllm.platforms import current_platform as platform
    model_config = vllm_config.model_config
    if model_config is None or not model_config.enable_sleep_mode:
        reason = "sleep mode is off: add --enable-sleep-mode"
    elif _cudagraphs_off(vllm_config):
        reason = "CUDA graphs are off (--enforce-eager or cudagraph_mode NONE): nothing to offload"
    elif not platform.is_cuda_alike():
        reason = f"platform {platform_name(platform)} is neither CUDA nor ROCm"
    else:
        return Gate(active=True, requested=True)
    return Gate(active=False, requested=True, reason=reason)


def warn_if_ineffective(gate: Gate) -> None:
    if gate.requested and not gate.active:
        logger.warning("--sleep-mode-offload-cudagraph has no effect: %s", gate.reason)


def nccl_value_unset(value: str | None) -> bool:
    """Whether an NCCL variable's value leaves NCCL's default: unset or empty
    (NCCL reads a value only when it is a non-empty string)."""
    return value is None or not value.strip()


def apply_nccl_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """With graph offload on, NCCL must not register graph buffers: a
    registration pins the pool sleep tries to release and goes stale when wake
    remaps it (fzyzcjy/torch_memory_saver#88, sgl-project/sglang#40648).
    Defaults NCCL_GRAPH_REGISTER to "0"; an explicit value is kept, with a
    warning unless it is "0". An empty one counts as unset, as NCCL reads it
    (its default, registration on). Returns the value in force."""
    environ = os.environ if environ is None else environ
    current = environ.get(NCCL_GRAPH_REGISTER)
    if nccl_value_unset(current):
        environ[NCCL_GRAPH_REGISTER] = "0"
        return "0"
    if current.strip() != "0":
        logger.warning(
            "%s=%s is kept as you set it, but with --sleep-mode-offload-cudagraph NCCL's "
            "graph-buffer registration can pin the graph pool (sleep frees less) and go stale "
            "after wake; set it to 0 unless you know otherwise.",
            NCCL_GRAPH_REGISTER,
            current,
        )
    return current


def mark_active() -> None:
    global _active_in_this_process
    _active_in_this_process = True


def mark_inactive() -> None:
    """The engine of this process shut down: a later engine decides afresh."""
    global _active_in_this_process
    _active_in_this_process = False


def is_active() -> bool:
    """True in a worker process where graph offload was switched on."""
    return _active_in_this_process


def routes_to_pools() -> bool:
    """True where allocations and captures go to our pools: graph offload is
    active and vLLM is not profiling with throwaway memory."""
    return _active_in_this_process and not _outside_pools.get()


@contextmanager
def outside_pools() -> Iterator[None]:
    """Allocations and graph captures inside use vLLM's stock memory."""
    token = _outside_pools.set(True)
    try:
        yield
    finally:
        _outside_pools.reset(token)


def multicast_free_all_reduce_backend(environ: MutableMapping[str, str]) -> str | None:
    """ "trtllm" where NVLink multicast is off (NCCL_NVLS_ENABLE=0) and no FlashInfer
    all-reduce backend was chosen, else None. At TP > 1 vLLM 0.26 picks FlashInfer's
    "mnnvl" backend, which creates multicast objects whatever NCCL was told; its
    "trtllm" backend uses plain IPC buffers. A TP=2 start on an H200 host with
    multicast off failed in memory profiling with mnnvl selected
    (docs/results/multi-gpu-h200x2.md)."""
    if environ.get("NCCL_NVLS_ENABLE") != "0":
        return None
    if environ.get(FLASHINFER_ALLREDUCE_BACKEND, "auto") != "auto":
        return None
    return "trtllm"
