"""The Triton kernel that takes memory.fingerprints' fingerprints on the GPU:
one program per block, reading it once, in steps of _STEP words. A launch
covers at most _CHUNK_WORDS words, so that every size is an int32 and the
kernel that warm-up compiled is the only one (Triton passes an integer of
2**31 or more as i64 whatever do_not_specialize says, a second variant).

One launch per range, not one for every range: a kernel that read each block's
start from a table took 21-27 ms for 8 GiB in 64 ranges inside a sleep on an
H100, where launches per range took 6.2 ms (sleep_copy, the `unchanged` case;
docs/results/sleep-speed-h100.md), although back-to-back calls in
benchmarks/fingerprint_speed.py timed the table kernel at 3.3 ms."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES, LANES, WORD_BYTES, blocks

_STEP = 2048
_CHUNK_WORDS = 1 << 30  # 8 GiB, a whole number of blocks


@triton.jit
def _mix(x):
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= 0x94D049BB133111EB
    x ^= x >> 31
    return x


@triton.jit(do_not_specialize=["num_words"])
def fingerprint_kernel(words, out, num_words, BLOCK_WORDS: tl.constexpr, STEP: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    first = block * BLOCK_WORDS
    lane0 = tl.zeros([STEP], dtype=tl.uint64)
    lane1 = tl.zeros([STEP], dtype=tl.uint64)
    for step in range(0, BLOCK_WORDS, STEP):
        index = first + step + tl.arange(0, STEP).to(tl.int64)
        inside = index < num_words
        word = tl.load(words + index, mask=inside, other=0).to(tl.uint64, bitcast=True)
        position = (step + tl.arange(0, STEP)).to(tl.uint64)  # within the block
        term0 = _mix(word ^ (position * 0x9E3779B97F4A7C15 + 0x243F6A8885A308D3))
        term1 = _mix(word ^ (position * 0xD1B54A32D192ED03 + 0x13198A2E03707344))
        lane0 += tl.where(inside, term0, 0)
        lane1 += tl.where(inside, term1, 0)
    tl.store(out + 2 * block, tl.sum(lane0, axis=0).to(tl.int64, bitcast=True))
    tl.store(out + 2 * block + 1, tl.sum(lane1, axis=0).to(tl.int64, bitcast=True))


def fingerprint(data: torch.Tensor, out: torch.Tensor) -> None:
    """Writes the fingerprints of `data` (uint8, contiguous, a multiple of 8
    bytes starting 8-byte aligned) into `out` (int64, [blocks(len), LANES],
    on the same device), queued on the current stream."""
    if data.numel() % WORD_BYTES or data.data_ptr() % WORD_BYTES:
        raise ValueError(
            f"fingerprints take whole 8-byte words: {data.numel()} bytes at {data.data_ptr():#x}"
        )
    count = blocks(data.numel())
    if out.shape != (count, LANES) or out.dtype != torch.int64:
        raise ValueError(f"out must be int64 [{count}, {LANES}], not {out.dtype} {list(out.shape)}")
    if count == 0:
        return
    words = data.view(torch.int64)
    per_block = BLOCK_BYTES // WORD_BYTES
    for first in range(0, words.numel(), _CHUNK_WORDS):
        chunk = words[first : first + _CHUNK_WORDS]
        rows = out[first // per_block :]
        fingerprint_kernel[(blocks(chunk.numel() * WORD_BYTES),)](
            chunk, rows, chunk.numel(), BLOCK_WORDS=per_block, STEP=_STEP, num_warps=8
        )
