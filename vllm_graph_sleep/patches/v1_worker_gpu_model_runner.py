"""Patch: vllm.v1.worker.gpu_model_runner (GPUModelRunner, model runner V1).

vLLM symbols: GPUModelRunner.initialize_kv_cache_tensors, which allocates the
KV tensors (uniform cross-layer layout or per layer) and reshapes them into
views; GPUModelRunner.profile_cudagraph_memory, which captures throwaway graphs
on a minimal KV cache to measure graph memory. Verified against vLLM 0.26.0.

Why: as for model runner V2 (see v1_worker_gpu_attn_utils): the rest of
initialize_kv_cache (input batch, attention metadata, block tables) is tagged
"runtime" and kept across sleep; only the KV tensors go to a "kv_cache" pool.
Profiling runs outside our pools (config.outside_pools), as in stock vLLM: its
minimal KV cache and encoder graphs are freed before vLLM takes its memory
sample, and in a pool of ours they would stay mapped (upstream 0.33 excludes
profiling captures the same way, capture_outside_cumem_pool).

Remove when: vLLM passes a KV allocation context itself (upstream PR #59158,
released in 0.33).
"""

from __future__ import annotations

from vllm_graph_sleep import config
from vllm_graph_sleep.patches._kv_tensors import in_kv_cache_pool
from vllm_graph_sleep.patches._wrap import require, wrap_function

WHERE = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"


def _outside_pools(original):
    def profile_cudagraph_memory(*args, **kwargs):
        with config.outside_pools():
            return original(*args, **kwargs)

    return profile_cudagraph_memory


def apply() -> None:
    from vllm.v1.worker import gpu_model_runner

    runner = require(gpu_model_runner, "GPUModelRunner", where=WHERE)
    wrap_function(runner, "initialize_kv_cache_tensors", in_kv_cache_pool, where=WHERE)
    wrap_function(runner, "profile_cudagraph_memory", _outside_pools, where=WHERE)
