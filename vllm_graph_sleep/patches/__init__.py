"""Every change this plugin makes to vLLM, in one list, applied lazily.

Each entry maps a module of this package, itself named after the vLLM module it
changes (dots become underscores, the leading "vllm." is dropped), to that vLLM
module. Each patch module starts with a header (vLLM symbol, version verified,
why, remove when) and has an idempotent `apply()` that feature-detects what it
wraps and fails loudly, naming the symbol and the vLLM version, when the shape
is not what it expects. tests/unit/test_patch_registry.py keeps this list, the
headers and the files equal.

vLLM loads the plugin in every process it starts (API server, engine core, each
worker), but each process imports only part of vLLM: the API server never
imports the GPU worker, the workers never import the HTTP routes. `install()`
therefore applies a patch only when its vLLM module is imported in this process:
at once if it already is, otherwise right after that import finishes (an import
hook), before any caller gets the module. A process pays only for the patches
of the vLLM modules it uses.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

#: patch module -> the vLLM module it changes.
PATCHES = {
    "config_vllm": "vllm.config.vllm",
    "engine_arg_utils": "vllm.engine.arg_utils",
    "entrypoints_serve_utils_server_utils": "vllm.entrypoints.serve.utils.server_utils",
    "entrypoints_serve_dev_sleep_api_router": "vllm.entrypoints.serve.dev.sleep.api_router",
    "entrypoints_serve_dev_rpc_api_router": "vllm.entrypoints.serve.dev.rpc.api_router",
    "v1_engine_core": "vllm.v1.engine.core",
    "v1_executor_abstract": "vllm.v1.executor.abstract",
    "v1_engine_async_llm": "vllm.v1.engine.async_llm",
    "distributed_device_communicators_custom_all_reduce": (
        "vllm.distributed.device_communicators.custom_all_reduce"
    ),
    "distributed_device_communicators_aiter_custom_all_reduce": (
        "vllm.distributed.device_communicators.aiter_custom_all_reduce"
    ),
    "distributed_parallel_state": "vllm.distributed.parallel_state",
    "v1_worker_gpu_worker": "vllm.v1.worker.gpu_worker",
    "v1_worker_gpu_attn_utils": "vllm.v1.worker.gpu.attn_utils",
    "v1_worker_gpu_model_runner": "vllm.v1.worker.gpu_model_runner",
    "v1_worker_encoder_cudagraph": "vllm.v1.worker.encoder_cudagraph",
    "v1_spec_decode_gemma4": "vllm.v1.spec_decode.gemma4",
}

_lock = threading.Lock()


def apply(name: str) -> None:
    """Applies one patch now (importing the vLLM module it changes)."""
    importlib.import_module(f"{__name__}.{name}").apply()


class _ApplyAfterExec(importlib.abc.Loader):
    """Runs the real loader, then the patches of the module it just executed,
    which from then on no longer wait (`applied`). A patch that raises leaves
    the module waiting: Python drops the half-imported module, and the next
    import of it must not get it unpatched."""

    def __init__(
        self, loader: importlib.abc.Loader, patches: Sequence[str], applied: Callable[[], None]
    ):
        self._loader = loader
        self._patches = patches
        self._applied = applied

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for name in self._patches:
            apply(name)
        self._applied()

    def __getattr__(self, attribute: str):
        # get_source, get_code, is_package, ...: what inspect and pickle ask a loader.
        return getattr(self._loader, attribute)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the vLLM modules we patch through the other finders and wraps their
    loader; every other import passes straight through."""

    def __init__(self, waiting: dict[str, list[str]]):
        self.waiting = waiting
        self._searching = threading.local()

    def find_spec(self, fullname, path, target=None):
        # A module waits until its spec is executed, not merely found: a bare
        # importlib.util.find_spec (an availability check) followed by the
        # real import must still patch it. A search nested in ours (a
        # profiler's or a tracer's import hook searching again) passes through
        # us, so that the spec is wrapped once.
        patches = self.waiting.get(fullname)
        searching = self._searching.__dict__.setdefault("names", set())
        if patches is None or fullname in searching:
            return None
        searching.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            searching.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ApplyAfterExec(
            spec.loader, list(patches), lambda: self.waiting.pop(fullname, None)
        )
        return spec

    def _find_elsewhere(self, fullname, path, target):
        """The spec the other finders give, in sys.meta_path's order."""
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(fullname, path, target)
                if spec is not None:
                    return spec
        return None


_finder: _PatchOnImport | None = None


def install() -> None:
    """Applies the patches whose vLLM module is imported already and arranges
    for the others to be applied when (if ever) their module is imported.
    Idempotent: a second call finds nothing left to do."""
    global _finder
    with _lock:
        if _finder is None:
            _finder = _PatchOnImport({})
            sys.meta_path.insert(0, _finder)
        now = []
        for name, target in PATCHES.items():
            if target in sys.modules:
                now.append(name)
            elif name not in _finder.waiting.get(target, []):
                _finder.waiting.setdefault(target, []).append(name)
    for name in now:
        apply(name)
