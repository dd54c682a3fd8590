"""One live `vllm serve` with graph offload, for the benchmarks that drive a single
server through many sleeps and wakes (benchmarks/wake_pressure.py and
benchmarks/serve_soak.py): a hard time limit, start and reference tokens, the
host memory of the server's whole process tree, and a results file rewritten
after every step so that a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench.client import Client
from vllm_graph_sleep.bench.gpu import MemorySource
from vllm_graph_sleep.bench.runner import host_info
from vllm_graph_sleep.bench.scenario import first_difference
from vllm_graph_sleep.bench.server import (
    ERROR_LINE,
    Server,
    free_port,
    serve_command,
    server_env,
)
from vllm_graph_sleep.bench.settings import positive_seconds
from vllm_graph_sleep.units import MiB

REPO_ROOT = Path(__file__).resolve().parents[2]

#: The `vllm serve` command line for a port (the benchmarks' real one, or a test's fake).
CommandFor = Callable[[int], list[str]]


class Overtime(RuntimeError):
    """The run passed its --timeout."""


class Interrupted(RuntimeError):
    """SIGTERM or Ctrl-C; raised instead of KeyboardInterrupt so the run records it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raises Overtime in the main thread after `seconds`, wherever it is blocked
    (an HTTP read, a wait for /health, a subprocess): every step of a run is
    bounded without a timeout of its own having to be right. SIGTERM (what a
    job runner sends at its own limit) becomes Interrupted the same way, so the
    caller's cleanup still stops the server and writes the results."""

    def expire(signum, frame):
        raise Overtime(f"stopped at the time limit of {seconds:.0f} s (--timeout)")

    def terminate(signum, frame):
        raise Interrupted("stopped by SIGTERM")

    previous = signal.signal(signal.SIGALRM, expire), signal.signal(signal.SIGTERM, terminate)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted("stopped by Ctrl-C") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def process_tree_rss(pid: int) -> dict[str, int]:
    """Resident bytes of a process and all its descendants, as {"pid name": bytes}.
    For `vllm serve`: the API server, the engine core, its workers and helpers.
    Processes that exit while being read are left out."""
    import psutil

    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    rss = {}
    for process in processes:
        try:
            rss[f"{process.pid} {process.name()}"] = process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return rss


def git_revision() -> str | None:
    """HEAD of the checkout the benchmark runs from, "-dirty" with local changes
    (as `git describe --dirty` marks it)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def environment(memory: MemorySource) -> dict[str, Any]:
    """Host, GPU and versions, with the keys tools/render_results.py reads. CUDA is
    never initialised here: the driver process must hold no GPU memory."""
    import torch

    info = host_info(memory)
    total = info.get("gpu_total_bytes")
    return {
        **info,
        "gpu_name": info["gpus"][0] if info["gpus"] else None,
        "gpu_total_memory_bytes": total[0] if total else None,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "git_revision": git_revision(),
    }


def header(benchmark: str, memory: MemorySource, argv: Sequence[str]) -> dict[str, Any]:
    """The fields every results file starts with."""
    return {
        "benchmark": benchmark,
        "command": ["python", *argv],
        "timestamp": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "environment": environment(memory),
    }


def write_json(data: dict[str, Any], path: Path) -> None:
    """Replaces `path` in one step, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def mib(value: int) -> float:
    return round(value / MiB, 3)


def compare(reference: list[list[int]], tokens: list[list[int]]) -> dict[str, Any]:
    """{"exact": bool}, plus where the first differing prompt departs."""
    if tokens == reference:
        return {"exact": True}
    for prompt, (want, got) in enumerate(zip(reference, tokens, strict=False)):
        if want != got:
            at = first_difference(want, got)
            return {"exact": False, "mismatch": {"prompt": prompt, "first_token": at}}
    return {"exact": False, "mismatch": {"prompts": [len(reference), len(tokens)]}}


class LiveServer:
    """`vllm serve` on a free port, started, healthy and with its model id known;
    the caller calls `stop` in a `finally`."""

    def __init__(
        self,
        command_for: CommandFor,
        log_path: Path,
        request_timeout: float,
        env: dict[str, str] | None = None,
    ):
        port = free_port()
        self.server = Server("serve", command_for(port), server_env(env), log_path)
        self.client = Client(
            f"http://127.0.0.1:{port}", "serve", self.server.where, request_timeout
        )
        self.start_s: float | None = None

    def start(self, timeout: float, progress: Callable[[str], None]) -> None:
        progress(f"starting vllm serve; log: {self.server.log_path}")
        self.server.start(self.client.base_url)
        self.start_s = self.server.wait_healthy(
            timeout, lambda s, phase: progress(f"waiting for /health ({s:.0f} s, {phase})")
        )
        self.client.served_model()
        progress(f"server healthy after {self.start_s:.1f} s")

    def alive(self) -> bool:
        return self.server.exit_code() is None

    def rss(self) -> dict[str, int]:
        process = self.server.process
        return {} if process is None else process_tree_rss(process.pid)

    def log_size(self) -> int:
        try:
            return self.server.log_path.stat().st_size
        except OSError:
            return 0

    def log_errors_since(self, offset: int, limit: int = 5) -> list[str]:
        """The distinct "<Name>Error: ..." lines the server logged after `offset`
        (the reason behind an HTTP 500 is only in the log)."""
        try:
            with open(self.server.log_path, "rb") as log:
                log.seek(offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return []
        found: list[str] = []
        for line in text.splitlines():
            match = ERROR_LINE.search(line)
            if match is not None:
                error = re.sub(r"\s+", " ", match.group(0))[:300]
                if error not in found:
                    found.append(error)
        return found[:limit]

    def stop(self) -> int | None:
        return self.server.stop()


def reference_tokens(
    client: Client, prompts: Sequence[str], max_tokens: int
) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens before any sleep, and a second run compared with them:
    a difference after a wake means nothing unless greedy decoding is stable
    without one (the second run hits the prefix cache)."""
    reference = client.complete(prompts, max_tokens).token_ids
    again = compare(reference, client.complete(prompts, max_tokens).token_ids)
    return reference, again


def add_arguments(parser: argparse.ArgumentParser, default_timeout: float) -> None:
    """The options both live-server benchmarks take."""
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument(
        "--model", help="a local model directory (default: the test suite's small Llama)"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.92,
        help="vllm serve's --gpu-memory-utilization (default: vLLM's own, 0.92)",
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument(
        "--timeout",
        type=positive_seconds,
        default=default_timeout,
        help="seconds for the whole run, engine start included; then the server is "
        "stopped and what was measured is written (default: %(default)s)",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, help="seconds per HTTP request"
    )
    parser.add_argument("--serve-args", default="", help="more vllm serve arguments, as one string")


def real_command(args: argparse.Namespace, model: str) -> CommandFor:
    """`vllm serve` with sleep mode and graph offload, for a port."""
    return lambda port: serve_command(
        "ours",
        model,
        port,
        tp=1,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        extra=shlex.split(args.serve_args),
    )


def settings(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The run's options as JSON values, with the model directory it used."""
    values = {key: str(v) if isinstance(v, Path) else v for key, v in vars(args).items()}
    return {**values, "model": model}
