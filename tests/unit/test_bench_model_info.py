"""The bench warms vLLM's model-info cache while it makes the model
(vllm_graph_sleep/bench/model_info.py)."""

from __future__ import annotations

import json
import os

import pytest

from vllm_graph_sleep.bench import model_info


def test_the_architecture_comes_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert model_info.architecture_of(tmp_path) == "LlamaForCausalLM"
    (tmp_path / "config.json").write_text("{}")
    assert model_info.architecture_of(tmp_path) is None
    assert model_info.architecture_of(tmp_path / "missing") is None


def test_finish_says_how_the_warm_up_ended(monkeypatch):
    assert model_info.finish(None) == "no architecture to warm"
    for code, says in ((0, "done"), (3, "no ModelRegistry._try_inspect_model_cls"), (7, "exit 7")):
        monkeypatch.setattr(model_info, "_INSPECT", f"import sys; sys.exit({code})")
        assert says in model_info.finish(model_info.start("X", dict(os.environ)))
    monkeypatch.setattr(model_info, "_INSPECT", "import time; time.sleep(30)")
    child = model_info.start("X", dict(os.environ))
    assert "not done after 0 s (stopped" in model_info.finish(child, wait_s=0.2)
    assert child.returncode is not None  # killed, not left running


@pytest.mark.slow
def test_vllms_registry_writes_the_cache_the_servers_read(tmp_path):
    """The real child against the installed vLLM: the cache file vLLM's registry
    reads at a server's start appears (about 30 s on CPU: marked slow)."""
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)}
    assert model_info.finish(model_info.start("LlamaForCausalLM", env)) == "done"
    cached = list((tmp_path / "modelinfos").glob("*LlamaForCausalLM*.json"))
    assert cached, sorted(p.name for p in tmp_path.rglob("*"))
    assert json.loads(cached[0].read_text())["modelinfo"]
