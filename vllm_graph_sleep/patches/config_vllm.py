"""Patch: vllm.config.vllm (VllmConfig.compute_hash).

vLLM symbol: the method VllmConfig.compute_hash(), the config part of the keys
of vLLM's torch.compile cache directory (vllm/compilation/backends.py), its AOT
compile cache and the FlashInfer autotune cache (both through
vllm/compilation/caching.py's aot_compile_hash_factors). Verified against vLLM
0.26.0.

Why: vLLM 0.26 hashes all of additional_config, where our flag lives (patch
vllm.engine.arg_utils), so turning graph offload on changed the cache key and a
server with the flag compiled afresh what a server without it had compiled
already, for code that does not depend on the flag. It hashes
ModelConfig.sleep_mode_backend too, which the worker sets to ours before the
model is compiled (patch vllm.v1.worker.gpu_worker): on an H200 the two
servers' compile caches differed in their config hash alone. The hash is taken
here as without the flag and as with vLLM's default backend where the field
names ours (config.hashed_as says why that is safe); the config itself, as the
engine core and the workers receive it, keeps both.

Remove when: the flag leaves additional_config (with patch vllm.engine.arg_utils,
vLLM 0.33+), if vLLM's own field for it and the backend field stay out of the
hash.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_graph_sleep import config
from vllm_graph_sleep.patches._wrap import wrap_function

WHERE = "vllm.config.vllm.VllmConfig"


def _wrap_compute_hash(original: Callable[[Any], str]) -> Callable[[Any], str]:
    def compute_hash(self: Any) -> str:
        return original(config.hashed_as(self))

    return compute_hash


def apply() -> None:
    from vllm.config.vllm import VllmConfig

    wrap_function(VllmConfig, "compute_hash", _wrap_compute_hash, where=WHERE)
