"""Patch: vllm.v1.worker.encoder_cudagraph (EncoderCudaGraphManager.capture).

vLLM symbol: EncoderCudaGraphManager.capture(graph_pool). Verified against
vLLM 0.26.0, where the V1 runner passes a fresh graph_pool_handle() for encoder
graphs (gpu_model_runner.py, capture_model), so they would stay resident.

Why: beyond upstream (0.33 leaves encoder graphs outside the pool too): with
graph offload active, encoder graphs are captured into our "cudagraph" pool.
Not while V1 profiles graph memory (config.outside_pools): those graphs are
thrown away and must not grow a pool that lives as long as the engine.

Remove when: vLLM routes encoder graph capture through the global graph pool.
"""

from __future__ import annotations

from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.patches._wrap import require, wrap_function

WHERE = "vllm.v1.worker.encoder_cudagraph.EncoderCudaGraphManager"


def _wrap_capture(original):
    def capture(self, graph_pool, *args, **kwargs):
        if not config.routes_to_pools():
            return original(self, graph_pool, *args, **kwargs)
        with GraphSleepAllocator.get_instance().cudagraph_pool() as pool:
            return original(self, pool.id, *args, **kwargs)

    return capture


def apply() -> None:
    from vllm.v1.worker import encoder_cudagraph

    manager = require(encoder_cudagraph, "EncoderCudaGraphManager", where=WHERE)
    require(manager, "capture", where=WHERE, parameters=("graph_pool",))
    wrap_function(manager, "capture", _wrap_capture, where=WHERE)
