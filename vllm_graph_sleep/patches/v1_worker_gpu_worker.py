"""Patch: vllm.v1.worker.gpu_worker (Worker, get_mem_allocator_instance).

vLLM symbols: Worker.init_device, Worker.compile_or_warm_up_model,
Worker._maybe_get_memory_pool_context, and the module global
get_mem_allocator_instance that it calls. Verified against vLLM 0.26.0.

Why: vLLM 0.26 has no seam that puts graph memory under sleep mode. When the
gate is on in this worker, this patch
- sets NCCL_GRAPH_REGISTER before init_device starts NCCL, and marks the
  process active before the all-reduce communicators are built;
- after init_device: serves all sleep-mode memory from our allocator, selects
  our sleep-mode backend, and points the platform's global graph pool (read by
  every capture wrapper of both model runners, and passed to NCCL's
  set_graph_pool_id while capturing) at our "cudagraph" pool;
- tags what compile_or_warm_up_model captures as "cudagraph";
- turns the "kv_cache" pool that initialize_from_config opens around
  initialize_kv_cache into a "runtime" pool, backed up at every level: the
  attention metadata, block tables and graph input buffers built there must
  survive sleep (FULL graphs read them). The KV tensors get their own
  "kv_cache" pool (v1_worker_gpu_attn_utils, v1_worker_gpu_model_runner).
  Upstream did the same in PR #59158.
With the gate off every wrapper calls straight through (stock behaviour).

Remove when: the plugin moves to a vLLM with the feature (upstream PRs #59160
and #59523, released in 0.33).
"""

from __future__ import annotations

import logging

from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GRAPH_TAG, KV_CACHE_TAG, RUNTIME_TAG, GraphSleepAllocator
from vllm_graph_sleep.patches._wrap import require, wrap_function

logger = logging.getLogger("vllm.graph_sleep")
WHERE = "vllm.v1.worker.gpu_worker"


def route_graph_capture_to_pool() -> None:
    """Makes our graph pool the platform's global graph pool."""
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    require(platform_cls, "get_global_graph_pool", where="vllm.platforms.interface.Platform")
    if not hasattr(platform_cls, "_global_graph_pool"):
        raise RuntimeError(
            "vllm-graph-sleep: Platform._global_graph_pool not found; cannot route capture"
        )
    with GraphSleepAllocator.get_instance().cudagraph_pool() as pool:
        platform_cls._global_graph_pool = pool.id


def _wrap_init_device(original):
    def init_device(self, *args, **kwargs):
        gate = config.evaluate_gate(self.vllm_config)
        config.warn_if_ineffective(gate)
        if gate.active:
            config.apply_nccl_policy()
            # Before the original: it builds the all-reduce communicators, whose
            # patches must already see graph offload on.
            config.mark_active()
        result = original(self, *args, **kwargs)
        if gate.active:
            self.vllm_config.model_config.sleep_mode_backend = config.BACKEND_NAME
            route_graph_capture_to_pool()
            logger.info("graph-sleep: CUDA/HIP graphs are captured into the cudagraph pool")
        return result

    return init_device


def _wrap_compile_or_warm_up_model(original):
    def compile_or_warm_up_model(self, *args, **kwargs):
        if not config.is_active():
            return original(self, *args, **kwargs)
        with GraphSleepAllocator.get_instance().allocation_tag(GRAPH_TAG):
            return original(self, *args, **kwargs)

    return compile_or_warm_up_model


def _wrap_maybe_get_memory_pool_context(original):
    def _maybe_get_memory_pool_context(self, tag, *args, **kwargs):
        # In 0.26 only initialize_from_config asks for "kv_cache", around all of
        # initialize_kv_cache.
        if config.is_active() and tag == KV_CACHE_TAG:
            tag = RUNTIME_TAG
        return original(self, tag, *args, **kwargs)

    return _maybe_get_memory_pool_context


def _wrap_get_mem_allocator_instance(original):
    def get_mem_allocator_instance():
        if config.is_active():
            return GraphSleepAllocator.get_instance()
        return original()

    return get_mem_allocator_instance


def apply() -> None:
    from vllm.v1.worker import gpu_worker

    wrap_function(gpu_worker.Worker, "init_device", _wrap_init_device, where=WHERE)
    wrap_function(
        gpu_worker.Worker,
        "compile_or_warm_up_model",
        _wrap_compile_or_warm_up_model,
        where=WHERE,
    )
    require(gpu_worker.Worker, "_maybe_get_memory_pool_context", where=WHERE, parameters=("tag",))
    wrap_function(
        gpu_worker.Worker,
        "_maybe_get_memory_pool_context",
        _wrap_maybe_get_memory_pool_context,
        where=WHERE,
    )
    wrap_function(
        gpu_worker, "get_mem_allocator_instance", _wrap_get_mem_allocator_instance, where=WHERE
    )
