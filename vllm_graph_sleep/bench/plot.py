"""The PNG: NVML used memory over time through the sleep/wake cycles, one panel
per GPU, configurations overlaid, sleeps and wakes marked on each curve.

Time 0 is each server's /health answer (engine start is in the table, not here),
so the cycles of the configurations line up from their first request. Memory is
drawn as steps between samples; a sleep marker sits on the reading just before
the sleep call, a wake marker on the reading just before the wake call.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench.server import CONFIG_LABELS
from vllm_graph_sleep.units import MiB

COLORS = {
    "ours": "tab:green",
    "ours_coded": "tab:olive",
    "ours_raw": "tab:cyan",
    "ours_deep": "tab:purple",
    "stock_graphs": "tab:red",
    "stock_eager": "tab:blue",
}
MARKERS = {"sleep": "v", "wake": "^"}
#: matplotlib is the bench's extra (pyproject: vllm-graph-sleep[bench]).
MATPLOTLIB_MISSING = (
    "matplotlib is not installed: pip install 'vllm-graph-sleep[bench]' to draw the plots"
)


class PlotUnavailable(RuntimeError):
    """No plotting library: the message says how to get one, in one line."""


def pyplot():
    """matplotlib.pyplot drawing to files (Agg); PlotUnavailable without matplotlib."""
    try:
        import matplotlib
    except ImportError as error:
        raise PlotUnavailable(MATPLOTLIB_MISSING) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(record: dict[str, Any], gpu: int) -> tuple[list[float], list[float]]:
    samples = record.get("samples") or {}
    ready = record.get("ready_t", 0.0)
    times = samples.get("t") or []
    used = (samples.get("used_bytes") or [[]])[gpu] if samples.get("used_bytes") else []
    points = [(t - ready, u / MiB) for t, u in zip(times, used, strict=False) if t >= ready - 1.0]
    return [p[0] for p in points], [p[1] for p in points]


def _at(times: list[float], values: list[float], t: float) -> float:
    """The last reading at or before `t` (the first one if `t` precedes all)."""
    return values[max(bisect.bisect_right(times, t) - 1, 0)]


def _gpu_names(results: dict[str, Any], gpus: int) -> list[str]:
    names = list((results.get("host") or {}).get("gpus") or [])
    return names[:gpus] + [""] * (gpus - len(names))


def _asleep_levels(record: dict[str, Any], gpu: int) -> list[float]:
    return [
        s["asleep_used_bytes"][gpu] / MiB
        for s in record.get("steps") or []
        if gpu < len(s.get("asleep_used_bytes") or [])
    ]


def _draw(ax, record: dict[str, Any], gpu: int, labels: bool) -> None:
    name = record["config"]
    color = COLORS.get(name)
    times, used = _series(record, gpu)
    if not times:
        return
    ax.plot(
        times,
        used,
        color=color,
        linewidth=1.2,
        drawstyle="steps-post",
        label=CONFIG_LABELS.get(name, name),
    )
    ready = record.get("ready_t", 0.0)
    for event in record.get("events", []):
        marker = MARKERS.get(event["kind"])
        if marker is None:
            continue
        t = event["t"] - ready
        y = _at(times, used, t)
        ax.plot([t], [y], marker=marker, color=color, markersize=6, linestyle="none")
        if labels and event["kind"] == "sleep":
            ax.annotate(
                f"L{event.get('level')}",
                (t, y),
                textcoords="offset points",
                xytext=(0, 7),
                ha="center",
                fontsize=6,
                color=color,
            )


def write_plot(results: dict[str, Any], path: Path) -> Path:
    """Per GPU two panels: the whole range, and a close-up of the asleep level
    (where the configurations differ by hundreds of MiB out of tens of GiB)."""
    import statistics

    plt = pyplot()
    from matplotlib.lines import Line2D

    configs = [r for r in results.get("configs", []) if r.get("samples", {}).get("t")]
    gpus = max((len(r["samples"].get("used_bytes") or []) for r in configs), default=1)
    fig, axes = plt.subplots(
        2 * gpus, 1, figsize=(11, 6.4 * gpus + 0.8), squeeze=False, sharex=True
    )
    names = _gpu_names(results, gpus)
    for gpu in range(gpus):
        full, zoom = axes[2 * gpu][0], axes[2 * gpu + 1][0]
        for record in configs:
            _draw(full, record, gpu, labels=True)
            _draw(zoom, record, gpu, labels=False)
        idle = [
            r["baseline_used_bytes"][gpu] / MiB for r in configs if r.get("baseline_used_bytes")
        ]
        if idle:
            full.axhline(
                statistics.median(idle),
                color="gray",
                linestyle="--",
                linewidth=0.8,
                label="idle GPU (before each server)",
            )
        full.set_ylabel(f"GPU {gpu} used (MiB)")
        full.set_title(f"GPU {gpu} {names[gpu]}".strip(), fontsize=9, loc="left")
        asleep = {r["config"]: _asleep_levels(r, gpu) for r in configs}
        values = [v for vs in asleep.values() for v in vs]
        if values:
            low, high = min(values), max(values)
            pad = max(0.25 * (high - low), 0.1 * high, 64.0)
            zoom.set_ylim(max(low - pad, 0.0), high + pad)
            for name, levels in asleep.items():
                if not levels:
                    continue
                level = statistics.median(levels)
                color = COLORS.get(name)
                zoom.axhline(level, color=color, linestyle=":", linewidth=0.8)
                zoom.annotate(
                    f"{CONFIG_LABELS.get(name, name)}: {level:,.0f} MiB",
                    (1.0, level),
                    xycoords=("axes fraction", "data"),
                    xytext=(-4, 2),
                    textcoords="offset points",
                    ha="right",
                    fontsize=7,
                    color=color,
                )
        zoom.set_ylabel(f"GPU {gpu} asleep, close-up (MiB)")
        for ax in (full, zoom):
            ax.grid(True, alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    handles += [
        Line2D([], [], marker="v", color="gray", linestyle="none", label="sleep (L1/L2)"),
        Line2D([], [], marker="^", color="gray", linestyle="none", label="wake"),
    ]
    axes[0][0].legend(handles=handles, fontsize=8, loc="best")
    axes[-1][0].set_xlabel("seconds since the server was healthy")
    settings = results.get("settings", {})
    levels = ",".join(str(v) for v in settings.get("levels", ()))
    wakes = ",".join(settings.get("wakes", ()))
    fig.suptitle(
        "vllm-graph-sleep bench: GPU memory (NVML used) through sleep/wake cycles\n"
        f"model {Path(str(results.get('model', '?'))).name}, tp {settings.get('tp', 1)}, "
        f"{settings.get('cycles', '?')} cycle(s) of levels {levels} x wakes {wakes}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
