"""Helpers shared by the GPU tests."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_CHILD_ENV = "VLLM_GRAPH_SLEEP_TEST_CHILD"

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (none visible)"
)
cuda_only = pytest.mark.skipif(torch.version.hip is not None, reason="CUDA-only behaviour")


def fresh_process(test):
    """Runs the test in a new Python process (a new CUDA context and a new
    allocator singleton), by re-running just this test id under pytest."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if os.environ.get(_CHILD_ENV) == "1":
            return test(*args, **kwargs)
        node_id = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
        # -s: the child's own logs go out first, so pytest's failure report
        # (assertion and traceback) ends the output and survives the tail below.
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-s", "--tb=short"]
            + ["-p", "no:cacheprovider", node_id],
            cwd=ROOT,
            env={**os.environ, _CHILD_ENV: "1"},
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            pytest.fail(
                f"{node_id} failed in its own process:\n{result.stdout[-6000:]}\n"
                f"{result.stderr[-3000:]}",
                pytrace=False,
            )

    return wrapper
