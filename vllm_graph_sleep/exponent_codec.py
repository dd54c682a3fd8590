"""Lossless coding of bf16-like memory: fewer bytes over the host link.

A level-1 wake of a large model is its weight copy, bound by the PCIe link
(an 8B-class Llama: 255 ms of a 274 ms wake on an H200, docs/results/archive/
bench-h200-run12.md). bf16 weights waste most of their 8 exponent bits: for
N(0, 0.02) the exponent carries 2.55 bits of information, and DFloat11 (Zhang
et al., arXiv 2504.11651) finds about 2.6 in real LLM weights. This codec
keeps each 16-bit word's sign and mantissa as one raw byte and gives its
exponent a Huffman code, so a piece of memory crosses the link in about 66%
of its bytes, and the GPU decodes it back bit for bit.

It is lossless for any bytes, bf16 or not; memory whose exponent field is
not skewed simply does not shrink, and `encode` says so (None) so that the
caller copies it as it is.

Format of one encoded piece of `n` 16-bit words (n * 2 bytes in), built and
read on the device, laid out for coalesced access: the words are dealt to
`lanes` lanes round-robin (word i belongs to lane i % lanes and is that
lane's (i // lanes)-th symbol), and each lane's codes form its own
bitstream, most significant bit first, padded to a 32-bit word; the streams
follow one another. So the piece is:
- `stream`: int32[total_words + 1], the lanes' streams (the extra word keeps
  the decoder's read-ahead inside the buffer);
- `starts`: int32[lanes], where each lane's stream starts, in words;
- `raw`: uint8[n], each word's sign bit and 7 mantissa bits;
- the code table (`Table`), kept by the caller beside the piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_graph_sleep.triton_device import launching_on

# Longest code: the decoder looks codes up in a table of 2**MAX_CODE_BITS entries.
MAX_CODE_BITS = 12
# Symbols per lane: fewer lanes means less padding and fewer stream starts
# (about 2 bytes of padding and 4 of start per lane: 0.6% of the 1 KiB a lane
# codes at 512), more lanes more parallelism for a decoder whose lanes step
# through their symbols one after another (64K lanes for a 64 MiB piece).
SYMBOLS_PER_LANE = 512
LANES_PER_PROGRAM = 128
# A piece that does not shrink below this share of its bytes is copied as it is.
WORTHWHILE = 0.9


@dataclass(frozen=True)
class Table:
    """A canonical Huffman code for the 256 exponent values."""

    lengths: tuple[int, ...]  # bits per symbol; 0 for symbols that do not occur
    codes: tuple[int, ...]

    def encoder_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.tensor(self.codes, dtype=torch.int32, device=device)
        lengths = torch.tensor(self.lengths, dtype=torch.int32, device=device)
        return codes, lengths

    def decoder_tensor(self, device: torch.device) -> torch.Tensor:
        """Entry k of the lookup table: (length << 8) | symbol of the code that
        the MAX_CODE_BITS bits k start with. Canonical codes, taken in order,
        cover the table's entries from 0 up, each 2**(MAX_CODE_BITS - length)
        of them (the rest, of a code with one symbol, stays 0)."""
        order = sorted((length, s) for s, length in enumerate(self.lengths) if length)
        entries = torch.tensor([(length << 8) | s for length, s in order], dtype=torch.int32)
        spans = torch.tensor([1 << (MAX_CODE_BITS - length) for length, _ in order])
        lookup = torch.zeros(1 << MAX_CODE_BITS, dtype=torch.int32)
        covered = torch.repeat_interleave(entries, spans)
        lookup[: covered.numel()] = covered
        return lookup.to(device)

    def coded_bits(self, histogram: list[int]) -> int:
        return sum(count * length for count, length in zip(histogram, self.lengths, strict=True))


def _huffman_depths(weights: list[int]) -> list[int]:
    """Code lengths of a Huffman code for `weights` (at least two, sorted
    ascending): the two-queue construction, leaves in order and merged nodes in
    the order they are made (which is ascending too), then each node's depth
    from its parent's."""
    count = len(weights)
    node_weight = weights + [0] * (count - 1)
    parent = [0] * (2 * count - 1)
    leaf, merged = 0, count
    for made in range(count, 2 * count - 1):
        picked = []
        for _ in range(2):
            if merged < made and (leaf >= count or node_weight[merged] < node_weight[leaf]):
                picked.append(merged)
                merged += 1
            else:
                picked.append(leaf)
                leaf += 1
        node_weight[made] = node_weight[picked[0]] + node_weight[picked[1]]
        parent[picked[0]] = parent[picked[1]] = made
    depth = [0] * (2 * count - 1)
    for node in range(2 * count - 3, -1, -1):
        depth[node] = depth[parent[node]] + 1
    return depth[:count]


