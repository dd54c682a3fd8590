"""The ledger of one GPU while its engine sleeps, measured in the worker:
`ledger(device, segments)` (the probe's memory report carries it as report["ledger"]).
Each field's meaning and how it is obtained: vllm_graph_sleep.ledger_fields.
"""

from __future__ import annotations

import functools
import heapq
import importlib
import os
import sys
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

from vllm_graph_sleep import device_query
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.ledger_fields import balance
from vllm_graph_sleep.sampler_scratch import SAMPLER_MODULE, vllm_has_module
from vllm_graph_sleep.units import MiB
from vllm_graph_sleep.vllm_version import vllm_version

NCCL_DEFAULT_BUFFSIZE = 4 * MiB  # NCCL's documented NCCL_BUFFSIZE default
# NCCL chooses its channel count from the topology and does not report it; the
# estimate assumes its usual ceiling unless NCCL_MAX_NCHANNELS says otherwise.
NCCL_ASSUMED_CHANNELS = 32
# torch 2.11's cuBLAS workspace without CUBLAS_WORKSPACE_CONFIG: 32 MiB from
# Hopper on, ":4096:2:16:8" before.
CUBLAS_WORKSPACE_HOPPER = 4096 * 8 * 1024
CUBLAS_WORKSPACE_OLDER = 4096 * 1024 * 2 + 16 * 1024 * 8
#: How many of torch's largest live blocks outside the sleep pools the ledger lists.
LARGEST_BLOCKS = 8
VLLM_WORKSPACE_MODULE = "vllm.v1.worker.workspace"
VLLM_TORCH_UTILS_MODULE = "vllm.utils.torch_utils"


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
    allocator = GraphSleepAllocator.current()
    return 0 if allocator is None else allocator.all_mapped_bytes()


def _last_backup(which: str) -> int:
    allocator = GraphSleepAllocator.current()
    if allocator is None:
        return 0
    return sum(getattr(allocator.last_backup(), which).values())


def _vllm_cumem_mapped() -> int:
    from vllm.device_allocator.cumem import CuMemAllocator

    if CuMemAllocator.instance is None:
        return 0
    data = CuMemAllocator.instance.pointer_to_data.values()
    return sum(d.handle[1] for d in data if not d.is_asleep)


def sleep_allocator_addresses() -> set[int]:
    """Addresses of every allocation of the sleep-mode allocators in this
    worker: ours and, for stock sleep mode, vLLM's CuMemAllocator. Both hand
    torch whole segments, so these are segment addresses."""
    from vllm.device_allocator.cumem import CuMemAllocator

    addresses = set()
    allocator = GraphSleepAllocator.current()
    if allocator is not None:
        addresses |= allocator.allocated_addresses()
    if CuMemAllocator.instance is not None:
        addresses |= CuMemAllocator.instance.pointer_to_data.keys()
    return addresses


