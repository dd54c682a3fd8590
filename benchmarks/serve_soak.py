"""Sleep/wake soak through a live `vllm serve` with graph offload.

One server (--enable-sleep-mode --sleep-mode-offload-cudagraph, dev endpoints on),
greedy reference tokens before any sleep, then --cycles cycles that alternate
level 1 and level 2 and, per level, full and staged wakes (weights, then
kv_cache; at level 2 reload_weights once the weights are back): level 1 full, level 2
staged, level 1 staged, level 2 full, and again. Each cycle records NVML used
memory of the GPU asleep and awake, the resident host memory of the server's
process tree (API server, engine core, workers) asleep and awake, and whether
the completion after the wake gave the reference tokens bit for bit. With
--checkpoint every sleep asks for the CUDA driver's checkpoint too (deep sleep,
issue 39), and each cycle also records whether /is_sleeping said so while asleep.

    python benchmarks/serve_soak.py --out docs/results/soak-h200.json

The summary says how far each figure moved after cycle 1 (the first cycle's
extra belongs to first-time allocations): NVML asleep and awake should stay
within ±2 MiB, host RSS within --rss-tolerance-mib; drift is reported, never
fatal. The JSON is rewritten after every cycle and on any failure.
Exit status: 0 when every cycle was exact (and /is_sleeping right), 1 when one
was not or the run failed, 2 when there is nothing to run on (no GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_graph_sleep.bench import live
from vllm_graph_sleep.bench.gpu import MemorySource, NoGpuError, settle
from vllm_graph_sleep.bench.runner import Progress
from vllm_graph_sleep.bench.server import ServerError
from vllm_graph_sleep.testing import PROMPTS, model_dir

#: (level, wake) of cycles 1, 2, 3, 4, then again: levels alternate every cycle
#: and each level alternates its wake.
KINDS = ((1, "full"), (2, "staged"), (1, "staged"), (2, "full"))
NVML_TOLERANCE_MIB = 2.0


def wake(client, level: int, kind: str) -> None:
    """Level 2 discarded the weights: they are reloaded once their memory is back
    (after the full wake, or between the stages of a staged one), as the bench does."""
    if kind == "full":
        client.wake_up()
        if level == 2:
            client.reload_weights()
        return
    client.wake_up(["weights"])
    if level == 2:
        client.reload_weights()
    client.wake_up(["kv_cache"])


def cycle(
    number: int,
    server: live.LiveServer,
    memory: MemorySource,
    reference: list[list[int]],
    max_tokens: int,
    checkpoint: bool = False,
) -> dict[str, Any]:
    client = server.client
    level, kind = KINDS[(number - 1) % len(KINDS)]
    record: dict[str, Any] = {"cycle": number, "level": level, "wake": kind}
    started = time.perf_counter()
    record["sleep_s"] = round(client.sleep(level, checkpoint=checkpoint), 4)
    record["is_sleeping_asleep"] = client.is_sleeping()
    record["asleep_mib"] = live.mib(settle(memory)[0])
    if checkpoint:  # a checkpointed engine runs nothing until its wake, the probe included
        record["checkpointed_asleep"] = client.checkpointed()
        record["asleep_mapped_mib"] = record["host_backup_mib"] = None
    else:
        asleep = client.memory_report()[0]
        record["asleep_mapped_mib"] = live.mib(sum(t["mapped"] for t in asleep["tags"].values()))
        record["host_backup_mib"] = live.mib(asleep.get("host_bytes", 0))
    record["host_rss_asleep_mib"] = live.mib(sum(server.rss().values()))
    begin = time.perf_counter()
    wake(client, level, kind)
    record["wake_s"] = round(time.perf_counter() - begin, 4)
    record["is_sleeping_awake"] = client.is_sleeping()
    check = live.compare(reference, client.complete(PROMPTS, max_tokens).token_ids)
    record.update(check)
    record["awake_mib"] = live.mib(settle(memory)[0])
    rss = server.rss()
    record["host_rss_mib"] = live.mib(sum(rss.values()))
    record["host_rss_by_process_mib"] = {name: live.mib(value) for name, value in rss.items()}
    record["cycle_s"] = round(time.perf_counter() - started, 3)
    return record


def flatness(records: list[dict[str, Any]], key: str, tolerance: float) -> dict[str, Any]:
    """How far `key` moved after cycle 1: against cycle 2 (max_dev_mib, and the
    cycle where it was largest), overall (spread_mib, drift_mib = last - cycle 2),
    and per level against that level's first cycle after cycle 1 (a steady
    difference between levels is not drift)."""
    first = records[0].get(key) if records else None
    result: dict[str, Any] = {"tolerance_mib": tolerance, "cycle1_mib": first}
    later = [r for r in records[1:] if r.get(key) is not None]
    if not later:
        result["flat"] = None
        return result
    base = later[0][key]
    worst = max(later, key=lambda r: abs(r[key] - base))
    by_level = {}
    for level in sorted({r["level"] for r in later}):
        series = [r[key] for r in later if r["level"] == level]
        by_level[str(level)] = round(max(abs(v - series[0]) for v in series), 3)
    result.update(
        cycle2_mib=base,
        min_mib=min(r[key] for r in later),
        max_mib=max(r[key] for r in later),
        spread_mib=round(max(r[key] for r in later) - min(r[key] for r in later), 3),
        drift_mib=round(later[-1][key] - base, 3),
        max_dev_mib=round(abs(worst[key] - base), 3),
        worst_cycle=worst["cycle"],
        max_dev_by_level_mib=by_level,
        flat=abs(worst[key] - base) <= tolerance,
    )
    return result


def summarize(records: list[dict[str, Any]], rss_tolerance: float) -> dict[str, Any]:
    return {
        "cycles_done": len(records),
        "all_exact": bool(records) and all(r.get("exact") is True for r in records),
        "inexact_cycles": [r["cycle"] for r in records if r.get("exact") is not True],
        "sleep_state_wrong_cycles": [
            r["cycle"]
            for r in records
            if r.get("is_sleeping_asleep") is not True
            or r.get("is_sleeping_awake") is not False
            or r.get("checkpointed_asleep") is False
        ],
        "asleep_mib": flatness(records, "asleep_mib", NVML_TOLERANCE_MIB),
        "awake_mib": flatness(records, "awake_mib", NVML_TOLERANCE_MIB),
        "host_rss_mib": flatness(records, "host_rss_mib", rss_tolerance),
        "host_rss_asleep_mib": flatness(records, "host_rss_asleep_mib", rss_tolerance),
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    lines = [
        f"cycles done: {summary['cycles_done']}, all exact: {summary['all_exact']}"
        + (f" (inexact: {summary['inexact_cycles']})" if summary["inexact_cycles"] else "")
    ]
    if summary["sleep_state_wrong_cycles"]:
        lines.append(
            "/is_sleeping wrong (not true asleep, not false awake, or not checkpointed "
            "asleep with --checkpoint) in cycles "
            f"{summary['sleep_state_wrong_cycles']}"
        )
    for key, label in (
        ("asleep_mib", "NVML asleep"),
        ("awake_mib", "NVML awake"),
        ("host_rss_mib", "host RSS awake"),
        ("host_rss_asleep_mib", "host RSS asleep"),
    ):
        s = summary[key]
        if s.get("flat") is None:
            lines.append(f"{label}: fewer than 2 cycles, no flatness figure")
            continue
        verdict = "FLAT" if s["flat"] else "NOT FLAT"
        lines.append(
            f"{label}: cycle 1 {s['cycle1_mib']:.1f} MiB; after it {s['min_mib']:.1f}.."
            f"{s['max_mib']:.1f} MiB, max deviation from cycle 2 {s['max_dev_mib']:.1f} MiB "
            f"(cycle {s['worst_cycle']}), drift {s['drift_mib']:+.1f} MiB, per level "
            f"{s['max_dev_by_level_mib']}: {verdict} (tolerance ±{s['tolerance_mib']:g} MiB)"
        )
    return lines


def run(
    args: argparse.Namespace,
    memory: MemorySource,
    command_for: live.CommandFor,
    model: str,
    progress: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Every cycle; returns the results, also written to args.out after each
    cycle and at the end, whatever happened."""
    progress = progress or Progress()
    records: list[dict[str, Any]] = []
    results: dict[str, Any] = {
        **live.header("sleep/wake soak, live vllm serve", memory, sys.argv),
        "settings": live.settings(args, model),
        "prompts": list(PROMPTS),
        "cycles": args.cycles,
        "results": records,
    }
    server = live.LiveServer(
        command_for, args.out.with_suffix(".server.log"), args.request_timeout, env
    )
    results["server_log"] = str(server.server.log_path)
    try:
        with live.time_limit(args.timeout):
            results["idle_mib"] = live.mib(settle(memory)[0])
            server.start(args.timeout, progress)
            results["start_s"] = round(server.start_s or 0.0, 3)
            reference, repeat = live.reference_tokens(server.client, PROMPTS, args.max_tokens)
            results["reference"] = reference
            results["stable_without_sleep"] = repeat["exact"]
            results["awake_before_mib"] = live.mib(settle(memory)[0])
            results["host_rss_before_mib"] = live.mib(sum(server.rss().values()))
            for number in range(1, args.cycles + 1):
                record = cycle(number, server, memory, reference, args.max_tokens, args.checkpoint)
                records.append(record)
                live.write_json(results, args.out)
                progress(
                    f"cycle {number}/{args.cycles} L{record['level']} {record['wake']:6}: "
                    f"asleep {record['asleep_mib']:.1f} MiB, awake {record['awake_mib']:.1f} "
                    f"MiB, host RSS {record['host_rss_mib']:.1f} MiB, "
                    + ("exact" if record["exact"] else f"DIFFERS {record.get('mismatch')}")
                )
    except (ServerError, live.Overtime, live.Interrupted) as error:
        results["error"] = str(error)
        progress(f"run failed after {len(records)} cycle(s): {error}")
    finally:
        results["server_exit_code"] = server.stop()
        results["summary"] = summary = summarize(records, args.rss_tolerance_mib)
        results["ok"] = (
            "error" not in results
            and results.get("stable_without_sleep") is True
            and len(records) == args.cycles
            and summary["all_exact"]
            and not summary["sleep_state_wrong_cycles"]
        )
        live.write_json(results, args.out)
    for line in summary_lines(summary):
        progress(line)
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    live.add_arguments(parser, default_timeout=500)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="every sleep asks for the CUDA driver's checkpoint too (/sleep?checkpoint=1)",
    )
    parser.add_argument(
        "--rss-tolerance-mib",
        type=float,
        default=16.0,
        help="host RSS movement after cycle 1 still called flat (default: %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm_graph_sleep.bench.gpu import NvmlMemory

    try:
        memory = NvmlMemory(1)
    except NoGpuError as error:
        print(f"serve_soak: {error}; nothing to run", file=sys.stderr)
        return 2
    model = args.model or model_dir("llama")
    results = run(args, memory, live.real_command(args, model), model)
    print(f"results: {args.out}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
