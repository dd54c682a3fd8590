"""One `vllm serve` process: its command line, its log, /health, and a stop that
always happens.

The server runs in its own process group (it starts an engine core and workers),
with stdout and stderr in a log file. `stop` sends SIGTERM to the server (vLLM
shuts its engine down on it), waits, and SIGKILLs the whole group if anything is
left after the timeout.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path

from vllm_graph_sleep import config
from vllm_graph_sleep.bench.phases import phase_of_log

PROBE_EXTENSION = "vllm_graph_sleep.probe.ProbeWorkerExtension"
#: While a server starts, a progress line this often (seconds).
PROGRESS_EVERY_S = 10.0
#: How vLLM starts its engine core (and workers): fork or spawn.
MULTIPROC_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"

#: Per configuration: what it adds to the common `vllm serve` arguments.
CONFIG_ARGS: dict[str, tuple[str, ...]] = {
    "ours": ("--sleep-mode-offload-cudagraph",),
    "ours_coded": ("--sleep-mode-offload-cudagraph",),
    "ours_raw": ("--sleep-mode-offload-cudagraph",),
    "ours_deep": ("--sleep-mode-offload-cudagraph",),
    "stock_graphs": (),
    "stock_eager": ("--enforce-eager",),
}
#: Per configuration: what it sets in the server's environment. Coded weight
#: backups (allocator.COMPRESS_BACKUPS_ENV) trade a little sleep for a faster
#: wake; as configurations of their own, one bench measures both sides.
CONFIG_ENV: dict[str, dict[str, str]] = {
    "ours_coded": {"VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS": "1"},
    "ours_raw": {"VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS": "0"},
}
#: Configurations whose sleeps ask for the CUDA driver's checkpoint too
#: (`/sleep?checkpoint=1`, vllm_graph_sleep.deep_sleep_http).
CHECKPOINTED = frozenset({"ours_deep"})
CONFIG_LABELS = {
    "ours": "ours (graph offload)",
    "ours_coded": "ours, coded backups",
    "ours_raw": "ours, raw backups",
    "ours_deep": "ours, checkpointed",
    "stock_graphs": "stock, graphs",
    "stock_eager": "stock, eager",
}


#: How an HTTP call fails before any status arrives: no connection, a reset, a
#: timeout (URLError, ConnectionError and TimeoutError are OSErrors), or an
#: answer cut short (IncompleteRead) or with a broken status line (HTTPException).
TRANSPORT_ERRORS = (http.client.HTTPException, OSError)


def transport_reason(error: BaseException) -> object:
    """What went wrong: the reason urllib wrapped (URLError.reason), else the error."""
    return getattr(error, "reason", None) or error


class ServerError(RuntimeError):
    """A server did not start, died, or answered an error; the message is one line.
    `status` is the HTTP status of an error answer (None when there was none), for
    callers that expect a particular error, e.g. a wake refused under memory pressure."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_command(
    config: str,
    model: str,
    port: int,
    *,
    tp: int,
    gpu_memory_utilization: float,
    max_model_len: int,
    extra: Sequence[str] = (),
    python: str = sys.executable,
) -> list[str]:
    """`vllm serve` for one configuration; every configuration has sleep mode on."""
    return [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-sleep-mode",
        "--tensor-parallel-size",
        str(tp),
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
        "--worker-extension-cls",
        PROBE_EXTENSION,
        "--disable-uvicorn-access-log",
        *CONFIG_ARGS[config],
        *extra,
    ]


def keep_multicast_off(env: MutableMapping[str, str]) -> None:
    """Keeps vLLM's FlashInfer all-reduce off NVLink multicast where it is off."""
    backend = config.multicast_free_all_reduce_backend(env)
    if backend is not None:
        env[config.FLASHINFER_ALLREDUCE_BACKEND] = backend