def _limited(per_length: list[int], limit: int) -> list[int]:
    """Counts of codes per length (index = bits), rearranged so that none is
    longer than `limit` and the code stays complete: two codes of the longest
    length become one a bit shorter, and a code of the longest length below
    that makes room for the other by splitting in two (JPEG, ITU T.81 Annex
    K.3). Fits whenever 2**limit covers the symbols."""
    per_length = per_length + [0] * max(0, limit + 1 - len(per_length))
    for longest in range(len(per_length) - 1, limit, -1):
        while per_length[longest]:
            shorter = longest - 2
            while per_length[shorter] == 0:
                shorter -= 1
            per_length[longest] -= 2
            per_length[longest - 1] += 1
            per_length[shorter + 1] += 2
            per_length[shorter] -= 1
    return per_length[: limit + 1]


def build_table(histogram: list[int]) -> Table:
    """A canonical code for `histogram` (256 counts, at least one nonzero)
    whose codes are at most MAX_CODE_BITS long.

    A Huffman code; where rare symbols would get longer codes than the limit,
    the counts of codes per length are moved up to it as JPEG's encoders do
    (`_limited`), the shortest codes going to the most frequent symbols. A
    sleep builds one table per weight allocation it codes, and one per
    allocation whose changed pieces it codes again: this is linear after one
    sort (docs/design.md, "Coded weight backups", has its cost)."""
    present = sorted((count, symbol) for symbol, count in enumerate(histogram) if count > 0)
    lengths = [0] * len(histogram)
    if len(present) == 1:
        lengths[present[0][1]] = 1
    else:
        depths = _huffman_depths([count for count, _ in present])
        per_length = [0] * (max(depths) + 1)
        for depth in depths:
            per_length[depth] += 1
        per_length = _limited(per_length, MAX_CODE_BITS)
        by_frequency = [symbol for _, symbol in reversed(present)]
        at = 0
        for length, how_many in enumerate(per_length):
            for symbol in by_frequency[at : at + how_many]:
                lengths[symbol] = length
            at += how_many
    codes = [0] * len(lengths)
    code, previous = 0, 0
    for length, symbol in sorted((length, s) for s, length in enumerate(lengths) if length):
        code <<= length - previous
        codes[symbol] = code
        code += 1
        previous = length
    return Table(tuple(lengths), tuple(codes))


@dataclass(frozen=True)
class Piece:
    """What the decoder needs besides the three buffers (see module docstring)."""

    symbols: int
    symbols_per_lane: int
    lanes: int
    total_words: int
    table: Table

    @property
    def encoded_bytes(self) -> int:
        return 4 * (self.total_words + 1) + 4 * self.lanes + self.symbols


