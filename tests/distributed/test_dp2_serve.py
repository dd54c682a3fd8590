"""DP=2 (two engines, one GPU each) behind one `vllm serve`, driven over HTTP
with the bench's own server and client.

Both engines hold the same weights, so greedy tokens must be identical whichever
engine serves a prompt, before the first sleep and after every wake. vLLM's
API server returns a collective RPC's result from the first engine only
(DPLBAsyncMPClient.call_utility_async), so the probe reads engine 0; NVML shows
that both GPUs give their memory back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import cuda_only, requires_gpu
from vllm_graph_sleep.testing import PROMPTS, cycles, model_dir

# cuda_only: it measures both GPUs through NVML (bench.gpu.NvmlMemory).
pytestmark = [requires_gpu, cuda_only, pytest.mark.distributed(num_gpus=2)]

MAX_TOKENS = 24


def test_dp2_cycles_bit_exact_and_both_gpus_release(tmp_path: Path):
    from vllm_graph_sleep.bench.client import Client
    from vllm_graph_sleep.bench.gpu import NvmlMemory, settle
    from vllm_graph_sleep.bench.server import Server, free_port, serve_command, server_env

    port = free_port()
    command = serve_command(
        "ours",
        model_dir("llama"),
        port,
        tp=1,
        gpu_memory_utilization=0.25,
        max_model_len=512,
        extra=("--data-parallel-size", "2"),
    )
    server = Server("dp2", command, server_env(), tmp_path / "dp2.server.log")
    memory = NvmlMemory(2)
    server.start(f"http://127.0.0.1:{port}")
    try:
        server.wait_healthy(timeout=900)
        client = Client(server.base_url, "dp2", server.where)
        client.served_model()
        probe = client.memory_report()[0]
        assert probe["graph_offload_active"] and probe["tags"]["cudagraph"]["mapped"] > 0
        assert probe["nccl_graph_register"] == "0"
        reference = client.complete(PROMPTS, MAX_TOKENS).token_ids
        awake = settle(memory)
        for cycle in range(cycles()):
            level = 1 if cycle % 3 < 2 else 2
            client.sleep(level)
            assert client.is_sleeping()
            asleep = settle(memory)
            for gpu, (before, now) in enumerate(zip(awake, asleep, strict=True)):
                assert before - now > 1 << 30, f"cycle {cycle}: GPU {gpu} kept its memory"
            if level == 1 and cycle % 3 == 0:
                client.wake_up()
            else:
                client.wake_up(["weights"])
                if level == 2:
                    client.reload_weights()
                client.wake_up(["kv_cache"])
            assert not client.is_sleeping()
            tokens = client.complete(PROMPTS, MAX_TOKENS).token_ids
            assert tokens == reference, f"cycle {cycle} (level {level}) changed the tokens"
    finally:
        server.stop()
