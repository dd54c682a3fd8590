"""vllm-graph-sleep: vLLM sleep mode that also offloads or releases CUDA/HIP graph memory.

`register` is the `vllm.general_plugins` entry point. vLLM calls it once in
every process it starts (API server, engine core, workers); it is idempotent.
It registers our sleep-mode backend and installs the patches listed in
`vllm_graph_sleep.patches`, each applied when its vLLM module is imported in
that process (so the API server does not import the GPU worker, nor a worker
the HTTP routes); each patch calls straight through to vLLM unless
`--sleep-mode-offload-cudagraph` is active in that process. One exception, on
or off: with VLLM_USE_BREAKABLE_CUDAGRAPH=1, the worker's init_device makes
the attention ops imported before it was set vLLM's break points
(breakable_order.py, docs/user-guide.md), as vLLM would had it been set first.
"""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from vllm_graph_sleep.config import BACKEND_NAME
    from vllm_graph_sleep.patches import install

    if BACKEND_NAME not in SleepModeBackendFactory._registry:
        SleepModeBackendFactory.register_backend(
            BACKEND_NAME, "vllm_graph_sleep.backend", "GraphSleepBackend"
        )
    install()
    _registered = True
