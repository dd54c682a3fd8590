"""The bench's floor on a real GPU: its child holds a CUDA context with a cuBLAS
handle and no stack reservation, NVML sees it, and the memory goes when it exits."""

from __future__ import annotations

from tests.utils import cuda_only, requires_gpu
from vllm_graph_sleep.bench import floor
from vllm_graph_sleep.bench.gpu import NvmlMemory, wait_released
from vllm_graph_sleep.units import MiB

pytestmark = [requires_gpu, cuda_only]


def test_the_floor_holds_a_context_without_its_stack_and_lets_it_go():
    memory = NvmlMemory(1)
    measured = floor.measure(memory, timeout=300)
    assert "error" not in measured, measured
    ((before, after),) = measured["stack_limit_before_after"]
    assert after < before, (before, after)  # the reservation went
    over = (measured["used_bytes"][0] - measured["baseline_used_bytes"][0]) / MiB
    assert 0 < over < 1024, over  # a context with cuBLAS holds something, not a server's worth
    released = wait_released(memory, measured["baseline_used_bytes"], slack=16 * MiB, timeout=30)
    assert released[0] - measured["baseline_used_bytes"][0] <= 16 * MiB