def _segments_outside_pools(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ours = sleep_allocator_addresses()
    return [segment for segment in segments if segment["address"] not in ours]


def _torch_outside_pools(segments: list[dict[str, Any]]) -> int:
    return sum(segment["total_size"] for segment in _segments_outside_pools(segments))


def stream_key(handle: int) -> str:
    """How the ledger writes a CUDA stream: its handle in hex ("0x0": the default stream)."""
    return hex(handle)


def torch_outside_pools_by_stream(segments: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Where torch's memory outside the sleep pools sits: per stream its segments
    were made for ("0x0": the default stream), bytes reserved and in use, and how
    many segments. A workspace cuBLAS took on the graph-capture stream, say, sits
    on that stream and not on the default one."""
    streams: dict[str, dict[str, int]] = {}
    for segment in _segments_outside_pools(segments):
        entry = streams.setdefault(
            stream_key(segment.get("stream", 0)), {"reserved": 0, "allocated": 0, "segments": 0}
        )
        entry["reserved"] += segment["total_size"]
        entry["allocated"] += segment.get("allocated_size", 0)
        entry["segments"] += 1
    return dict(sorted(streams.items(), key=lambda item: -item[1]["reserved"]))


def vllm_attribute(module: str, path: str) -> Any:
    """vLLM's `module` and then its dotted attribute `path`; None where an object on
    the way is None (not made yet). These are private and move between vLLM
    releases, so one that is missing raises LookupError naming it and the version."""
    try:
        value: Any = importlib.import_module(module)
    except ImportError:
        raise LookupError(f"vLLM {vllm_version()} has no {module}") from None
    walked = module
    for name in path.split("."):
        if value is None:
            return None
        walked += f".{name}"
        if not hasattr(value, name):
            raise LookupError(f"vLLM {vllm_version()} has no {walked}")
        value = getattr(value, name)
    return value


def vllm_workspace_buffers() -> dict[int, Any]:
    """ubatch -> the buffer vLLM's WorkspaceManager keeps for it (the scratch its
    fused-MoE kernels and attention backends share; it grows and is never given
    back); none before the manager is made."""
    buffers = vllm_attribute(VLLM_WORKSPACE_MODULE, "_manager._current_workspaces") or []
    return {ubatch: buffer for ubatch, buffer in enumerate(buffers) if buffer is not None}


def _in_segments(address: int, segments: list[dict[str, Any]]) -> bool:
    return any(s["address"] <= address < s["address"] + s["total_size"] for s in segments)


def vllm_workspace_bytes(
    buffers: dict[int, Any], segments: list[dict[str, Any]]
) -> tuple[int, int]:
    """(bytes of vLLM's workspace buffers, the part of them in torch's segments
    outside the sleep pools, which no sleep releases)."""
    outside = _segments_outside_pools(segments)
    return (
        sum(buffer.nbytes for buffer in buffers.values()),
        sum(b.nbytes for b in buffers.values() if _in_segments(b.data_ptr(), outside)),
    )


def vllm_sampler_scratch() -> list[Any]:
    """The tensors vLLM's Triton top-k/top-p sampler keeps for the life of the
    process, every device's: its per-program scratch buffers and its two lookup
    tables. None at all where vLLM has not imported the sampler (it does
    wherever Triton works, so then nothing sampled with it); an import here
    would pull in Triton for nothing."""
    if sys.modules.get(SAMPLER_MODULE) is None:
        if not vllm_has_module(SAMPLER_MODULE):
            raise LookupError(f"vLLM {vllm_version()} has no {SAMPLER_MODULE}")
        return []
    buffers = vllm_attribute(SAMPLER_MODULE, "_TRITON_BUFFER_CACHE")
    tables = vllm_attribute(SAMPLER_MODULE, "_TRITON_TABLE_CACHE")
    return [*buffers.values(), *(table for pair in tables.values() for table in pair)]


def sampler_scratch_storages(tensors: list[Any], device: torch.device) -> dict[int, int]:
    """Address -> bytes of the storages of `tensors` on `device`, each once: the
    memory held is the storage's, however many tensors view it."""
    storages = (tensor.untyped_storage() for tensor in tensors if tensor.device == device)
    return {storage.data_ptr(): storage.nbytes() for storage in storages}


def _vllm_aux_stream() -> str | None:
    stream = vllm_attribute(VLLM_TORCH_UTILS_MODULE, "_aux_stream")
    return None if stream is None else stream_key(stream.cuda_stream)


@dataclass(frozen=True)
class KnownMemory:
    """What the ledger can name among torch's blocks: vLLM's workspace buffers
    (ubatch -> buffer) and its sampler's scratch (storage addresses) by address,
    a cuBLAS workspace only by its size (torch does not expose their addresses,
    so any block of that size matches), and streams by their key (stream_key ->
    name)."""

    workspace_buffers: dict[int, Any]
    sampler_scratch: Collection[int]
    cublas_workspace_size: int | None
    streams: dict[str, str]

    def what(self, address: int, size: int, stream: str) -> str | None:
        names = [
            f"vLLM workspace buffer of ubatch {ubatch}"
            for ubatch, buffer in self.workspace_buffers.items()
            if address <= buffer.data_ptr() < address + size
        ]
        if any(address <= scratch < address + size for scratch in self.sampler_scratch):
            names.append("vLLM's top-k/top-p sampler scratch")
        if not names and size == self.cublas_workspace_size:
            names.append("a cuBLAS workspace's size")
        if stream in self.streams:
            names.append(f"on {self.streams[stream]}")
        return ", ".join(names) or None


def torch_outside_pools_largest_blocks(
    segments: list[dict[str, Any]], known: KnownMemory
) -> list[dict[str, Any]]:
    """The LARGEST_BLOCKS largest live tensors' blocks in torch's segments outside
    the sleep pools, largest first: bytes, stream (keyed as in
    torch_outside_pools_by_stream) and, where `known` names it, what it is."""
    blocks = [
        (block["size"], block["address"], stream_key(segment.get("stream", 0)))
        for segment in _segments_outside_pools(segments)
        for block in segment.get("blocks", [])
        # Allocated as segment["allocated_size"] counts it: freed blocks that
        # still wait for another stream are not a live tensor.
        if block["state"] == "active_allocated"
    ]
    largest = heapq.nlargest(LARGEST_BLOCKS, blocks, key=lambda block: block[0])
    return [
        _described(size, stream, known.what(address, size, stream))
        for size, address, stream in largest
    ]


def _described(size: int, stream: str, what: str | None) -> dict[str, Any]:
    return {"size": size, "stream": stream} | ({} if what is None else {"what": what})


def cudagraphs_captured() -> int:
    """Graphs this worker captured (vLLM counts FULL and PIECEWISE alike): what
    per-graph residue multiplies with."""
    from vllm.compilation.counter import compilation_counter

    return compilation_counter.num_cudagraph_captured


def _guarded(
    unavailable: dict[str, str],
    name: str,
    read: Callable[[], Any],
    why_none: str = "the driver library is absent or did not answer",
) -> Any:
    """`read()`, or None with the reason in `unavailable`: a figure that cannot
    be had must not take the report down; `why_none` is the reason when `read()`
    answers None."""
    try:
        value = read()
    except Exception as error:
        unavailable[name] = f"{type(error).__name__}: {error}"
        return None
    if value is None and name not in unavailable:
        unavailable[name] = why_none
    return value


def _stack_reservation(limit: int | None, threads: int | None) -> tuple[int | None, str]:
    """(bytes, why not) of the context's stack reservation: limit x resident threads."""
    if torch.version.hip:
        return None, "not derived on ROCm: the CUDA formula is not known to hold there"
    if limit is None or threads is None:
        return None, "needs the stack limit and the resident threads"
    return limit * threads, ""


def _what_torch_holds(
    device: int,
    segments: list[dict[str, Any]],
    cublas_size: int | None,
    unavailable: dict[str, str],
) -> dict[str, Any]:
    """The ledger's fields that name memory inside torch's: vLLM's workspace and
    sampler scratch, the streams it can name, and torch's largest blocks outside
    the sleep pools."""
    get = functools.partial(_guarded, unavailable)
    fields: dict[str, Any] = {
        "current_stream": get(
            "current_stream", lambda: stream_key(torch.cuda.current_stream(device).cuda_stream)
        ),
        "vllm_aux_stream": get(
            "vllm_aux_stream",
            _vllm_aux_stream,
            why_none=f"vLLM made no aux stream in this process ({VLLM_TORCH_UTILS_MODULE}."
            "_aux_stream is None; MoE layers make it to overlap their shared experts)",
        ),
    }
    buffers = get("vllm_workspace", vllm_workspace_buffers)
    sizes = None
    if buffers is not None:
        sizes = get("vllm_workspace", lambda: vllm_workspace_bytes(buffers, segments))
    fields["vllm_workspace"], fields["vllm_workspace_outside_pools"] = sizes or (None, None)
    if sizes is None:
        unavailable["vllm_workspace_outside_pools"] = unavailable["vllm_workspace"]
    scratch = get(
        "vllm_sampler_scratch",
        lambda: sampler_scratch_storages(vllm_sampler_scratch(), torch.device("cuda", device)),
    )
    fields["vllm_sampler_scratch"] = None if scratch is None else sum(scratch.values())
    streams = {
        key: name
        for key, name in (
            (fields["current_stream"], "the current stream"),
            (fields["vllm_aux_stream"], "vLLM's aux stream"),
        )
        if key is not None
    }
    known = KnownMemory(buffers or {}, frozenset(scratch or ()), cublas_size, streams)
    fields["torch_outside_pools_largest_blocks"] = get(
        "torch_outside_pools_largest_blocks",
        lambda: torch_outside_pools_largest_blocks(segments, known),
    )
    return fields


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
        "instantiated_graphs": get("instantiated_graphs", cudagraphs_captured),
        "host_backup_copied": get("host_backup_copied", lambda: _last_backup("copied")),
        "host_backup_kept": get("host_backup_kept", lambda: _last_backup("kept")),
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
    fields.update(_what_torch_holds(device, segments, fields["cublas_workspaces"], unavailable))
    fields["attributed"], fields["unattributed"] = balance(fields)
    fields["estimated"] = estimated
    fields["unavailable"] = unavailable
    return fields
