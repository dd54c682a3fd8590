"""Helpers shared by the GPU tests."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_graph_sleep.settings import TEST_LOG, TEST_TIMEOUT

ROOT = Path(__file__).resolve().parent.parent
_CHILD_ENV = "VLLM_GRAPH_SLEEP_TEST_CHILD"

requires_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU (none visible)"
)
cuda_only = pytest.mark.skipif(torch.version.hip is not None, reason="CUDA-only behaviour")


#: Seconds a fresh-process test may run before it is stopped and reported.
CHILD_TIMEOUT_S = TEST_TIMEOUT.read()
#: If set, every child's whole output is appended to this file (GPU runs keep it).
CHILD_LOG = TEST_LOG.read()


def _child_skip_reason(stdout: str) -> str | None:
    """The reason of the skip in a child's -rs summary, or None if it ran."""
    for line in stdout.splitlines():
        if line.startswith("SKIPPED"):
            return line.split(": ", 1)[-1]
    return None


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
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-s", "-rs", "--tb=short"]
        command += ["-p", "no:cacheprovider", node_id]
        env = {**os.environ, _CHILD_ENV: "1"}
        # A session of its own: a stopped child takes its engine processes along.
        with subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ) as child:
            try:
                stdout, stderr = child.communicate(timeout=CHILD_TIMEOUT_S)
                failure = None if child.returncode == 0 else "failed in its own process"
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                stdout, stderr = child.communicate()
                failure = f"ran past {CHILD_TIMEOUT_S:.0f} s in its own process and was stopped"
        if CHILD_LOG:
            with open(CHILD_LOG, "a") as log:
                log.write(f"\n===== {node_id}: {failure or 'passed'}\n{stdout}\n{stderr}\n")
        if failure:
            pytest.fail(f"{node_id} {failure}:\n{stdout[-6000:]}\n{stderr[-3000:]}", pytrace=False)
        skipped = _child_skip_reason(stdout)
        if skipped is not None:  # a child that skipped exits 0: not a pass
            pytest.skip(f"in its own process: {skipped}")

    return wrapper
