#!/usr/bin/env python3
"""Renders docs/results/index.md, tables.md and the charts from the data files in
docs/results/, and README.md's results table from one bench run there.

Every JSON file in the folder is read and recognised by its shape:
- `vllm-graph-sleep bench` results: "schema" vllm-graph-sleep-bench/... and "summary";
- allocator benchmark (benchmarks/bench_allocator.py): "bandwidth" and "environment";
- sleep memory (benchmarks/sleep_memory.py): "results" whose entries carry
  "level1_asleep_used_bytes";
- any other benchmark with "command" and a "results" list of objects: a table of
  the scalar fields of each result;
- anything else is listed as not rendered.
Hand-written pages (*.md other than index.md and tables.md) are the subject pages:
index.md lists them with the files each names, and every data file with what it is,
when and by which command it was measured, and the pages that cite it; tables.md
renders every data file in full. The archive/ folder (the earlier runs' pages) is
linked, not read.

README.md's results table sits between `<!-- results table: docs/results/RUN.json
[code=COMMIT] -->` and `<!-- end of results table -->`; `--readme` renders it from
RUN.json (COMMIT is used where the run did not record its commit).

Output: index.md, tables.md, one SVG bar chart per recognised benchmark file,
named after it (<stem>.svg). The output depends on the input files only (no clock,
no host, sorted listings, fixed number formats), so rendering twice gives the same
bytes; tests/unit/test_render_results.py checks that the committed files and
README's table are what this script renders. A bench run's section and README's
table come from the bench's own renderer (vllm_graph_sleep.bench.markdown: the same
rows the bench prints), the charts from its chart engine (matplotlib, the `bench`
extra; without it the charts are left as they are, said in one line).

    python tools/render_results.py              # rewrite index.md, tables.md and the charts
    python tools/render_results.py --check      # exit 1 if they or README's table are stale
    python tools/render_results.py --out DIR    # write somewhere else
    python tools/render_results.py --readme docs/results/RUN.json [--code COMMIT]
                                                # README's table from that run
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench.markdown import (
    code,
    is_bench_run,
    provenance,
    readme_table,
    run_lines,
    run_title,
    short_command,
    table,
)
from vllm_graph_sleep.units import MiB, format_exact_bytes

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "docs" / "results"
INDEX = "index.md"
Json = dict[str, Any]

# -- formatting -------------------------------------------------------------------


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / MiB:,.0f}"


def fixed(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def flag(value: Any) -> str:
    if value is None:
        return "n/a"
    return "yes" if value else "**no**"


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to dashes."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


# -- charts -----------------------------------------------------------------------


#: Charts left undrawn for want of matplotlib (main says so in one line).
UNDRAWN: list[str] = []


def draw_bar_chart(
    charts: dict[str, str],
    chart: str,
    title: str,
    unit: str,
    groups: list[str],
    series: list[tuple[str, list[float]]],
) -> None:
    """charts[chart]: a grouped bar chart as a self-contained SVG document, drawn
    by the bench's chart engine (matplotlib); left out, and noted, without it."""
    from vllm_graph_sleep.bench.charts import grouped_bar_svg
    from vllm_graph_sleep.bench.plot import PlotUnavailable

    try:
        charts[chart] = grouped_bar_svg(title, unit, groups, series)
    except PlotUnavailable:
        UNDRAWN.append(chart)


# -- shared pieces ---------------------------------------------------------------


NOT_RECORDED = "- Hardware and versions: not recorded in this file."


def environment_lines(environment: Json | None) -> list[str]:
    if not environment:
        return [NOT_RECORDED]
    gpu = environment.get("gpu_name") or "not recorded"
    total = environment.get("gpu_total_memory_bytes")
    memory = f" ({mib(total)} MiB)" if total else ""
    platform = (
        f"ROCm/HIP {environment['hip']}"
        if environment.get("hip")
        else f"CUDA {environment.get('cuda') or 'n/a'}"
    )
    lines = [
        f"- Hardware: {gpu}{memory}, driver {environment.get('driver_version') or 'n/a'}.",
        f"- Versions: torch {environment.get('torch') or 'n/a'}, {platform}, "
        f"Python {environment.get('python') or 'n/a'}"
        + (f", vLLM {environment['vllm']}" if environment.get("vllm") else "")
        + ".",
    ]
    revision = environment.get("git_revision")
    lines.append(f"- Code: {code(revision) if revision else 'git revision not recorded'}.")
    return lines


