"""A whole bench run: the estimate of its time, the model, the floor
(bench/floor.py), each configuration in turn, and the outputs (results.json
after every configuration, with the time so far; the table and the plots at
the end).

`run` takes the memory source and (optionally) the server command as arguments,
so the same code runs against NVML and real `vllm serve` (the CLI) or against
stand-ins (the CPU tests).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_graph_sleep import settings as switches
from vllm_graph_sleep.bench import estimate, floor, model_info, start_rounds
from vllm_graph_sleep.bench.client import Client
from vllm_graph_sleep.bench.gpu import NO_GPU, MemorySource
from vllm_graph_sleep.bench.report import SCHEMA, floor_line, format_table, write_json
from vllm_graph_sleep.bench.scenario import Scenario
from vllm_graph_sleep.bench.server import (
    MULTIPROC_METHOD,
    Server,
    free_port,
    serve_command,
    server_env,
    with_forked_engine_core,
)
from vllm_graph_sleep.bench.settings import BenchSettings, made_on_the_cpu

CommandFor = Callable[[str, str, int, BenchSettings], list[str]]
RESULTS_JSON = "results.json"
PLOT_PNG = "memory.png"
ASLEEP_PNG = "asleep.png"
WAKE_PNG = "wake.png"
TABLE_TXT = "table.txt"


class BenchError(RuntimeError):
    """A bench that cannot go on; the message is one line."""


def default_out_dir(root: Path = Path("bench-results")) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = root / stamp
    n = 1
    while out.exists():
        n += 1
        out = root / f"{stamp}-{n}"
    return out


def real_command(name: str, model: str, port: int, settings: BenchSettings) -> list[str]:
    return serve_command(
        name,
        model,
        port,
        tp=settings.tp,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_model_len=settings.max_model_len,
        extra=settings.serve_args,
    )


def _made_model_dir(settings: BenchSettings) -> Path:
    return (Path(settings.cache_dir).expanduser() / settings.model_kind).resolve()


def model_to_make(settings: BenchSettings) -> bool:
    """True when the run makes its model first (no --model, none cached yet)."""
    from vllm_graph_sleep.testing.models import is_complete

    return settings.model is None and not is_complete(
        _made_model_dir(settings), settings.model_kind
    )


def start_model(
    settings: BenchSettings,
    progress: Callable[[str], None],
    env: dict[str, str] | None = None,
) -> MadeInAChild | None:
    """Starts making the run's model in a child process with `env` (None:
    this process's); None when there is nothing to make (--model, or one
    cached already)."""
    if not model_to_make(settings):
        return None
    target = _made_model_dir(settings)
    progress(f"making the {settings.model_kind} model in {target} (once; reused next time)")
    return MadeInAChild(settings.model_kind, target, env)


def model_directory(model: str) -> str:
    """The --model directory, resolved; BenchError if it holds no model."""
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise BenchError(f"--model {model}: not a model directory (no config.json)")
    return str(path.resolve())


def resolve_model(
    settings: BenchSettings,
    progress: Callable[[str], None],
    making: MadeInAChild | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """The run's model directory: --model, or the made one, once `making` (or a
    child started here with `env`, when none was) has made it."""
    if settings.model is not None:
        return model_directory(settings.model)
    if making is None:
        making = start_model(settings, progress, env)
    if making is not None:
        making.finish()
    return str(_made_model_dir(settings))


def _architecture(settings: BenchSettings) -> str | None:
    """The architecture the run's model has, known before a made model exists."""
    if settings.model is not None:
        return model_info.architecture_of(Path(settings.model).expanduser())
    from vllm_graph_sleep.testing.models import ARCHITECTURES

    return ARCHITECTURES.get(settings.model_kind)


def model_command(kind: str, target: Path) -> list[str]:
    return [sys.executable, "-m", "vllm_graph_sleep.testing.models", kind, str(target)]


