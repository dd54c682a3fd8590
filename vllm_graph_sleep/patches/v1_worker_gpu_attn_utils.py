"""Patch: vllm.v1.worker.gpu.attn_utils (_allocate_kv_cache, model runner V2).

vLLM symbol: the module function _allocate_kv_cache, which init_kv_cache looks
up as a module global. Verified against vLLM 0.26.0.

Why: 0.26 runs all of initialize_kv_cache in the "kv_cache" pool, so attention
metadata buffers, block tables and graph input buffers are dropped by every
sleep and come back as garbage; FULL graphs read some of them. With graph
offload active the worker patch tags that state "runtime" (backed up at every
level) and this patch puts only the KV tensors in a "kv_cache" pool.

Remove when: vLLM passes a KV allocation context itself (upstream PR #59158,
released in 0.33).
"""

from __future__ import annotations

from vllm_graph_sleep.patches._kv_tensors import in_kv_cache_pool
from vllm_graph_sleep.patches._wrap import wrap_function

WHERE = "vllm.v1.worker.gpu.attn_utils"


def apply() -> None:
    from vllm.v1.worker.gpu import attn_utils

    wrap_function(attn_utils, "_allocate_kv_cache", in_kv_cache_pool, where=WHERE)