class Section:
    def __init__(self, title: str, source: str, lines: list[str], gpu_platform: str | None):
        self.title = title
        self.source = source
        self.lines = lines
        # "cuda", "rocm" or None when the file does not say.
        self.gpu_platform = gpu_platform


def _platform_of(environment: Json | None) -> str | None:
    if not environment:
        return None
    if environment.get("hip"):
        return "rocm"
    if environment.get("cuda"):
        return "cuda"
    return None


# -- allocator benchmark ---------------------------------------------------------


def is_allocator_bench(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("bandwidth"), list)
        and ("environment" in data)
    )


def render_allocator_bench(name: str, data: Json, charts: dict[str, str]) -> Section:
    title = f"Allocator sleep/wake against plain pinned copies ({name})"
    settings = data.get("settings") or {}
    lines = [
        f"{data.get('benchmark', 'allocator benchmark')}. One allocation of each size under "
        f"tag {code(str(settings.get('tag', 'weights')))}; sleep = backup to pinned host + "
        "unmap, wake = map + restore. GB/s are 1e9 bytes per second over the median of "
        f"{settings.get('repeats', 'n/a')} steady-state cycles after a cold first one; "
        '"plain" is a torch copy of the same bytes to or from an already pinned host '
        f"tensor in the same run; the target ratio is {settings.get('target_ratio', 'n/a')}.",
        "",
        *provenance(data),
        *environment_lines(data.get("environment")),
        "",
    ]
    target = settings.get("target_ratio")
    rows, groups = [], []
    sleep_ours, sleep_plain, wake_ours, wake_plain = [], [], [], []
    for entry in data["bandwidth"]:
        size = f"{entry.get('size_gib', 0):g} GiB"
        if "error" in entry:
            rows.append([size, f"error: {entry['error']}", *[""] * 9])
            continue
        ours, plain, cold = entry["ours"], entry["plain"], entry["ours"]["cold"]
        memory = entry.get("memory") or {}
        met = entry.get("sleep_pass") and entry.get("wake_pass")
        rows.append(
            [
                size,
                fixed(ours["sleep"]["gbps"], 1),
                fixed(plain["d2h"]["gbps"], 1),
                fixed(entry["ratio_sleep_vs_d2h"], 2),
                fixed(ours["wake"]["gbps"], 1),
                fixed(plain["h2d"]["gbps"], 1),
                fixed(entry["ratio_wake_vs_h2d"], 2),
                flag(met) if target is not None else "n/a",
                f"{fixed(cold['sleep_gbps'], 2)} / {fixed(cold['wake_gbps'], 1)}",
                f"{mib(memory.get('driver_freed_by_sleep_bytes'))} / "
                f"{mib(memory.get('nvml_freed_by_sleep_bytes'))}",
                flag(entry.get("bit_exact")),
            ]
        )
        groups.append(size)
        sleep_ours.append(ours["sleep"]["gbps"])
        sleep_plain.append(plain["d2h"]["gbps"])
        wake_ours.append(ours["wake"]["gbps"])
        wake_plain.append(plain["h2d"]["gbps"])
    lines += table(
        [
            "size",
            "sleep GB/s",
            "plain D2H GB/s",
            "ratio",
            "wake GB/s",
            "plain H2D GB/s",
            "ratio",
            "target met",
            "cold sleep / wake GB/s",
            "freed while asleep, driver / NVML MiB",
            "bit-exact",
        ],
        rows,
    )
    if groups:
        chart = f"{Path(name).stem}.svg"
        draw_bar_chart(
            charts,
            chart,
            "Sleep and wake bandwidth: allocator vs plain pinned copies",
            "GB/s",
            groups,
            [
                ("sleep (ours)", sleep_ours),
                ("plain D2H", sleep_plain),
                ("wake (ours)", wake_ours),
                ("plain H2D", wake_plain),
            ],
        )
        lines += ["", f"![Sleep and wake bandwidth]({chart})"]
    small = data.get("small_allocations")
    if isinstance(small, dict) and "error" not in small:
        lines += [
            "",
            f"Many small allocations: {small['tensors']} tensors of "
            + ", ".join(format_exact_bytes(s) for s in small["tensor_sizes"])
            + " in turn, packed by torch into "
            f"{small['allocator_allocations']} allocations of the allocator "
            f"({mib(small['allocator_allocation_bytes'])} MiB). Milliseconds, median "
            "(first cycle):",
            "",
        ]
        rows = []
        for mode, meaning in (("offload", "backed up"), ("drop", "dropped, no backup")):
            timing = small.get(mode)
            if not timing:
                continue
            rows.append(
                [
                    f"{mode} ({meaning})",
                    fixed(timing["sleep"]["median_s"] * 1e3, 1),
                    fixed(timing["wake"]["median_s"] * 1e3, 1),
                    f"{fixed(timing['first']['sleep_s'] * 1e3, 1)} / "
                    f"{fixed(timing['first']['wake_s'] * 1e3, 1)}",
                    flag(timing.get("bit_exact")),
                ]
            )
        lines += table(["mode", "sleep ms", "wake ms", "first sleep / wake ms", "bit-exact"], rows)
    elif isinstance(small, dict):
        lines += ["", f"Many small allocations: error: {small['error']}"]
    return Section(title, name, lines, _platform_of(data.get("environment")))