def server_env(environ: dict[str, str] | None = None, config: str | None = None) -> dict[str, str]:
    """The bench's environment (NCCL_* and the rest kept) plus the dev endpoints
    and what `config` sets (CONFIG_ENV)."""
    env = dict(os.environ if environ is None else environ)
    env.update(CONFIG_ENV.get(config, {}))
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep, /wake_up, /is_sleeping, /collective_rpc
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # skips a ~96 s JIT build
    env.setdefault("PYTHONUNBUFFERED", "1")
    keep_multicast_off(env)
    return env


def with_forked_engine_core(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment with VLLM_WORKER_MULTIPROC_METHOD=fork unless it names a
    method already (which is kept: spawn gives the start as `vllm serve` makes it).

    `vllm serve` spawns its engine core, which then imports again what the API
    server has imported already; forked, it starts from those imports. Server
    starts are the bench's longest waits (bench/estimate.py), the same for every
    configuration; memory, sleep, wake and tokens do not depend on how the
    engine core's process began."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault(MULTIPROC_METHOD, "fork")
    return env


#: What vLLM 0.26's engine core logs when it dies during start-up
#: (vllm/v1/engine/core.py); the root cause follows as "<Name>Error: ..." lines.
ENGINE_START_FAILED = "EngineCore failed to start."
ERROR_LINE = re.compile(r"\b[A-Z]\w*(?:Error|Exception): .*$")
#: What vLLM 0.26's engine core logs once initialized (vllm/v1/engine/core.py):
#: profile, KV cache, compilation, capture and kernel warm-up, without the
#: processes' imports and the API server around them.
ENGINE_INIT_LINE = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"
    # With an encoder, vLLM goes on after the seconds: "(compilation: X s — language_model: ...".
    r"(?: \(compilation: ([\d.]+) s)?"
)

#: What vLLM 0.26's executor logs at the end of every sleep (vllm/v1/executor/
#: abstract.py, and our patch of it, patches/v1_executor_abstract.py): the
#: sleep's time on the engine's side, without the HTTP and engine-core round trip
#: around it, which stock and ours pay alike.
SLEEP_LINE = re.compile(r"It took ([\d.]+) seconds to fall asleep\.")
#: What our allocator logs at the end of each sleep, on each rank
#: (GraphSleepAllocator.sleep): its own seconds, before the phases in brackets.
ALLOCATOR_SLEEP_LINE = re.compile(r"graph-sleep sleep: .*; ([\d.]+) s \(")
#: What our worker logs once it has backed the weights up at the end of the
#: engine's start (memory.backups.back_up_ahead), on each rank: its seconds.
BACKUP_AHEAD_LINE = re.compile(r"graph-sleep: backed up .* ahead.*; ([\d.]+) s \(")


