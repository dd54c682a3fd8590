"""A whole bench run: the model, the floor (bench/floor.py), each configuration
in turn, and the outputs (results.json after every configuration, memory.png
and the table at the end).

`run` takes the memory source and (optionally) the server command as arguments,
so the same code runs against NVML and real `vllm serve` (the CLI) or against
stand-ins (the CPU tests).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench import floor, start_rounds
from vllm_graph_sleep.bench.client import Client
from vllm_graph_sleep.bench.gpu import MemorySource
from vllm_graph_sleep.bench.report import SCHEMA, floor_line, format_table, write_json
from vllm_graph_sleep.bench.scenario import Scenario
from vllm_graph_sleep.bench.server import Server, ServerError, free_port, serve_command, server_env
from vllm_graph_sleep.bench.settings import BenchSettings

CommandFor = Callable[[str, str, int, BenchSettings], list[str]]
RESULTS_JSON = "results.json"
PLOT_PNG = "memory.png"
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


def resolve_model(settings: BenchSettings, progress: Callable[[str], None]) -> str:
    if settings.model is not None:
        path = Path(settings.model).expanduser()
        if not (path / "config.json").is_file():
            raise BenchError(f"--model {settings.model}: not a model directory (no config.json)")
        return str(path.resolve())
    from vllm_graph_sleep.models import is_complete

    target = (Path(settings.cache_dir).expanduser() / settings.model_kind).resolve()
    if not is_complete(target, settings.model_kind):
        progress(f"making the {settings.model_kind} model in {target} (once; reused next time)")
        _make_model_in_a_child(settings.model_kind, target)
    return str(target)


def _make_model_in_a_child(kind: str, target: Path) -> None:
    """Makes the model in another process: a large kind is drawn on the GPU,
    and the bench's own process must leave the GPU idle (no context, nothing
    cached) for the baselines it measures."""
    made = subprocess.run(
        [sys.executable, "-m", "vllm_graph_sleep.models", kind, str(target)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        errors="replace",
    )
    if made.returncode != 0:
        lines = (made.stderr or made.stdout).strip().splitlines()
        raise BenchError(
            f"making the {kind} model failed (exit {made.returncode}): "
            + (lines[-1] if lines else "no output")
        )


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
    # Imported here: the allocator brings torch, which the bench's own process
    # otherwise loads only for the floor.
    from vllm_graph_sleep.allocator import HOST_BUFFERS_ENV, SWITCH_ENVS

    names = (*SWITCH_ENVS, HOST_BUFFERS_ENV)
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
    progress = progress or Progress()
    command_for = command_for or real_command
    out = settings.out or default_out_dir()
    settings.out = out
    out.mkdir(parents=True, exist_ok=True)
    progress(f"results go to {out}")
    model = resolve_model(settings, progress)
    results: dict[str, Any] = {
        "schema": SCHEMA,
        "command": sys.argv,
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": model,
        "settings": settings.as_dict(),
        "host": host_info(memory),
        "switches": switches_set(server_env(env)),
        "configs": [],
    }
    if settings.floor:
        progress(f"measuring the floor: {floor.WHAT}")
        results["floor"] = floor.measure(memory, server_env(env))
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
        except ServerError as error:
            scenario.record["error"] = str(error)
            results["configs"].append(scenario.record)
            write_json(results, out / RESULTS_JSON)
            raise
        results["configs"].append(record)
        write_json(results, out / RESULTS_JSON)
    if settings.start_rounds:
        start_rounds.run_rounds(
            results,
            settings,
            command_for,
            env,
            memory,
            progress,
            save=lambda: write_json(results, out / RESULTS_JSON),
        )
    return results


def write_outputs(results: dict[str, Any], out: Path) -> tuple[str, Path, Path]:
    """results.json, memory.png and table.txt in `out`; returns (table, json, png)."""
    write_json(results, out / RESULTS_JSON)
    table, png = _table_and_plot(results, out / TABLE_TXT, out / PLOT_PNG)
    return table, out / RESULTS_JSON, png


def _table_and_plot(results: dict[str, Any], table_path: Path, png_path: Path) -> tuple[str, Path]:
    from vllm_graph_sleep.bench.plot import write_plot

    table = format_table(results)
    png = write_plot(results, png_path)
    table_path.write_text(table + "\n")
    return table, png


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


def rerender(json_paths: list[Path], out: Path | None = None) -> tuple[str, Path]:
    """Table and plot of recorded results. One file: <stem>.png and
    <stem>.table.txt next to it (or in `out`), the JSON left as it is. Several
    files: merged into merged.json, merged.png, merged.table.txt."""
    from vllm_graph_sleep.bench.report import read_json

    parts = [read_json(path) for path in json_paths]
    out = json_paths[0].parent if out is None else out
    if len(parts) == 1:
        results, stem = parts[0], json_paths[0].stem
    else:
        results, stem = merge(parts, [str(p) for p in json_paths]), "merged"
        write_json(results, out / f"{stem}.json")
    return _table_and_plot(results, out / f"{stem}.table.txt", out / f"{stem}.png")
