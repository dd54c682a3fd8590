"""TP=2 with graph offload (two GPUs, one fresh process per test).

With vLLM's custom all-reduce on, capture into our pool only succeeds if no
pool memory is exported over legacy IPC (cudaIpcGetMemHandle fails on it, see
tests/basic_correctness/memory/cumem): the engine starting at all is part of
the check, and the probe confirms the custom all-reduce was really in use.
"""

from __future__ import annotations

import pytest

from tests.engine_utils import (
    CYCLES,
    greedy_tokens,
    mapped,
    reports,
    sleep_wake_cycles,
    start_engine,
)
from tests.utils import fresh_process, requires_gpu

pytestmark = [requires_gpu, pytest.mark.distributed(num_gpus=2)]


@pytest.mark.parametrize("custom_all_reduce", [True, False], ids=["custom-ar", "nccl-only"])
@fresh_process
def test_tp2_cycles_bit_exact(custom_all_reduce):
    llm = start_engine(
        "llama",
        "full_and_piecewise",
        tensor_parallel_size=2,
        disable_custom_all_reduce=not custom_all_reduce,
    )
    awake = reports(llm)
    assert len(awake) == 2
    for rank in awake:
        assert rank["graph_offload_active"] and mapped(rank)["cudagraph"] > 0
        assert rank["nccl_graph_register"] == "0"
        assert rank["custom_all_reduce"] == ("copy-in" if custom_all_reduce else "off")
    reference = greedy_tokens(llm)
    sleep_wake_cycles(llm, reference, CYCLES)
