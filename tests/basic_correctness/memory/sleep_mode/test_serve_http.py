"""The sleep endpoints of a live `vllm serve` with graph offload (GPU): an
invalid level or wake tag is a 400 that leaves the engine as it was, and the
valid calls around it still give bit-exact tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import requires_gpu
from vllm_graph_sleep.testing import PROMPTS, model_dir

pytestmark = requires_gpu


def test_invalid_level_and_tag_are_400_and_change_nothing(tmp_path: Path):
    from vllm_graph_sleep.bench.client import Client
    from vllm_graph_sleep.bench.server import (
        Server,
        ServerError,
        free_port,
        serve_command,
        server_env,
    )

    port = free_port()
    command = serve_command(
        "ours", model_dir("llama"), port, tp=1, gpu_memory_utilization=0.25, max_model_len=512
    )
    server = Server("http", command, server_env(), tmp_path / "http.server.log")
    server.start(f"http://127.0.0.1:{port}")
    try:
        server.wait_healthy(timeout=900)
        client = Client(server.base_url, "http", server.where)
        client.served_model()
        reference = client.complete(PROMPTS, 24).token_ids

        with pytest.raises(ServerError, match="answered 400"):
            client.sleep(3)
        assert not client.is_sleeping()
        assert client.complete(PROMPTS, 24).token_ids == reference

        client.sleep(1)
        with pytest.raises(ServerError, match="answered 400"):
            client.wake_up(["weights", "graphs"])
        assert client.is_sleeping()
        client.wake_up(["weights"])
        client.wake_up(["kv_cache"])
        assert not client.is_sleeping()
        assert client.complete(PROMPTS, 24).token_ids == reference
    finally:
        server.stop()
