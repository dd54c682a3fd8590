"""Warming vLLM's model-info cache while the bench makes its model.

A host's first `vllm serve` of an architecture spends about 20 s inspecting the
model class in a child process (vllm/model_executor/models/registry.py) before
its engine starts, then caches what it found under VLLM_CACHE_ROOT/modelinfos;
every later start reads the cache. Without a warm-up, whichever configuration
the bench starts first pays it alone, which made ours' first start look 1.57x
stock's on a fresh H200 (docs/results/bench-default.md). The bench asks the
registry for the same inspection in a child process of its own while it
measures the floor and makes the model, and waits for it before the first server starts, so every
configuration starts with the cache warm.

vLLM's registry inspects in a further child of the process that asks
(registry._run_in_subprocess), so that the asking process never initialises
CUDA. The bench's child is such a process already, one that cannot reach a GPU
at all (gpu.NO_GPU) and exits before the first server starts, so it inspects in
itself, as vLLM's child does, after loading the general plugins: one
interpreter's imports instead of two, which halves the warm-up (11-12 s instead
of 25-26 s on a 2-core machine), and the cache file is the one vLLM's own child
writes (test_bench_model_info.py compares them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_graph_sleep.bench.gpu import NO_GPU

#: Seconds a warm-up may take before the bench goes on without it (the server
#: then inspects the model itself, as without a warm-up).
WAIT_S = 90.0
#: What finish says of a vLLM without the registry functions the child uses.
NOT_THIS_VLLM = "this vLLM has no ModelRegistry._try_inspect_model_cls or _run_in_subprocess"

# Run in the child: vLLM's own inspection of one architecture, which writes the
# cache the servers read (ModelRegistry._try_inspect_model_cls, vLLM 0.26.0),
# with vLLM's further child replaced by a call in this one (see above).
_INSPECT = (
    "import sys\n"
    "from vllm.model_executor.models import registry\n"
    "from vllm.plugins import load_general_plugins\n"
    "inspect = getattr(registry.ModelRegistry, '_try_inspect_model_cls', None)\n"
    "if inspect is None or not hasattr(registry, '_run_in_subprocess'):\n"
    "    sys.exit(3)\n"
    "load_general_plugins()\n"
    "registry._run_in_subprocess = lambda fn: fn()\n"
    "sys.exit(0 if inspect(sys.argv[1]) is not None else 4)\n"
)


def architecture_of(model_dir: str | Path) -> str | None:
    """The first architecture a model directory's config.json names, if any."""
    try:
        names = json.loads((Path(model_dir) / "config.json").read_text())["architectures"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return names[0] if isinstance(names, list) and names else None


def start(architecture: str | None, env: dict[str, str]) -> subprocess.Popen | None:
    """Starts the inspection of `architecture` in a child process (None: nothing
    to warm)."""
    if architecture is None:
        return None
    return subprocess.Popen(
        [sys.executable, "-c", _INSPECT, architecture],
        # What it finds are the model class's interfaces, no GPU's: it runs
        # while the floor is measured, where nothing of the bench's may hold one.
        env={**env, **NO_GPU},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop(child: subprocess.Popen | None) -> None:
    """Stops the warm-up, if it still runs (a run that stops early, or one
    that outlived its wait)."""
    if child is None:
        return
    if child.poll() is None:
        child.kill()
    child.wait()


def finish(child: subprocess.Popen | None, wait_s: float = WAIT_S) -> str:
    """Waits for the warm-up; says how it ended, for the progress line."""
    if child is None:
        return "no architecture to warm"
    try:
        code = child.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        stop(child)
        return f"not done after {wait_s:.0f} s (stopped; the first server inspects the model)"
    if code == 0:
        return "done"
    why = {3: NOT_THIS_VLLM}.get(code, f"exit {code}")
    return f"failed ({why}; the first server inspects the model)"
