"""AITER's custom all-reduce without IPC-registered graph inputs (ROCm).

With graph offload active, AITER's CustomAllreduce must be built with
`enable_register_for_capturing=False` and its fused launchers called with
registered=False: graph inputs live in the HIP VMM graph pool, for which
hipIpcGetMemHandle returns an unusable handle without an error (ROCm/aiter#2075).
The patch of vLLM's wrapper
(patches/distributed_device_communicators_aiter_custom_all_reduce.py) wires
these in; doctor asks `require_keyword` whether the installed AITER can.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import sys
from typing import Any

from vllm_graph_sleep import config

AITER_CLASS = "aiter.dist.device_communicators.custom_all_reduce.CustomAllreduce"
KEYWORD = "enable_register_for_capturing"
# AITER launchers with a `registered` argument that vLLM 0.26.0 reaches while
# capturing with registered=True (the call sites are in the header of
# patches/distributed_device_communicators_aiter_custom_all_reduce.py).
LAUNCHERS = ("fused_ar_rms", "fused_ar_rms_per_group_quant", "fused_qknorm_ar")
_FORCED = "__vllm_graph_sleep_forced_unregistered__"


class IncompatibleAiterError(RuntimeError):
    pass


def aiter_version() -> str:
    try:
        return importlib.metadata.version("amd-aiter")
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(sys.modules.get("aiter"), "__version__", "unknown"))


def aiter_class() -> type:
    # The same lazy import vLLM's __init__ does (aiter_custom_all_reduce.py:36-38).
    from aiter.dist.device_communicators.custom_all_reduce import CustomAllreduce

    return CustomAllreduce


def require_keyword(aiter_cls: type) -> None:
    # __init__, not the class: a class's signature can come from __new__.
    if KEYWORD in inspect.signature(aiter_cls.__init__).parameters:
        return
    raise IncompatibleAiterError(
        f"vllm-graph-sleep: --sleep-mode-offload-cudagraph needs {AITER_CLASS} to accept "
        f"`{KEYWORD}` (ROCm/aiter#2075), and the installed AITER {aiter_version()} does not. "
        "Without it AITER IPC-registers CUDA-graph inputs, which live in the HIP VMM graph "
        "pool: hipIpcGetMemHandle returns an unusable handle for that memory without an error "
        "and the ranks hang at graph replay. Fix: upgrade AITER (amd-aiter) to a build with "
        f"`{KEYWORD}`, or start vLLM with --disable-custom-all-reduce, or set "
        "VLLM_ROCM_USE_AITER_CUSTOM_AR=0 (vLLM's own custom all-reduce), or drop "
        "--sleep-mode-offload-cudagraph."
    )


def force_unregistered(impl: Any, name: str) -> None:
    """Shadows impl.name with a wrapper that calls it with registered=False."""
    launcher = getattr(impl, name, None)
    if launcher is None or hasattr(launcher, _FORCED):
        # Absent from this AITER build (vLLM 0.26.0 checks before calling,
        # e.g. build_supports_per_group_quant), or already done.
        return
    signature = inspect.signature(launcher)
    if "registered" not in signature.parameters:
        raise IncompatibleAiterError(
            f"vllm-graph-sleep: {AITER_CLASS}.{name} in AITER {aiter_version()} has no "
            "`registered` parameter, so graph-pool memory cannot be kept out of IPC "
            "registration. Start vLLM with --disable-custom-all-reduce or set "
            "VLLM_ROCM_USE_AITER_CUSTOM_AR=0."
        )

    @functools.wraps(launcher)
    def unregistered(*args, **kwargs):
        if not config.is_active():
            return launcher(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.arguments["registered"] = False
        return launcher(*bound.args, **bound.kwargs)

    setattr(unregistered, _FORCED, launcher)
    setattr(impl, name, unregistered)