# -- sleep memory ------------------------------------------------------------------

CONFIG_MEANING = {
    "ours": "this plugin, graph offload on",
    "stock_graphs": "stock vLLM, CUDA graphs",
    "stock_eager": "stock vLLM, `--enforce-eager`",
}
TAG_ORDER = ("weights", "kv_cache", "cudagraph")
LEVELS = (1, 2)


def is_sleep_memory(data: Any) -> bool:
    results = data.get("results") if isinstance(data, dict) else None
    return (
        isinstance(results, list)
        and bool(results)
        and all(isinstance(r, dict) and "level1_asleep_used_bytes" in r for r in results)
    )


def _tag_cell(usage: Json | None) -> str:
    if usage is None:
        return "-"
    parts = []
    for key, word in (
        ("mapped", "mapped"),
        ("backed_up", "on host"),
        ("dropped", "dropped"),
        ("asleep", "asleep"),
    ):
        if usage.get(key):
            parts.append(f"{mib(usage[key])} {word}")
    return ", ".join(parts) or "0"


def render_sleep_memory(name: str, data: Json, charts: dict[str, str]) -> Section:
    title = f"GPU memory while asleep: graph offload vs stock vLLM ({name})"
    results = data["results"]
    environment = data.get("environment")
    lines = [
        "Each configuration runs the same model and settings in its own process. "
        "Memory is NVML's used memory of the GPU once it stops moving (what another process "
        "can no longer use); per-tag figures are the worker's own allocator bookkeeping. "
        "Level 1 is followed by a full wake, level 2 by a staged wake (`weights`, "
        "`reload_weights`, `kv_cache`). Bit-exact: greedy tokens after the wake equal the "
        "tokens before the first sleep.",
        "",
        *provenance(data),
    ]
    if data.get("model"):
        lines.append(f"- Model: {code(str(data['model']))}")
    lines += environment_lines(environment)
    if not environment:
        totals = sorted(
            {
                r["awake_report"]["driver_total_bytes"]
                for r in results
                if isinstance(r.get("awake_report"), dict)
                and r["awake_report"].get("driver_total_bytes")
            }
        )
        if totals:
            lines.append(
                "- GPU memory reported by the driver: "
                + ", ".join(f"{mib(t)} MiB" for t in totals)
                + "."
            )
    lines += ["", "Configurations:", ""]
    for result in results:
        meaning = CONFIG_MEANING.get(result["config"], "")
        lines.append(f"- {code(result['config'])}" + (f": {meaning}" if meaning else ""))

    summary = data.get("summary") or {}
    lines += ["", "GPU memory used (MiB, NVML):", ""]
    rows = []
    for result in results:
        over = summary.get(result["config"], {})
        rows.append(
            [
                code(result["config"]),
                mib(result.get("awake_used_bytes")),
                *[mib(result.get(f"level{lv}_asleep_used_bytes")) for lv in LEVELS],
                *[fixed(over.get(f"level{lv}_over_stock_eager_mib"), 0) for lv in LEVELS],
            ]
        )
    lines += table(
        [
            "configuration",
            "awake",
            "asleep, level 1",
            "asleep, level 2",
            "level 1 over stock eager",
            "level 2 over stock eager",
        ],
        rows,
    )

    lines += ["", "Latency (seconds) and correctness:", ""]
    rows = []
    for result in results:
        rows.append(
            [
                code(result["config"]),
                fixed(result.get("start_s"), 1),
                fixed(result.get("level1_sleep_s"), 3),
                fixed(result.get("level1_wake_s"), 3),
                fixed(result.get("level2_sleep_s"), 3),
                fixed(result.get("level2_wake_s"), 3),
                f"{flag(result.get('level1_bit_exact'))} / {flag(result.get('level2_bit_exact'))}",
            ]
        )
    lines += table(
        [
            "configuration",
            "engine start",
            "level 1 sleep",
            "level 1 wake",
            "level 2 sleep",
            "level 2 staged wake + reload",
            "bit-exact L1 / L2",
        ],
        rows,
    )

    tags: list[str] = []
    for result in results:
        for state in ("awake", *[f"level{lv}_asleep" for lv in LEVELS]):
            report = result.get(f"{state}_report") or {}
            for tag in report.get("tags") or {}:
                if tag not in tags:
                    tags.append(tag)
    ordered = [t for t in TAG_ORDER if t in tags] + sorted(t for t in tags if t not in TAG_ORDER)
    if ordered:
        lines += [
            "",
            'Per tag (MiB, allocator bookkeeping; "on host" = pinned host backup, '
            '"-" = tag not used):',
            "",
        ]
        rows = []
        for result in results:
            for state, label in (
                ("awake", "awake"),
                *[(f"level{lv}_asleep", f"asleep, level {lv}") for lv in LEVELS],
            ):
                report = result.get(f"{state}_report")
                if not isinstance(report, dict):
                    continue
                per_tag = report.get("tags") or {}
                host = report.get("host_bytes")
                rows.append(
                    [
                        code(result["config"]),
                        label,
                        *[_tag_cell(per_tag.get(tag)) for tag in ordered],
                        mib(host) if host is not None else "n/a",
                    ]
                )
        lines += table(
            ["configuration", "state", *ordered, "pinned host held"],
            rows,
        )

    if summary:
        groups = [r["config"] for r in results if r["config"] in summary]
        series = [
            (
                f"level {lv}",
                [float(summary[g].get(f"level{lv}_over_stock_eager_mib") or 0.0) for g in groups],
            )
            for lv in LEVELS
        ]
        unit, chart_title = "MiB", "GPU memory used while asleep, over stock --enforce-eager"
    else:
        groups = [r["config"] for r in results]
        series = [
            (f"level {lv}", [r[f"level{lv}_asleep_used_bytes"] / MiB for r in results])
            for lv in LEVELS
        ]
        unit, chart_title = "MiB", "GPU memory used while asleep"
    chart = f"{Path(name).stem}.svg"
    draw_bar_chart(charts, chart, chart_title, unit, groups, series)
    lines += ["", f"![{chart_title}]({chart})"]
    return Section(title, name, lines, _platform_of(environment))


