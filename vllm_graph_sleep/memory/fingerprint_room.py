"""Device memory for a sleep's fingerprints and their block table, taken
before the sleep empties torch's cache, from what torch caches there.

Taken after, by the first device allocations that follow that release, the
block table's host-side build stalled for 12-37 ms at the 8B's first sleep
and at its level-1 sleeps after a reload (leases 13 and 14,
docs/results/sleep-speed-h100.md). A sleep that finds its room too small
allocates as before."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from vllm_graph_sleep.memory import fingerprints as blocks_of
from vllm_graph_sleep.memory.records import Allocation

# Per device: int64 words, a block's fingerprint (its lanes) and its table
# row (where it starts, how many words) per block.
FingerprintRoom = dict[torch.device, torch.Tensor]

_WORDS_PER_BLOCK = blocks_of.LANES + 2


def reserve(
    allocations: Iterable[Allocation], device_of: Callable[[Allocation], torch.device]
) -> FingerprintRoom:
    """Room for the blocks of `allocations` (those mapped): as many as each
    one's last fingerprints had, or as its size holds where it has none (a
    graph-pool segment cut into many ranges may need more)."""
    rows: dict[int, int] = {}
    devices: dict[int, torch.device] = {}
    for allocation in allocations:
        if allocation.mapped:
            known = allocation.fingerprints
            blocks = blocks_of.blocks(allocation.size) if known is None else known.shape[0]
            rows[allocation.device] = rows.get(allocation.device, 0) + blocks
            if allocation.device not in devices:
                devices[allocation.device] = device_of(allocation)
    return {
        devices[index]: torch.empty(
            count * _WORDS_PER_BLOCK, dtype=torch.int64, device=devices[index]
        )
        for index, count in rows.items()
    }


def place(
    room: FingerprintRoom, device: torch.device, count: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fingerprints' `out` (int64 [count, LANES]) and their table's room
    (int64 [count, 2]) on `device`: in `room` where it holds them, else `out`
    of its own and no table room (the kernel then takes its own)."""
    words = room.get(device)
    if words is None or words.numel() < count * _WORDS_PER_BLOCK:
        return torch.empty((count, blocks_of.LANES), dtype=torch.int64, device=device), None
    out = words[: count * blocks_of.LANES].view(count, blocks_of.LANES)
    return out, words[count * blocks_of.LANES : count * _WORDS_PER_BLOCK].view(count, 2)
