"""A bench run as markdown: its section of the results pages and README's results
table, from the results dictionary as written to JSON (tools/render_results.py
renders docs/results/ with them). The rows, labels and ratios are report.py's, the
same the text table `vllm-graph-sleep bench` prints has.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench import ledger_table
from vllm_graph_sleep.bench.report import (
    RATIO_NOTE,
    SCHEMA,
    floor_line,
    ledger_rows,
    sleeps_ms_by_kind,
    table_rows,
)
from vllm_graph_sleep.bench.server import CONFIG_LABELS
from vllm_graph_sleep.bench.settings import LEVELS, WAKES

#: Every version of the bench's file format.
SCHEMA_PREFIX = SCHEMA.rsplit("/", 1)[0] + "/"


def code(text: str) -> str:
    return f"`{text}`"


def command_text(command: Any) -> str:
    if isinstance(command, list):
        return shlex.join(str(part) for part in command)
    return str(command)


def table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def provenance(data: dict[str, Any]) -> list[str]:
    lines = []
    if data.get("command") is not None:
        lines.append(f"- Command (as recorded): {code(command_text(data['command']))}")
    if data.get("timestamp"):
        lines.append(f"- Measured: {data['timestamp']}")
    return lines


def is_bench_run(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and str(data.get("schema", "")).startswith(SCHEMA_PREFIX)
        and isinstance(data.get("summary"), dict)
    )


def run_title(name: str) -> str:
    return f"`vllm-graph-sleep bench`: stock vs graph offload over HTTP ({name})"


def run_lines(name: str, data: dict[str, Any]) -> list[str]:
    """The run's section of the results pages: what ran, the table (the same rows,
    labels and ratios as `vllm-graph-sleep bench` prints), the floor, the ledger
    while asleep and the memory plot the bench drew beside the file."""
    settings = data.get("settings") or {}
    host = data.get("host") or {}
    levels = [str(level) for level in settings.get("levels") or LEVELS]
    wakes = list(settings.get("wakes") or WAKES)
    names, rows, baseline = table_rows(data)
    lines = [
        "A real `vllm serve` per configuration, driven over HTTP: greedy completions, "
        "`/sleep`, `/wake_up` (full, or `weights` then `kv_cache` with `reload_weights` "
        f"after level 2). {RATIO_NOTE}"
        + (f" Ratios against {CONFIG_LABELS.get(baseline, baseline)}." if baseline else ""),
        "",
        *provenance(data),
        f"- Model: {code(str(data.get('model')))}, tp {settings.get('tp')}, "
        f"{settings.get('cycles')} cycle(s) of levels {', '.join(levels)} x wakes "
        f"{', '.join(wakes)}, gpu_memory_utilization {settings.get('gpu_memory_utilization')}",
        "- Host: "
        + ", ".join(
            f"{key} {', '.join(map(str, host[key])) if isinstance(host[key], list) else host[key]}"
            for key in ("gpus", "driver_version", "vllm", "torch", "python")
            if host.get(key) is not None
        ),
        *[
            f"- Switches the servers inherited: {code(f'{key}={value}')}"
            for key, value in sorted((data.get("switches") or {}).items())
        ],
        "",
    ]
    lines += table(["", *[code(c) for c in names]], rows)
    floor = floor_line(data)
    if floor:
        lines += ["", f"The run's {floor}."]
    _, ledger_lines = ledger_rows(data)
    if ledger_lines:
        lines += [
            "",
            ledger_table.note(ledger_lines),
            "",
            *table(["", *[code(c) for c in names]], ledger_lines),
        ]
    return lines


def short_command(command: Any) -> str:
    """The recorded command with the interpreter's path to our CLI shown as the
    console script it stands for."""
    parts = [str(part) for part in command] if isinstance(command, list) else None
    if parts and (parts[0].endswith("vllm_graph_sleep/cli.py") or parts[0] == "vllm-graph-sleep"):
        return shlex.join(["vllm-graph-sleep", *parts[1:]])
    return command_text(command)


def _ms(value: float | None, reference: float | None) -> str:
    if value is None:
        return "-"
    cell = f"{value:.0f}"
    if reference not in (None, 0):
        cell += f" ({value / reference:.2f}x)"
    return cell


def readme_table(data: dict[str, Any], source: str, page: str, revision: str | None) -> list[str]:
    """README's one results table: asleep memory, the level-1 wake, the first
    sleep, the later level-1 sleeps by the cycle before them (report.
    sleeps_ms_by_kind), the level-2 sleeps (issue 38 holds each sleep against
    stock's) and the exact tokens of each configuration of a bench run, with
    ratios against stock with graphs (or stock eager), and a line naming the run."""
    summary = data["summary"]
    names = list(summary)
    baseline = next((b for b in ("stock_graphs", "stock_eager") if b in names), None)
    records = {r["config"]: r for r in data.get("configs") or []}
    sleeps = {
        name: sleeps_ms_by_kind((records.get(name) or {}).get("steps") or []) for name in names
    }

    def asleep(name: str, level: str) -> str:
        per_gpu = (summary[name].get("asleep_mib") or {}).get(level)
        return " / ".join(f"{value:.0f}" for value in per_gpu) if per_gpu else "-"

    def ratio_row(label: str, values: dict[str, float | None]) -> list[str]:
        reference = values.get(baseline) if baseline else None
        return [label] + [_ms(values[n], None if n == baseline else reference) for n in names]

    rows = [
        ["asleep, level 1 (MiB over the idle GPU)", *[asleep(n, "1") for n in names]],
        ["asleep, level 2 (MiB over the idle GPU)", *[asleep(n, "2") for n in names]],
        ratio_row(
            "level-1 wake (ms)", {n: (summary[n].get("wake_ms") or {}).get("1 full") for n in names}
        ),
        ratio_row("first sleep (ms)", {n: sleeps[n]["first"] for n in names}),
        ratio_row(
            "later level-1 sleeps after a level-1 cycle, median (ms)",
            {n: sleeps[n]["level 1 after a wake"] for n in names},
        ),
        ratio_row(
            "level-1 sleeps after a level-2 cycle and reload, median (ms)",
            {n: sleeps[n]["level 1 after level 2"] for n in names},
        ),
        ratio_row(
            "level-2 sleeps, median (ms)",
            {n: (summary[n].get("sleep_ms") or {}).get("2") for n in names},
        ),
        [
            "tokens exact after each wake",
            *["{}/{}".format(*summary[n]["exact"]) for n in names],
        ],
    ]
    host = data.get("host") or {}
    gpus = host.get("gpus") or []
    revision = revision or host.get("git_revision") or data.get("git_revision")
    where = f"{len(gpus)} x {gpus[0]}" if len(gpus) > 1 else (gpus[0] if gpus else "a GPU")
    duration = data.get("duration_s")
    took = f", {duration / 60:.1f} min end to end" if isinstance(duration, int | float) else ""
    caption = (
        f"From [{Path(source).name}]({source}) ({where}, vLLM {host.get('vllm', 'n/a')}, "
        f"{str(data.get('started') or 'date not recorded')[:10]}{took}, code "
        f"{code(revision) if revision else 'not recorded'}): "
        f"{code(short_command(data.get('command')))}; page: [{Path(page).name}]({page}). "
        + (f"Ratios against {CONFIG_LABELS.get(baseline, baseline)}; " if baseline else "")
        + "memory is NVML's used memory over the idle GPU, the median over the cycles."
    )
    header = ["", *[CONFIG_LABELS.get(n, n) for n in names]]
    return [*table(header, rows), "", caption]
