"""A weight allocation's host backup in the exponent codec's format.

With VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1 a sleep codes each weight allocation's
backup on the device (`exponent_codec`) and copies the coded pieces into the
allocation's host buffer, where they take about two thirds of the room the raw
bytes would; a wake copies them back while the previous piece decodes
(`exponent_codec.restore`). A piece that does not shrink is kept raw, and so
is one that does not decode back to its original: the sleep checks every coded
piece on the device while the original is still there (each lane's codes end
where its count said, so that the wake, which reads the stream up to the
counts' total, decodes what the check decoded; and the decode gives the
original back), so that a coder fault costs bytes, not weights. The host
buffer keeps its raw size, so a backup always fits whatever the weights hold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
from collections.abc import Iterable

import torch

from vllm_graph_sleep import exponent_codec
from vllm_graph_sleep.exponent_codec import Encoded, Table
from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES

logger = logging.getLogger("vllm.graph_sleep")

# Bytes a wake decodes per piece; each of the wake's two staging slots holds one
# coded piece (about 43 MiB for this size).
PIECE_BYTES = 64 << 20
# Below this many changed bytes on a device, a sleep copies the changed pieces
# raw instead of coding them again. Coding again costs a fixed ~6 ms (its counts
# read back, a table built on the host, the coder's scratch, the check): 6.4 ms
# for one 9 MiB piece in run 19 (docs/results/bench-default.md), a fifth of
# that sleep. Coding X bytes saves copying X/3 over the link at the sleep and
# again at the wake (about 2X/3 at 50 GB/s), which pays for the fixed cost from
# about 450 MiB on; at 256 MiB a weight update of whole layers of an 8B model
# (436 MiB a layer) is still coded.
RECODE_MIN_BYTES = 256 << 20
_warned_short_of_memory = False


@dataclasses.dataclass
class _Piece:
    pair: int  # index into the allocation's (device range, host range) pairs
    offset: int  # bytes into the device range
    size: int
    coded: Encoded | None  # views into the host buffer; None: raw
    raw: torch.Tensor | None  # the host bytes of a raw piece

    def on_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return pairs[self.pair][0][self.offset : self.offset + self.size]


@dataclasses.dataclass
class CodedBackup:
    table: Table
    pieces: list[_Piece]
    # Left raw because the device had no memory for the coder (not because
    # its pieces would not shrink): a backup made ahead is given up then.
    short_of_memory: bool = False

    @functools.cached_property
    def lookup(self) -> torch.Tensor:
        """The table's decoder, in host memory: made once, at the sleep that
        codes a piece with it (a backup left all raw never needs it)."""
        return self.table.decoder_tensor(torch.device("cpu"))

    def pieces_touching(self, spans: list[tuple[int, int, int]]) -> list[int]:
        """Indices of the pieces that overlap any (pair, start, end) span."""
        return [
            index
            for index, piece in enumerate(self.pieces)
            if any(
                pair == piece.pair and lo < piece.offset + piece.size and piece.offset < hi
                for pair, lo, hi in spans
            )
        ]

    def bytes_of(self, indices: list[int]) -> int:
        return sum(self.pieces[index].size for index in indices)

    @property
    def coded_bytes(self) -> int:
        return sum(p.size if p.coded is None else p.coded.piece.encoded_bytes for p in self.pieces)


# Pieces coded at once, each on a stream of its own with its own scratch
# (about 81 MiB for 64 MiB pieces): a lane steps through its symbols one after
# another, so one kernel leaves most of the GPU idle, and one piece's check
# runs beside the next ones' count and encode while the copier takes an
# earlier piece to the host.
SLOTS = 3


@dataclasses.dataclass
class _Plan:
    """A piece to code, planned from its exponent counts."""

    backup: int  # index into the sleep's backups (and tables)
    piece: int  # index into that backup's pieces
    chunk: torch.Tensor
    room: torch.Tensor  # its bytes of the host buffer
    lanes: int
    bound: int  # the most words its stream can take

    @property
    def symbols(self) -> int:
        return self.chunk.numel() // 2

    def coded_piece(self, total_words: int, table: Table) -> exponent_codec.Piece:
        return exponent_codec.Piece(
            self.symbols, exponent_codec.SYMBOLS_PER_LANE, self.lanes, total_words, table
        )

    def host_views(self, total_words: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The room's stream (its first `total_words` + 1 words of bound + 1),
        starts and raw bytes: int32 buffers first, so the views stay aligned
        wherever the room starts on a 4-byte boundary (a piece of a host buffer
        starts at a multiple of PIECE_BYTES, a pair at one of 512)."""
        starts_at = 4 * (self.bound + 1)
        raw_at = starts_at + 4 * self.lanes
        return (
            self.room[: 4 * (total_words + 1)].view(torch.int32),
            self.room[starts_at:raw_at].view(torch.int32),
            self.room[raw_at : raw_at + self.symbols],
        )