# -- any other benchmark with a results list ------------------------------------------


def is_generic_bench(data: Any) -> bool:
    results = data.get("results") if isinstance(data, dict) else None
    return (
        isinstance(results, list)
        and "command" in data
        and bool(results)
        and all(isinstance(r, dict) for r in results)
    )


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _cell(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return flag(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_generic_bench(name: str, data: Json, charts: dict[str, str]) -> Section:
    title = f"{data.get('benchmark') or Path(name).stem} ({name})"
    environment = data.get("environment")
    lines = [*provenance(data), *environment_lines(environment), ""]
    columns: list[str] = []
    for result in data["results"]:
        for key, value in result.items():
            if _scalar(value) and key not in columns:
                columns.append(key)
    rows = [[_cell(result.get(column, "")) for column in columns] for result in data["results"]]
    lines += table(columns, rows)
    return Section(title, name, lines, _platform_of(environment))


# -- vllm-graph-sleep bench ------------------------------------------------------------


def render_bench_run(name: str, data: Json, charts: dict[str, str]) -> Section:
    host = data.get("host") or {}
    return Section(
        run_title(name), name, run_lines(name, data), "cuda" if host.get("gpus") else None
    )


#: The bench's charts of a run, drawn beside its JSON by `vllm-graph-sleep bench
#: --report FILE.json` (vllm_graph_sleep/bench/charts.py): file suffix, alt text.
BENCH_CHARTS = (
    (".png", "GPU memory through the cycles"),
    (".asleep.png", "Asleep memory per configuration, with the floor"),
    (".wake.png", "Level-1 wake per configuration, full and staged"),
)


def _link_bench_charts(section: Section, results_dir: Path) -> None:
    """Shows the bench's charts of the run under its table, where they were drawn."""
    stem = Path(section.source).stem
    for suffix, alt in BENCH_CHARTS:
        if (results_dir / f"{stem}{suffix}").is_file():
            section.lines += ["", f"![{alt}]({stem}{suffix})"]


RENDERERS: tuple[tuple[Callable[[Any], bool], Callable[..., Section]], ...] = (
    (is_bench_run, render_bench_run),
    (is_allocator_bench, render_allocator_bench),
    (is_sleep_memory, render_sleep_memory),
    (is_generic_bench, render_generic_bench),
)


# -- the pages ----------------------------------------------------------------------

ARCHIVE = "archive"
TABLES = "tables.md"
ROCM_UNTESTED = (
    "**ROCm is untested on hardware.** None of these results ran on an AMD GPU: the "
    "ROCm build is compiled and linked in CI, its logic is tested on CPU with fakes, and "
    "its allocator code path runs on an NVIDIA GPU only through a HIP-on-CUDA test "
    "build, which does not exercise AMD's driver."
)
DATA_KINDS = {
    render_bench_run: "`vllm-graph-sleep bench`",
    render_allocator_bench: "allocator benchmark",
    render_sleep_memory: "sleep memory, in-process engines",
    render_generic_bench: "benchmark",
}


def _page_title(path: Path) -> str:
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def _data_row(name: str, data: Any, kind: str, pages: list[str]) -> list[str]:
    data = data if isinstance(data, dict) else {}
    what = kind
    if data.get("model") or data.get("benchmark"):
        model = Path(str(data.get("model"))).name if data.get("model") else ""
        what += f": {code(model)}" if model else f": {data.get('benchmark')}"
    if isinstance(data.get("summary"), dict) and kind == DATA_KINDS[render_bench_run]:
        what += ", " + ", ".join(code(c) for c in data["summary"])
    when = str(data.get("started") or data.get("timestamp") or "")[:10] or "not recorded"
    command = data.get("command")
    return [
        f"[{name}]({name})",
        what,
        when,
        code(short_command(command)) if command is not None else "not recorded",
        ", ".join(f"[{page}]({page})" for page in pages) or "none",
    ]


def render(results_dir: Path) -> dict[str, str]:
    """Everything this script writes: file name -> content. index.md is the table
    of contents (the pages, the data each cites, the archive); tables.md renders
    every data file in full."""
    charts: dict[str, str] = {}
    sections: list[Section] = []
    data_rows: list[tuple[str, Any, str]] = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            data_rows.append((path.name, None, "not rendered (not JSON)"))
            continue
        for matches, renderer in RENDERERS:
            if matches(data):
                sections.append(renderer(path.name, data, charts))
                data_rows.append((path.name, data, DATA_KINDS[renderer]))
                if renderer is render_bench_run:
                    _link_bench_charts(sections[-1], results_dir)
                break
        else:
            data_rows.append((path.name, data, "not rendered (format not recognised)"))

    outputs = {INDEX, TABLES, *charts}
    pages = sorted(p for p in results_dir.glob("*.md") if p.name not in outputs and p.is_file())
    page_texts = {page.name: page.read_text(encoding="utf-8") for page in pages}
    files = sorted(
        p.name
        for p in results_dir.iterdir()
        if p.is_file() and p.name not in outputs and not p.name.startswith(".")
    )

    def citing(name: str) -> list[str]:
        return [page for page, text in page_texts.items() if name in text and page != name]

    # A hand-written page that names a data file describes that run; say so where
    # the file itself does not record its hardware and versions.
    for section in sections:
        describing = citing(section.source)
        if describing:
            links = ", ".join(f"[{name}]({name})" for name in describing)
            section.lines = [
                line.replace(NOT_RECORDED, f"{NOT_RECORDED[:-1]}; {links} describes this run.")
                for line in section.lines
            ]

    rocm_runs = [s.source for s in sections if s.gpu_platform == "rocm"]
    rocm = (
        "**ROCm**: measured on AMD hardware in " + ", ".join(code(s) for s in rocm_runs) + "."
        if rocm_runs
        else ROCM_UNTESTED
    )
    generated = (
        "<!-- Generated by tools/render_results.py from the files in this folder. "
        "Do not edit by hand: run `python tools/render_results.py`. -->"
    )
    index = [
        "# Measured results",
        "",
        generated,
        "",
        "One page per subject, each saying what ran, on what, with which command and code, "
        "beside its data. [tables.md](tables.md) renders every data file in full; "
        "`python tools/render_results.py` regenerates both pages and the charts, and "
        "`tests/unit/test_render_results.py` fails when they are out of date.",
        "",
        rocm,
        "",
        "## Pages",
        "",
    ]
    for page in pages:
        cited = [n for n in files if not n.endswith(".md") and n in page_texts[page.name]]
        index.append(
            f"- [{_page_title(page)}]({page.name})"
            + (": " + ", ".join(f"[{n}]({n})" for n in cited) if cited else "")
        )
    index += ["", "## Data", ""]
    index += table(
        ["file", "what", "measured", "command (as recorded)", "cited by"],
        [_data_row(name, data, kind, citing(name)) for name, data, kind in data_rows],
    )
    uncited = [
        name
        for name in files
        if not name.endswith((".json", ".md"))
        and not citing(name)
        and not any(name == f"{Path(s.source).stem}.png" for s in sections)
    ]
    if uncited:
        index += ["", "Not cited by any page: " + ", ".join(f"[{n}]({n})" for n in uncited)]
    if (results_dir / ARCHIVE).is_dir():
        index += [
            "",
            "## History",
            "",
            f"Every earlier run's page, with a line on each: [{ARCHIVE}/]({ARCHIVE}/README.md).",
        ]

    tables = [
        "# Every data file, rendered",
        "",
        generated,
        "",
        "Every table below is rendered from a JSON file in this folder, written by the command "
        "shown with it on the hardware shown with it. The subject pages say what each run was "
        "for: see [index.md](index.md).",
        "",
        rocm,
        "",
        "## Contents",
        "",
    ]
    for section in sections:
        tables.append(f"- [{section.title}](#{anchor(section.title)})")
    for section in sections:
        tables += [
            "",
            f"## {section.title}",
            "",
            f"Data: [{section.source}]({section.source})",
            "",
            *section.lines,
        ]
    return {
        INDEX: "\n".join(index) + "\n",
        TABLES: "\n".join(tables) + "\n",
        **dict(sorted(charts.items())),
    }


# -- README's results table -----------------------------------------------------------

README = ROOT / "README.md"
README_BEGIN = re.compile(r"<!-- results table: (?P<source>\S+?\.json)(?: code=(?P<code>\w+))? -->")
README_END = "<!-- end of results table -->"


def readme_block(readme: str, results_dir: Path, source: str | None, revision: str | None) -> str:
    """README with its results table rendered again from the run its marker names,
    or from `source` (a path from the repository root) with the marker moved to it."""
    begin = README_BEGIN.search(readme)
    end = readme.find(README_END)
    if not begin or end < begin.end():
        raise ValueError(f"README has no '<!-- results table: FILE.json -->' ... '{README_END}'")
    if source is None:
        source, revision = begin["source"], revision or begin["code"]
    name = Path(source).name
    path = results_dir / name
    if not path.is_file():
        raise ValueError(f"{source}: no such file in {results_dir}")
    data = json.loads(path.read_text(encoding="utf-8"))
    if not is_bench_run(data):
        raise ValueError(f"{source}: not a `vllm-graph-sleep bench` result")
    pages = sorted(
        p.name
        for p in results_dir.glob("*.md")
        if p.name not in (INDEX, TABLES) and name in p.read_text(encoding="utf-8")
    )
    if not pages:
        raise ValueError(f"no page in {results_dir} names {name}: describe the run on a page first")
    folder = str(Path(source).parent)
    marker = f"<!-- results table: {source}" + (f" code={revision}" if revision else "") + " -->"
    lines = readme_table(data, source, f"{folder}/{pages[0]}", revision)
    return readme[: begin.start()] + "\n".join([marker, "", *lines, ""]) + readme[end:]


def stale(outputs: dict[str, str], directory: Path) -> list[str]:
    return [
        name
        for name, text in outputs.items()
        if not (directory / name).is_file()
        or (directory / name).read_text(encoding="utf-8") != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="folder of data files")
    parser.add_argument("--out", type=Path, help="output folder (default: --results)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the output (and README's table, for the default "
        "folder) is stale",
    )
    parser.add_argument(
        "--readme",
        nargs="?",
        const="",
        metavar="RUN.json",
        help="render README's results table again, from RUN.json (docs/results/NAME.json) "
        "if given, else from the run README names",
    )
    parser.add_argument("--code", help="with --readme RUN.json: the commit the run measured")
    args = parser.parse_args(argv)
    if args.readme is not None:
        text = README.read_text(encoding="utf-8")
        try:
            new = readme_block(text, args.results, args.readme or None, args.code)
        except ValueError as error:
            print(f"README.md not changed: {error}", file=sys.stderr)
            return 1
        README.write_text(new, encoding="utf-8")
        print(README)
        return 0
    outputs = render(args.results)
    if UNDRAWN:
        from vllm_graph_sleep.bench.plot import MATPLOTLIB_MISSING

        print(f"{', '.join(sorted(set(UNDRAWN)))} not drawn: {MATPLOTLIB_MISSING}", file=sys.stderr)
    out = args.out or args.results
    if args.check:
        names = stale(outputs, out)
        if args.results == RESULTS_DIR:
            text = README.read_text(encoding="utf-8")
            if readme_block(text, RESULTS_DIR, None, None) != text:
                names.append(str(README))
        if names:
            print(
                f"out of date in {out}: {', '.join(names)}; run python tools/render_results.py"
                " (and --readme for README.md)",
                file=sys.stderr,
            )
            return 1
        return 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in outputs.items():
        (out / name).write_text(text, encoding="utf-8")
        print(out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
