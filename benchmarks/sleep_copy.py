"""How long the allocator's level-1 sleep takes against a plain device-to-host
copy of the same bytes, and what keeping unchanged backups saves (issue 38).

One GPU, 8 GiB of bf16 weights (N(0, 0.02), what the coder is made for) in 64
tensors under the tag "weights". Each mode runs in a fresh process (the
allocator is a per-process singleton): raw backups, coded backups, and raw
backups with keeping switched off. In each, after a first sleep and wake
(host buffers made), --repeats rounds of:
- `changed`: every tensor rewritten with new weights, then a timed sleep;
- `unchanged`: a timed sleep right after the wake;
- `quarter`: 16 of the 64 tensors rewritten, then a timed sleep;
- `level_2`: a timed level-2 sleep (the weights dropped, no backup), a wake,
  the same weights copied back in (a reload of the same checkpoint), and
  `after_level_2`: the timed level-1 sleep that follows;
- `plain`: a timed copy of the same 8 GiB into one pinned host buffer made
  beforehand, non_blocking, then a synchronize;
every wake checked bit for bit against a device copy kept outside the pools.
Each sleep's own log line (where its time went) is kept for the last round.

    python benchmarks/sleep_copy.py --out docs/results/sleep-copy-h200.json

Exit status 0 when every mode ran and every wake was exact, 1 otherwise,
2 without a GPU or the extension.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vllm_graph_sleep.units import GiB, MiB

TENSORS = 64
# The level-1 sleeps timed against the plain copy.
SLEEP_CASES = ("changed", "unchanged", "quarter", "after_level_2")
# Everything timed: those, the level-2 sleep and the plain copy.
TIMED_CASES = (*SLEEP_CASES, "level_2", "plain")
MODES = {
    "raw": {
        "VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS": "0",
        "VLLM_GRAPH_SLEEP_KEEP_UNCHANGED_BACKUPS": "1",
    },
    "coded": {
        "VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS": "1",
        "VLLM_GRAPH_SLEEP_KEEP_UNCHANGED_BACKUPS": "1",
    },
    "raw_not_kept": {
        "VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS": "0",
        "VLLM_GRAPH_SLEEP_KEEP_UNCHANGED_BACKUPS": "0",
    },
}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "graph-sleep sleep:" in record.getMessage():
            self.sleeps.append(record.getMessage())


def _timed(action) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    action()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_mode(total_bytes: int, repeats: int) -> dict[str, Any]:
    from vllm_graph_sleep.allocator import GraphSleepAllocator

    lines = _Lines()
    logging.getLogger("vllm.graph_sleep").addHandler(lines)
    logging.getLogger("vllm.graph_sleep").setLevel(logging.INFO)
    alloc = GraphSleepAllocator.get_instance()
    per_tensor = total_bytes // TENSORS // 2  # bf16 elements
    generator = torch.Generator("cuda").manual_seed(0)

    def new_weights(into: torch.Tensor) -> None:
        into.normal_(0.0, 0.02, generator=generator)

    with alloc.use_memory_pool("weights"):
        weights = [
            torch.empty(per_tensor, dtype=torch.bfloat16, device="cuda") for _ in range(TENSORS)
        ]
    for tensor in weights:
        new_weights(tensor)
    expected = [tensor.clone() for tensor in weights]
    host = torch.empty(total_bytes, dtype=torch.uint8, pin_memory=True)
    exact = True
    # What vLLM's engine core does once it has started (vllm.utils.gc_utils.
    # freeze_gc_heap): a sleep's gc.collect then walks only what came after.
    # Without it the collection of torch's own objects took 70-86 ms of every
    # sleep here on the H200, against 0.5-3.9 ms in the bench's engine.
    gc.collect()
    gc.freeze()

    def sleep() -> float:
        return _timed(lambda: alloc.sleep(offload_tags=("weights",)))

    def wake() -> None:
        nonlocal exact
        alloc.wake_up()
        exact &= all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(weights, expected, strict=True)
        )
        # The check's temporaries, cached by torch: an engine's sleep would not
        # find them, and the sleep's own empty_cache took 88-124 ms for them
        # on the H200 (the first run of this script).
        torch.cuda.empty_cache()

    def rewrite(count: int) -> None:
        for tensor, copy in zip(weights[:count], expected[:count], strict=True):
            new_weights(tensor)
            copy.copy_(tensor)

    def plain() -> float:
        def copy_all() -> None:
            at = 0
            for tensor in weights:
                flat = tensor.view(torch.uint8)
                host[at : at + flat.numel()].copy_(flat, non_blocking=True)
                at += flat.numel()

        return _timed(copy_all)

    first = sleep()
    wake()
    seconds: dict[str, list[float]] = {case: [] for case in TIMED_CASES}
    copied: dict[str, int] = {}
    sleep_lines: dict[str, str | None] = {}
    for _ in range(repeats):
        seconds["plain"].append(plain())
        for case, count in (("changed", TENSORS), ("unchanged", 0), ("quarter", TENSORS // 4)):
            rewrite(count)
            lines.sleeps.clear()
            seconds[case].append(sleep())
            copied[case] = sum(alloc.last_backup().copied.values())
            sleep_lines[case] = lines.sleeps[-1] if lines.sleeps else None
            wake()
        seconds["level_2"].append(_timed(lambda: alloc.sleep(offload_tags=())))
        alloc.wake_up()  # the weights come back without contents...
        for tensor, copy in zip(weights, expected, strict=True):
            tensor.copy_(copy)  # ...until the reload writes them
        lines.sleeps.clear()
        seconds["after_level_2"].append(sleep())
        copied["after_level_2"] = sum(alloc.last_backup().copied.values())
        sleep_lines["after_level_2"] = lines.sleeps[-1] if lines.sleeps else None
        wake()
    return {
        "bytes": total_bytes,
        "first_sleep_s": first,
        "median_s": {case: statistics.median(values) for case, values in seconds.items()},
        "all_s": seconds,
        "copied_bytes": copied,
        "last_sleep_lines": sleep_lines,
        "coded": alloc.compress_backups,
        "kept": alloc.keeps_unchanged_backups,
        "exact": exact,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode-result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    total = int(args.gib * GiB) // (TENSORS * 2 * 4096) * TENSORS * 2 * 4096
    if args.mode_result:
        args.mode_result.write_text(json.dumps(run_mode(total, args.repeats)))
        return 0
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure", file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "benchmark": "allocator sleep against a plain device-to-host copy (issue 38)",
        "command": shlex.join(["python", "benchmarks/sleep_copy.py", *(argv or sys.argv[1:])]),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gib": args.gib,
        "tensors": TENSORS,
        "device": torch.cuda.get_device_name(),
    }
    ok = True
    for mode in args.modes:
        result = args.out.with_suffix(f".{mode}.part.json")
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--gib",
                str(args.gib),
                "--repeats",
                str(args.repeats),
                "--out",
                str(args.out),
                "--mode-result",
                str(result),
            ],
            env={**os.environ, **MODES[mode]},
            capture_output=True,
            text=True,
        )
        if child.returncode != 0 or not result.exists():
            report[mode] = {"error": child.stderr[-3000:]}
            ok = False
            continue
        report[mode] = json.loads(result.read_text())
        result.unlink()
        ok &= report[mode]["exact"]
        median = report[mode]["median_s"]
        ratios = {case: median[case] / median["plain"] for case in SLEEP_CASES}
        report[mode]["over_plain"] = ratios
        print(
            f"{mode:13s} plain {1000 * median['plain']:7.1f} ms | "
            + " | ".join(f"{c} {1000 * median[c]:7.1f} ms ({ratios[c]:.2f}x)" for c in ratios)
            + f" | level 2 {1000 * median['level_2']:7.1f} ms | exact {report[mode]['exact']}"
        )
    report["results"] = summary_rows(report, args.modes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


def summary_rows(report: dict[str, Any], modes: list[str]) -> list[dict[str, Any]]:
    """One row per mode and timed case, the results page's table
    (tools/render_results.py renders a report with "command" and "results"):
    the median in ms, its ratio to the plain copy's, the bytes copied."""
    rows = []
    for mode in modes:
        result = report.get(mode) or {}
        if "median_s" not in result:
            rows.append({"mode": mode, "case": "error", "median_ms": None})
            continue
        median = result["median_s"]
        for case in TIMED_CASES:
            copied = result["copied_bytes"].get(case)
            rows.append(
                {
                    "mode": mode,
                    "case": case,
                    "median_ms": round(1000 * median[case], 1),
                    "over_plain": round(median[case] / median["plain"], 3),
                    "copied_mib": None if copied is None else round(copied / MiB, 1),
                    "exact": result["exact"],
                }
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
