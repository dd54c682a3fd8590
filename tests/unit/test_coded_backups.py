"""Weight backups coded on the device (VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1),
through the allocator with the fake driver: every byte comes back, bf16
weights take about two thirds of the bytes on the host, what does not shrink
is kept raw. The kernels run in Triton's CPU interpreter (tests/unit/
triton_interpreter.py), with 1 MiB pieces: two to an allocation."""

from __future__ import annotations

import logging
import re
import sys

import pytest
import torch

from tests.unit.fake_vmm import FakeVmmDriver
from tests.unit.test_allocator_bookkeeping import allocate, make
from tests.unit.test_exponent_codec import bf16_weights
from tests.unit.triton_interpreter import interpret_codec
from vllm_graph_sleep import coded_backup, exponent_codec
from vllm_graph_sleep.allocator import GraphSleepAllocator

MIB = 1 << 20
SIZE = 2 * MIB  # the fake driver's granule


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    # A lane of 128 symbols codes bf16 weights in 0.69 of their bytes (0.67
    # with the real 512), a program of 4096 lanes a piece.
    interpret_codec(monkeypatch, symbols_per_lane=128, lanes_per_program=4096)
    monkeypatch.setattr(coded_backup, "PIECE_BYTES", MIB)
    # Every changed piece is coded again, however few its bytes: the tests of
    # copying small changes raw set their own bound.
    monkeypatch.setattr(coded_backup, "RECODE_MIN_BYTES", 0)
    # What a worker starts its first sleep with: the coder compiled and
    # checked at its warm-up (coded_backup.prepare; the tests of that first
    # use, and of a sleep short of memory for it, start before it), no
    # warning said yet.
    monkeypatch.setattr(coded_backup, "_broken", None)
    monkeypatch.setattr(coded_backup, "_proven", {torch.device("cpu")})
    monkeypatch.setattr(coded_backup, "_warned_short_of_memory", False)


