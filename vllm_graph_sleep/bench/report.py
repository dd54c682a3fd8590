"""From the recorded results to numbers: per-configuration summary, the
side-by-side table (with ratios against stock), and the JSON file.

Everything here works on the results dictionary exactly as it is written to
JSON, so a recorded file can be summarised and printed again
(`vllm-graph-sleep bench --report results.json`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench import ledger_table
from vllm_graph_sleep.bench.server import CONFIG_LABELS
from vllm_graph_sleep.units import MiB

SCHEMA = "vllm-graph-sleep-bench/1"
#: Ratios are taken against the first of these that ran.
BASELINES = ("stock_graphs", "stock_eager")


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _over(used: list[int], baseline: list[int]) -> list[float]:
    return [(u - b) / MiB for u, b in zip(used, baseline, strict=True)]


def _fastest_decode_tps(decode: dict[str, Any] | None) -> float | None:
    """Decode speed from the fastest of the runs of `measure_decode` (the fastest
    all-tokens run minus the fastest one-token run). On a small model the host
    paces decode, and whatever else runs on it only slows a run down, so the
    fastest run tells two servers or two moments apart where medians of five
    scatter by 10-20% (seen on an H200 with the bench's default model)."""
    if not decode or not decode.get("all_tokens_s") or not decode.get("one_token_s"):
        return None
    seconds = min(decode["all_tokens_s"]) - min(decode["one_token_s"])
    return (decode["tokens"] - 1) / seconds if seconds > 0 else None


def _per_gpu_median(rows: list[list[float]]) -> list[float] | None:
    if not rows:
        return None
    return [statistics.median(column) for column in zip(*rows, strict=True)]


def _tag_mib(reports: list[dict[str, Any]] | None, key: str) -> dict[str, list[float]]:
    """Per tag, `key` bytes ("mapped", ...) per worker, in MiB."""
    tags: dict[str, list[float]] = {}
    if not reports:
        return tags
    for rank, report in enumerate(reports):
        for tag, entry in (report or {}).get("tags", {}).items():
            tags.setdefault(tag, [0.0] * len(reports))[rank] = entry.get(key, 0) / MiB
    return tags


def _first_sleep_pinning_ms(record: dict[str, Any]) -> list[float] | None:
    """Per GPU, the time torch spent pinning host memory between the awake report
    and the first sleep's report (the first sleep's host buffers); None without
    both reports."""
    steps = record.get("steps") or []
    before = record.get("awake_report")
    after = steps[0].get("asleep_report") if steps else None
    if not before or not after or len(before) != len(after):
        return None
    spans = []
    for awake, asleep in zip(before, after, strict=True):
        start = (awake or {}).get("pinned_host") or {}
        end = (asleep or {}).get("pinned_host") or {}
        if "pinning_s" not in start or "pinning_s" not in end:
            return None
        spans.append(1000 * (end["pinning_s"] - start["pinning_s"]))
    return spans


def sleeps_ms_by_kind(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """The run's sleeps by what came before them, in ms: "first" (the first
    sleep of the run), and the median of the later level-1 sleeps that follow a
    level-1 cycle ("level 1 after a wake": the backups kept from it apply) and
    of those that follow a level-2 cycle ("level 1 after level 2": the weights
    were reloaded; the host buffers level 2 kept apply to what the reload left
    as it was). Issue 38 holds each kind against stock's."""
    later: dict[str, list[float]] = {"level 1 after a wake": [], "level 1 after level 2": []}
    for before, step in zip(steps, steps[1:], strict=False):
        if step.get("level") == 1:
            kind = "level 1 after a wake" if before.get("level") == 1 else "level 1 after level 2"
            later[kind].append(1000 * step["sleep_s"])
    return {
        "first": 1000 * steps[0]["sleep_s"] if steps else None,
        **{kind: _median(values) for kind, values in later.items()},
    }


def _sleeps_in_engine(
    steps: list[dict[str, Any]], seconds: list[float] | None
) -> dict[str, dict[str, float | None]]:
    """The sleeps as vLLM logged them (the engine's side, without the round
    trip the client's figures include), per level and per kind as
    `sleeps_ms_by_kind` tells them apart; nothing where the log has no line
    per step (older files, a sleep that failed)."""
    if not seconds or len(seconds) != len(steps):
        return {}
    timed = [{**step, "sleep_s": s} for step, s in zip(steps, seconds, strict=True)]
    return {
        "sleep_engine_ms": _sleep_ms_by_level(timed),
        "sleep_engine_ms_by_kind": sleeps_ms_by_kind(timed),
    }


def _sleeps_in_allocator(
    steps: list[dict[str, Any]], engine: list[float] | None, allocator: list[float] | None
) -> dict[str, dict[str, float | None]]:
    """Of each sleep vLLM logged, the part in our allocator's sleep (its log
    line, the slowest rank) and the rest (vLLM's worker and executor, and our
    backend around the allocator), per level as `_sleep_ms_by_level` takes
    them: issue 38 looks for a sleep's time there. Nothing without a line of
    ours per step (stock, older files)."""
    if not engine or not allocator or not len(engine) == len(allocator) == len(steps):
        return {}
    inside = [{**step, "sleep_s": a} for step, a in zip(steps, allocator, strict=True)]
    outside = [
        {**step, "sleep_s": e - a} for step, e, a in zip(steps, engine, allocator, strict=True)
    ]
    return {
        "sleep_allocator_ms": _sleep_ms_by_level(inside),
        "sleep_outside_allocator_ms": _sleep_ms_by_level(outside),
    }


def _sleep_ms_by_level(steps: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median sleep of each level, in ms, keyed by the level as text; the
    run's first sleep left out (it pins the host buffers: a row of its own)."""
    later = steps[1:]
    medians = {}
    for level in sorted({s["level"] for s in steps}):
        median = _median([s["sleep_s"] for s in later if s["level"] == level])
        medians[str(level)] = None if median is None else 1000 * median
    return medians


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """The figures of one configuration (MiB over the idle GPU, ms, tok/s)."""
    base = record.get("baseline_used_bytes") or []
    steps = record.get("steps") or []
    summary: dict[str, Any] = {"start_s": record.get("start_s"), "gpus": len(base)}
    warm_ups = record.get("warm_up_start_s") or []
    summary["first_start_s"] = warm_ups[0] if warm_ups else None
    summary["engine_init"] = record.get("engine_init") or {}
    if record.get("error"):
        summary["error"] = record["error"]
    if "awake_used_bytes" in record:
        summary["awake_mib"] = _over(record["awake_used_bytes"], base)
    summary["tags_awake_mib"] = _tag_mib(record.get("awake_report"), "mapped")
    asleep, freed, mapped_back, host, pinned, tags_asleep, ledgers = {}, {}, {}, {}, {}, {}, {}
    asleep_ms = {}
    for level in sorted({s["level"] for s in steps}):
        mine = [s for s in steps if s["level"] == level]
        key = str(level)
        asleep[key] = _per_gpu_median([_over(s["asleep_used_bytes"], base) for s in mine])
        if all("before_sleep_used_bytes" in s for s in mine):  # older files have no such figure
            freed[key] = _per_gpu_median(
                [_over(s["before_sleep_used_bytes"], s["asleep_used_bytes"]) for s in mine]
            )
        # Read at once after the wake, before any request grows torch's cache again.
        mapped_back[key] = _per_gpu_median(
            [_over(s["awake_used_bytes"], s["asleep_used_bytes"]) for s in mine]
        )
        intervals = [s.get("asleep_s") for s in mine]
        if None not in intervals:  # older files have no such figure
            asleep_ms[key] = 1000 * _median(intervals)
        last_report = next((s["asleep_report"] for s in reversed(mine) if s["asleep_report"]), None)
        if last_report:
            tags_asleep[key] = _tag_mib(last_report, "mapped")
            backups = [r.get("host_bytes") for r in last_report]
            if all(b is not None for b in backups):
                host[key] = [b / MiB for b in backups]
            pinned_bytes = [(r.get("pinned_host") or {}).get("bytes") for r in last_report]
            if all(b is not None for b in pinned_bytes):
                pinned[key] = [b / MiB for b in pinned_bytes]
            if any(r.get("ledger") for r in last_report):
                ledgers[key] = [r.get("ledger") for r in last_report]
    wake_ms = {}
    for level, wake in sorted({(s["level"], s["wake"]) for s in steps}):
        mine = [s for s in steps if (s["level"], s["wake"]) == (level, wake)]
        wake_ms[f"{level} {wake}"] = 1000 * _median([s["wake_s"] for s in mine])
    reloads = [s["reload_s"] for s in steps if s.get("reload_s")]
    summary.update(_sleeps_in_engine(steps, record.get("sleeps_in_engine_s")))
    summary.update(
        _sleeps_in_allocator(
            steps, record.get("sleeps_in_engine_s"), record.get("sleeps_in_allocator_s")
        )
    )
    summary["first_sleep_pinning_ms"] = _first_sleep_pinning_ms(record)
    if record.get("backup_ahead_s") is not None:
        summary["backup_ahead_ms"] = 1000 * record["backup_ahead_s"]
    summary.update(
        asleep_mib=asleep,
        freed_mib=freed,
        mapped_back_mib=mapped_back,
        tags_asleep_mib=tags_asleep,
        host_backup_mib=host,
        pinned_host_mib=pinned,
        ledger_asleep=ledgers,
        sleep_ms=_sleep_ms_by_level(steps),
        sleep_ms_by_kind=sleeps_ms_by_kind(steps),
        asleep_before_wake_ms=asleep_ms,
        wake_ms=wake_ms,
        reload_ms=1000 * _median(reloads) if reloads else None,
        decode_tps={
            "before": (record.get("decode_before") or {}).get("tokens_per_s"),
            "again": (record.get("decode_before_again") or {}).get("tokens_per_s"),
            "after": (record.get("decode_after") or {}).get("tokens_per_s"),
        },
        decode_tps_fastest={
            "before": _fastest_decode_tps(record.get("decode_before")),
            "again": _fastest_decode_tps(record.get("decode_before_again")),
            "after": _fastest_decode_tps(record.get("decode_after")),
        },
        exact=[sum(1 for s in steps if s.get("bit_exact")), len(steps)],
        told_asleep=_told_asleep(steps),
        # None in files written before the bench took a second completion.
        repeats_before_sleep=(record.get("reference_repeat") or {}).get("bit_exact"),
    )
    return summary


def summarize_all(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    summaries = {r["config"]: summarize(r) for r in results.get("configs", [])}
    for name, summary in summaries.items():
        summary["start_rounds"] = _start_rounds(results, name)
    return summaries


def _start_rounds(results: dict[str, Any], name: str) -> dict[str, Any]:
    """Medians of the alternating starts of `name` that reached /health
    (bench/start_rounds.py), and how many there were."""
    done = [
        entry
        for entry in results.get("start_rounds") or []
        if entry["config"] == name and "start_s" in entry
    ]
    inits = [(entry.get("engine_init") or {}).get("engine_init_s") for entry in done]
    return {
        "count": len(done),
        "start_s": _median([entry["start_s"] for entry in done]),
        "engine_init_s": _median(inits),
    }


def baseline_of(names: list[str]) -> str | None:
    return next((b for b in BASELINES if b in names), None)


# -- the table ---------------------------------------------------------------

Getter = Callable[[dict[str, Any]], float | None]


def _get(*path: Any) -> Getter:
    def getter(summary: dict[str, Any]) -> float | None:
        value: Any = summary
        for key in path:
            if isinstance(value, dict):
                value = value.get(key)
            elif isinstance(value, list) and isinstance(key, int) and key < len(value):
                value = value[key]
            else:
                return None
        return value if isinstance(value, int | float) else None

    return getter


def _rows(summaries: dict[str, dict[str, Any]]) -> list[tuple[str, Getter, str]]:
    """(label, getter, number format) for every row the table shows."""
    gpus = max((s.get("gpus") or 1) for s in summaries.values()) if summaries else 1
    levels = sorted({k for s in summaries.values() for k in s.get("asleep_mib", {})})
    wakes = sorted({k for s in summaries.values() for k in s.get("wake_ms", {})})
    tags = sorted({t for s in summaries.values() for t in s.get("tags_awake_mib", {})})
    rounds = max((s.get("start_rounds", {}).get("count", 0) for s in summaries.values()), default=0)

    def per_gpu(label: str, *path: Any) -> list[tuple[str, Getter, str]]:
        if gpus == 1:
            return [(label, _get(*path, 0), "{:.0f}")]
        return [(f"{label} gpu{g}", _get(*path, g), "{:.0f}") for g in range(gpus)]

    rows: list[tuple[str, Getter, str]] = [
        ("engine start (s)", _get("start_s"), "{:.1f}"),
        ("engine start, first of the run (s)", _get("first_start_s"), "{:.1f}"),
        ("engine core init, vLLM's log (s)", _get("engine_init", "engine_init_s"), "{:.2f}"),
        ("  of which torch.compile (s)", _get("engine_init", "compile_s"), "{:.2f}"),
        (
            f"engine start, median of {rounds} alternating (s)",
            _get("start_rounds", "start_s"),
            "{:.1f}",
        ),
        (
            f"engine core init, median of {rounds} alternating (s)",
            _get("start_rounds", "engine_init_s"),
            "{:.2f}",
        ),
    ]
    rows += per_gpu("awake, over idle GPU (MiB)", "awake_mib")
    for level in levels:
        rows += per_gpu(f"asleep L{level}, over idle GPU (MiB)", "asleep_mib", level)
    for level in levels:
        rows += per_gpu(f"freed by L{level} sleep (MiB)", "freed_mib", level)
    for level in levels:
        rows += per_gpu(f"mapped back by the L{level} wake (MiB)", "mapped_back_mib", level)
    for tag in tags:
        rows += per_gpu(f"tag {tag}, awake (MiB)", "tags_awake_mib", tag)
    for level in levels:
        rows += per_gpu(f"host backup at L{level} (MiB)", "host_backup_mib", level)
    for level in levels:
        rows += per_gpu(f"pinned host memory at L{level} (MiB)", "pinned_host_mib", level)
    # Ours backs the weights up at the end of the engine's start, where
    # stock's first sleep pins and copies them: the two rows side by side.
    rows.append(("weights backed up at the engine's start (ms)", _get("backup_ahead_ms"), "{:.0f}"))
    rows += per_gpu("pinning in the first sleep (ms)", "first_sleep_pinning_ms")
    rows += _sleep_rows(
        levels, "sleep L{}, median after the first sleep (ms)", "sleep_ms", "{:.0f}"
    )
    rows += _sleep_rows(
        levels,
        "sleep L{} in the engine (vLLM's log), median after the first sleep (ms)",
        "sleep_engine_ms",
        "{:.1f}",
    )
    for level in levels:
        for label, key in (
            ("in our allocator (its log line)", "sleep_allocator_ms"),
            ("outside our allocator (vLLM's figure less it)", "sleep_outside_allocator_ms"),
        ):
            row = f"sleep L{level} {label}, median after the first sleep (ms)"
            rows.append((row, _get(key, level), "{:.1f}"))
    for level in levels:
        asleep = _get("asleep_before_wake_ms", level)
        rows.append((f"asleep before the wake, L{level} (ms)", asleep, "{:.0f}"))
    for wake in wakes:
        rows.append((f"wake L{wake} (ms)", _get("wake_ms", wake), "{:.0f}"))
    rows.append(("reload_weights after L2 (ms)", _get("reload_ms"), "{:.0f}"))
    rows.append(("decode before 1st sleep (tok/s)", _get("decode_tps", "before"), "{:.0f}"))
    rows.append(("  measured again, still before (tok/s)", _get("decode_tps", "again"), "{:.0f}"))
    rows.append(("decode after last wake (tok/s)", _get("decode_tps", "after"), "{:.0f}"))
    for label, moment in (
        ("decode before 1st sleep, fastest run (tok/s)", "before"),
        ("  measured again, fastest run (tok/s)", "again"),
        ("decode after last wake, fastest run (tok/s)", "after"),
    ):
        rows.append((label, _get("decode_tps_fastest", moment), "{:.0f}"))
    return rows


def _sleep_rows(levels: list[str], label: str, key: str, fmt: str) -> list[tuple[str, Getter, str]]:
    """A row per level of the sleeps under `key` (`label` names the level),
    and under level 1 one per kind of sleep (`key`_by_kind, sleeps_ms_by_kind)."""
    rows = []
    for level in levels:
        rows.append((label.format(level), _get(key, level), fmt))
        if level == "1":
            for kind_label, kind in (
                ("  the run's first sleep (ms)", "first"),
                ("  later, after an L1 cycle (ms)", "level 1 after a wake"),
                ("  later, after an L2 cycle and reload (ms)", "level 1 after level 2"),
            ):
                rows.append((kind_label, _get(f"{key}_by_kind", kind), fmt))
    return rows


def table_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]], str | None]:
    """The table as text cells: the configurations (columns), one row per figure
    (label first; each figure with its ratio to the baseline), and the baseline.
    `format_table` prints it; tools/render_results.py writes it as Markdown."""
    summaries = summarize_all(results)
    names = list(summaries)
    baseline = baseline_of(names)
    lines: list[list[str]] = []
    for label, getter, fmt in _rows(summaries):
        values = [getter(summaries[n]) for n in names]
        if all(v is None for v in values):
            continue
        reference = getter(summaries[baseline]) if baseline else None
        cells = [label]
        for name, value in zip(names, values, strict=True):
            if value is None:
                cells.append("-")
                continue
            cell = fmt.format(value)
            if name != baseline and reference not in (None, 0):
                cell += f" ({value / reference:.2f}x)"
            cells.append(cell)
        lines.append(cells)
    exact = ["bit-exact after wake"]
    for name in names:
        good, total = summaries[name]["exact"]
        exact.append(f"{good}/{total}" + ("" if good == total else " DIFFER"))
    lines.append(exact)
    repeats = [summaries[name]["repeats_before_sleep"] for name in names]
    if any(repeat is not None for repeat in repeats):  # older files render as they did
        lines.append(
            [
                "same tokens twice before any sleep",
                *("-" if repeat is None else "yes" if repeat else "NO" for repeat in repeats),
            ]
        )
    return names, lines, baseline


RATIO_NOTE = (
    "Memory: NVML used memory minus the idle GPU before the server started; medians over "
    "the cycles. Engine start: to the first 200 on /health, after the warm-up starts (if any) "
    "of the same configuration filled its compile caches; engine core init: what vLLM logs "
    "for it (profile, KV cache, compilation, graph capture, kernel warm-up); alternating "
    "(--start-rounds): medians of the starts made after every configuration ran, the order "
    "rotated each round."
)


def ledger_rows(results: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The ledger while asleep as text cells: the configurations (columns) and one
    row per level, field and GPU (bench.ledger_table); no rows without ledgers."""
    summaries = summarize_all(results)
    return list(summaries), ledger_table.rows(summaries)


def _aligned(header: list[str], lines: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

    def render(row: list[str]) -> str:
        cells = [c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        return "  ".join(cells).rstrip()

    return [render(header), "  ".join("-" * w for w in widths), *map(render, lines)]


def floor_mib(results: dict[str, Any]) -> list[float] | None:
    """The run's floor (bench/floor.py) per GPU, MiB over the idle GPU; None
    when it was not measured."""
    measured = results.get("floor") or {}
    if "used_bytes" not in measured:
        return None
    return _over(measured["used_bytes"], measured["baseline_used_bytes"])


def floor_line(results: dict[str, Any]) -> str | None:
    """The run's floor (bench/floor.py) in one line; None when it was not measured."""
    measured = results.get("floor")
    if not measured:
        return None
    mib = floor_mib(results)
    if mib is None:
        return f"floor ({measured.get('what')}): not measured: {measured.get('error')}"
    values = ", ".join(f"{value:.0f}" for value in mib)
    return f"floor ({measured.get('what')}): {values} MiB over the idle GPU"


def start_line(results: dict[str, Any]) -> str | None:
    """How this run's engine starts were measured, in one line; None for files
    written before the bench said (they have no "engine_core_start")."""
    method = results.get("engine_core_start")
    if method is None:
        return None
    core = "forked" if method == "fork" else f"started by {method}"
    # bench/model_info.py: the first start does not pay vLLM's model inspection alone.
    warmed = (
        " and vLLM's model-info cache warmed before the first"
        if results.get("model_info_warm") == "done"
        else ""
    )
    warm = (results.get("settings") or {}).get("warm_starts") or 0
    if warm:
        return (
            f"engine start: after {warm} warm-up start(s) of the same configuration "
            f"(compile caches warm), engine core {core}."
        )
    return (
        "engine start: each configuration's first start in this run, with the compile caches "
        f"as this host had them (none on its first run){warmed}, engine core {core}; "
        "--warm-starts 2 measures starts with warm caches."
    )


def format_table(results: dict[str, Any]) -> str:
    """One table, configurations side by side, each figure with its ratio to stock;
    then the ledger while asleep, side by side the same way."""
    names, lines, baseline = table_rows(results)
    header = ["", *[CONFIG_LABELS.get(n, n) for n in names]]
    summaries = summarize_all(results)
    out = _aligned(header, lines)
    out += [f"error ({n}): {s['error']}" for n, s in summaries.items() if s.get("error")]
    if baseline:
        out.append(f"ratios: against {CONFIG_LABELS.get(baseline, baseline)}. {RATIO_NOTE}")
    for line in (start_line(results), floor_line(results)):
        if line:
            out.append(line)
    switches = results.get("switches") or {}
    if switches:
        out.append("switches: " + ", ".join(f"{k}={v}" for k, v in sorted(switches.items())))
    ledger_lines = ledger_table.rows(summaries)
    if ledger_lines:
        out += ["", *_aligned(header, ledger_lines), ledger_table.note(ledger_lines)]
    return "\n".join(out)


def _told_asleep(steps: list[dict[str, Any]]) -> list[int] | None:
    """[cycles whose /is_sleeping said asleep after the sleep and awake after
    the wake, cycles asked]; None in files written before the bench asked."""
    asked = [s for s in steps if "is_sleeping_asleep" in s and "is_sleeping_awake" in s]
    if not asked:
        return None
    good = [s for s in asked if s["is_sleeping_asleep"] is True and s["is_sleeping_awake"] is False]
    return [len(good), len(asked)]


def _short_of(results: dict[str, Any], key: str) -> list[str]:
    """Configurations whose [good cycles, cycles] under `key` has a bad one
    (None: the file has no such figure)."""
    return [
        name
        for name, summary in summarize_all(results).items()
        if (counted := summary.get(key)) is not None and counted[0] != counted[1]
    ]


def not_told_asleep(results: dict[str, Any]) -> list[str]:
    """Configurations with a cycle whose /is_sleeping contradicted the sleep or
    the wake: a sleep that answered 200 and did nothing passes the token check."""
    return _short_of(results, "told_asleep")


def not_exact(results: dict[str, Any]) -> list[str]:
    """Configurations with a cycle whose tokens differ from the reference."""
    return _short_of(results, "exact")


def not_repeatable(results: dict[str, Any]) -> list[str]:
    """Configurations that gave different tokens for the same prompts twice
    before any sleep (not deterministic on this model)."""
    return [
        name
        for name, summary in summarize_all(results).items()
        if summary["repeats_before_sleep"] is False
    ]


def write_json(results: dict[str, Any], path: Path) -> None:
    results = {**results, "summary": summarize_all(results)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    schema = data.get("schema") if isinstance(data, dict) else None
    if schema != SCHEMA:
        raise ValueError(f"{path}: not a bench result (schema {schema!r}, want {SCHEMA!r})")
    return data
