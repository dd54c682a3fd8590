"""The Triton kernel that takes memory.fingerprints' fingerprints on the GPU:
one program per block, reading it once, in steps of _STEP words; one launch
for every block of every range a sleep fingerprints.

Each program reads where its block starts, as a word offset from the lowest
range, and how many words it holds, from a table built on the host, one row
per block, and kept for the next launch over the same ranges; a block's
fingerprint depends only on its own words, so it is the same as that of a
launch over its range alone. The lowest range goes in as a
pointer argument: a kernel that turned each block's absolute address from the
table into a pointer took 21-27 ms inside a sleep for 8 GiB in 64 ranges on an
H100, where this one took 4.6-5.8 ms and launches per range 5.9-6.9 ms
(sleep_copy; docs/results/sleep-speed-h100.md)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES, LANES, WORD_BYTES, blocks
from vllm_graph_sleep.triton_device import launching_on

_STEP = 2048
_BLOCK_WORDS = BLOCK_BYTES // WORD_BYTES


@triton.jit
def _mix(x):
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= 0x94D049BB133111EB
    x ^= x >> 31
    return x


@triton.jit
def fingerprint_kernel(base, table, out, BLOCK_WORDS: tl.constexpr, STEP: tl.constexpr):
    # base: the lowest range, as int64 words; table: (word offset from base,
    # words) per block.
    block = tl.program_id(0).to(tl.int64)
    words = base + tl.load(table + 2 * block)
    num_words = tl.load(table + 2 * block + 1)
    lane0 = tl.zeros([STEP], dtype=tl.uint64)
    lane1 = tl.zeros([STEP], dtype=tl.uint64)
    for step in range(0, BLOCK_WORDS, STEP):
        offset = step + tl.arange(0, STEP)  # within the block
        inside = offset < num_words
        word = tl.load(words + offset, mask=inside, other=0).to(tl.uint64, bitcast=True)
        position = offset.to(tl.uint64)
        term0 = _mix(word ^ (position * 0x9E3779B97F4A7C15 + 0x243F6A8885A308D3))
        term1 = _mix(word ^ (position * 0xD1B54A32D192ED03 + 0x13198A2E03707344))
        lane0 += tl.where(inside, term0, 0)
        lane1 += tl.where(inside, term1, 0)
    tl.store(out + 2 * block, tl.sum(lane0, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + 2 * block + 1, tl.sum(lane1, axis=0).to(tl.int64, bitcast=True))


# A sleep's layout: (address, bytes) of each range, in order.
_Layout = tuple[tuple[int, int], ...]

# Launch tables kept, one per layout: a level-1 sleep's, a level-2 sleep's,
# the warm-up's, and one spare. About 16 bytes of pinned host memory per
# fingerprinted MiB each (214 KiB for the 8B's 13 GiB).
_LAYOUTS_KEPT = 4


def _layout(ranges: list[torch.Tensor]) -> _Layout:
    """The layout of `ranges`, each checked (at every call, whatever is kept):
    ValueError for one that is not contiguous uint8 in whole 8-byte words."""
    for data in ranges:
        if data.dtype != torch.uint8 or not data.is_contiguous():
            raise ValueError(f"fingerprints take contiguous uint8 ranges, not {data.dtype}")
        if data.numel() % WORD_BYTES or data.data_ptr() % WORD_BYTES:
            raise ValueError(
                "fingerprints take whole 8-byte words: "
                f"{data.numel()} bytes at {data.data_ptr():#x}"
            )
    return tuple((data.data_ptr(), data.numel()) for data in ranges)


def block_table(ranges: list[torch.Tensor]) -> torch.Tensor:
    """int64 [blocks, 2], on the host: where each block of `ranges` (in order)
    starts, and how many words it holds (a whole block but for each range's
    last). ValueError for a range that is not whole 8-byte words."""
    return _block_table(_layout(ranges))


def _block_table(layout: _Layout) -> torch.Tensor:
    starts = [address for address, _ in layout]
    lengths = [size // WORD_BYTES for _, size in layout]
    counts = torch.tensor([blocks(size) for _, size in layout], dtype=torch.int64)
    total = int(counts.sum())
    owner = torch.repeat_interleave(torch.arange(len(layout)), counts)
    index = torch.arange(total, dtype=torch.int64) - (torch.cumsum(counts, 0) - counts)[owner]
    table = torch.empty((total, 2), dtype=torch.int64)
    table[:, 0] = torch.tensor(starts, dtype=torch.int64)[owner] + index * BLOCK_BYTES
    remaining = torch.tensor(lengths, dtype=torch.int64)[owner] - index * _BLOCK_WORDS
    table[:, 1] = remaining.clamp_(max=_BLOCK_WORDS)
    return table


def _lowest(ranges: list[torch.Tensor]) -> torch.Tensor:
    return min((data for data in ranges if data.numel()), key=lambda data: data.data_ptr())


def _offsets(table: torch.Tensor, base: int) -> torch.Tensor:
    """`table` with each start as a word offset from `base`, as the kernel reads it."""
    offsets = table.clone()
    offsets[:, 0] = (table[:, 0] - base) // WORD_BYTES
    return offsets


@functools.lru_cache(maxsize=_LAYOUTS_KEPT)
def _launch_table(layout: _Layout, pinned: bool) -> torch.Tensor:
    """The table a launch over `layout` reads (never written after), pinned
    for a GPU: kept, so that a sleep over the layout of the one before builds
    nothing on the host. Built at a sleep on the 8B, it took 12-37 ms at some
    (why is open) and 0.3-1.3 ms at the others; kept, 0.02-0.14 ms at every
    sleep that found it (leases 13-15, docs/results/archive/sleep-speed-h100-2026-12-07.md)."""
    base = min(address for address, size in layout if size)
    offsets = _offsets(_block_table(layout), base)
    return offsets.pin_memory() if pinned else offsets


def _launch(
    base: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    step: int = _STEP,
    num_warps: int = 8,
) -> None:
    fingerprint_kernel[(table.shape[0],)](
        base.view(torch.int64),
        table,
        out,
        BLOCK_WORDS=_BLOCK_WORDS,
        STEP=step,
        num_warps=num_warps,
    )


def launch(
    ranges: list[torch.Tensor],
    table: torch.Tensor,
    out: torch.Tensor,
    step: int = _STEP,
    num_warps: int = 8,
) -> None:
    """Queues the kernel over `table` (block_table(ranges), on the host) into
    `out`, on the current stream of `out`'s device."""
    base = _lowest(ranges)
    offsets = _offsets(table, base.data_ptr())
    if out.device.type != "cpu":
        offsets = offsets.pin_memory()
    with launching_on(out.device):
        _launch(base, _to_device(offsets, out.device), out, step, num_warps)


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """From pinned memory, without waiting, on a GPU: a sleep releases the KV
    cache on another thread meanwhile, and the driver makes a synchronous copy
    wait for that (release.EarlyDrop). As it is for Triton's interpreter."""
    if device.type == "cpu":
        return table
    return table.to(device, non_blocking=True)


def fingerprint(ranges: list[torch.Tensor], out: torch.Tensor) -> None:
    """Writes the fingerprints of the blocks of `ranges` (uint8, contiguous,
    each a multiple of 8 bytes starting 8-byte aligned, all on `out`'s device)
    into `out` (int64, [sum of blocks(len), LANES]), range after range,
    queued on the current stream of `out`'s device in one launch, over the
    launch table kept for their layout (built where there is none)."""
    if any(data.device != out.device for data in ranges):
        raise ValueError(f"every range must be on {out.device}, as out is")
    layout = _layout(ranges)
    count = sum(blocks(size) for _, size in layout)
    if out.shape != (count, LANES) or out.dtype != torch.int64:
        raise ValueError(f"out must be int64 [{count}, {LANES}], not {out.dtype} {list(out.shape)}")
    if count:
        table = _launch_table(layout, out.device.type != "cpu")
        with launching_on(out.device):
            _launch(_lowest(ranges), _to_device(table, out.device), out)
