"""vllm-graph-sleep: vLLM sleep mode that also offloads or releases CUDA/HIP graph memory.

`register` is the `vllm.general_plugins` entry point. vLLM calls it once in
every process it starts (API server, engine core, workers); it is idempotent.
It registers our sleep-mode backend and applies the patches listed in
`vllm_graph_sleep.patches`; each patch calls straight through to vLLM unless
`--sleep-mode-offload-cudagraph` is active in that process.
"""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from vllm_graph_sleep.config import BACKEND_NAME
    from vllm_graph_sleep.patches import apply_all

    if BACKEND_NAME not in SleepModeBackendFactory._registry:
        SleepModeBackendFactory.register_backend(
            BACKEND_NAME, "vllm_graph_sleep.backend", "GraphSleepBackend"
        )
    apply_all()
    _registered = True
