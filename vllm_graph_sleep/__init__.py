"""vllm-graph-sleep: vLLM sleep mode that also offloads or releases CUDA/HIP graph memory.

`register` is the `vllm.general_plugins` entry point. vLLM calls it once in
every process it starts (API server, engine core, workers); it must stay cheap
and idempotent.
"""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
