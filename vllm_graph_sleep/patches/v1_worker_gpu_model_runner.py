"""Patch: vllm.v1.worker.gpu_model_runner (GPUModelRunner, model runner V1).

vLLM symbol: GPUModelRunner.initialize_kv_cache_tensors, which allocates the
KV tensors (uniform cross-layer layout or per layer) and reshapes them into
views. Verified against vLLM 0.26.0.

Why: as for model runner V2 (see v1_worker_gpu_attn_utils): the rest of
initialize_kv_cache (input batch, attention metadata, block tables) is tagged
"runtime" and kept across sleep; only the KV tensors go to a "kv_cache" pool.

Remove when: vLLM passes a KV allocation context itself (upstream PR #59158,
released in 0.33).
"""

from __future__ import annotations

from vllm_graph_sleep.patches._kv_tensors import in_kv_cache_pool
from vllm_graph_sleep.patches._wrap import require, wrap_function

WHERE = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"


def apply() -> None:
    from vllm.v1.worker import gpu_model_runner

    runner = require(gpu_model_runner, "GPUModelRunner", where=WHERE)
    wrap_function(runner, "initialize_kv_cache_tensors", in_kv_cache_pool, where=WHERE)
