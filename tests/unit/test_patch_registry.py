"""The patch list and the patch files agree, and every patch follows the rules."""

import importlib
import inspect
from pathlib import Path

import pytest

from vllm_graph_sleep import patches

PATCH_DIR = Path(patches.__file__).parent
HEADER_FIELDS = ("Patch: vllm.", "Verified against vLLM 0.26.0", "Why:", "Remove when:")


def test_every_patch_file_is_listed_and_every_listed_patch_exists():
    files = {p.stem for p in PATCH_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert files == set(patches.PATCH_MODULES)


@pytest.mark.parametrize("name", patches.PATCH_MODULES)
def test_patch_module_has_header_and_apply(name):
    module = importlib.import_module(f"vllm_graph_sleep.patches.{name}")
    doc = " ".join((module.__doc__ or "").split())
    for field in HEADER_FIELDS:
        assert field in doc, f"{name}: header lacks {field!r}"
    # Named after the vLLM module it changes.
    patched = doc.split("Patch: ", 1)[1].split(" ", 1)[0]
    assert patched.removeprefix("vllm.").replace(".", "_") == name
    assert importlib.util.find_spec(patched) is not None, f"{patched} is not a vLLM module"
    assert callable(module.apply) and not inspect.signature(module.apply).parameters


def test_apply_all_is_idempotent():
    from vllm.v1.worker import gpu_worker

    patches.apply_all()
    first = (gpu_worker.Worker.init_device, gpu_worker.get_mem_allocator_instance)
    patches.apply_all()
    assert (gpu_worker.Worker.init_device, gpu_worker.get_mem_allocator_instance) == first


def test_kv_init_split_is_wired_into_both_model_runners():
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    from vllm.v1.worker.gpu import attn_utils

    from vllm_graph_sleep.patches._wrap import is_wrapped

    patches.apply_all()
    assert is_wrapped(gpu_worker.Worker._maybe_get_memory_pool_context)
    assert is_wrapped(attn_utils._allocate_kv_cache)  # V2, looked up as a module global
    assert is_wrapped(gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors)  # V1