class Server:
    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path):
        self.name = name
        self.command = command
        self.env = env
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.base_url = ""

    def where(self) -> str:
        return f"server log: {self.log_path}"

    def start(self, base_url: str) -> None:
        self.base_url = base_url
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )

    def _log_text(self) -> str | None:
        """The server's log so far; None while there is none to read."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return None

    def startup_failure(self) -> str | None:
        """The root-cause line vLLM logs when its engine core dies during start-up,
        once it has; None before. The API server can hang on after that (seen
        with TP=2 workers stuck in teardown), so waiting for its exit is not enough."""
        text = self._log_text()
        if text is None:
            return None
        if ENGINE_START_FAILED not in text:
            return None
        for line in text.split(ENGINE_START_FAILED, 1)[1].splitlines():
            error = ERROR_LINE.search(line)
            if error is not None:
                return error.group(0).strip()
        return ENGINE_START_FAILED

    def engine_init(self) -> dict[str, float] | None:
        """vLLM's own figures for its engine core's initialization, from the log:
        {"engine_init_s", "compile_s"} (the slowest engine core where there are
        several; compile_s 0 without torch.compile); None when not logged."""
        text = self._log_text()
        if text is None:
            return None
        found = [
            (float(init), float(compile_s or 0))
            for init, compile_s in ENGINE_INIT_LINE.findall(text)
        ]
        if not found:
            return None
        init_s, compile_s = max(found)
        return {"engine_init_s": init_s, "compile_s": compile_s}

    def sleeps_in_engine(self) -> list[float]:
        """The seconds vLLM logged for each sleep so far, in order; empty
        without a log."""
        text = self._log_text()
        if text is None:
            return []
        return [float(seconds) for seconds in SLEEP_LINE.findall(text)]

    def sleeps_in_allocator(self) -> list[float]:
        """For each sleep vLLM logged, the seconds our allocator's sleep took
        (the slowest rank's, from the lines logged since the sleep before),
        in order; empty without a log or where a sleep has no line of ours
        (stock)."""
        text = self._log_text()
        if text is None:
            return []
        sleeps: list[float] = []
        ranks: list[float] = []
        for line in text.splitlines():
            ours = ALLOCATOR_SLEEP_LINE.search(line)
            if ours is not None:
                ranks.append(float(ours.group(1)))
            elif SLEEP_LINE.search(line) is not None:
                if not ranks:
                    return []
                sleeps.append(max(ranks))
                ranks = []
        return sleeps

    def backup_ahead_s(self) -> float | None:
        """The seconds the backup of the weights at the engine's start took
        (the slowest rank's); None without a log or such a line (stock, or
        VLLM_GRAPH_SLEEP_BACK_UP_AT_START=0)."""
        text = self._log_text()
        if text is None:
            return None
        ranks = [float(seconds) for seconds in BACKUP_AHEAD_LINE.findall(text)]
        return max(ranks) if ranks else None

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def phase(self) -> str:
        """What the server is doing, from its log (bench/phases.py)."""
        return phase_of_log(self.log_path)

    def wait_healthy(
        self, timeout: float, progress: Callable[[float, str], None] | None = None
    ) -> float:
        """Seconds from start to the first 200 on /health; ServerError if the
        process exits first or `timeout` passes. Every PROGRESS_EVERY_S,
        `progress(seconds so far, phase)`."""
        assert self.process is not None
        started = time.monotonic()
        next_note = started + PROGRESS_EVERY_S
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerError(
                    f"[{self.name}] vllm serve exited with code {code} before it was healthy; "
                    f"{self.where()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except TRANSPORT_ERRORS:  # not up yet, or answering something else than HTTP
                pass
            failure = self.startup_failure()
            if failure is not None:
                raise ServerError(
                    f"[{self.name}] vllm serve's engine failed to start: {failure}; {self.where()}"
                )
            now = time.monotonic()
            if now - started > timeout:
                raise ServerError(
                    f"[{self.name}] vllm serve was not healthy after {timeout:.0f} s "
                    f"(--start-timeout); {self.where()}"
                )
            if progress is not None and now >= next_note:
                progress(now - started, self.phase())
                next_note = now + PROGRESS_EVERY_S
            time.sleep(0.5)

    def start_to_health(
        self, base_url: str, timeout: float, progress: Callable[[float, str], None] | None = None
    ) -> float:
        """Starts the server, waits for its first 200 on /health and stops it,
        whatever happens (a warm-up start, a start round); the seconds to that 200."""
        try:
            self.start(base_url)
            return self.wait_healthy(timeout, progress)
        finally:
            self.stop()

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stops the server and everything it started; safe to call twice."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            try:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill_group(process.pid)
                process.wait(timeout=30)
            except ProcessLookupError:
                pass
            except BaseException:
                # A second Ctrl-C or SIGTERM while it shuts down: nothing is
                # left running for it.
                self._kill_group(process.pid)
                raise
        # Engine core and workers share the group; give them a moment, then kill.
        deadline = time.monotonic() + 15
        while self._group_alive(process.pid) and time.monotonic() < deadline:
            time.sleep(0.25)
        if self._group_alive(process.pid):
            self._kill_group(process.pid)
        return process.returncode

    @staticmethod
    def _group_alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    @staticmethod
    def _kill_group(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
