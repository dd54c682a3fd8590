"""The ledger of one GPU while its engine sleeps, measured in the worker:
`ledger(device, segments)` (the probe's memory report carries it as report["ledger"]).
Each field's meaning and how it is obtained: vllm_graph_sleep.ledger_fields.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from vllm_graph_sleep import device_query
from vllm_graph_sleep.ledger_fields import balance

MiB = 2**20
NCCL_DEFAULT_BUFFSIZE = 4 * MiB  # NCCL's documented NCCL_BUFFSIZE default
# NCCL chooses its channel count from the topology and does not report it; the
# estimate assumes its usual ceiling unless NCCL_MAX_NCHANNELS says otherwise.
NCCL_ASSUMED_CHANNELS = 32
# torch 2.11's cuBLAS workspace without CUBLAS_WORKSPACE_CONFIG: 32 MiB from
# Hopper on, ":4096:2:16:8" before.
CUBLAS_WORKSPACE_HOPPER = 4096 * 8 * 1024
CUBLAS_WORKSPACE_OLDER = 4096 * 1024 * 2 + 16 * 1024 * 8


def workspace_config_bytes(config: str) -> int | None:
    """Bytes CUBLAS_WORKSPACE_CONFIG asks for (":SIZE_KiB:COUNT" pairs), None if unparsable."""
    parts = config.split(":")[1:]
    if not parts or len(parts) % 2:
        return None
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        return None
    return sum(size * 1024 * count for size, count in zip(numbers[::2], numbers[1::2], strict=True))


def cublas_workspace_estimate(device: int) -> tuple[int | None, str]:
    """(bytes, how) of one torch cuBLAS workspace on `device`."""
    if torch.version.hip:
        return None, "ROCm keeps hipBLAS and hipBLASLt workspaces apart; not modelled"
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        size = workspace_config_bytes(config)
        if size is not None:
            return size, f"one workspace of CUBLAS_WORKSPACE_CONFIG={config}"
    major = torch.cuda.get_device_properties(device).major
    size = CUBLAS_WORKSPACE_HOPPER if major >= 9 else CUBLAS_WORKSPACE_OLDER
    return size, (
        f"one workspace of torch's default for compute capability {major}.x; torch keeps "
        "one per (handle, stream) that ran a GEMM, a count it does not expose"
    )


def nccl_estimate(tp_size: int) -> tuple[int | None, str]:
    """(bytes, how) of the NCCL buffers of a TP group of `tp_size` ranks."""
    if tp_size <= 1:
        return None, "TP=1: no NCCL communicator"
    buffsize = int(os.environ.get("NCCL_BUFFSIZE") or NCCL_DEFAULT_BUFFSIZE)
    channels_env = os.environ.get("NCCL_MAX_NCHANNELS")
    channels = int(channels_env) if channels_env else NCCL_ASSUMED_CHANNELS
    return buffsize * channels * (tp_size - 1), (
        f"NCCL_BUFFSIZE {buffsize} B x {channels} channels "
        f"({'NCCL_MAX_NCHANNELS' if channels_env else 'assumed; NCCL picks by topology'}) "
        f"x {tp_size - 1} peer(s); Simple protocol only, one communicator"
    )


def _tp_size() -> int:
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    return get_tp_group().world_size if model_parallel_is_initialized() else 1


def _our_mapped() -> int:
    from vllm_graph_sleep.allocator import GraphSleepAllocator

    allocator = GraphSleepAllocator._instance
    if allocator is None:
        return 0
    return sum(a.size for a in allocator.allocations.values() if a.mapped)


def _vllm_cumem_mapped() -> int:
    from vllm.device_allocator.cumem import CuMemAllocator

    if CuMemAllocator.instance is None:
        return 0
    data = CuMemAllocator.instance.pointer_to_data.values()
    return sum(d.handle[1] for d in data if not d.is_asleep)


def _segments_outside_pools(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from vllm_graph_sleep.probe import sleep_allocator_addresses

    ours = sleep_allocator_addresses()
    return [segment for segment in segments if segment["address"] not in ours]


def _torch_outside_pools(segments: list[dict[str, Any]]) -> int:
    return sum(segment["total_size"] for segment in _segments_outside_pools(segments))


def torch_outside_pools_by_stream(segments: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Where torch's memory outside the sleep pools sits: per stream its segments
    were made for ("0x0": the default stream), bytes reserved and in use, and how
    many segments. A workspace cuBLAS took on the graph-capture stream, say, sits
    on that stream and not on the default one."""
    streams: dict[str, dict[str, int]] = {}
    for segment in _segments_outside_pools(segments):
        entry = streams.setdefault(
            hex(segment.get("stream", 0)), {"reserved": 0, "allocated": 0, "segments": 0}
        )
        entry["reserved"] += segment["total_size"]
        entry["allocated"] += segment.get("allocated_size", 0)
        entry["segments"] += 1
    return dict(sorted(streams.items(), key=lambda item: -item[1]["reserved"]))


