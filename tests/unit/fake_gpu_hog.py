"""A stand-in for benchmarks/wake_pressure.py's `hog` process, for its CPU tests
(stdlib only): it "takes" the free memory of tests/unit/fake_vllm_server.py's
fake GPU by writing the bytes it holds to the server's --pressure-file, speaks
the same protocol as the real one (one READY line on stdout, then holds until
stdin closes or SIGTERM) and gives the memory back when it ends, as the driver
does for a process that exits.

    python fake_gpu_hog.py --used-file PATH --pressure-file PATH --margin BYTES
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from fake_vllm_server import IDLE, TOTAL


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--used-file", type=Path, required=True)
    parser.add_argument("--pressure-file", type=Path, required=True)
    parser.add_argument("--margin", type=int, required=True)
    args = parser.parse_args()
    try:
        used = int(args.used_file.read_text())
    except (OSError, ValueError):
        used = IDLE
    free = TOTAL - used
    held = max(free - args.margin, 0)

    def give_back_and_exit(*_) -> None:
        # The harness closes stdin and then terminates: the signal can land
        # while the finally below runs, so the handler gives the memory back
        # itself (an exception raised there would skip the unlink).
        args.pressure_file.unlink(missing_ok=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, give_back_and_exit)
    try:
        args.pressure_file.write_text(str(held))
        print(f"READY {held} {free} {free - held}", flush=True)
        sys.stdin.read()
    finally:
        args.pressure_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