class _Slot:
    """Scratch and a stream for one piece in flight."""

    def __init__(self, device: torch.device, lanes: int, symbols: int) -> None:
        def scratch(count: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(count, dtype=dtype, device=device)

        self.lane_bits = scratch(lanes, torch.int32)
        self.lane_words = scratch(lanes, torch.int32)
        self.ends = scratch(lanes, torch.int32)
        self.starts = scratch(lanes, torch.int32)
        self.written_ends = scratch(lanes, torch.int32)
        # Room for the longest code on every symbol: a stream longer than its
        # plan's bound (a fault) stays inside the slot and is found at the end.
        per_lane = -(-exponent_codec.SYMBOLS_PER_LANE * exponent_codec.MAX_CODE_BITS // 32)
        self.words = scratch(lanes * per_lane + 1, torch.int32)
        self.raw = scratch(symbols, torch.uint8)
        on_gpu = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if on_gpu else None
        self.coded = torch.cuda.Event() if on_gpu else None
        self.copied: torch.cuda.Event | None = None  # recorded once the slot's piece is out


def _stream(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _split(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], cuts: Iterable[int] = ()
) -> list[_Piece]:
    """An allocation's pieces, raw until coded: at most PIECE_BYTES each, and,
    in an allocation of one pair, cut at `cuts` too (the starts of the tensors
    torch placed in it, rounded down to fingerprint blocks), so that a tensor
    that changed alone is coded again alone (`recode`)."""
    pieces = []
    for index, (device, host) in enumerate(pairs):
        size = device.numel()
        starts = set(range(0, size, PIECE_BYTES))
        if len(pairs) == 1:
            starts.update(cut // BLOCK_BYTES * BLOCK_BYTES for cut in cuts if 0 < cut < size)
        bounds = sorted(starts) + [size]
        pieces += [
            _Piece(index, lo, hi - lo, None, host[lo:hi]) for lo, hi in itertools.pairwise(bounds)
        ]
    return pieces


def _histograms(chunks: list[list[torch.Tensor]], device: torch.device) -> list[list[list[int]]]:
    """The exponent counts of every piece (its device bytes) of every
    allocation: one pass over the weights, one wait."""
    rows = torch.zeros(sum(map(len, chunks)), 256, dtype=torch.int32, device=device)
    row = 0
    for chunk in itertools.chain.from_iterable(chunks):
        usable = chunk[: chunk.numel() // 2 * 2].view(torch.int16)
        # One row per piece: a piece is at most PIECE_BYTES.
        exponent_codec.add_piece_histograms(usable, PIECE_BYTES // 2, rows[row : row + 1])
        row += 1
    counts = rows.tolist()
    per_allocation, row = [], 0
    for pieces in chunks:
        per_allocation.append(counts[row : row + len(pieces)])
        row += len(pieces)
    return per_allocation


def _counted(chunks: list[list[torch.Tensor]], device: torch.device) -> tuple[list, _Coder]:
    """The exponent counts of the pieces in `chunks` (per allocation, their
    device bytes) and a coder with scratch for them; OutOfMemoryError where
    the device has no room for either."""
    counts = _histograms(chunks, device)
    largest = max(chunk.numel() for chunk in itertools.chain.from_iterable(chunks))
    return counts, _Coder(device, len(chunks), sum(map(len, chunks)), largest // 2)


def _plans(
    backup: CodedBackup,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    number: int,
    counts: list[list[int]],
    indices: list[int],
) -> list[_Plan]:
    """The plans of the pieces numbered `indices` (their `counts`) worth coding
    with `backup`'s table."""
    plans = []
    for index, piece_counts in zip(indices, counts, strict=True):
        piece = backup.pieces[index]
        if piece.size % 2:
            continue
        lanes = exponent_codec.lanes_for(piece.size // 2)
        bound = exponent_codec.stream_words_bound(backup.table.coded_bits(piece_counts), lanes)
        if 4 * (bound + 1 + lanes) + piece.size // 2 <= exponent_codec.WORTHWHILE * piece.size:
            plans.append(_Plan(number, index, piece.on_device(pairs), piece.raw, lanes, bound))
    return plans


def _plan(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    pieces: list[_Piece],
    number: int,
    counts: list[list[int]] | None,
) -> tuple[CodedBackup, list[_Plan]]:
    """The allocation's backup, every piece raw, with its table made from its
    counts, and the plans of the pieces worth coding."""
    histogram = [sum(column) for column in zip(*counts, strict=True)] if counts else [0] * 256
    if not any(histogram):
        return CodedBackup(exponent_codec.build_table([1] + [0] * 255), pieces), []
    backup = CodedBackup(exponent_codec.build_table(histogram), pieces)
    return backup, _plans(backup, pairs, number, counts, list(range(len(pieces))))


# A table's row on the device: its codes, its lengths, its decoder.
_CODES = slice(0, 256)
_LENGTHS = slice(256, 512)
_LOOKUP = slice(512, 512 + (1 << exponent_codec.MAX_CODE_BITS))


class _Coder:
    """Queues the coding of planned pieces on its slots' streams and their
    copies, and the raw pieces' copies, on a stream of its own; `finish`
    waits and keeps what decoded back. Each allocation's table goes to the
    device on one more stream as soon as it is made, so that the host makes
    the next tables while the device codes."""

    def __init__(self, device: torch.device, allocations: int, pieces: int, symbols: int):
        self._device = device
        self._on_gpu = device.type == "cuda"
        self._plans: list[_Plan] = []
        self._backups: list[CodedBackup] = []
        rows = (allocations, _LOOKUP.stop)
        self._tables_host = torch.empty(rows, dtype=torch.int32, pin_memory=self._on_gpu)
        self._tables = torch.empty(rows, dtype=torch.int32, device=device)
        self._totals = torch.zeros(pieces, dtype=torch.int32, device=device)
        # A row of 16 bytes per piece: its counter's address stays 16-byte
        # aligned, which Triton would otherwise compile another variant for.
        self._mismatches = torch.zeros(pieces, 4, dtype=torch.int32, device=device)
        lanes = exponent_codec.lanes_for(symbols)
        self._slots = [_Slot(device, lanes, symbols) for _ in range(SLOTS)]
        self._table_stream = torch.cuda.Stream(device) if self._on_gpu else None
        self._table_ready: dict[int, torch.cuda.Event] = {}
        self.copier = torch.cuda.Stream(device) if self._on_gpu else None
        if self._on_gpu:
            # Every stream starts after what the current one queued (the scratch).
            current = torch.cuda.current_stream(device)
            for stream in [self._table_stream, self.copier] + [s.stream for s in self._slots]:
                stream.wait_stream(current)

    def add(self, backup: CodedBackup, plans: list[_Plan], pairs, indices: Iterable[int]) -> None:
        """Queues the coding of `plans` and the copies of the other pieces
        numbered in `indices`."""
        number = len(self._backups)
        self._backups.append(backup)
        if plans:
            self._send_table(number, backup)
        with _stream(self.copier):
            _copy_raw(backup, pairs, set(indices) - {plan.piece for plan in plans})
        for plan in plans:
            self._queue(plan)

    def _send_table(self, number: int, backup: CodedBackup) -> None:
        row = self._tables_host[number]
        row[_CODES] = torch.tensor(backup.table.codes, dtype=torch.int32)
        row[_LENGTHS] = torch.tensor(backup.table.lengths, dtype=torch.int32)
        row[_LOOKUP] = backup.lookup
        with _stream(self._table_stream):
            self._tables[number].copy_(row, non_blocking=True)
            if self._on_gpu:
                self._table_ready[number] = torch.cuda.Event()
                self._table_ready[number].record(self._table_stream)

    def _queue(self, plan: _Plan) -> None:
        number = len(self._plans)
        self._plans.append(plan)
        slot = self._slots[number % len(self._slots)]
        table = self._tables[plan.backup]
        lanes, symbols = plan.lanes, plan.symbols
        words = plan.chunk.view(torch.int16)
        starts, raw = slot.starts[:lanes], slot.raw[:symbols]
        with _stream(slot.stream):
            if self._on_gpu:
                slot.stream.wait_event(self._table_ready[plan.backup])
                if slot.copied is not None:
                    slot.stream.wait_event(slot.copied)
            lane_bits, lane_words = slot.lane_bits[:lanes], slot.lane_words[:lanes]
            exponent_codec.count_lanes(words, table[_LENGTHS], lane_bits)
            torch.add(lane_bits, 31, out=lane_words).bitwise_right_shift_(5)
            ends = torch.cumsum(lane_words, dim=0, dtype=torch.int32, out=slot.ends[:lanes])
            torch.sub(ends, lane_words, out=starts)
            self._totals[number : number + 1].copy_(ends[lanes - 1 :])
            written_ends = slot.written_ends[:lanes]
            exponent_codec.encode_lanes(
                words, (table[_CODES], table[_LENGTHS]), starts, slot.words, raw, written_ends
            )
            # The wake reads the stream up to the count's total and zeros past
            # it; the check below reads it up to the bound. The two decode the
            # same when every lane's codes end where its count said (a lane
            # reads at most one word past its end, its codes decode the same
            # whatever bits follow them, and the word at the total is kept).
            torch.sum(
                written_ends != ends, dim=0, dtype=torch.int32, out=self._mismatches[number, 1]
            )
            piece = plan.coded_piece(plan.bound, self._backups[plan.backup].table)
            on_device = Encoded(piece, slot.words[: plan.bound + 1], starts, raw)
            mismatches = self._mismatches[number, :1]
            exponent_codec.count_mismatches(on_device, plan.chunk, table[_LOOKUP], mismatches)
            if self._on_gpu:
                slot.coded.record(slot.stream)
        with _stream(self.copier):
            if self._on_gpu:
                self.copier.wait_event(slot.coded)
            for host, coded in zip(plan.host_views(plan.bound), on_device.buffers(), strict=True):
                host.copy_(coded, non_blocking=True)
            if self._on_gpu:
                slot.copied = torch.cuda.Event()
                slot.copied.record(self.copier)

    def finish(self) -> None:
        """Waits for every copy, then keeps each coded piece whose lanes
        ended where their counts said, whose stream stayed in its bound and
        which decoded back to its original; the others are copied raw (the
        originals are still on the device)."""
        if self._on_gpu:
            torch.cuda.synchronize(self._device)
        count = len(self._plans)
        totals, checks = self._totals[:count].tolist(), self._mismatches[:count, :2].tolist()
        for plan, total, (wrong, lanes_off) in zip(self._plans, totals, checks, strict=True):
            backup = self._backups[plan.backup]
            piece = backup.pieces[plan.piece]
            faults = []
            if wrong:
                faults.append(f"{wrong} words decoded wrong")
            if lanes_off:
                faults.append(f"{lanes_off} lanes did not end where their counts said")
            if total > plan.bound:
                faults.append(f"its {total} words exceed its bound of {plan.bound}")
            if faults:
                logger.error(
                    "graph-sleep: a coded backup piece (%d bytes) did not decode to its "
                    "original (%s); it is kept raw. Please report this with your GPU, driver, "
                    "torch and Triton versions.",
                    piece.size,
                    "; ".join(faults),
                )
                plan.room.copy_(plan.chunk)
                continue
            coded = plan.coded_piece(total, backup.table)
            piece.coded, piece.raw = Encoded(coded, *plan.host_views(total)), None


def _copy_raw(backup: CodedBackup, pairs, indices: Iterable[int]) -> None:
    """Queues the copies of `backup`'s pieces numbered in `indices`."""
    for index in sorted(indices):
        piece = backup.pieces[index]
        piece.raw.copy_(piece.on_device(pairs), non_blocking=True)


def back_up(
    allocations: list[list[tuple[torch.Tensor, torch.Tensor]]],
    cuts: list[Iterable[int]] | None = None,
) -> list[CodedBackup]:
    """Copies every allocation's device ranges into its host ranges ((device,
    host) pairs, one list per allocation, all on one device), coded where that
    pays and the coded piece decodes back to its original, and waits for the
    copies. One code table per allocation (its weights share their shape of
    distribution), planned from one pass of exponent counts over all of them;
    then the pieces are coded, checked and copied out without a wait between
    them. `cuts`: per allocation, where its tensors start (see `_split`).
    Coding needs device memory for its scratch (a few hundred MiB):
    without it, everything is backed up raw, so that a sleep on a full GPU
    still frees it; so is everything in a process whose coder failed its
    first use (`prepare`)."""
    device = allocations[0][0][0].device
    ready = prepare(device)
    backups = _code(allocations, device, coding=ready, cuts=cuts)
    if not ready and _broken is None:  # the sample found no memory (`prepare`)
        for backup in backups:
            backup.short_of_memory = True
    return backups


def _code(
    allocations: list[list[tuple[torch.Tensor, torch.Tensor]]],
    device: torch.device,
    coding: bool,
    fall_back: bool = True,
    cuts: list[Iterable[int]] | None = None,
) -> list[CodedBackup]:
    """`back_up`, coding unless told not to; without device memory for the
    coder, everything raw if `fall_back`, else the error raised."""
    cuts = cuts if cuts is not None else [()] * len(allocations)
    pieces = [_split(pairs, own) for pairs, own in zip(allocations, cuts, strict=True)]
    coder = counts = None
    if coding:
        try:
            chunks = [
                [p.on_device(pairs) for p in own]
                for pairs, own in zip(allocations, pieces, strict=True)
            ]
            counts, coder = _counted(chunks, device)
        except torch.OutOfMemoryError as error:
            if not fall_back:
                raise
            _short_of_memory(error)
            coder = None
    backups = []
    for number, (pairs, own) in enumerate(zip(allocations, pieces, strict=True)):
        backup, plans = _plan(pairs, own, number, None if coder is None else counts[number])
        backup.short_of_memory = coding and coder is None
        backups.append(backup)
        if coder is not None:
            coder.add(backup, plans, pairs, range(len(own)))
            continue
        _copy_raw(backup, pairs, range(len(own)))
    if coder is not None:
        coder.finish()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
    return backups


def recode(
    items: list[tuple[CodedBackup, list[tuple[torch.Tensor, torch.Tensor]], list[int]]],
) -> bool:
    """Backs up again the pieces numbered in each item (backup, its pairs,
    piece indices), coded where that pays with a table made from their own
    counts (new weights often hold an exponent the old ones lacked, which the
    allocation's table has no code for), leaving the other pieces as the host
    holds them, with theirs; waits for the copies. False, with nothing
    written, when the coder cannot run or has no room: the caller backs the
    items up again whole (`back_up`)."""
    device = items[0][1][0][0].device
    if not prepare(device):
        return False
    try:
        chunks = [
            [backup.pieces[index].on_device(pairs) for index in indices]
            for backup, pairs, indices in items
        ]
        counts, coder = _counted(chunks, device)
    except torch.OutOfMemoryError as error:
        _short_of_memory(error)
        return False
    for number, (item, item_counts) in enumerate(zip(items, counts, strict=True)):
        backup, pairs, indices = item
        _make_raw(backup, pairs, indices)  # raw until coded again: what a fault leaves
        # The same pieces under the new table: what the coder codes them with.
        histogram = [sum(column) for column in zip(*item_counts, strict=True)]
        again = CodedBackup(exponent_codec.build_table(histogram), backup.pieces)
        coder.add(again, _plans(again, pairs, number, item_counts, indices), pairs, indices)
        backup.short_of_memory = False  # the coder had room this time
    coder.finish()
    return True


def too_few_to_code(
    items: list[tuple[CodedBackup, list[tuple[torch.Tensor, torch.Tensor]], list[int]]],
) -> bool:
    """Whether the pieces numbered in the items (backup, its pairs, piece
    indices), all on one device, hold too few bytes for coding them again to
    pay (RECODE_MIN_BYTES): `copy_again_raw` backs them up then."""
    return sum(backup.bytes_of(indices) for backup, _, indices in items) < RECODE_MIN_BYTES


def copy_again_raw(
    items: list[tuple[CodedBackup, list[tuple[torch.Tensor, torch.Tensor]], list[int]]],
) -> None:
    """Queues the raw copies of the pieces numbered in each item (backup, its
    pairs, piece indices), leaving the others as the host holds them; the
    caller waits for them with the sleep's other copies."""
    for backup, pairs, indices in items:
        _make_raw(backup, pairs, indices)
        _copy_raw(backup, pairs, indices)


def _make_raw(backup: CodedBackup, pairs, indices: Iterable[int]) -> None:
    """Points the pieces numbered in `indices` at their raw host ranges, uncoded."""
    for index in indices:
        piece = backup.pieces[index]
        piece.coded = None
        piece.raw = pairs[piece.pair][1][piece.offset : piece.offset + piece.size]


# Words of the sample a first use codes: one lane program's worth and more.
SAMPLE_WORDS = 1 << 16
# Why the coder cannot run in this process (its first use failed), else None;
# and the devices where its first use succeeded.
_broken: str | None = None
_proven: set[torch.device] = set()


def prepare(device: torch.device) -> bool:
    """Whether the coder runs right on `device`. Triton compiles its kernels
    at their first use, which can fail where its compiler cannot run, and a
    sleep must not fail for an optimization: so before a device's first coded
    backup (at the engine's warm-up, or else at the first sleep), a small
    sample is coded, checked and restored. A failure is logged once and every
    later backup of the process is raw; a device short of memory for the
    sample is tried again at the next sleep."""
    global _broken
    if _broken is not None or device in _proven:
        return _broken is None
    try:
        sample = torch.linspace(-0.1, 0.1, SAMPLE_WORDS, device=device).to(torch.bfloat16)
        original = sample.view(torch.uint8)
        host = torch.empty_like(original, device="cpu")
        (backup,) = _code([[(original, host)]], device, coding=True, fall_back=False)
        restored = torch.empty_like(original)
        Restore([backup]).add(backup, [(restored, host)])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if any(piece.coded is None for piece in backup.pieces):
            raise RuntimeError("a sample of bf16 weights was not coded")
        if not torch.equal(restored, original):
            raise RuntimeError("a coded sample of bf16 weights did not come back bit-exact")
    except torch.OutOfMemoryError as error:
        _short_of_memory(error)
        return False
    except Exception as error:  # noqa: BLE001 - whatever the kernels' first use raised
        first_line = (str(error).strip().splitlines() or ["no message"])[0]
        _broken = f"{type(error).__name__}: {first_line}"
        logger.warning(
            "graph-sleep: weight backups cannot be coded in this process (%s); they are copied "
            "as they are. VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=0 skips the attempt.",
            _broken,
        )
        return False
    _proven.add(device)
    return True


def _short_of_memory(error: torch.OutOfMemoryError) -> None:
    global _warned_short_of_memory
    if not _warned_short_of_memory:
        _warned_short_of_memory = True
        logger.warning(
            "graph-sleep: no device memory left to code a weight backup (%s); what is left of "
            "it, and of any other the GPU has no room for, is backed up raw (said once)",
            str(error).splitlines()[0],
        )


class Restore:
    """One wake's restore of coded backups: `add` queues a backup's raw copies
    and coded decodes, on the current stream, as soon as its memory is mapped
    (the caller synchronizes). `backups`: every backup the wake will add."""

    def __init__(self, backups: list[CodedBackup]) -> None:
        self._backups = backups
        self._restorer: exponent_codec.Restorer | None = None

    def add(self, backup: CodedBackup, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for piece in backup.pieces:
            device = piece.on_device(pairs)
            if piece.coded is None:
                device.copy_(piece.raw, non_blocking=True)
            else:
                if self._restorer is None:
                    self._restorer = self._start(device.device)
                self._restorer.add(piece.coded, device)

    def _start(self, device: torch.device) -> exponent_codec.Restorer:
        # The decoder tables in one copy, before the first coded piece: one
        # per allocation, made at the sleep that coded it whole, and one per
        # sleep that coded some of its pieces again.
        pieces = [
            piece.coded
            for backup in self._backups
            for piece in backup.pieces
            if piece.coded is not None
        ]
        own = {backup.table: backup for backup in self._backups}  # their lookups made once
        tables: dict[Table, torch.Tensor] = {}
        for table in (coded.piece.table for coded in pieces):
            if table not in tables:
                made_at_sleep = own.get(table)
                tables[table] = (
                    made_at_sleep.lookup
                    if made_at_sleep is not None
                    else table.decoder_tensor(torch.device("cpu"))
                )
        stacked = torch.stack(list(tables.values())).to(device)
        lookups = dict(zip(tables, stacked, strict=True))
        return exponent_codec.Restorer(pieces, lookups, device)
