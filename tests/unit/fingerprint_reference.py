"""The fingerprints of vllm_graph_sleep.memory.fingerprints, computed with
numpy on host memory: what the fake driver answers with, and the oracle the
Triton kernel is checked against (tests/unit/test_fingerprints.py)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_graph_sleep.memory import fingerprints as fp


def _mix(x: np.ndarray) -> np.ndarray:
    first, second, third = (np.uint64(shift) for shift in fp.MIX_SHIFTS)
    x = x ^ (x >> first)
    x = x * np.uint64(fp.MIX_MULTIPLIERS[0])
    x = x ^ (x >> second)
    x = x * np.uint64(fp.MIX_MULTIPLIERS[1])
    return x ^ (x >> third)


def fingerprints(data: torch.Tensor) -> torch.Tensor:
    """int64 [blocks, lanes] fingerprints of `data` (uint8, on the CPU)."""
    if data.numel() % fp.WORD_BYTES:
        raise ValueError(f"fingerprints take whole 8-byte words: {data.numel()} bytes")
    words = data.contiguous().numpy().view(np.uint64)
    per_block = fp.BLOCK_BYTES // fp.WORD_BYTES
    count = fp.blocks(data.numel())
    positions = np.arange(words.size, dtype=np.uint64) % np.uint64(per_block)  # within the block
    out = np.zeros((count, fp.LANES), dtype=np.uint64)
    for lane in range(fp.LANES):
        keys = positions * np.uint64(fp.KEY_MULTIPLIERS[lane]) + np.uint64(fp.KEY_OFFSETS[lane])
        terms = _mix(words ^ keys)
        padded = np.zeros(count * per_block, dtype=np.uint64)
        padded[: terms.size] = terms
        out[:, lane] = padded.reshape(count, per_block).sum(axis=1, dtype=np.uint64)
    return torch.from_numpy(out.view(np.int64))
