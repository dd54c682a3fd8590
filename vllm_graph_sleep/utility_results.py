"""Utility-call results that the engine core's output thread could not encode,
answered as errors instead.

vLLM 0.26's output socket thread serializes a utility call's result without
error handling: an unencodable one kills the thread and every later call waits
forever. The patch of vllm.v1.engine.core (its header has the details) passes
each call's enqueue_output through `guard_enqueue`, which encodes a successful
result once with vLLM's own MsgpackEncoder in the calling thread and, if that
fails, queues a failure message in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_GUARDED = "__vllm_graph_sleep_encodable__"


def unencodable_reason(output: Any) -> str | None:
    """Why the output thread could not encode this UtilityOutput's result, or None."""
    from vllm.v1.serial_utils import MsgpackEncoder

    if output.failure_message is not None or output.result is None:
        return None
    try:
        MsgpackEncoder().encode(output.result)
    except Exception as error:  # whatever the output thread would die of
        return f"{type(error).__name__}: {error}"
    return None


def guard_enqueue(name: str, enqueue_output: Callable[[Any], None]) -> Callable[[Any], None]:
    """`enqueue_output` of the utility call `name`, turning a result the output
    thread could not encode into a failure message naming the method, the
    result's type and the encoder's reason."""
    if getattr(enqueue_output, _GUARDED, False):  # a deferred (Future) result re-enters
        return enqueue_output

    def enqueue(output: Any) -> None:
        reason = unencodable_reason(output)
        if reason is not None:
            kind = type(output.result.result).__name__
            output.result = None
            output.failure_message = (
                f"Call to {name} method failed: its result (a {kind}) cannot be sent "
                f"back from the engine ({reason})"
            )
        enqueue_output(output)

    setattr(enqueue, _GUARDED, True)
    return enqueue
