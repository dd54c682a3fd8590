"""How long another Python thread may keep the GIL from a sleep or a wake.

Every driver call of the extension gives the GIL up while the driver works
(Py_BEGIN_ALLOW_THREADS) and takes it back when the driver returns. If another
thread of the process is busy in Python meanwhile (a trainer's, where an RL
framework runs vLLM's engine in its own process), taking it back waits up to
the interpreter's switch interval, 5 ms by default: once per call, and a sleep
or a wake makes hundreds (the 8B's sleep: 184 releases). Lease 21's probe 1
measured the wait on an H100 (docs/results/sleep-speed-h100.md);
`benchmarks/gil_handoffs.py` measures what it costs a sleep and a wake of the
allocator, with and without this. For the time of one, the switch interval is
lowered, so that a busy thread hands the GIL back within SWITCH_INTERVAL_S.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

# Well under one driver call of a sleep (releasing one of the bench's KV cache
# handles took about 1-2 ms in lease 21), and still thousands of the busy
# thread's bytecodes between two handoffs.
SWITCH_INTERVAL_S = 50e-6


@contextlib.contextmanager
def quick_gil_handoffs() -> Iterator[None]:
    """Lowers the interpreter's switch interval to SWITCH_INTERVAL_S (one
    already lower stays) and puts the one before back on the way out."""
    before = sys.getswitchinterval()
    if before <= SWITCH_INTERVAL_S:
        yield
        return
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)
