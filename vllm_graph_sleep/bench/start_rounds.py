"""Engine starts in alternating order after every configuration ran
(`vllm-graph-sleep bench --start-rounds N`).

One measured start per configuration cannot tell a few percent from start-up
noise: in one H200 run the API server alone printed its first line 20 s after
launch in one configuration and 26 s in the next
(docs/results/archive/bench-h200-run5.md). Here each configuration's server is started
to /health and stopped N more times, with warm caches, the order rotated from
round to round so that every configuration takes every place; the report shows
the median of each (report.summarize_all).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench.gpu import MemorySource, wait_released
from vllm_graph_sleep.bench.server import Server, free_port, server_env
from vllm_graph_sleep.bench.settings import BenchSettings
from vllm_graph_sleep.units import MiB


def rotated(names: Sequence[str], round_number: int) -> list[str]:
    """The order of round `round_number` (0-based): over as many rounds as there
    are names, each takes each place once (benchmarks/pinning.py orders its
    modes with it too)."""
    items = list(names)
    shift = round_number % len(items) if items else 0
    return items[shift:] + items[:shift]


def run_rounds(
    results: dict[str, Any],
    settings: BenchSettings,
    command_for: Callable[[str, str, int, BenchSettings], list[str]],
    env: dict[str, str] | None,
    memory: MemorySource,
    progress: Callable[[str], None],
    save: Callable[[], None],
) -> None:
    """Appends {"round", "config", "start_s", "engine_init"} to
    results["start_rounds"] after each start, and saves; a start that fails is
    recorded with its error and raises ServerError."""
    baselines = {r["config"]: r["baseline_used_bytes"] for r in results["configs"]}
    starts = results.setdefault("start_rounds", [])
    for number in range(settings.start_rounds):
        for name in rotated(list(baselines), number):
            entry: dict[str, Any] = {"round": number + 1, "config": name}
            starts.append(entry)
            progress(f"[{name}] start round {number + 1} of {settings.start_rounds}")
            try:
                entry.update(
                    _start_once(name, number + 1, results, settings, command_for, env, progress)
                )
            except Exception as error:
                entry["error"] = str(error)
                raise
            finally:
                wait_released(memory, baselines[name], slack=256 * MiB, timeout=30)
                save()
            progress(f"[{name}] start round {number + 1}: healthy after {entry['start_s']:.1f} s")


def _start_once(
    name: str,
    number: int,
    results: dict[str, Any],
    settings: BenchSettings,
    command_for: Callable[[str, str, int, BenchSettings], list[str]],
    env: dict[str, str] | None,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    port = free_port()
    log = Path(settings.out) / f"{name}.start-round-{number}.server.log"
    server = Server(
        name, command_for(name, results["model"], port, settings), server_env(env, name), log
    )
    seconds = server.start_to_health(
        f"http://127.0.0.1:{port}",
        settings.start_timeout,
        lambda waited, phase: progress(
            f"[{name}] start round {number}: {waited:.0f} s (vLLM: {phase})"
        ),
    )
    return {"start_s": round(seconds, 3), "engine_init": server.engine_init(), "log": str(log)}