class MadeInAChild:
    """Makes the model in another process: a large kind is drawn on the GPU,
    and the bench's own process must leave the GPU idle (no context, nothing
    cached) for the baselines it measures. A kind made on the CPU is made with
    CUDA hidden (NO_GPU), so it can be made while the floor is measured. The
    child's output goes to a file, which it cannot fill up as it could a pipe
    nobody reads while the floor is measured. `env`: the run's environment
    (None: this process's, for a caller that measures nothing meanwhile)."""

    def __init__(self, kind: str, target: Path, env: dict[str, str] | None = None):
        self.kind = kind
        self._output = tempfile.TemporaryFile()
        if env is not None and made_on_the_cpu(kind):
            env = {**env, **NO_GPU}
        self._process = subprocess.Popen(
            model_command(kind, target),
            stdin=subprocess.DEVNULL,
            stdout=self._output,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def finish(self) -> None:
        """Waits for the model; BenchError with the child's last line if it failed."""
        try:
            code = self._process.wait()
        except BaseException:  # an interrupt while waiting: the child goes too
            self.kill()
            raise
        self._output.seek(0)
        text = self._output.read().decode(errors="replace")
        self._output.close()
        if code != 0:
            lines = text.strip().splitlines()
            raise BenchError(
                f"making the {self.kind} model failed (exit {code}): "
                + (lines[-1] if lines else "no output")
            )

    def kill(self) -> None:
        """Stops the child (a run that stops early): a large kind holds the GPU."""
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._output.close()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def host_info(memory: MemorySource) -> dict[str, Any]:
    info: dict[str, Any] = {
        "gpus": list(memory.gpus),
        "python": sys.version.split()[0],
        "vllm": _version("vllm"),
        "torch": _version("torch"),
        "vllm_graph_sleep": _version("vllm-graph-sleep"),
    }
    # NVML has these; the CPU tests' stand-in memory source does not.
    for method, key in (("driver_version", "driver_version"), ("total", "gpu_total_bytes")):
        if callable(getattr(memory, method, None)):
            info[key] = getattr(memory, method)()
    return info


def switches_set(environ: dict[str, str]) -> dict[str, str]:
    """This plugin's environment switches that the servers inherit (they change
    what "ours" measures, e.g. coded weight backups): recorded with the results."""
    # From the declarations, not the allocator, which would bring torch into the
    # bench's own process (2-3.5 s of imports; its children load torch themselves).
    names = (*switches.WORKER_YES_NO, switches.HOST_BUFFERS.name)
    return {name: environ[name] for name in names if name in environ}


class Progress:
    """Timestamped progress lines on stderr."""

    def __init__(self, stream=None):
        self.started = time.monotonic()
        self.stream = stream

    def __call__(self, text: str) -> None:
        stream = self.stream or sys.stderr
        print(f"[{time.monotonic() - self.started:7.1f}s] {text}", file=stream, flush=True)


def run(
    settings: BenchSettings,
    memory: MemorySource,
    command_for: CommandFor | None = None,
    progress: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Runs every configuration; returns the results (also written to
    settings.out). Raises BenchError or ServerError with a one-line reason after
    writing what was measured so far."""
    started = time.monotonic()
    progress = progress or Progress()
    command_for = command_for or real_command
    env = with_forked_engine_core(env)
    if settings.model is not None:
        model_directory(settings.model)  # before anything is written or measured
    out = settings.out or default_out_dir()
    settings.out = out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BenchError(f"--out {out}: {error}") from None
    progress(f"results go to {out}")
    making = model_to_make(settings)
    progress(estimate.describe(settings, making))
    # vLLM's model-info cache is warmed (bench/model_info.py) and a model made
    # on the CPU is made while the floor is measured: neither child can reach a
    # GPU (NO_GPU), so nothing of the bench's holds one then. A large kind is
    # drawn on the GPU, after the floor.
    warming = model_info.start(_architecture(settings), server_env(env))
    early = None
    try:
        if making and made_on_the_cpu(settings.model_kind):
            early = start_model(settings, progress, env)
        measured_floor = None
        if settings.floor:
            progress(f"measuring the floor: {floor.WHAT}")
            measured_floor = floor.measure(memory, server_env(env))
        model = resolve_model(settings, progress, early, env)
        warmed = model_info.finish(warming)
    except BaseException:  # an interrupt or a failure before any server: no child stays
        if early is not None:
            early.kill()
        model_info.stop(warming)
        raise
    progress(f"vLLM's model-info cache warmed: {warmed}")
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "command": sys.argv,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": model,
        "settings": settings.as_dict(),
        "host": host_info(memory),
        "switches": switches_set(server_env(env)),
        "engine_core_start": env[MULTIPROC_METHOD],
        "model_info_warm": warmed,
        "estimate_s": round(estimate.estimate_s(settings, making), 1),
        "configs": [],
    }

    def save() -> None:
        # Each save records the time so far: the last one, the whole run's.
        results["duration_s"] = round(time.monotonic() - started, 1)
        write_json(results, out / RESULTS_JSON)

    if measured_floor is not None:
        results["floor"] = measured_floor
        progress(floor_line(results) or "")
    for name in settings.configs:
        port = free_port()
        server = Server(
            name,
            command_for(name, model, port, settings),
            server_env(env, name),
            out / f"{name}.server.log",
        )
        client = Client(f"http://127.0.0.1:{port}", name, server.where, settings.request_timeout)
        scenario = Scenario(name, server, client, memory, settings, progress)
        try:
            record = scenario.run()
        except BaseException as error:  # an interrupt too: what was measured is kept
            scenario.record["error"] = str(error) or type(error).__name__
            results["configs"].append(scenario.record)
            save()
            raise
        results["configs"].append(record)
        save()
    if settings.start_rounds:
        start_rounds.run_rounds(results, settings, command_for, env, memory, progress, save)
    save()
    progress(
        f"measured in {estimate.minutes(results['duration_s'])} "
        f"(estimated {estimate.minutes(results['estimate_s'])})"
    )
    return results


def plot_paths(folder: Path, stem: str | None = None) -> dict[str, Path]:
    """Where a run's plots go: memory.png, asleep.png and wake.png in the bench's
    folder; <stem>.png, <stem>.asleep.png and <stem>.wake.png beside a recorded file."""
    if stem is None:
        return {
            "memory": folder / PLOT_PNG,
            "asleep": folder / ASLEEP_PNG,
            "wake": folder / WAKE_PNG,
        }
    return {
        "memory": folder / f"{stem}.png",
        "asleep": folder / f"{stem}.asleep.png",
        "wake": folder / f"{stem}.wake.png",
    }


def write_plots(results: dict[str, Any], paths: dict[str, Path]) -> list[Path]:
    """The memory-over-time plot (bench/plot.py) and the two charts
    (bench/charts.py); PlotUnavailable without matplotlib."""
    from vllm_graph_sleep.bench.charts import write_asleep_chart, write_wake_chart
    from vllm_graph_sleep.bench.plot import write_plot

    writers = {"memory": write_plot, "asleep": write_asleep_chart, "wake": write_wake_chart}
    return [writers[kind](results, path) for kind, path in paths.items()]


def write_outputs(results: dict[str, Any], out: Path) -> tuple[str, Path, list[Path], str | None]:
    """results.json, table.txt and the plots in `out`; returns (table, json, plots,
    why there are no plots or None)."""
    write_json(results, out / RESULTS_JSON)
    table, pngs, missing = _table_and_plots(results, out / TABLE_TXT, plot_paths(out))
    return table, out / RESULTS_JSON, pngs, missing


def _table_and_plots(
    results: dict[str, Any], table_path: Path, png_paths: dict[str, Path]
) -> tuple[str, list[Path], str | None]:
    from vllm_graph_sleep.bench.plot import PlotUnavailable

    table = format_table(results)
    table_path.write_text(table + "\n")
    try:
        return table, write_plots(results, png_paths), None
    except PlotUnavailable as error:
        return table, [], str(error)


def merge(parts: list[dict[str, Any]], sources: list[str]) -> dict[str, Any]:
    """One results dictionary from runs of different configurations (e.g. one
    run per configuration where a time limit forbids all in one): settings,
    host and floor of the first, configurations of all, in order; a
    configuration that appears twice is refused."""
    merged = {**parts[0], "configs": [], "merged_from": sources}
    merged.pop("summary", None)
    merged.pop("start_rounds", None)
    for part in parts:
        for record in part.get("configs", []):
            if any(r["config"] == record["config"] for r in merged["configs"]):
                raise ValueError(f"configuration {record['config']!r} is in more than one file")
            merged["configs"].append(record)
    # Each file's rounds alternate only among its own configurations.
    rounds = [entry for part in parts for entry in part.get("start_rounds", [])]
    if rounds:
        merged["start_rounds"] = rounds
    merged["settings"] = {
        **merged.get("settings", {}),
        "configs": [r["config"] for r in merged["configs"]],
    }
    return merged


def rerender(json_paths: list[Path], out: Path | None = None) -> tuple[str, list[Path], str | None]:
    """Table and plots of recorded results. One file: <stem>.table.txt and the
    plots of plot_paths next to it (or in `out`), the JSON left as it is.
    Several files: merged into merged.json, merged.table.txt and merged's plots.
    Returns (table, plots, why there are no plots or None)."""
    from vllm_graph_sleep.bench.report import read_json

    parts = [read_json(path) for path in json_paths]
    out = json_paths[0].parent if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    if len(parts) == 1:
        results, stem = parts[0], json_paths[0].stem
    else:
        results, stem = merge(parts, [str(p) for p in json_paths]), "merged"
        write_json(results, out / f"{stem}.json")
    return _table_and_plots(results, out / f"{stem}.table.txt", plot_paths(out, stem))
