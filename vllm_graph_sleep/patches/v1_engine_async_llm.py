"""Patch: vllm.v1.engine.async_llm (AsyncLLM._add_request, AsyncLLM.shutdown).

vLLM symbols: the method AsyncLLM._add_request(request, prompt, parent_req,
index, queue), through which the API server process hands every request to the
engine core: AsyncLLM.generate and encode (so every OpenAI, Anthropic, pooling
and token-in route) reach it via add_request, once per request (once per child
for n > 1); and AsyncLLM.shutdown(timeout), which stops the engine core.
Verified against vLLM 0.26.0.

Why: AsleepGate (vllm_graph_sleep.request_gate) holds
inference requests while the engine sleeps. Holding them before vLLM reads
them made a malformed request (not JSON, not UTF-8, a prompt longer than
max_model_len, an unknown model, ...) wait out the bound and get 503, where an
awake server answers 400 or 404 at once. By the time _add_request runs, vLLM
has parsed and validated the body, rendered and tokenized the prompt, checked
its length and the sampling parameters (route handler, renderer and
InputProcessor.process_inputs, all in the API server), so every request it
rejects has been rejected with its own 4xx, and nothing has reached the engine
core yet. The wrapper waits here, before the original runs, while the request
carries a hold (REQUEST_HOLD, set by AsleepGate for the tasks that serve one
HTTP request); without one it only reads that context variable.

The shutdown wrapper restores an engine that a deep sleep left checkpointed
(deep_sleep.restore_before_shutdown) before vLLM stops it: on SIGINT or
SIGTERM vLLM's launcher stops the engine client first, and the engine core's
CUDA calls would wait on the driver's lock.

Applied only with VLLM_SERVER_DEV_MODE=1, the only mode that has AsleepGate
and deep sleep's HTTP endpoints.

Remove when: AsleepGate goes (vLLM bounds the wait of a request sent to a
sleeping engine; 0.33 does not), and, for the shutdown, when deep sleep goes
or vLLM restores a checkpointed engine itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_graph_sleep.deep_sleep import restore_before_shutdown
from vllm_graph_sleep.patches._wrap import require, wrap_function
from vllm_graph_sleep.request_gate import REQUEST_HOLD

WHERE = "vllm.v1.engine.async_llm.AsyncLLM"


def _wrap_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    async def _add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        hold = REQUEST_HOLD.get()
        if hold is not None:
            await hold.until_awake(self)
        return await original(self, *args, **kwargs)

    return _add_request


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        restore_before_shutdown(self)
        return original(self, *args, **kwargs)

    return shutdown


def apply() -> None:
    from vllm import envs

    if not envs.VLLM_SERVER_DEV_MODE:
        return
    from vllm.v1.engine.async_llm import AsyncLLM

    require(AsyncLLM, "_add_request", where=WHERE, parameters=("request", "queue"))
    wrap_function(AsyncLLM, "_add_request", _wrap_add_request, where=WHERE)
    require(AsyncLLM, "shutdown", where=WHERE, parameters=("timeout",))
    wrap_function(AsyncLLM, "shutdown", _wrap_shutdown, where=WHERE)
