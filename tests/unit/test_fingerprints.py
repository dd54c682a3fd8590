"""The fingerprints a sleep compares to keep unchanged backup blocks (issue
38): any flipped bit of any byte changes its block's fingerprint and no
other's, whatever the bytes hold (bf16 NaN payloads, fp8, integers); moved
words change it; the Triton kernel, launched in chunks of whole blocks,
gives the numpy reference's numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.unit.fingerprint_reference import fingerprints
from vllm_graph_sleep.memory import fingerprints as fp

ROOT = Path(__file__).resolve().parents[2]
BLOCK = fp.BLOCK_BYTES


def _contents(kind: str, size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(hash(kind) % 1000)
    if kind == "bf16 NaNs":
        # Every word a NaN: exponent all ones, payloads that differ in one bit only.
        words = torch.full((size // 2,), 0x7FC0, dtype=torch.int16)
        words[::3] = 0x7FC1
        return words.view(torch.uint8)
    if kind == "fp8":
        values = torch.randn(size, generator=generator).to(torch.float8_e4m3fn)
        return values.view(torch.uint8)
    if kind == "int32":
        return torch.arange(size // 4, dtype=torch.int32).view(torch.uint8)
    if kind == "zeros":
        return torch.zeros(size, dtype=torch.uint8)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize("kind", ["bf16 NaNs", "fp8", "int32", "zeros", "random"])
def test_any_flipped_bit_changes_its_blocks_fingerprint_and_no_other(kind):
    data = _contents(kind, 3 * BLOCK)
    before = fingerprints(data)
    assert before.shape == (3, fp.LANES)
    generator = torch.Generator().manual_seed(7)
    places = torch.randint(0, data.numel(), (24,), generator=generator).tolist()
    for byte in [0, BLOCK - 1, BLOCK, data.numel() - 1, *places]:
        for bit in (0, 7) if byte not in places else (byte % 8,):
            flipped = data.clone()
            flipped[byte] ^= 1 << bit
            after = fingerprints(flipped)
            changed = (after != before).all(dim=1)  # both lanes
            assert changed.tolist() == [i == byte // BLOCK for i in range(3)], (kind, byte, bit)


def test_words_that_move_change_the_fingerprint():
    data = _contents("random", BLOCK)
    words = data.view(torch.int64)
    swapped = words.clone()
    swapped[[10, 20]] = swapped[[20, 10]]
    shifted = torch.roll(words, 1)
    before = fingerprints(data)
    for moved in (swapped, shifted):
        assert not torch.equal(fingerprints(moved.view(torch.uint8)), before)
    # A block's fingerprint is of its bytes, wherever the block is in the range.
    two = torch.cat([data, data])
    assert torch.equal(fingerprints(two), torch.cat([before, before]))


def test_a_short_last_block_and_bad_ranges():
    data = _contents("random", BLOCK + 4096)
    assert fingerprints(data).shape == (2, fp.LANES)
    assert fp.blocks(0) == 0 and fp.blocks(1) == 1 and fp.blocks(BLOCK) == 1
    pytest.importorskip("triton")
    from vllm_graph_sleep.memory import fingerprint_kernel

    out = torch.empty(1, fp.LANES, dtype=torch.int64)
    with pytest.raises(ValueError, match="whole 8-byte words"):
        fingerprint_kernel.fingerprint([torch.zeros(12, dtype=torch.uint8)], out)
    with pytest.raises(ValueError, match="whole 8-byte words"):
        fingerprint_kernel.fingerprint([torch.zeros(24, dtype=torch.uint8)[4:20]], out)
    with pytest.raises(ValueError, match="contiguous uint8"):
        fingerprint_kernel.fingerprint([torch.zeros(2, dtype=torch.int64)], out)
    with pytest.raises(ValueError, match=r"int64 \[1, 2\]"):
        fingerprint_kernel.fingerprint([torch.zeros(16, dtype=torch.uint8)], out[:, :1])
    with pytest.raises(ValueError, match=r"int64 \[2, 2\]"):
        fingerprint_kernel.fingerprint([torch.zeros(16, dtype=torch.uint8)] * 2, out)


def test_the_block_table_says_where_each_block_starts_and_how_many_words_it_holds():
    pytest.importorskip("triton")
    from vllm_graph_sleep.memory import fingerprint_kernel

    words = fp.BLOCK_BYTES // fp.WORD_BYTES
    first = torch.zeros(2 * fp.BLOCK_BYTES + 64, dtype=torch.uint8)
    second = torch.zeros(4096, dtype=torch.uint8)
    empty = torch.zeros(0, dtype=torch.uint8)
    table = fingerprint_kernel.block_table([first, empty, second[8:]])
    assert table.tolist() == [
        [first.data_ptr(), words],
        [first.data_ptr() + fp.BLOCK_BYTES, words],
        [first.data_ptr() + 2 * fp.BLOCK_BYTES, 8],
        [second.data_ptr() + 8, 511],
    ]
    assert fingerprint_kernel.block_table([]).shape == (0, 2)


def _interpreted(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh process under TRITON_INTERPRET=1 (which turns
    the interpreter on for kernels defined after it is set); fails the test
    if it fails."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


_KERNEL_CHECK = """
import torch
from tests.unit.fingerprint_reference import fingerprints
from vllm_graph_sleep.memory import fingerprint_kernel, fingerprints as fp
generator = torch.Generator().manual_seed(3)
ranges = []
for size in (8, 4096, fp.BLOCK_BYTES + 520):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
    if size > 8:
        data[:512] = 0xFF  # NaN bit patterns of every float type
    out = torch.empty(fp.blocks(size), fp.LANES, dtype=torch.int64)
    fingerprint_kernel.fingerprint([data], out)
    assert torch.equal(out, fingerprints(data)), size
    # A range that starts inside a larger buffer, as a graph-pool live range does.
    inner = data[8:]
    out = torch.empty(fp.blocks(inner.numel()), fp.LANES, dtype=torch.int64)
    fingerprint_kernel.fingerprint([inner], out)
    assert torch.equal(out, fingerprints(inner)), size
    ranges += [data, inner]
