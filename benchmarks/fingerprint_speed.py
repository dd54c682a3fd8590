"""How fast a sleep's fingerprints are taken on one GPU, against the memory's
own read bandwidth, and what the kernel's launch shape changes (issue 38).

A sleep that keeps unchanged backups first fingerprints every byte it would
back up (on the 8B-class Llama, 13 GiB in 152 allocations), in one launch.
The calls here come back to back over slices of one allocation, so they time
the kernel's shapes, not a sleep: a kernel that ran 3.3 ms here took 21-27 ms
inside sleep_copy's sleeps (docs/results/sleep-speed-h100.md), and sleep_copy
is what says how long a sleep's fingerprints take. Over --gib of random bytes
cut into --ranges equal ranges, median wall time of --repeats (each call
waited for):
- `per_range`: the driver's fingerprint call once for each range, as a
  sleep made it before;
- `one_launch`: one call over all the ranges, as a sleep makes it;
- `one_range`: one call over all the bytes as one range;
- `step<STEP>_warps<W>`: the kernel launched over all the ranges with
  another STEP and num_warps; its fingerprints must equal `one_launch`'s (the
  fingerprint does not depend on either);
- `read`: torch summing the same bytes as int64, a read at the memory's
  bandwidth: what no fingerprint can beat.

    python benchmarks/fingerprint_speed.py --out fingerprint-speed.json

Exit status: 0 when every variant gave the same fingerprints, 1 otherwise,
2 without a GPU or Triton.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES, LANES, WORD_BYTES, blocks
from vllm_graph_sleep.units import GiB

STEPS = (1024, 2048, 4096)
WARPS = (4, 8, 16)
# What a sleep of the largest single-GPU models fingerprints, about.
MAX_GIB = 64


def timed(action: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median seconds of `action` with the device idle before and waited for after."""
    seconds = []
    for _ in range(repeats):
        _wait(device)
        start = time.perf_counter()
        action()
        _wait(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    total_bytes: int, ranges: int, repeats: int, device: torch.device
) -> list[dict[str, Any]]:
    """The cases' rows: case, seconds, whether its fingerprints equal the
    reference's, ms and GB/s. On the CPU only under TRITON_INTERPRET=1 (the
    unit test's check of the cases, not a measurement)."""
    from vllm_graph_sleep.memory import fingerprint_kernel

    words = torch.randint(
        -(2**62), 2**62, (total_bytes // WORD_BYTES,), dtype=torch.int64, device=device
    )
    data = words.view(torch.uint8)
    rows = blocks(total_bytes)
    reference = torch.empty((rows, LANES), dtype=torch.int64, device=device)
    parts = list(data.chunk(ranges))
    fingerprint_kernel.fingerprint(parts, reference)  # compiled here, not timed
    part_rows = torch.empty_like(reference).split([blocks(p.numel()) for p in parts])

    def per_range() -> None:
        for part, out in zip(parts, part_rows, strict=True):
            fingerprint_kernel.fingerprint([part], out)

    def same_as_reference(out: torch.Tensor) -> bool:
        return torch.equal(out, reference)

    results = [
        {"case": "per_range", "seconds": timed(per_range, repeats, device)},
        {
            "case": "one_launch",
            "seconds": timed(
                lambda: fingerprint_kernel.fingerprint(parts, reference), repeats, device
            ),
        },
        {
            "case": "one_range",
            "seconds": timed(
                lambda: fingerprint_kernel.fingerprint([data], reference), repeats, device
            ),
        },
    ]
    results[0]["same"] = same_as_reference(torch.cat(part_rows))
    results[1]["same"] = results[2]["same"] = True  # they wrote the reference
    table = fingerprint_kernel.block_table(parts)
    for step in STEPS:
        for warps in WARPS:
            out = torch.zeros_like(reference)

            def launch(out=out, step=step, warps=warps) -> None:
                fingerprint_kernel.launch(parts, table, out, step=step, num_warps=warps)

            launch()  # compiled here
            results.append(
                {
                    "case": f"step{step}_warps{warps}",
                    "seconds": timed(launch, repeats, device),
                    "same": same_as_reference(out),
                }
            )
    results.append({"case": "read", "seconds": timed(words.sum, repeats, device), "same": True})
    for result in results:
        result["ms"] = round(1000 * result["seconds"], 3)
        result["gb_per_s"] = round(total_bytes / result["seconds"] / 1e9, 1)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help=f"at most {MAX_GIB}")
    parser.add_argument("--ranges", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not 0 < args.gib <= MAX_GIB:
        parser.error(f"--gib must be more than 0 and at most {MAX_GIB}")
    if not torch.cuda.is_available():
        print("fingerprint_speed: no GPU visible, nothing to run", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError as error:
        print(f"fingerprint_speed: Triton missing ({error}), nothing to run", file=sys.stderr)
        return 2
    # Whole blocks, and as many in each range.
    total = int(args.gib * GiB) // (args.ranges * BLOCK_BYTES) * args.ranges * BLOCK_BYTES
    results = measure(total, args.ranges, args.repeats, torch.device("cuda"))
    report = {
        "benchmark": "fingerprint speed against a read of the same bytes (issue 38)",
        "command": shlex.join(
            ["python", "benchmarks/fingerprint_speed.py", *(argv or sys.argv[1:])]
        ),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "bytes": total,
        "ranges": args.ranges,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for result in results:
        print(
            f"{result['case']:22s} {result['ms']:9.3f} ms {result['gb_per_s']:8.1f} GB/s"
            f"{'' if result['same'] else '  DIFFERENT FINGERPRINTS'}"
        )
    return 0 if all(result["same"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
