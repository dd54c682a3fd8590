"""Every change this plugin makes to vLLM, in one list.

Each entry names a module of this package, itself named after the vLLM module
it changes (dots become underscores, the leading "vllm." is dropped). Each
module starts with a header (vLLM symbol, version verified, why, remove when)
and has an idempotent `apply()` that feature-detects what it wraps and fails
loudly, naming the symbol and the vLLM version, when the shape is not what it
expects. tests/unit/test_patch_registry.py keeps this list and the files equal.
"""

from __future__ import annotations

import importlib

PATCH_MODULES = (
    "engine_arg_utils",
    "entrypoints_serve_utils_server_utils",
    "entrypoints_serve_dev_sleep_api_router",
    "entrypoints_serve_dev_rpc_api_router",
    "v1_engine_core",
    "distributed_device_communicators_custom_all_reduce",
    "distributed_device_communicators_aiter_custom_all_reduce",
    "v1_worker_gpu_worker",
    "v1_worker_gpu_attn_utils",
    "v1_worker_gpu_model_runner",
    "v1_worker_encoder_cudagraph",
    "v1_spec_decode_gemma4",
)


def apply_all() -> None:
    for name in PATCH_MODULES:
        importlib.import_module(f"{__name__}.{name}").apply()
