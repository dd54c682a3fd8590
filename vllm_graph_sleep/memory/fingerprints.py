"""Fingerprints of device memory, per block, computed on the GPU at memory
bandwidth: a sleep compares them with those of the host backup it kept, and
copies only the blocks that changed (issue 38).

A block's fingerprint is two 64-bit lanes. Word i of the block (8 bytes, its
position within the block) with value w adds mix(w ^ key_k(i)) to lane k,
modulo 2**64, where key_k(i) = i * M_k + S_k and mix is SplitMix64's finalizer
(Stafford's variant 13, a bijection of 64-bit words with full avalanche). So:
- a change to one word (any flipped bit of any byte, in a NaN payload or in
  data that is not bf16 at all) changes both lanes, always: for a fixed key,
  XOR and mix are bijections, so the word's term cannot stay the same;
- words that move within a block (two swapped, a shifted range) change their
  keys, and so their terms; a word that moves to another block changes both
  blocks, and each block is only ever compared with its own earlier fingerprint;
- several words that change together go unnoticed only if their term changes
  cancel in both lanes at once, which for terms this well mixed happens about
  once in 2**128.
The fingerprint is no defence against someone who crafts memory to collide
(the keys are fixed); it guards a process's own memory against its own
writes, which is what a kept backup needs.

The kernel that takes them is memory.fingerprint_kernel (it brings Triton).
"""

from __future__ import annotations

#: Bytes per fingerprinted block: what a sleep copies again when one byte changed.
BLOCK_BYTES = 1 << 20
WORD_BYTES = 8
#: Lanes per block, int64 each (their bits are the uint64 sums).
LANES = 2

# Keys and mixer. The kernel spells them out (Triton reads no Python globals
# that are not constexpr); the fake driver's reference implementation
# (tests/unit/fingerprint_reference.py) reads them here, and a test checks
# the kernel against it.
KEY_MULTIPLIERS = (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03)
KEY_OFFSETS = (0x243F6A8885A308D3, 0x13198A2E03707344)
MIX_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
MIX_SHIFTS = (30, 27, 31)


def blocks(num_bytes: int) -> int:
    """How many blocks (the last one possibly short) cover `num_bytes`."""
    return -(-num_bytes // BLOCK_BYTES)
