"""Worker-side reports, run through vLLM's collective_rpc (tests, bench).

Each function takes the worker as its only argument, as collective_rpc passes
it, and returns plain data.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vllm_graph_sleep import config
from vllm_graph_sleep.all_reduce_counts import captured_all_reduces
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.earlier_pools import ORDINARY_POOL, pools_of_earlier_engines
from vllm_graph_sleep.ledger import cudagraphs_captured, ledger, sleep_allocator_addresses


def pinned_host() -> dict[str, float] | None:
    """Page-locked host memory in this process: what torch's pinned allocator
    holds (each block rounded up to a power of two, as it asks the driver for
    them; stock vLLM's backups and vLLM's own staging) plus our registered host
    buffers (`registered_bytes`, not in torch's statistics), and the seconds
    spent pinning both so far. None where torch does not keep statistics."""
    from vllm_graph_sleep._native import registered_host_memory

    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    if "allocated_bytes.current" not in stats:  # nothing before CUDA is initialized
        return None
    registered_bytes, registering_s = registered_host_memory()
    return {
        "bytes": stats["allocated_bytes.current"] + registered_bytes,
        "pinning_s": stats.get("host_alloc_time.total", 0) / 1e6 + registering_s,
        "registered_bytes": registered_bytes,
    }


def memory_report(worker: Any) -> dict[str, Any]:
    """What this worker holds: per-tag bytes of whichever sleep-mode allocator
    serves it, torch's own reserved memory, the driver's view, and the ledger
    of what its GPU holds and why (vllm_graph_sleep.ledger)."""
    free, total = torch.cuda.mem_get_info()
    segments = torch.cuda.memory_snapshot(include_traces=False)
    report: dict[str, Any] = {
        "graph_offload_active": config.is_active(),
        "pid": os.getpid(),
        "driver_free_bytes": free,
        "driver_total_bytes": total,
        "torch_reserved_bytes": torch.cuda.memory_reserved(),
        "nccl_graph_register": os.environ.get(config.NCCL_GRAPH_REGISTER),
        "custom_all_reduce": custom_all_reduce_mode(),
        "custom_all_reduce_captures": custom_all_reduce_captures(),
        "cudagraphs_captured": cudagraphs_captured(),
        "foreign_pool_bytes": foreign_pool_bytes(
            segments, sleep_allocator_addresses(), pools_of_earlier_engines()
        ),
        "earlier_engines_pool_bytes": pool_bytes(segments, pools_of_earlier_engines()),
        "ledger": ledger(torch.cuda.current_device(), segments),
        "pinned_host": pinned_host(),
    }
    # The allocator that serves this engine: an earlier engine of this process
    # may have left ours behind with the flag off now.
    allocator = GraphSleepAllocator.current()
    if config.is_active() and allocator is not None:
        report["allocator"] = "vllm_graph_sleep"
        report["tags"] = allocator.usage_by_tag()
        report["host_bytes"] = allocator.host_bytes()
    else:
        from vllm.device_allocator.cumem import CuMemAllocator

        tags: dict[str, dict[str, int]] = {}
        if CuMemAllocator.instance is not None:
            for data in CuMemAllocator.instance.pointer_to_data.values():
                entry = tags.setdefault(data.tag, {"mapped": 0, "asleep": 0})
                entry["asleep" if data.is_asleep else "mapped"] += data.handle[1]
        report["allocator"] = "vllm"
        report["tags"] = tags
    return report


def our_pool_ids() -> set[tuple[int, int]]:
    allocator = GraphSleepAllocator.current()
    return set() if allocator is None else allocator.pool_ids()


def pool_bytes(segments: list[dict[str, Any]], pools: frozenset[tuple[int, int]]) -> int:
    return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) in pools)


def foreign_pool_bytes(
    segments: list[dict[str, Any]],
    sleep_addresses: set[int],
    earlier_pools: frozenset[tuple[int, int]] = frozenset(),
) -> int:
    """Bytes of private-pool segments (`segments` as torch.cuda.memory_snapshot()
    lists them) that no sleep-mode allocator made, so no sleep releases them:
    graph pools. With graph offload, a capture site of this engine that escaped
    our graph pool shows up here; in stock vLLM, all its graphs. Pools of
    earlier engines of this process (`earlier_pools`) are left out."""
    not_graphs = earlier_pools | {ORDINARY_POOL}
    return sum(
        segment["total_size"]
        for segment in segments
        if tuple(segment["segment_pool_id"]) not in not_graphs
        and segment["address"] not in sleep_addresses
    )


def _tp_custom_all_reduce() -> Any | None:
    """vLLM's custom all-reduce of this worker's TP group, if it has one."""
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized():
        return None
    return getattr(get_tp_group().device_communicator, "ca_comm", None)


def custom_all_reduce_mode() -> str:
    """How vLLM's custom all-reduce of this worker's TP group treats graph
    inputs: "off" (absent or disabled), "copy-in" (graph offload on: inputs are
    copied into its own registered buffer) or "registered" (stock)."""
    custom = _tp_custom_all_reduce()
    if custom is None or custom.disabled:
        return "off"
    return "copy-in" if config.is_active() else "registered"


def custom_all_reduce_captures() -> dict[str, int] | None:
    """How many captured all-reduces of vLLM's custom all-reduce took the copy-in
    path and how many read a registered (IPC-exported) input; None without one.
    Counted only while graph offload is active."""
    custom = _tp_custom_all_reduce()
    return None if custom is None else captured_all_reduces(custom)


class ProbeWorkerExtension:
    """`--worker-extension-cls vllm_graph_sleep.probe.ProbeWorkerExtension` makes
    the report callable by name, e.g. over HTTP: `POST /collective_rpc` with
    `{"method": "graph_sleep_memory_report"}` (dev mode) returns one report per
    worker. vLLM mixes this class into the worker class and asserts that its
    attribute names are new there, hence the prefixed name."""

    def graph_sleep_memory_report(self) -> dict[str, Any]:
        return memory_report(self)
