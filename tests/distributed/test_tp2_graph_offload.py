"""TP=2 with graph offload (two GPUs, one fresh process per test).

With vLLM's custom all-reduce on, capture into our pool only succeeds if no
pool memory is exported over legacy IPC (cudaIpcGetMemHandle fails on it, see
tests/basic_correctness/memory/cumem): the engine starting at all is part of
the check, and the probe confirms the custom all-reduce was really in use.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.utils import fresh_process, requires_gpu
from vllm_graph_sleep.testing import (
    cycles,
    greedy_tokens,
    mapped,
    reports,
    set_engine_env,
    sleep_wake_cycles,
    start_engine,
)

pytestmark = [requires_gpu, pytest.mark.distributed(num_gpus=2)]


ray_installed = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed"
)


@pytest.mark.parametrize(
    "custom_all_reduce,executor",
    [(True, "mp"), (False, "mp"), pytest.param(True, "ray", marks=ray_installed)],
    ids=["custom-ar", "nccl-only", "ray"],
)
@fresh_process
def test_tp2_cycles_bit_exact(custom_all_reduce, executor):
    if executor == "ray":
        import ray

        # The plugin must load in Ray's own worker processes (vLLM's general
        # plugins); the probe below reads its state there. Workers inherit the
        # environment Ray starts with, so it is set first.
        set_engine_env()
        ray.init(num_gpus=2, object_store_memory=1 << 30, include_dashboard=False)
    llm = start_engine(
        "llama",
        "full_and_piecewise",
        tensor_parallel_size=2,
        disable_custom_all_reduce=not custom_all_reduce,
        distributed_executor_backend=executor,
        # Keeps every all-reduce in vLLM's custom all-reduce (or NCCL): the
        # AR + RMSNorm fusion would hand them to FlashInfer's kernels instead.
        pass_config={"fuse_allreduce_rms": False},
    )
    awake = reports(llm)
    assert len(awake) == 2
    assert len({rank["pid"] for rank in awake}) == 2
    for rank in awake:
        assert rank["graph_offload_active"] and mapped(rank)["cudagraph"] > 0
        assert rank["foreign_pool_bytes"] == 0, rank["foreign_pool_bytes"]
        assert rank["nccl_graph_register"] == "0"
        assert rank["custom_all_reduce"] == ("copy-in" if custom_all_reduce else "off")
        if custom_all_reduce:
            # Graphs did capture custom all-reduces, and none read a graph-pool
            # input in place (that would need the input IPC-registered).
            captures = rank["custom_all_reduce_captures"]
            assert captures["copy_in"] > 0 and captures["registered"] == 0, captures
    reference = greedy_tokens(llm)
    sleep_wake_cycles(llm, reference, cycles())