def _graphs() -> int:
    from vllm_graph_sleep.probe import cudagraphs_captured

    return cudagraphs_captured()


def _guarded(unavailable: dict[str, str], name: str, read: Callable[[], Any]) -> Any:
    """`read()`, or None with the reason in `unavailable`: a figure that cannot
    be had must not take the report down."""
    try:
        value = read()
    except Exception as error:
        unavailable[name] = f"{type(error).__name__}: {error}"
        return None
    if value is None and name not in unavailable:
        unavailable[name] = "the driver library is absent or did not answer"
    return value


def _stack_reservation(limit: int | None, threads: int | None) -> tuple[int | None, str]:
    """(bytes, why not) of the context's stack reservation: limit x resident threads."""
    if torch.version.hip:
        return None, "not derived on ROCm: the CUDA formula is not known to hold there"
    if limit is None or threads is None:
        return None, "needs the stack limit and the resident threads"
    return limit * threads, ""


def ledger(device: int, segments: list[dict[str, Any]]) -> dict[str, Any]:
    """The ledger of `device` in this process (fields: vllm_graph_sleep.ledger_fields);
    `segments` is torch.cuda.memory_snapshot(), taken once by the caller."""
    unavailable: dict[str, str] = {}
    estimated: dict[str, str] = {}

    def get(name: str, read: Callable[[], Any]) -> Any:
        return _guarded(unavailable, name, read)

    used, source = get("nvml_used", lambda: device_query.used_bytes(device)) or (None, None)
    if used is None:
        unavailable.setdefault("nvml_used", "neither NVML nor the driver answered")
    stack = get("stack_limit_per_thread", lambda: device_query.context_limit(device, "stack"))
    threads = get("resident_threads", lambda: device_query.resident_threads(device))
    reservation, why_not = _stack_reservation(stack, threads)
    if reservation is None:
        unavailable["stack_reservation"] = why_not
    fields: dict[str, Any] = {
        "device": device,
        "nvml_used": used,
        "nvml_used_source": source,
        "stack_limit_per_thread": stack,
        "resident_threads": threads,
        "stack_reservation": reservation,
        **{
            which: get(which, lambda which=which: device_query.context_limit(device, which))
            for which in ("printf_fifo", "malloc_heap")
        },
        "our_pools_mapped": get("our_pools_mapped", _our_mapped),
        "vllm_cumem_mapped": get("vllm_cumem_mapped", _vllm_cumem_mapped),
        "torch_reserved_outside_pools": get(
            "torch_reserved_outside_pools", lambda: _torch_outside_pools(segments)
        ),
        "instantiated_graphs": get("instantiated_graphs", _graphs),
        "cuda_modules": None,
        "torch_outside_pools_by_stream": get(
            "torch_outside_pools_by_stream", lambda: torch_outside_pools_by_stream(segments)
        ),
    }
    unavailable["cuda_modules"] = "no driver call counts the modules a context has loaded"
    for name, estimate in (
        ("cublas_workspaces", lambda: cublas_workspace_estimate(device)),
        ("nccl_buffers", lambda: nccl_estimate(_tp_size())),
    ):
        value, how = get(name, estimate) or (None, None)
        fields[name] = value
        if value is None:
            unavailable.setdefault(name, how)
        else:
            estimated[name] = how
    fields["attributed"], fields["unattributed"] = balance(fields)
    fields["estimated"] = estimated
    fields["unavailable"] = unavailable
    return fields
