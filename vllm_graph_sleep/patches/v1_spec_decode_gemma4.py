"""Patch: vllm.v1.spec_decode.gemma4 (Gemma4Proposer._setup_centroids_cuda_graphs).

vLLM symbol: Gemma4Proposer._setup_centroids_cuda_graphs, which the Gemma4 MTP
drafter calls from load_model to capture its centroid top-token graphs with
`torch.cuda.graph(g)` and no pool. Verified against vLLM 0.26.0.

Why: without a pool, torch gives each of those graphs a private pool of its
own, which no sleep releases. With graph offload active, the captures inside
this method default to our "cudagraph" pool: `torch.cuda.graph` is swapped, for
the duration of the call only, for a subclass whose pool defaults to ours (the
method looks it up on the torch module at each capture). Captures that name a
pool keep it. The method runs inside the "weights" pool of load_model, and
torch serves a capture from the pool routed first, so that pool is unrouted
meanwhile (allocator.graph_pool_without_routing): the graphs' memory goes to
the graph pool, the few static buffers to torch's own allocator.

Remove when: vLLM routes these captures through the global graph pool (not the
case in 0.33 either).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.patches._wrap import require, wrap_function

WHERE = "vllm.v1.spec_decode.gemma4.Gemma4Proposer"


@contextmanager
def captures_default_to(pool_id: tuple[int, int]) -> Iterator[None]:
    """`torch.cuda.graph(g)` without a pool captures into `pool_id` inside."""
    stock = torch.cuda.graph

    class graph_into_pool(stock):
        def __init__(self, cuda_graph, pool=None, *args, **kwargs):
            super().__init__(cuda_graph, pool_id if pool is None else pool, *args, **kwargs)

    torch.cuda.graph = graph_into_pool
    try:
        yield
    finally:
        torch.cuda.graph = stock


def _wrap_setup(original):
    def _setup_centroids_cuda_graphs(self, *args, **kwargs):
        if not config.routes_to_pools():
            return original(self, *args, **kwargs)
        with (
            GraphSleepAllocator.get_instance().graph_pool_without_routing() as pool,
            captures_default_to(pool.id),
        ):
            return original(self, *args, **kwargs)

    return _setup_centroids_cuda_graphs


def apply() -> None:
    from vllm.v1.spec_decode import gemma4

    proposer = require(gemma4, "Gemma4Proposer", where=WHERE)
    wrap_function(proposer, "_setup_centroids_cuda_graphs", _wrap_setup, where=WHERE)
