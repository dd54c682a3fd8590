"""The private pools that earlier engines of this process left behind.

vLLM 0.26 keeps some graphs of a shut-down engine referenced, so an engine that
starts in a process where another ran (vLLM's test suites make several) finds
their pools still holding memory. The worker patch notes them as each worker
starts (cheap, and before CUDA only where CUDA is already up); the worker probe
(vllm_graph_sleep.probe) leaves them out when it counts graph memory that
escaped our pool. Pool ids are never reused, so none of these can hold a graph
of the current engine.
"""

from __future__ import annotations

import torch

#: Pool id of torch's ordinary (non-private) caching allocator segments.
ORDINARY_POOL = (0, 0)
_pools_of_earlier_engines: frozenset[tuple[int, int]] = frozenset()


def remember_pools_of_earlier_engines() -> None:
    """Called as a worker starts. A process whose CUDA is not up yet (a fresh
    worker process) has no earlier engine, and must not start CUDA here."""
    global _pools_of_earlier_engines
    if not torch.cuda.is_initialized():
        _pools_of_earlier_engines = frozenset()
        return
    _pools_of_earlier_engines = frozenset(
        tuple(segment["segment_pool_id"])
        for segment in torch.cuda.memory_snapshot(include_traces=False)
        if tuple(segment["segment_pool_id"]) != ORDINARY_POOL
    )


def pools_of_earlier_engines() -> frozenset[tuple[int, int]]:
    """The private pools that held memory when this process's current engine
    started its worker."""
    return _pools_of_earlier_engines
