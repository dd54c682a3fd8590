"""The host's planning of the coder (`coded_backup._plan` for every allocation, and the
decoder tables it sends) on the CPU, for the 8B's 161 allocation sizes: made to compare the
code of one commit with another's on the same host. No GPU; the counts are made up (30
exponents in use, as in bf16 weights). Usage: python plan_host_cost.py <repository root>"""

import random
import sys
import time

import torch

sys.path.insert(0, sys.argv[1])
from vllm_graph_sleep import coded_backup  # noqa: E402

MIB = 1 << 20
sizes = [size * MIB for _ in range(32) for size in (48, 32, 224, 112, 2)] + [1002 * MIB]
memory = torch.empty(max(sizes), dtype=torch.uint8)
allocations = [[(memory[:size], memory[:size])] for size in sizes]
random.seed(0)
counts = [
    [
        [0] * 100 + [random.randint(1000, 100000) for _ in range(30)] + [0] * 126
        for _ in range(-(-size // coded_backup.PIECE_BYTES))
    ]
    for size in sizes
]


def plan_all():
    return [coded_backup._plan(pairs, n, counts[n]) for n, pairs in enumerate(allocations)]


plan_ms, tables_ms = [], []
for _ in range(7):
    started = time.perf_counter()
    planned = plan_all()
    plan_ms.append(1000 * (time.perf_counter() - started))
    started = time.perf_counter()
    # Built in _plan before c79ec53; since, when a sleep first sends the table.
    tables = [backup.lookup for backup, _ in planned]
    tables_ms.append(1000 * (time.perf_counter() - started))
totals = [a + b for a, b in zip(plan_ms, tables_ms, strict=True)]
print(
    f"{sys.argv[1]}: plan {min(plan_ms):.1f} ms, decoder tables after it {min(tables_ms):.1f} ms, "
    f"both {min(totals):.1f} ms (fastest of 7)"
)
