"""What a starting `vllm serve` is doing, read from its log: the bench names it in
the progress line it prints while it waits for /health, so that a minute-long
wait says where the minute goes.

Each phase starts at a line vLLM 0.26 logs (its source file in the comment);
the phase of a log is that of the last such line in it. A line that a later
vLLM words differently only makes the phase before it last longer.
"""

from __future__ import annotations

from pathlib import Path

#: Before vLLM logs anything: the API server's Python imports.
IMPORTING = "importing Python modules"

#: (text of a vLLM 0.26 log line, what the server does from that line on).
PHASES: tuple[tuple[str, str], ...] = (
    # entrypoints/serve/utils/api_utils.py; next the model registry inspects the
    # model class in a child process (model_executor/models/registry.py) unless
    # it cached what it found there before.
    ("non-default args:", "inspecting the model"),
    ("Resolved architecture:", "starting the engine core"),  # config/model.py
    ("Initializing a V1 LLM engine", "initializing the engine"),  # v1/engine/core.py
    ("Loading model from scratch", "loading the weights"),  # v1/worker/gpu/model_runner.py
    ("Starting to load model", "loading the weights"),  # v1/worker/gpu_model_runner.py
    # This one and "Graph capturing finished": both model runners.
    ("Model loading took", "first forward pass (torch.compile unless eager)"),
    ("torch.compile took", "profiling memory"),  # compilation/monitor.py
    # v1/worker/gpu_worker.py, then the model runners.
    ("Available KV cache memory", "allocating the KV cache, capturing CUDA graphs"),
    ("Graph capturing finished", "warming up kernels (Triton JIT)"),
    # v1/engine/core.py: the engine is ready; the API server builds its routes.
    ("init engine (profile, create kv cache, warmup model) took", "starting the HTTP server"),
    ("Application startup complete", "answering /health"),  # uvicorn
)


def phase_of(text: str) -> str:
    """The phase of a server log's text (IMPORTING before any known line)."""
    found = [(text.rfind(marker), phase) for marker, phase in PHASES]
    position, phase = max(found, key=lambda item: item[0])
    return phase if position >= 0 else IMPORTING


def phase_of_log(path: Path) -> str:
    """The phase of the log at `path`; IMPORTING while it cannot be read."""
    try:
        return phase_of(path.read_text(errors="replace"))
    except OSError:
        return IMPORTING