# Every range in one launch, as a sleep takes them: each block as alone.
out = torch.empty(sum(fp.blocks(r.numel()) for r in ranges), fp.LANES, dtype=torch.int64)
fingerprint_kernel.fingerprint(ranges, out)
assert torch.equal(out, torch.cat([fingerprints(r) for r in ranges])), "one launch"
print("kernel equals reference")
"""


def test_the_kernel_gives_the_references_fingerprints():
    """In Triton's interpreter, which TRITON_INTERPRET=1 turns on for kernels
    defined after it is set: a fresh process."""
    result = _interpreted(_KERNEL_CHECK)
    assert "kernel equals reference" in result.stdout


_KEPT_TABLE_CHECK = """
import torch
from tests.unit.fingerprint_reference import fingerprints
from vllm_graph_sleep.memory import fingerprint_kernel as fk, fingerprints as fp
built = []
real = fk._block_table
fk._block_table = lambda layout: built.append(layout) or real(layout)
generator = torch.Generator().manual_seed(5)
buffer = torch.randint(0, 256, (3 * fp.BLOCK_BYTES,), dtype=torch.uint8, generator=generator)

def check(ranges, label):
    out = torch.empty(sum(fp.blocks(r.numel()) for r in ranges), fp.LANES, dtype=torch.int64)
    fk.fingerprint(ranges, out)
    assert torch.equal(out, torch.cat([fingerprints(r) for r in ranges])), label

first = [buffer[: fp.BLOCK_BYTES + 64], buffer[2 * fp.BLOCK_BYTES :]]
check(first, "first")
buffer[100] ^= 1  # other contents, the same layout: its table is kept
check(first, "same layout")
assert len(built) == 1, built
# As many blocks, other bounds: a table of its own, and the first one kept.
moved = [buffer[8 : fp.BLOCK_BYTES + 64], buffer[2 * fp.BLOCK_BYTES : 3 * fp.BLOCK_BYTES - 8]]
check(moved, "moved")
assert len(built) == 2, built
check(first, "first again")
assert len(built) == 2, built
# Whatever is kept, each range is checked: the same address and size, not contiguous.
square = buffer[: 64 * 64]
check([square], "square")
try:
    fk.fingerprint([square.view(64, 64).T], torch.empty(1, fp.LANES, dtype=torch.int64))
except ValueError as error:
    assert "contiguous uint8" in str(error), error
else:
    raise AssertionError("a non-contiguous range was fingerprinted")
print("kept tables checked")
"""


def test_a_layout_fingerprinted_before_reuses_its_table_and_any_other_gets_its_own():
    """Issue 38: building the launch table at a sleep stalled for 12-37 ms on
    the 8B (leases 13-15); a sleep over the layout of one before builds none.
    In Triton's interpreter, on the host."""
    result = _interpreted(_KEPT_TABLE_CHECK)
    assert "kept tables checked" in result.stdout


_SPEED_CHECK = """
import torch
from benchmarks import fingerprint_speed
from vllm_graph_sleep.memory import fingerprint_kernel, fingerprints as fp
fingerprint_speed.STEPS, fingerprint_speed.WARPS = (1024, 2048), (4,)
real = fingerprint_kernel.fingerprint_kernel


class WrongAtOtherSteps:
    # The kernel, but rows written wrong when launched with a STEP the driver
    # does not use: the benchmark must notice.
    def __getitem__(self, grid):
        def launch(base, table, out, *args, STEP, **kwargs):
            real[grid](base, table, out, *args, STEP=STEP, **kwargs)
            if STEP != 2048:
                out[0, 0] ^= 1
        return launch


fingerprint_kernel.fingerprint_kernel = WrongAtOtherSteps()
rows = fingerprint_speed.measure(2 * fp.BLOCK_BYTES, 2, 1, torch.device("cpu"))
print({row["case"]: row["same"] for row in rows})
"""


def test_the_speed_benchmark_checks_every_variant_against_the_drivers_fingerprints():
    """benchmarks/fingerprint_speed.py, in Triton's interpreter: every case
    runs, and a variant that gives other fingerprints is marked so."""
    result = _interpreted(_SPEED_CHECK)
    assert result.stdout.strip().splitlines()[-1] == str(
        {
            "per_range": True,
            "one_launch": True,
            "one_range": True,
            "step1024_warps4": False,
            "step2048_warps4": True,
            "read": True,
        }
    )
