"""Worker-side reports, run through vLLM's collective_rpc (tests, bench).

Each function takes the worker as its only argument, as collective_rpc passes
it, and returns plain data.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GraphSleepAllocator


def memory_report(worker: Any) -> dict[str, Any]:
    """What this worker holds: per-tag bytes of whichever sleep-mode allocator
    serves it, torch's own reserved memory, and the driver's view."""
    free, total = torch.cuda.mem_get_info()
    report: dict[str, Any] = {
        "graph_offload_active": config.is_active(),
        "driver_free_bytes": free,
        "driver_total_bytes": total,
        "torch_reserved_bytes": torch.cuda.memory_reserved(),
        "nccl_graph_register": __import__("os").environ.get(config.NCCL_GRAPH_REGISTER),
    }
    if GraphSleepAllocator._instance is not None:
        allocator = GraphSleepAllocator._instance
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
