"""The floor a sleeping engine is compared with: what any process that has used
the GPU keeps at least, measured in the bench's run before any server starts.

A child process creates a CUDA context on each GPU the servers use, a cuBLAS
handle with its workspace (one matmul), and releases the context's stack
reservation as graph offload does while asleep; NVML's used memory over the
idle GPU, while the child holds all that, is the floor. Issue 15's stretch
target is an engine asleep at or below it.

Run as `python -m vllm_graph_sleep.bench.floor GPUS`: the child prints HOLDING
once ready and exits when its standard input closes.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from typing import Any

from vllm_graph_sleep.bench.gpu import MemorySource, settle, wait_released
from vllm_graph_sleep.units import MiB

HOLDING = "vllm-graph-sleep floor: holding"
STACK = "vllm-graph-sleep floor: stack"  # then the device's limit before and after, in bytes
WHAT = "a bare CUDA context with a cuBLAS handle, stack reservation released"


def floor_command(gpus: int) -> list[str]:
    return [sys.executable, "-m", "vllm_graph_sleep.bench.floor", str(gpus)]


def _wait_for_holding(
    process: subprocess.Popen, timeout: float, stacks: list[list[int]]
) -> str | None:
    """None once the child says HOLDING (its STACK lines appended to `stacks`);
    otherwise why it did not (its last line)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return f"not ready after {timeout:.0f} s"
        if line is None:
            return f"exited with code {process.wait()}" + (f": {last}" if last else "")
        if line.strip() == HOLDING:
            return None
        if line.startswith(STACK):
            try:
                stacks.append([int(value) for value in line[len(STACK) :].split()])
            except ValueError:
                return f"said {line.strip()!r}"
        last = line.strip() or last


def measure(
    memory: MemorySource, env: dict[str, str] | None = None, timeout: float = 120.0
) -> dict[str, Any]:
    """The floor per GPU: {"what", "baseline_used_bytes", "used_bytes",
    "stack_limit_before_after"} (the child's per-thread stack limit before and
    after it released it, bytes), or {"what", "error"} when the child could not
    hold a context (the bench goes on)."""
    baseline = settle(memory)
    process = subprocess.Popen(
        floor_command(len(baseline)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        errors="replace",
    )
    try:
        stacks: list[list[int]] = []
        failure = _wait_for_holding(process, timeout, stacks)
        if failure is not None:
            return {"what": WHAT, "error": f"the floor's child process {failure}"}
        return {
            "what": WHAT,
            "baseline_used_bytes": baseline,
            "used_bytes": settle(memory),
            "stack_limit_before_after": stacks,
        }
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        # The driver frees an exited process's memory a moment later; the first
        # server's baseline must not include it.
        wait_released(memory, baseline, slack=16 * MiB, timeout=30)


def _hold(gpus: int) -> None:
    import torch

    from vllm_graph_sleep._native import VmmDriver
    from vllm_graph_sleep.allocator import STACK_WHILE_ASLEEP

    driver = VmmDriver()
    for device in range(gpus):
        with torch.cuda.device(device):
            x = torch.ones(256, 256, device=device)
            (x @ x).sum().item()  # the cuBLAS handle and its workspace
            torch.cuda.synchronize(device)
            before = driver.stack_limit(device)
            driver.set_stack_limit(device, STACK_WHILE_ASLEEP)
            print(f"{STACK} {before} {driver.stack_limit(device)}", flush=True)
    print(HOLDING, flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    _hold(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