def lanes_for(symbols: int) -> int:
    return -(-symbols // SYMBOLS_PER_LANE)


def stream_words_bound(coded_bits: int, lanes: int) -> int:
    """The most words `lanes` lanes' streams take for `coded_bits` bits of
    codes in all: each lane pads its bits to whole words, by at most 31."""
    return (coded_bits + 31 * lanes) // 32


def exponent_histogram(words: torch.Tensor, chunk: int = 1 << 25) -> list[int]:
    """Counts of the 256 exponent values of `words` (int16, any device), `chunk`
    words at a time: the temporaries stay small beside a large allocation."""
    counts = torch.zeros(256, dtype=torch.int64, device=words.device)
    for part in words.split(chunk):
        counts += torch.bincount(((part >> 7) & 0xFF).to(torch.uint8), minlength=256)
    return counts.tolist()


@triton.jit
def _program_lanes(lanes, LANES_PER_PROGRAM: tl.constexpr):
    lane = tl.program_id(0) * LANES_PER_PROGRAM + tl.arange(0, LANES_PER_PROGRAM)
    return lane, lane < lanes


@triton.jit
def _symbol(i, lane, lane_ok, lanes, symbols):
    """Where lane `lane`'s i-th symbol is, and whether it has one."""
    index = i * lanes + lane
    return index, lane_ok & (index < symbols)


@triton.jit
def _low_bits(value, count):
    """The low `count` bits of int64 `value`."""
    return value & ((tl.full(value.shape, 1, tl.int64) << count.to(tl.int64)) - 1)


@triton.jit
def _exponent(words, index, ok):
    word = tl.load(words + index, mask=ok, other=0).to(tl.int32)
    return word, (word >> 7) & 0xFF


# The kernels' sizes take whatever values the weights and their codes give;
# specialized, Triton would compile another variant of a kernel for a size
# divisible by 16 or equal to 1 at the first sleep or wake that meets one,
# after the worker's warm-up (coded_backup.prepare) compiled the kernels. The
# histogram's sizes are an allocation's: typed int64, so that one of 4 GiB or
# more (2**31 words, which Triton passes as i64 whatever it is told about
# specializing) takes the variant the warm-up's small sample compiled.
@triton.jit(do_not_specialize=["symbols", "piece_symbols"])
def _histogram_kernel(
    words,
    symbols: tl.int64,
    piece_symbols: tl.int64,
    histograms,
    BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
):
    """Adds the exponent counts of `words` to row (i // piece_symbols) of
    `histograms` (int32[rows, 256]) for each word i: a program's words all
    lie in one piece (piece_symbols is a multiple of its BLOCK *
    BLOCKS_PER_PROGRAM), so it adds its 256 counts once."""
    start = tl.program_id(0).to(tl.int64) * (BLOCK * BLOCKS_PER_PROGRAM)
    counts = tl.zeros([256], dtype=tl.int32)
    for block in range(BLOCKS_PER_PROGRAM):
        index = start + block * BLOCK + tl.arange(0, BLOCK)
        ok = index < symbols
        _, exponent = _exponent(words, index, ok)
        counts += tl.histogram(exponent, 256, mask=ok)
    row = start // piece_symbols
    tl.atomic_add(histograms + row * 256 + tl.arange(0, 256), counts)


@triton.jit(do_not_specialize=["symbols", "lanes"])
def _count_kernel(
    words,
    symbols,
    lanes,
    lengths,
    lane_bits,
    SYMBOLS_PER_LANE: tl.constexpr,
    LANES_PER_PROGRAM: tl.constexpr,
):
    lane, lane_ok = _program_lanes(lanes, LANES_PER_PROGRAM)
    bits = tl.zeros([LANES_PER_PROGRAM], dtype=tl.int32)
    for i in range(SYMBOLS_PER_LANE):
        index, ok = _symbol(i, lane, lane_ok, lanes, symbols)
        _, symbol = _exponent(words, index, ok)
        bits += tl.where(ok, tl.load(lengths + symbol), 0)
    tl.store(lane_bits + lane, bits, mask=lane_ok)


@triton.jit(do_not_specialize=["symbols", "lanes"])
def _encode_kernel(
    words,
    symbols,
    lanes,
    codes,
    lengths,
    starts,
    stream,
    raw,
    ends,
    SYMBOLS_PER_LANE: tl.constexpr,
    LANES_PER_PROGRAM: tl.constexpr,
):
    """Writes each lane's codes from its start and stores where they end."""
    lane, lane_ok = _program_lanes(lanes, LANES_PER_PROGRAM)
    at = tl.load(starts + lane, mask=lane_ok, other=0)
    pending = tl.zeros([LANES_PER_PROGRAM], dtype=tl.int64)  # `held` bits, low end
    held = tl.zeros([LANES_PER_PROGRAM], dtype=tl.int32)
    for i in range(SYMBOLS_PER_LANE):
        index, ok = _symbol(i, lane, lane_ok, lanes, symbols)
        word, symbol = _exponent(words, index, ok)
        tl.store(raw + index, (((word >> 8) & 0x80) | (word & 0x7F)).to(tl.uint8), mask=ok)
        length = tl.where(ok, tl.load(lengths + symbol), 0)
        code = tl.where(ok, tl.load(codes + symbol), 0)
        pending = (pending << length.to(tl.int64)) | code.to(tl.int64)
        held += length
        full = held >= 32
        out = (pending >> tl.maximum(held - 32, 0).to(tl.int64)) & 0xFFFFFFFF
        tl.store(stream + at, out.to(tl.int32), mask=full)
        at += full.to(tl.int32)
        held = tl.where(full, held - 32, held)
        pending = _low_bits(pending, held)
    tail = (pending << (32 - held).to(tl.int64)) & 0xFFFFFFFF
    tl.store(stream + at, tail.to(tl.int32), mask=lane_ok & (held > 0))
    tl.store(ends + lane, at + (held > 0).to(tl.int32), mask=lane_ok)


@triton.jit(do_not_specialize=["total_words", "symbols", "lanes"])
def _decode_kernel(
    stream,
    total_words,
    starts,
    raw,
    lookup,
    out,
    symbols,
    lanes,
    mismatches,
    SYMBOLS_PER_LANE: tl.constexpr,
    LANES_PER_PROGRAM: tl.constexpr,
    MAX_CODE_BITS: tl.constexpr,
    CHECK: tl.constexpr,
):
    """Decodes into `out`; with CHECK, compares with what `out` holds instead
    and adds the words that differ to `mismatches` (int32[1])."""
    lane, lane_ok = _program_lanes(lanes, LANES_PER_PROGRAM)
    at = tl.load(starts + lane, mask=lane_ok, other=0)
    wrong = tl.zeros([LANES_PER_PROGRAM], dtype=tl.int32)
    buffered = tl.zeros([LANES_PER_PROGRAM], dtype=tl.int64)  # `held` bits, low end
    held = tl.zeros([LANES_PER_PROGRAM], dtype=tl.int32)
    for i in range(SYMBOLS_PER_LANE):
        index, ok = _symbol(i, lane, lane_ok, lanes, symbols)
        refill = ok & (held < MAX_CODE_BITS)
        word = tl.load(stream + at, mask=refill & (at <= total_words), other=0)
        word = word.to(tl.int64) & 0xFFFFFFFF
        buffered = tl.where(refill, (buffered << 32) | word, buffered)
        held = tl.where(refill, held + 32, held)
        at += refill.to(tl.int32)
        peek = (buffered >> tl.maximum(held - MAX_CODE_BITS, 0).to(tl.int64)) & (
            (1 << MAX_CODE_BITS) - 1
        )
        entry = tl.load(lookup + peek, mask=ok, other=0)
        length = tl.where(ok, entry >> 8, 0)
        held -= length
        buffered = _low_bits(buffered, held)
        sign_mantissa = tl.load(raw + index, mask=ok, other=0).to(tl.int32)
        value = ((sign_mantissa & 0x80) << 8) | ((entry & 0xFF) << 7) | (sign_mantissa & 0x7F)
        if CHECK:
            original = tl.load(out + index, mask=ok, other=0).to(tl.int32) & 0xFFFF
            wrong += (ok & (value != original)).to(tl.int32)
        else:
            tl.store(out + index, value.to(tl.int16), mask=ok)
    if CHECK:
        tl.atomic_add(mismatches, tl.sum(wrong, axis=0))


class Encoded:
    """One encoded piece: its three device (or host) buffers and its `Piece`."""

    def __init__(self, piece: Piece, stream: torch.Tensor, starts: torch.Tensor, raw: torch.Tensor):
        self.piece = piece
        self.stream = stream
        self.starts = starts
        self.raw = raw

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.stream, self.starts, self.raw


HISTOGRAM_BLOCK = 2048
HISTOGRAM_BLOCKS_PER_PROGRAM = 32


def add_piece_histograms(words: torch.Tensor, piece_symbols: int, rows: torch.Tensor) -> None:
    """Adds the exponent counts of each `piece_symbols` words of `words`
    (int16, on the device) to its row of `rows` (int32[pieces, 256], zeroed by
    the caller), on the current stream, without waiting for them. One pass,
    no scratch; `piece_symbols` is a multiple of the kernel's 64K words."""
    per_program = HISTOGRAM_BLOCK * HISTOGRAM_BLOCKS_PER_PROGRAM
    if piece_symbols % per_program:
        raise ValueError(f"pieces of {piece_symbols} words: not a multiple of {per_program}")
    if words.numel() == 0:
        return
    with launching_on(words.device):
        _histogram_kernel[(triton.cdiv(words.numel(), per_program),)](
            words,
            words.numel(),
            piece_symbols,
            rows,
            BLOCK=HISTOGRAM_BLOCK,
            BLOCKS_PER_PROGRAM=HISTOGRAM_BLOCKS_PER_PROGRAM,
        )


def _lane_grid(lanes: int) -> tuple[int]:
    return (triton.cdiv(lanes, LANES_PER_PROGRAM),)


def _launch_over_lanes(kernel, words: torch.Tensor, lanes: int, *arguments) -> None:
    """Launches a kernel whose lanes step through `words`, on the current
    stream: (words, symbols, lanes, *arguments)."""
    with launching_on(words.device):
        kernel[_lane_grid(lanes)](
            words,
            words.numel(),
            lanes,
            *arguments,
            SYMBOLS_PER_LANE=SYMBOLS_PER_LANE,
            LANES_PER_PROGRAM=LANES_PER_PROGRAM,
        )


def count_lanes(words: torch.Tensor, lengths: torch.Tensor, lane_bits: torch.Tensor) -> None:
    """Each lane's coded bits into `lane_bits` (int32[lanes_for(words)]), on
    the current stream."""
    _launch_over_lanes(_count_kernel, words, lane_bits.numel(), lengths, lane_bits)


def encode_lanes(
    words: torch.Tensor,
    encoder: tuple[torch.Tensor, torch.Tensor],
    starts: torch.Tensor,
    stream: torch.Tensor,
    raw: torch.Tensor,
    ends: torch.Tensor,
) -> None:
    """Codes `words` into `stream` at each lane's start (`starts`, from
    `count_lanes`) and their sign and mantissa bytes into `raw`, on the current
    stream, and stores in `ends` (int32[lanes]) the word after each lane's last.
    The lanes write from their starts up to their ends: a caller that keeps
    only the words up to the lanes' ends its count gave compares them with
    `ends` first (a count that disagreed would cut off a lane's codes)."""
    codes, lengths = encoder
    _launch_over_lanes(
        _encode_kernel, words, starts.numel(), codes, lengths, starts, stream, raw, ends
    )


def encode(
    data: torch.Tensor,
    table: Table | None = None,
    encoder: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Encoded | None:
    """Encodes `data` (uint8, an even number of bytes under 4 GiB, contiguous)
    on its device and waits for the size; None when it would not shrink below
    WORTHWHILE of its size. `encoder`: `table.encoder_tensors(data.device)`,
    made once by a caller that codes many pieces with one table (each making
    is a copy that waits)."""
    if data.dtype != torch.uint8 or data.numel() % 2 or not data.is_contiguous():
        raise ValueError("encode takes contiguous uint8 data of an even number of bytes")
    if data.numel() >= 1 << 32:
        raise ValueError("encode takes under 4 GiB at a time (the kernels index in int32)")
    words16 = data.view(torch.int16)
    symbols = words16.numel()
    if symbols == 0:
        return None
    if table is None:
        table = build_table(exponent_histogram(words16))
    lanes = lanes_for(symbols)
    with launching_on(data.device):
        encoder = encoder or table.encoder_tensors(data.device)
        lane_bits = torch.empty(lanes, dtype=torch.int32, device=data.device)
        count_lanes(words16, encoder[1], lane_bits)
        lane_words = (lane_bits + 31) // 32
        ends = torch.cumsum(lane_words, dim=0, dtype=torch.int32)
        total_words = int(ends[-1])
        piece = Piece(symbols, SYMBOLS_PER_LANE, lanes, total_words, table)
        if piece.encoded_bytes > WORTHWHILE * data.numel():
            return None
        starts = ends - lane_words
        stream = torch.zeros(total_words + 1, dtype=torch.int32, device=data.device)
        raw = torch.empty(symbols, dtype=torch.uint8, device=data.device)
        written = torch.empty_like(ends)
        encode_lanes(words16, encoder, starts, stream, raw, written)
        if not torch.equal(written, ends):
            raise RuntimeError("the encoder's lanes did not end where their counts said")
    return Encoded(piece, stream, starts, raw)


def _decode(encoded: Encoded, out: torch.Tensor, lookup: torch.Tensor, mismatches) -> None:
    piece = encoded.piece
    if out.dtype != torch.uint8 or out.numel() != 2 * piece.symbols or not out.is_contiguous():
        raise ValueError(f"decoding needs {2 * piece.symbols} contiguous uint8 bytes")
    with launching_on(out.device):
        _decode_kernel[_lane_grid(piece.lanes)](
            encoded.stream,
            piece.total_words,
            encoded.starts,
            encoded.raw,
            lookup,
            out.view(torch.int16),
            piece.symbols,
            piece.lanes,
            lookup if mismatches is None else mismatches,  # any pointer: unread without CHECK
            SYMBOLS_PER_LANE=piece.symbols_per_lane,
            LANES_PER_PROGRAM=LANES_PER_PROGRAM,
            MAX_CODE_BITS=MAX_CODE_BITS,
            CHECK=mismatches is not None,
        )


def decode_into(encoded: Encoded, out: torch.Tensor, lookup: torch.Tensor | None = None) -> None:
    """Decodes `encoded` (its buffers on `out`'s device) into `out` (uint8,
    the piece's size), on the current stream."""
    if lookup is None:
        lookup = encoded.piece.table.decoder_tensor(out.device)
    _decode(encoded, out, lookup, None)


def count_mismatches(
    encoded: Encoded, original: torch.Tensor, lookup: torch.Tensor, mismatches: torch.Tensor
) -> None:
    """Decodes `encoded` as `decode_into` would and adds the words that differ
    from `original` to `mismatches` (int32[1]), on the current stream: the
    wake's decoder checked against the bytes it will have to give back,
    without a copy of them."""
    _decode(encoded, original, lookup, mismatches)


def restore(pieces: list[tuple[Encoded, torch.Tensor]], lookups: dict[Table, torch.Tensor]) -> None:
    """Decodes host-resident pieces into their device destinations, copying
    the next piece over the link while the current one decodes (a `Restorer`
    given them all at once)."""
    if not pieces:
        return
    restorer = Restorer([host for host, _ in pieces], lookups, pieces[0][1].device)
    for host, out in pieces:
        restorer.add(host, out)


class Restorer:
    """Decodes host-resident pieces into their device destinations as they are
    added, copying the next piece over the link while the current one decodes:
    a caller that maps each destination just before adding it maps the next
    while this one's copy runs.

    `pieces`: every piece that will be added (in page-locked host memory; they
    size the staging slots); `lookups`: each piece's decoder table, already on
    `device` (made before, so that no copy of ours stalls the pipeline). Two
    staging slots on the device, each the size of the largest piece; the
    copies run on a stream of their own, the decodes on the stream current at
    construction, which the caller synchronizes (the slots are freed after
    that)."""

    def __init__(
        self, pieces: list[Encoded], lookups: dict[Table, torch.Tensor], device: torch.device
    ) -> None:
        self._lookups = lookups
        self._device = device
        self._added = 0
        if device.type != "cuda":
            return  # the unit tests' fake devices are CPU memory: nothing to overlap
        with launching_on(device):
            self._compute = torch.cuda.current_stream()
            self._copier = torch.cuda.Stream()
            sizes = [
                max(getattr(e, name).numel() for e in pieces)
                for name in ("stream", "starts", "raw")
            ]
            self._slots = [
                (
                    torch.empty(sizes[0], dtype=torch.int32, device=device),
                    torch.empty(sizes[1], dtype=torch.int32, device=device),
                    torch.empty(sizes[2], dtype=torch.uint8, device=device),
                )
                for _ in range(2)
            ]
            # The copier writes the slots: whenever they are freed, not before it is done.
            for slot in self._slots:
                for buffer in slot:
                    buffer.record_stream(self._copier)
            self._copied = [torch.cuda.Event() for _ in self._slots]
            self._decoded = [torch.cuda.Event() for _ in self._slots]
            self._copier.wait_stream(self._compute)  # nothing queued before may still use them

    def add(self, host: Encoded, out: torch.Tensor) -> None:
        """Queues `host`'s copy and its decode into `out`, whose memory is
        mapped and whose earlier writes are queued on the decoding stream."""
        lookup = self._lookups[host.piece.table]
        if self._device.type != "cuda":
            decode_into(host, out, lookup)
            return
        slot = self._added % 2
        stream, starts, raw = self._slots[slot]
        with launching_on(self._device):
            with torch.cuda.stream(self._copier):
                if self._added >= 2:
                    self._copier.wait_event(self._decoded[slot])
                staged = Encoded(
                    host.piece,
                    stream[: host.stream.numel()],
                    starts[: host.starts.numel()],
                    raw[: host.raw.numel()],
                )
                staged.stream.copy_(host.stream, non_blocking=True)
                staged.starts.copy_(host.starts, non_blocking=True)
                staged.raw.copy_(host.raw, non_blocking=True)
                self._copied[slot].record(self._copier)
            self._compute.wait_event(self._copied[slot])
            with torch.cuda.stream(self._compute):
                decode_into(staged, out, lookup)
            self._decoded[slot].record(self._compute)
        self._added += 1
