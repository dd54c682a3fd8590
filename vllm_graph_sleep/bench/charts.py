"""The two pictures of a bench run, for a reader who would rather look than read:
asleep memory per configuration beside the floor, and the level-1 wake per
configuration, full and staged. Drawn from the results dictionary as written to
results.json (report.summarize_all), so a recorded run draws them again
(`vllm-graph-sleep bench --report results.json`).

Where a run used several GPUs, GPU 0 is drawn (the table has every GPU).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench.plot import COLORS, pyplot
from vllm_graph_sleep.bench.report import floor_mib, summarize_all
from vllm_graph_sleep.bench.server import CONFIG_LABELS

#: (summary key of a wake, its legend) in the order drawn.
LEVEL_1_WAKES = (("1 full", "full wake"), ("1 staged", "staged: weights, then kv_cache"))
ASLEEP_LEVELS = (("1", "level 1"), ("2", "level 2"))
FLOOR_LABEL = "floor: a bare CUDA context with a cuBLAS handle"


def _caption(results: dict[str, Any]) -> str:
    settings = results.get("settings") or {}
    gpus = (results.get("host") or {}).get("gpus") or []
    where = gpus[0] if gpus else "GPU"
    if len(gpus) > 1:
        where += f", GPU 0 of {len(gpus)}"
    model = Path(str(results.get("model", "?"))).name
    return f"model {model}, tp {settings.get('tp', 1)}, {where}"


def _bars(ax, names: list[str], series: list[tuple[str, list[float | None]]], unit: str) -> None:
    """Grouped bars: one group per configuration, one bar per series, values on top."""
    width = 0.8 / max(len(series), 1)
    for index, (_, values) in enumerate(series):
        offset = (index - (len(series) - 1) / 2) * width
        for position, (name, value) in enumerate(zip(names, values, strict=True)):
            if value is None:
                continue
            bar = ax.bar(
                position + offset,
                value,
                width * 0.92,
                color=COLORS.get(name, "tab:gray"),
                alpha=1.0 if index == 0 else 0.55,
                hatch="" if index == 0 else "//",
                edgecolor="white",
            )
            ax.bar_label(bar, labels=[f"{value:,.0f} {unit}"], fontsize=8, padding=2)
    ax.set_xticks(range(len(names)), [CONFIG_LABELS.get(name, name) for name in names])
    # The colours name the configurations; the legend names the series by fill.
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(
                facecolor="dimgray" if index == 0 else "darkgray",
                hatch="" if index == 0 else "//",
                edgecolor="white",
                label=label,
            )
            for index, (label, _) in enumerate(series)
        ],
        fontsize=8,
        loc="upper left",
        frameon=False,
    )
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def write_asleep_chart(results: dict[str, Any], path: Path) -> Path:
    return _save(asleep_figure(results), path)


def write_wake_chart(results: dict[str, Any], path: Path) -> Path:
    return _save(wake_figure(results), path)


def asleep_figure(results: dict[str, Any]):
    """Asleep memory (NVML used over the idle GPU) per configuration and level,
    with the run's floor as a line where it was measured."""
    plt = pyplot()
    summaries = summarize_all(results)
    names = list(summaries)

    def at(name: str, level: str) -> float | None:
        values = (summaries[name].get("asleep_mib") or {}).get(level)
        return values[0] if values else None

    series = [
        (label, [at(name, level) for name in names])
        for level, label in ASLEEP_LEVELS
        if any(at(name, level) is not None for name in names)
    ]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    _bars(ax, names, series, "MiB")
    floor = floor_mib(results)
    if floor:
        ax.axhline(floor[0], color="black", linestyle="--", linewidth=1)
        ax.annotate(
            f"{FLOOR_LABEL}: {floor[0]:,.0f} MiB",
            (1.0, floor[0]),
            xycoords=("axes fraction", "data"),
            xytext=(-2, 3),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
    ax.set_ylabel("GPU memory while asleep (MiB over the idle GPU)")
    ax.margins(y=0.15)
    ax.set_title(f"Asleep memory, lower is better\n{_caption(results)}", fontsize=10, loc="left")
    return fig


def wake_figure(results: dict[str, Any]):
    """Level-1 wake time per configuration: one wake_up, and staged (weights,
    then kv_cache), medians over the run's cycles."""
    plt = pyplot()
    summaries = summarize_all(results)
    names = list(summaries)

    def at(name: str, key: str) -> float | None:
        return (summaries[name].get("wake_ms") or {}).get(key)

    series = [
        (label, [at(name, key) for name in names])
        for key, label in LEVEL_1_WAKES
        if any(at(name, key) is not None for name in names)
    ]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    _bars(ax, names, series, "ms")
    ax.set_ylabel("wake after a level-1 sleep (ms)")
    ax.margins(y=0.15)
    ax.set_title(f"Level-1 wake, lower is better\n{_caption(results)}", fontsize=10, loc="left")
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


#: Bar colours of grouped_bar_svg, one per series in order.
SERIES_COLORS = ("#4c72b0", "#a1c9f4", "#dd8452", "#ffb482", "#55a868", "#8de5a1")


def grouped_bar_svg(
    title: str, unit: str, groups: list[str], series: list[tuple[str, list[float]]]
) -> str:
    """A grouped bar chart (one group per entry of `groups`, one bar per series,
    values on top) as a self-contained SVG document: the results pages' charts
    (tools/render_results.py). The same input gives the same bytes: no date, a
    fixed id salt, text kept as text. PlotUnavailable without matplotlib."""
    plt = pyplot()
    import matplotlib

    width = 0.8 / max(len(series), 1)
    with matplotlib.rc_context({"svg.hashsalt": "vllm-graph-sleep", "svg.fonttype": "none"}):
        fig, ax = plt.subplots(figsize=(7.5, 3.75))
        for index, (label, values) in enumerate(series):
            offset = (index - (len(series) - 1) / 2) * width
            bars = ax.bar(
                [position + offset for position in range(len(groups))],
                [max(value, 0.0) for value in values],
                width * 0.92,
                color=SERIES_COLORS[index % len(SERIES_COLORS)],
                label=label,
            )
            ax.bar_label(bars, labels=[_bar_label(value) for value in values], fontsize=7)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=11, fontweight="bold")
        ax.legend(fontsize=8, loc="upper left", frameon=False, ncols=max(len(series), 1))
        ax.margins(y=0.2)
        ax.grid(True, axis="y", color="#dddddd")
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        fig.tight_layout()
        out = io.StringIO()
        fig.savefig(out, format="svg", metadata={"Date": None})
        plt.close(fig)
    text = out.getvalue()
    # The XML declaration and doctype are optional; the document starts at <svg.
    return text[text.index("<svg ") :]


def _bar_label(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 or value == 0 else f"{value:.1f}"
