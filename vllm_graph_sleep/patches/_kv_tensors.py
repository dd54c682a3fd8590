"""Shared by the two KV-tensor patches: allocate the KV cache itself in its own
"kv_cache" pool while the rest of KV-cache initialisation is tagged "runtime"."""

from __future__ import annotations

from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import KV_CACHE_TAG, GraphSleepAllocator


def in_kv_cache_pool(original):
    def allocate_kv_cache(*args, **kwargs):
        if not config.routes_to_pools():
            return original(*args, **kwargs)
        with GraphSleepAllocator.get_instance().use_memory_pool(tag=KV_CACHE_TAG):
            return original(*args, **kwargs)

    return allocate_kv_cache
