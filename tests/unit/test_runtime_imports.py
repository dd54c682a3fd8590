"""`vllm serve` with the plugin loads none of the bench, testing or diagnostics
modules: a fresh process loads the plugin as vLLM does, applies every patch (the
API server's, the engine core's and a worker's vLLM modules, patched), loads our
sleep-mode backend and runs a worker's init_device wrapper (flag requested, the
CPU platform: the gate stays off), then counts our modules (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Modules only a bench run, a test or a probe asks for.
NOT_ON_THE_SERVING_PATH = (
    "vllm_graph_sleep.bench",
    "vllm_graph_sleep.testing",
    "vllm_graph_sleep.cli",
    "vllm_graph_sleep.doctor",
    "vllm_graph_sleep.probe",
    "vllm_graph_sleep.ledger",
    "vllm_graph_sleep.ledger_fields",
    "vllm_graph_sleep.device_query",
    "matplotlib",
)

_SERVE = """
import json, sys
from types import SimpleNamespace
from vllm.plugins import load_general_plugins

load_general_plugins()  # the entry point vllm_graph_sleep:register, as every vLLM process runs it
from vllm_graph_sleep import patches

for name in patches.PATCHES:  # what the import hook applies in the processes that import them
    patches.apply(name)
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

SleepModeBackendFactory.get_backend_class("graph_sleep")
worker = SimpleNamespace(
    vllm_config=SimpleNamespace(
        additional_config={"sleep_mode_offload_cudagraph": True},
        model_config=SimpleNamespace(enable_sleep_mode=True, enforce_eager=False),
        compilation_config=SimpleNamespace(cudagraph_mode=None),
    )
)
# vLLM's init_device needs a GPU: run our wrapper around a stand-in for it.
worker_patch = sys.modules["vllm_graph_sleep.patches.v1_worker_gpu_worker"]
init_device = worker_patch._wrap_init_device(lambda self: "started")
assert init_device(worker) == "started"
ours = [m for m in sys.modules if m.startswith(("vllm_graph_sleep", "matplotlib"))]
print("REPORT " + json.dumps(sorted(ours)))
"""


def _modules_after_serving_start() -> list[str]:
    env = {**os.environ, "VLLM_PLUGINS": "graph_sleep", "VLLM_LOGGING_LEVEL": "ERROR"}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # the dev routes' patches load the request gate too
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _SERVE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


@pytest.mark.slow
def test_serving_loads_no_bench_testing_or_diagnostics_module():
    loaded = _modules_after_serving_start()
    # The serving path itself was exercised: the patches, the backend, the worker's wiring.
    for needed in (
        "vllm_graph_sleep.backend",
        "vllm_graph_sleep.allocator",
        "vllm_graph_sleep.request_gate",
        "vllm_graph_sleep.earlier_pools",
        "vllm_graph_sleep.patches.v1_worker_gpu_worker",
        "vllm_graph_sleep.patches.entrypoints_serve_dev_sleep_api_router",
    ):
        assert needed in loaded
    unwanted = [
        module
        for module in loaded
        if any(module == name or module.startswith(name + ".") for name in NOT_ON_THE_SERVING_PATH)
    ]
    assert unwanted == []
