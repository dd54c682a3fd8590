"""A utility call whose result cannot be encoded gets an error answer instead of
killing the engine core's output thread (vLLM 0.26 hangs every later call)."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from vllm.v1.engine import EngineCoreOutputs, UtilityOutput
from vllm.v1.engine.core import EngineCoreProc
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_graph_sleep.patches import v1_engine_core as patch
from vllm_graph_sleep.patches._wrap import original_of


@pytest.fixture(autouse=True)
def secure_serialization(monkeypatch):
    # vLLM's default: no pickle fallback, so a module or any object is refused.
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)


def invoke(invoke_utility_method, get_result) -> list[UtilityOutput]:
    """Runs one utility call the way EngineCoreProc does; returns what it queued."""
    queued: list[UtilityOutput] = []
    invoke_utility_method("collective_rpc", get_result, UtilityOutput(7), queued.append)
    return queued


def output_thread_encodes(output: UtilityOutput) -> EngineCoreOutputs:
    """What the output thread does with it, and what the client decodes."""
    buffers = MsgpackEncoder().encode(EngineCoreOutputs(utility_output=output))
    return MsgpackDecoder(EngineCoreOutputs).decode(buffers)


def test_stock_vllm_queues_a_result_its_output_thread_cannot_encode():
    stock = original_of(EngineCoreProc._invoke_utility_method)
    (output,) = invoke(stock, lambda: torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="not serializable"):
        output_thread_encodes(output)


@pytest.fixture
def guarded():
    patch.apply()
    return EngineCoreProc._invoke_utility_method


def test_unencodable_result_becomes_a_failure_message(guarded):
    (output,) = invoke(guarded, lambda: [torch.nn.Linear(2, 2)])
    decoded = output_thread_encodes(output).utility_output
    assert decoded.call_id == 7 and decoded.result is None
    message = decoded.failure_message
    assert message.startswith("Call to collective_rpc method failed")
    assert "list" in message and "Linear" in message and "cannot be sent back" in message


def test_encodable_results_pass_unchanged(guarded):
    result = [{"a": 1, "t": torch.arange(3)}, None, "text"]
    (output,) = invoke(guarded, lambda: result)
    assert output.failure_message is None and output.result.result is result
    decoded = output_thread_encodes(output).utility_output
    assert decoded.failure_message is None
    assert decoded.result.result[0]["a"] == 1 and decoded.result.result[2] == "text"


def test_a_raising_method_is_still_vllms_own_failure(guarded):
    def raises():
        raise AttributeError("'Worker' object has no attribute 'nope'")

    (output,) = invoke(guarded, raises)
    assert output.result is None
    assert "has no attribute 'nope'" in output.failure_message


def test_deferred_result_is_guarded_once(guarded):
    future: Future = Future()
    queued = invoke(guarded, lambda: future)
    assert queued == []  # waits for the future, as stock does
    future.set_result(torch.nn.ReLU())
    (output,) = queued
    assert "ReLU" in output.failure_message
    output_thread_encodes(output)


def test_apply_is_idempotent(guarded):
    patch.apply()
    assert EngineCoreProc._invoke_utility_method is guarded
    assert original_of(original_of(guarded)) is original_of(guarded)
