"""The bench warms vLLM's model-info cache while it makes the model
(vllm_graph_sleep/bench/model_info.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


# vLLM's inspection as a server asks for it: in a further child of this one.
_VLLMS_OWN_CHILD = (
    "import sys\n"
    "from vllm.model_executor.models.registry import ModelRegistry\n"
    "sys.exit(0 if ModelRegistry._try_inspect_model_cls(sys.argv[1]) is not None else 4)\n"
)


@pytest.mark.slow
def test_vllms_registry_writes_the_cache_the_servers_read(tmp_path):
    """The real child against the installed vLLM: the cache file vLLM's registry
    reads at a server's start appears, the same file that vLLM's registry writes
    when it inspects in a child of its own, as a server does, GPUs visible (about
    40 s on CPU: marked slow)."""

    def cached(root):
        files = list((root / "modelinfos").glob("*LlamaForCausalLM*.json"))
        assert files, sorted(p.name for p in root.rglob("*"))
        return files[0].name, json.loads(files[0].read_text())

    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "ours")}
    assert model_info.finish(model_info.start("LlamaForCausalLM", env)) == "done"
    ours = cached(tmp_path / "ours")
    assert ours[1]["modelinfo"]
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm")}
    command = [sys.executable, "-c", _VLLMS_OWN_CHILD, "LlamaForCausalLM"]
    subprocess.run(command, env=env, check=True, capture_output=True, timeout=300)
    assert cached(tmp_path / "vllm") == ours
