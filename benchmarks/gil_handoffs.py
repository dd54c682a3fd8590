"""What a Python thread busy beside a sleep or a wake costs them, with the
interpreter's switch interval as it is and as `quick_gil_handoffs` lowers it.

Each driver call of the extension gives the GIL up and takes it back after;
beside a thread busy in Python (an RL trainer's, with vLLM's engine in its
process) taking it back waits up to the switch interval, once per call
(vllm_graph_sleep/gil_handoffs.py). One GPU: --allocations tensors of --mib
each under the tag "kv_cache" (dropped at a sleep, mapped afresh at a wake:
driver calls, no copies), then --repeats rounds of four timed sleep-and-wake
cycles in turn: with or without a thread spinning in Python, at the
interpreter's interval or inside `quick_gil_handoffs` (what the backend does).

    python benchmarks/gil_handoffs.py --out gil-handoffs.json

Exit status 0 when every cycle ran, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from vllm_graph_sleep.gil_handoffs import SWITCH_INTERVAL_S, quick_gil_handoffs
from vllm_graph_sleep.units import MiB

WAYS = ("alone", "alone_quick", "beside_busy", "beside_busy_quick")


@contextlib.contextmanager
def busy_thread(on: bool):
    """A thread that spins in Python while the block runs (when `on`)."""
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin, name="busy-python") if on else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def cycle(alloc: Any, way: str) -> tuple[float, float]:
    """Seconds of one sleep (everything dropped) and of the wake after it."""
    quick = quick_gil_handoffs() if way.endswith("_quick") else contextlib.nullcontext()
    with busy_thread(way.startswith("beside_busy")), quick:
        start = time.perf_counter()
        alloc.sleep(offload_tags=())
        slept = time.perf_counter()
        alloc.wake_up()
        torch.cuda.synchronize()
        woke = time.perf_counter()
    return slept - start, woke - slept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocations", type=int, default=184, help="the 8B's: 184")
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gil_handoffs: no GPU visible, nothing to measure", file=sys.stderr)
        return 2
    from vllm_graph_sleep.allocator import GraphSleepAllocator

    alloc = GraphSleepAllocator.get_instance()
    with alloc.use_memory_pool("kv_cache"):
        held = [
            torch.empty(args.mib * MiB, dtype=torch.uint8, device="cuda")
            for _ in range(args.allocations)
        ]
    gc.collect()
    gc.freeze()  # as vLLM's engine core does once it has started
    cycle(alloc, "alone")  # the first sleep makes what the later ones reuse
    seconds: dict[str, dict[str, list[float]]] = {w: {"sleep": [], "wake": []} for w in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            slept, woke = cycle(alloc, way)
            seconds[way]["sleep"].append(slept)
            seconds[way]["wake"].append(woke)
    report = {
        "benchmark": "a busy Python thread beside a sleep and a wake (gil_handoffs)",
        "command": shlex.join(["python", "benchmarks/gil_handoffs.py", *(argv or sys.argv[1:])]),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "allocations": len(held),
        "mib_each": args.mib,
        "switch_interval_s": {"interpreter": sys.getswitchinterval(), "quick": SWITCH_INTERVAL_S},
        "median_ms": {
            way: {phase: round(1000 * statistics.median(v), 2) for phase, v in phases.items()}
            for way, phases in seconds.items()
        },
        "all_s": seconds,
    }
    for way, phases in report["median_ms"].items():
        print(f"{way:18s} sleep {phases['sleep']:8.2f} ms   wake {phases['wake']:8.2f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