def coded_weights(seed: int) -> tuple[FakeVmmDriver, GraphSleepAllocator, int]:
    """An allocator that codes backups, with one allocation of bf16 weights."""
    driver, manager = make(compress_backups=True)
    weights = allocate(driver, manager, "weights", SIZE)
    driver.memory[weights].copy_(bf16_weights(SIZE // 2, seed=seed))
    return driver, manager, weights


@pytest.fixture
def first_use(monkeypatch):
    """A process whose coder was never used: its first use is still to come."""
    monkeypatch.setattr(coded_backup, "_proven", set())


def test_coded_weight_backups_come_back_bit_exact_in_fewer_bytes(caplog):
    driver, manager = make(compress_backups=True)
    weights = allocate(driver, manager, "weights", SIZE)
    noise = allocate(driver, manager, "weights", SIZE)
    runtime = allocate(driver, manager, "runtime", SIZE)
    driver.memory[weights].copy_(bf16_weights(SIZE // 2, seed=1))
    generator = torch.Generator().manual_seed(2)
    noise_bytes = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=generator)
    driver.memory[noise].copy_(noise_bytes)
    driver.memory[runtime].copy_(bf16_weights(SIZE // 2, seed=3))
    expected = {address: driver.memory[address].clone() for address in (weights, noise, runtime)}

    for cycle in range(2):
        with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
            manager.sleep(offload_tags=("weights", "runtime"))
        coded = manager.allocations[weights].coded
        assert coded is not None and len(coded.pieces) == 2
        assert all(piece.coded is not None for piece in coded.pieces)
        assert coded.coded_bytes < 0.7 * SIZE
        assert all(piece.coded is None for piece in manager.allocations[noise].coded.pieces)
        assert manager.allocations[runtime].coded is None  # only weights are coded
        (line,) = [r.getMessage() for r in caplog.records if "graph-sleep sleep" in r.getMessage()]
        assert "(weights coded: 4.00 MiB in 3.3" in line, line
        caplog.clear()
        manager.wake_up()
        for address, contents in expected.items():
            assert torch.equal(driver.memory[address], contents), (cycle, hex(address))


def test_a_coded_piece_that_does_not_decode_to_its_original_is_kept_raw(monkeypatch, caplog):
    real_encode_lanes = exponent_codec.encode_lanes

    def encode_with_a_flipped_bit(words, encoder, starts, stream, raw, ends):
        real_encode_lanes(words, encoder, starts, stream, raw, ends)
        if words.numel() == coded_backup.PIECE_BYTES // 2:  # not the first use's sample
            stream[0] ^= 1

    monkeypatch.setattr(exponent_codec, "encode_lanes", encode_with_a_flipped_bit)
    every_piece_is_kept_raw_with_an_error(caplog, seed=5, reason=r"\(\d+ words decoded wrong\)")


def every_piece_is_kept_raw_with_an_error(caplog, seed, reason):
    driver, manager, weights = coded_weights(seed=seed)
    expected = driver.memory[weights].clone()
    with caplog.at_level(logging.ERROR, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights",))
    assert all(piece.coded is None for piece in manager.allocations[weights].coded.pieces)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all("did not decode to its original" in e for e in errors)
    assert all(re.search(reason, error) for error in errors), errors
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_coded_stream_longer_than_its_bound_is_kept_raw(monkeypatch, caplog):
    # The bound comes from the exponent counts; a count kernel that disagreed
    # would make a longer stream. It stays in the slot's scratch and the piece raw.
    real_count_lanes = exponent_codec.count_lanes

    def count_a_word_more(words, lengths, lane_bits):
        real_count_lanes(words, lengths, lane_bits)
        if words.numel() == coded_backup.PIECE_BYTES // 2:  # not the first use's sample
            lane_bits[-1] += 32 * 2 * lane_bits.numel()  # past the bound's 31 bits per lane

    monkeypatch.setattr(exponent_codec, "count_lanes", count_a_word_more)
    every_piece_is_kept_raw_with_an_error(caplog, seed=7, reason="exceed its bound")


@pytest.mark.parametrize(
    "lane, bits",
    [(-1, -3 * 32), (0, 32)],
    ids=["count-under-reports-the-last-lane", "count-over-reports-a-lane"],
)
def test_a_count_that_disagrees_with_the_encoder_is_kept_raw(monkeypatch, caplog, lane, bits):
    # The wake decodes the stream up to the count's total and reads zeros past
    # it; the check decodes it up to the bound. A last lane counted 3 words
    # short stays in the bound and checks right, then comes back wrong at the
    # wake; one counted a word long wastes it. Either disagreement is a fault.
    real_count_lanes = exponent_codec.count_lanes

    def count_wrong(words, lengths, lane_bits):
        real_count_lanes(words, lengths, lane_bits)
        if words.numel() == coded_backup.PIECE_BYTES // 2:  # not the first use's sample
            lane_bits[lane] += bits

    monkeypatch.setattr(exponent_codec, "count_lanes", count_wrong)
    every_piece_is_kept_raw_with_an_error(caplog, seed=11, reason=r"\(1 lanes did not end where")


@pytest.mark.usefixtures("first_use")
def test_a_sleep_without_device_memory_for_the_coder_backs_up_raw(monkeypatch, caplog):
    # The sleep is what frees the GPU: coding must not make it fail on a full one.
    def scratch_on_a_full_device(device, lanes, symbols):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 44.00 MiB")

    monkeypatch.setattr(coded_backup, "_Slot", scratch_on_a_full_device)
    driver, manager = make(compress_backups=True)
    first = allocate(driver, manager, "weights", SIZE)
    second = allocate(driver, manager, "weights", SIZE)
    for seed, address in enumerate((first, second)):
        driver.memory[address].copy_(bf16_weights(SIZE // 2, seed=seed))
    expected = {address: driver.memory[address].clone() for address in (first, second)}
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
            manager.sleep(offload_tags=("weights",))
        for address in (first, second):
            assert [p.coded for p in manager.allocations[address].coded.pieces] == [None] * 2
        manager.wake_up()
        for address, contents in expected.items():
            assert torch.equal(driver.memory[address], contents)
    warnings = [r.getMessage() for r in caplog.records if "no device memory" in r.getMessage()]
    assert len(warnings) == 1 and "Tried to allocate 44.00 MiB" in warnings[0]


@pytest.mark.usefixtures("first_use")
def test_a_sleep_without_device_memory_for_the_counts_backs_up_raw(monkeypatch):
    def counts_on_a_full_device(words, piece_symbols, rows):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(exponent_codec, "add_piece_histograms", counts_on_a_full_device)
    driver, manager, weights = coded_weights(seed=6)
    expected = driver.memory[weights].clone()
    manager.sleep(offload_tags=("weights",))
    assert all(piece.coded is None for piece in manager.allocations[weights].coded.pieces)
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


@pytest.mark.usefixtures("first_use")
def test_a_coder_that_fails_its_first_use_leaves_every_backup_raw(monkeypatch, caplog):
    # Triton compiles the kernels at their first use; where that fails, the
    # sleep still backs up and frees, and no later sleep tries again.
    calls = []

    def a_compiler_that_cannot_run(words, lengths, lane_bits):
        calls.append(words.numel())
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(exponent_codec, "count_lanes", a_compiler_that_cannot_run)
    driver, manager, weights = coded_weights(seed=8)
    expected = driver.memory[weights].clone()
    for _ in range(2):
        with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
            manager.sleep(offload_tags=("weights",))
        assert all(piece.coded is None for piece in manager.allocations[weights].coded.pieces)
        manager.wake_up()
        assert torch.equal(driver.memory[weights], expected)
    assert calls == [coded_backup.SAMPLE_WORDS]
    (warning,) = [r.getMessage() for r in caplog.records if "cannot be coded" in r.getMessage()]
    assert "RuntimeError: Failed to find C compiler" in warning


@pytest.mark.usefixtures("first_use")
def test_the_coder_is_compiled_and_checked_at_warm_up_not_at_the_first_sleep(monkeypatch, caplog):
    # The worker's warm-up calls prepare_backup_kernels before vLLM turns its JIT
    # monitor on; the sleep then codes without trying the sample again.
    from vllm_graph_sleep.patches import v1_worker_gpu_worker

    real_count_lanes = exponent_codec.count_lanes
    counted = []

    def counting(words, lengths, lane_bits):
        counted.append(words.numel())
        real_count_lanes(words, lengths, lane_bits)

    monkeypatch.setattr(exponent_codec, "count_lanes", counting)
    driver, manager = make(compress_backups=True)
    monkeypatch.setattr(v1_worker_gpu_worker.config, "is_active", lambda: True)
    monkeypatch.setattr(GraphSleepAllocator, "get_instance", staticmethod(lambda: manager))

    class Worker:
        device = torch.device("cpu")

    def warm_up(worker):
        assert counted == [coded_backup.SAMPLE_WORDS]  # before the original runs
        return "warmed"

    wrapped = v1_worker_gpu_worker._wrap_compile_or_warm_up_model(warm_up)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        assert wrapped(Worker()) == "warmed"
    assert "weight backups are coded; the coder compiled and checked on cpu" in caplog.text
    weights = allocate(driver, manager, "weights", SIZE)
    driver.memory[weights].copy_(bf16_weights(SIZE // 2, seed=9))
    manager.sleep(offload_tags=("weights",))
    assert counted == [coded_backup.SAMPLE_WORDS] + [coded_backup.PIECE_BYTES // 2] * 2
    assert all(piece.coded is not None for piece in manager.allocations[weights].coded.pieces)
    raw_manager = make(compress_backups=False)[1]
    raw_manager.prepare_backup_kernels(torch.device("cpu"))  # nothing to prepare
    assert len(counted) == 3


def test_a_level_two_sleep_keeps_the_coded_backup_for_the_sleep_after_the_reload():
    """Issue 38: after a level-2 sleep and a reload, the level-1 sleep codes
    again only the pieces the reload changed, into the buffer it kept."""
    driver, manager, weights = coded_weights(seed=4)
    manager.sleep(offload_tags=("weights",))
    first = manager.allocations[weights].coded
    untouched, changing = first.pieces
    untouched_coded = untouched.coded
    manager.wake_up()
    loaded = driver.memory[weights].clone()
    manager.sleep(offload_tags=())
    allocation = manager.allocations[weights]
    assert allocation.coded is first and allocation.host is not None
    assert not allocation.has_backup  # the wake maps it back without it
    manager.wake_up()
    driver.memory[weights].copy_(loaded)  # the reload: the same weights...
    driver.memory[weights][SIZE - 3] ^= 0x01  # ...but for one byte of the second piece
    expected = driver.memory[weights].clone()
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": SIZE // 2}
    assert manager.allocations[weights].coded is first
    assert untouched.coded is untouched_coded
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_coded_wake_needs_no_more_device_memory_than_the_sleep_freed(monkeypatch):
    # On a GPU the wake's decoder stages the coded pieces in two slots of
    # torch's own memory (exponent_codec.Restorer): taken while the memory
    # without a backup (the KV cache) is still unmapped, given back before it
    # maps, they fit in what the sleep freed.
    driver, manager = make(compress_backups=True)
    weights = allocate(driver, manager, "weights", SIZE)
    kv_cache = allocate(driver, manager, "kv_cache", SIZE, value=3)
    driver.memory[weights].copy_(bf16_weights(SIZE // 2, seed=12))
    expected = driver.memory[weights].clone()
    driver.occupied_elsewhere = driver.capacity - driver.used_bytes()  # a full device
    manager.sleep(offload_tags=("weights",))
    assert all(piece.coded is not None for piece in manager.allocations[weights].coded.pieces)
    assert driver.capacity - driver.used_bytes() == 2 * SIZE  # what the sleep freed

    staged = []

    class StagingRestorer(exponent_codec.Restorer):
        def __init__(self, pieces, lookups, device):
            super().__init__(pieces, lookups, device)
            # What its two slots take on a GPU: the largest piece's buffers, twice.
            buffers = zip(*(piece.buffers() for piece in pieces), strict=True)
            staged.append(2 * sum(max(buffer.nbytes for buffer in same) for same in buffers))
            driver.torch_allocates(self, staged[-1])

    monkeypatch.setattr(exponent_codec, "Restorer", StagingRestorer)
    manager.wake_up()
    assert staged and 0 < staged[0] < SIZE
    assert torch.equal(driver.memory[weights], expected)
    assert kv_cache in driver.memory
    assert driver.torch_held == []  # the staging is given back, not left in torch's cache


def test_coding_follows_the_switch_then_the_drivers_default(monkeypatch, caplog):
    # On by default where the driver says so (CUDA, not ROCm) and Triton
    # imports; the switch decides either way; unset without Triton: raw, said.
    monkeypatch.delenv("VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS", raising=False)
    for by_default in (False, True):
        driver = FakeVmmDriver()
        driver.codes_by_default = by_default
        assert GraphSleepAllocator(driver).compress_backups is by_default
        for switch, coding in (("0", False), ("1", True)):
            monkeypatch.setenv("VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS", switch)
            assert GraphSleepAllocator(driver).compress_backups is coding
        monkeypatch.delenv("VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS")
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        assert GraphSleepAllocator(driver).compress_backups is False
    assert "Triton, which codes backups, cannot be imported" in caplog.text
    driver, manager = make()
    weights = allocate(driver, manager, "weights", SIZE, value=7)
    manager.sleep(offload_tags=("weights",))
    assert manager.allocations[weights].coded is None
    manager.wake_up()
    assert int(driver.memory[weights].sum()) == 7 * SIZE


def test_switching_coding_on_without_triton_fails_at_start_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS", "1")
    with pytest.raises(RuntimeError, match="VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1 codes backups"):
        make()


def test_an_unchanged_coded_backup_is_kept_and_a_changed_piece_coded_again_alone(caplog):
    """Issue 38: a coded backup is kept while its fingerprints match; when one
    byte changed, the piece that holds it is coded again and the other piece
    stays as the host holds it; both come back exact, and the sleep's log
    line says what its coding phase coded."""
    driver, manager, weights = coded_weights(seed=4)
    manager.sleep(offload_tags=("weights",))
    first = manager.allocations[weights].coded
    untouched, changing = first.pieces
    untouched_coded, changing_coded = untouched.coded, changing.coded
    manager.wake_up()
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0}
    assert manager.allocations[weights].coded is first
    manager.wake_up()
    driver.memory[weights][SIZE - 3] ^= 0x01
    expected = driver.memory[weights].clone()
    caplog.clear()  # the lines of the sleeps before, where the logger already logs INFO
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights",))
    (line,) = [r.getMessage() for r in caplog.records if "graph-sleep sleep" in r.getMessage()]
    assert re.search(
        r"coding \(0 allocations whole, 1 pieces again, 0 copied again raw\) \d+\.\d ms", line
    ), line
    assert manager.last_backup().copied == {"weights": SIZE // 2}
    assert manager.last_backup().kept == {"weights": SIZE // 2}
    assert manager.allocations[weights].coded is first
    assert untouched.coded is untouched_coded
    assert changing.coded is not None and changing.coded is not changing_coded
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_change_too_small_to_code_again_is_copied_raw_and_comes_back(monkeypatch, caplog):
    """Issue 38: coding again has a fixed cost that a small change does not
    repay (coded_backup.RECODE_MIN_BYTES), so the pieces that hold it are
    copied raw; the other piece stays coded as the host holds it, both come
    back exact, and a later sleep that changes them again keeps them raw."""
    monkeypatch.setattr(coded_backup, "RECODE_MIN_BYTES", MIB + 1)
    driver, manager, weights = coded_weights(seed=5)
    manager.sleep(offload_tags=("weights",))
    first = manager.allocations[weights].coded
    untouched, changing = first.pieces
    untouched_coded = untouched.coded
    assert changing.coded is not None
    for flip in range(2):
        manager.wake_up()
        driver.memory[weights][SIZE - 3 - flip] ^= 0x01
        expected = driver.memory[weights].clone()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
            manager.sleep(offload_tags=("weights",))
        (line,) = [r.getMessage() for r in caplog.records if "graph-sleep sleep" in r.getMessage()]
        assert "coding (0 allocations whole, 0 pieces again, 1 copied again raw)" in line, line
        assert manager.last_backup().copied == {"weights": SIZE // 2}
        assert manager.allocations[weights].coded is first
        assert untouched.coded is untouched_coded
        assert changing.coded is None and changing.raw is not None
        manager.wake_up()
        assert torch.equal(driver.memory[weights], expected)


def test_a_change_of_at_least_the_bound_is_coded_again(monkeypatch):
    """The bound is on the bytes of the changed pieces: a change that fills
    it is coded again."""
    monkeypatch.setattr(coded_backup, "RECODE_MIN_BYTES", MIB)
    driver, manager, weights = coded_weights(seed=6)
    manager.sleep(offload_tags=("weights",))
    changing = manager.allocations[weights].coded.pieces[1]
    manager.wake_up()
    driver.memory[weights][SIZE - 3] ^= 0x01
    manager.sleep(offload_tags=("weights",))
    assert changing.coded is not None
    manager.wake_up()


def test_a_coded_backup_is_cut_where_torch_placed_its_tensors(monkeypatch):
    """The RL loop of issue 38 on one allocation that holds three tensors:
    pieces start at each tensor (rounded down to a fingerprint block), so new
    weights for the last tensor code that piece again, not the allocation."""
    monkeypatch.setattr(coded_backup, "PIECE_BYTES", 4 * MIB)
    driver, manager = make(compress_backups=True)
    weights = allocate(driver, manager, "weights", 2 * SIZE)
    # Tensors at 0, 1.5 MiB and 3 MiB: pieces [0, 1), [1, 3) and [3, 4) MiB.
    driver.blocks[weights] = [
        (0, 3 * MIB // 2, "active_allocated"),
        (3 * MIB // 2, 3 * MIB // 2, "active_allocated"),
        (3 * MIB, MIB, "active_allocated"),
    ]
    driver.memory[weights].copy_(bf16_weights(SIZE, seed=8))
    manager.sleep(offload_tags=("weights",))
    coded = manager.allocations[weights].coded
    assert [(p.offset, p.size) for p in coded.pieces] == [(0, MIB), (MIB, 2 * MIB), (3 * MIB, MIB)]
    assert all(piece.coded is not None for piece in coded.pieces)
    for step in range(2):
        manager.wake_up(["weights"])
        driver.memory[weights][3 * MIB :].copy_(bf16_weights(MIB // 2, seed=20 + step))
        manager.wake_up(["kv_cache"])
        expected = driver.memory[weights].clone()
        manager.sleep(offload_tags=("weights",))
        assert manager.last_backup().copied == {"weights": MIB}, step
        assert all(piece.coded is not None for piece in coded.pieces)
        manager.wake_up()
        assert torch.equal(driver.memory[weights], expected), step


def test_an_exponent_the_first_weights_lacked_is_coded_with_a_table_of_the_pieces_own():
    """The allocation's table has no code for an exponent its weights lacked:
    the piece coded again gets a table made from its own counts, the other
    piece keeps the allocation's, and the wake decodes each with its own."""
    driver, manager, weights = coded_weights(seed=9)
    manager.sleep(offload_tags=("weights",))
    first = manager.allocations[weights].coded
    changing, untouched = first.pieces
    huge = torch.tensor([3e38], dtype=torch.bfloat16)
    assert first.table.lengths[huge.view(torch.int16).item() >> 7 & 0xFF] == 0
    manager.wake_up()
    driver.memory[weights][:2].copy_(huge.view(torch.uint8))
    expected = driver.memory[weights].clone()
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": SIZE // 2}
    assert manager.allocations[weights].coded is first
    assert changing.coded is not None and changing.coded.piece.table != first.table
    assert untouched.coded.piece.table == first.table
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_coder_without_room_to_code_pieces_again_backs_the_allocation_up_whole(monkeypatch):
    driver, manager, weights = coded_weights(seed=11)
    manager.sleep(offload_tags=("weights",))
    first = manager.allocations[weights].coded
    manager.wake_up()
    real_coder = coded_backup._Coder

    def no_room(*args, **kwargs):
        monkeypatch.setattr(coded_backup, "_Coder", real_coder)  # the whole backup gets room
        raise torch.OutOfMemoryError("no room for the coder's scratch")

    monkeypatch.setattr(coded_backup, "_Coder", no_room)
    driver.memory[weights][5] ^= 0x40
    expected = driver.memory[weights].clone()
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": SIZE}
    assert manager.allocations[weights].coded is not first
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_piece_coded_again_that_does_not_decode_is_kept_raw(monkeypatch, caplog):
    driver, manager, weights = coded_weights(seed=10)
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    real_encode_lanes = exponent_codec.encode_lanes

    def encode_with_a_flipped_bit(words, encoder, starts, stream, raw, ends):
        real_encode_lanes(words, encoder, starts, stream, raw, ends)
        stream[0] ^= 1

    monkeypatch.setattr(exponent_codec, "encode_lanes", encode_with_a_flipped_bit)
    driver.memory[weights][7] ^= 0x01
    expected = driver.memory[weights].clone()
    with caplog.at_level(logging.ERROR, logger="vllm.graph_sleep"):
        manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": SIZE // 2}
    changed, untouched = manager.allocations[weights].coded.pieces
    assert changed.coded is None and untouched.coded is not None
    assert any("did not decode to its original" in r.getMessage() for r in caplog.records)
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_target_torch_frees_between_the_wakes_phases_is_left_alone(monkeypatch):
    """A coded wake gives the decoder's staging back to the driver before it
    maps what has no backup; a tensor that died asleep is freed there, and the
    second phase must not map its record (the extension released it)."""
    driver, manager, weights = coded_weights(seed=4)
    expected = driver.memory[weights].clone()
    with manager.use_memory_pool("kv_cache"):
        kv = driver.malloc(SIZE)
        doomed = driver.malloc(SIZE)
    manager.sleep(offload_tags=("weights",))
    release = driver.release_cached_memory
    releases = []

    def release_between_the_phases():
        releases.append(len(releases))
        if len(releases) == 2:  # the wake's first is before it maps anything
            driver.tensor_dies(doomed)
        release()

    monkeypatch.setattr(driver, "release_cached_memory", release_between_the_phases)
    manager.wake_up()
    assert len(releases) == 2 and manager.allocations[weights].coded is not None
    assert doomed not in manager.allocations and doomed not in driver.memory
    assert kv in driver.memory and torch.equal(driver.memory[weights], expected)
    assert manager.all_mapped_bytes() == driver.mapped_bytes() == 2 * SIZE


def test_weights_coded_ahead_are_neither_coded_nor_copied_again_at_the_first_sleep(caplog):
    """The backup the worker makes once warm-up is done (back_up_ahead) is the
    coded one a sleep would make: the first sleep keeps it whole."""
    driver, manager, weights = coded_weights(seed=11)
    expected = driver.memory[weights].clone()
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        manager.back_up_ahead(("weights",))
    coded = manager.allocations[weights].coded
    assert coded is not None and all(piece.coded is not None for piece in coded.pieces)
    assert re.search(r"backed up weights 2.00 MiB ahead \(weights coded: 2.00 MiB in", caplog.text)
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0}
    assert manager.allocations[weights].coded is coded  # the same pieces, not coded again
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_backup_ahead_the_coder_had_no_memory_for_is_given_up(monkeypatch, caplog):
    """At the end of warm-up the KV cache is resident; kept raw, the weights
    would stay raw at every later sleep (their fingerprints unchanged). The
    first sleep codes them, the KV cache's memory released beside it."""
    driver, manager, weights = coded_weights(seed=12)
    expected = driver.memory[weights].clone()
    real = coded_backup._Coder

    def no_room_once(*args, **kwargs):
        monkeypatch.setattr(coded_backup, "_Coder", real)
        raise torch.OutOfMemoryError("CUDA out of memory (the KV cache is resident)")

    monkeypatch.setattr(coded_backup, "_Coder", no_room_once)
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        assert manager.back_up_ahead(("weights",)) is None
    assert "ahead failed (the coder found no device memory)" in caplog.text
    assert manager.host_bytes() == 0
    assert not manager.allocations[weights].has_backup  # mapped, nothing kept
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": SIZE}
    pieces = manager.allocations[weights].coded.pieces
    assert all(piece.coded is not None for piece in pieces)
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_coder_whose_first_use_found_no_memory_marks_its_backups(monkeypatch):
    """`prepare` short of memory for its sample: the backup is raw for want of
    memory, which a backup made ahead gives up; a broken coder is not."""
    monkeypatch.setattr(coded_backup, "prepare", lambda device: False)
    original = bf16_weights(SIZE // 2, seed=13).view(torch.uint8)
    host = torch.empty_like(original)
    (backup,) = coded_backup.back_up([[(original, host)]])
    assert backup.short_of_memory and torch.equal(host, original)
    monkeypatch.setattr(coded_backup, "_broken", "RuntimeError: no compiler")
    (backup,) = coded_backup.back_up([[(original, host)]])
    assert not backup.short_of_memory


def test_a_backup_coded_again_is_no_longer_short_of_memory(monkeypatch):
    """A backup left raw for want of coder memory, then coded again in part
    at a later sleep, no longer says it is short: a second backup ahead on
    it (elastic EP warms up again) is kept, not given up."""
    driver, manager, weights = coded_weights(seed=14)
    real_prepare = coded_backup.prepare
    monkeypatch.setattr(coded_backup, "prepare", lambda device: False)
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    assert manager.allocations[weights].coded.short_of_memory
    monkeypatch.setattr(coded_backup, "prepare", real_prepare)
    driver.memory[weights][: SIZE // 2].copy_(bf16_weights(SIZE // 4, seed=15))
    expected = driver.memory[weights].clone()
    assert manager.back_up_ahead(("weights",)) is not None
    assert not manager.allocations[weights].coded.short_of_memory
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0}  # all kept since the backup ahead
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)


def test_a_second_backup_ahead_keeps_an_unchanged_backup_left_raw(monkeypatch):
    """A sleep short of coder memory left the weights raw; nothing changed
    them since, so a second backup ahead (elastic EP) codes nothing, and the
    old backup's flag is no reason to give it and its buffer up."""
    driver, manager, weights = coded_weights(seed=16)
    expected = driver.memory[weights].clone()
    real_prepare = coded_backup.prepare
    monkeypatch.setattr(coded_backup, "prepare", lambda device: False)
    manager.sleep(offload_tags=("weights",))
    manager.wake_up()
    monkeypatch.setattr(coded_backup, "prepare", real_prepare)
    assert manager.back_up_ahead(("weights",)).copied == {"weights": 0}
    assert manager.host_bytes() > 0
    manager.sleep(offload_tags=("weights",))
    assert manager.last_backup().copied == {"weights": 0}
    manager.wake_up()
    assert torch.equal(driver.memory[weights], expected)
