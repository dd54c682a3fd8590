"""Patch: vllm.v1.engine.core (EngineCoreProc._invoke_utility_method).

vLLM symbol: the staticmethod EngineCoreProc._invoke_utility_method(name,
get_result, output, enqueue_output), which runs a utility call (the engine
side of collective_rpc, sleep, wake_up, ...) and queues its UtilityOutput for
the output thread. Verified against vLLM 0.26.0.

Why: the result of a utility call is serialized only later, by the engine
core's output socket thread (EngineCoreProc.process_output_sockets), which has
no error handling. A result msgspec cannot encode (without
VLLM_ALLOW_INSECURE_SERIALIZATION, anything but plain data and tensors: e.g.
`POST /collective_rpc {"method": "get_model"}` returns the nn.Module) raises
TypeError there and kills the thread. The engine core process lives on and
keeps stepping, so nothing notices: that call and every later request or
utility call waits for an answer forever (seen on an H200: 3 minutes, no
answer, no exit). The fault is in vLLM's engine core, so it is guarded here and
not in the HTTP route: it covers LLM.collective_rpc and every other utility
call as well.

How: enqueue_output is wrapped so that, before a successful result is queued,
it is encoded once with vLLM's own MsgpackEncoder in the calling thread. If
that fails, the output carries a failure_message naming the method, the
result's type and the encoder's reason instead, which the client raises as
an error (HTTP: a 500 JSON answer) while the output thread stays alive. Results
that encode are queued unchanged. The cost is one extra encode per utility
result (control-plane calls, not per-token work).

Remove when: vLLM's output thread survives an unserializable utility result
(not so in 0.33).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_graph_sleep.patches._wrap import require, wrap_function
from vllm_graph_sleep.utility_results import guard_enqueue

WHERE = "vllm.v1.engine.core.EngineCoreProc"


def _wrap_invoke(original: Callable[..., Any]) -> Callable[..., Any]:
    def _invoke_utility_method(
        name: str, get_result: Callable, output: Any, enqueue_output: Callable
    ) -> None:
        return original(name, get_result, output, guard_enqueue(name, enqueue_output))

    return _invoke_utility_method


def apply() -> None:
    from vllm.v1.engine import core

    engine_core_proc = require(core, "EngineCoreProc", where="vllm.v1.engine.core")
    require(
        engine_core_proc,
        "_invoke_utility_method",
        where=WHERE,
        parameters=("name", "get_result", "output", "enqueue_output"),
    )
    wrap_function(engine_core_proc, "_invoke_utility_method", _wrap_invoke, where=WHERE)
