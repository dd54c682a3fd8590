"""A weight allocation's host backup in the exponent codec's format.

With VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1 a sleep codes each weight allocation's
backup on the device (`exponent_codec`) and copies the coded pieces into the
allocation's host buffer, where they take about two thirds of the room the raw
bytes would; a wake copies them back while the previous piece decodes
(`exponent_codec.restore`). A piece that does not shrink is kept raw, and so
is one that does not decode back to its original: the sleep checks every coded
piece on the device while the original is still there, so that a coder fault
costs bytes, not weights. The host buffer keeps its raw size, so a backup
always fits whatever the weights hold.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from vllm_graph_sleep import exponent_codec
from vllm_graph_sleep.exponent_codec import Encoded, Table

logger = logging.getLogger("vllm.graph_sleep")

# Bytes a wake decodes per piece; each of the wake's two staging slots holds one
# coded piece (about 43 MiB for this size).
PIECE_BYTES = 64 << 20
_warned_short_of_memory = False


@dataclasses.dataclass
class _Piece:
    pair: int  # index into the allocation's (device range, host range) pairs
    offset: int  # bytes into the device range
    size: int
    coded: Encoded | None  # views into the host buffer; None: raw
    raw: torch.Tensor | None  # the host bytes of a raw piece


@dataclasses.dataclass
class CodedBackup:
    table: Table
    lookup: torch.Tensor  # the table's decoder, in host memory: made once, at the sleep
    pieces: list[_Piece]

    @property
    def coded_bytes(self) -> int:
        return sum(p.size if p.coded is None else p.coded.piece.encoded_bytes for p in self.pieces)


def _place(host: torch.Tensor, encoded: Encoded) -> Encoded | None:
    """Views of `host` for `encoded`'s three buffers, copies queued into them;
    None when they would not fit in `host`. Two int32 buffers, then bytes: the
    views stay aligned wherever `host` starts on a 4-byte boundary (a piece of a
    host buffer starts at a multiple of PIECE_BYTES, a pair at one of 512)."""
    starts_at = 4 * encoded.stream.numel()
    raw_at = starts_at + 4 * encoded.starts.numel()
    end = raw_at + encoded.raw.numel()
    if end > host.numel():
        return None
    placed = Encoded(
        encoded.piece,
        host[:starts_at].view(torch.int32),
        host[starts_at:raw_at].view(torch.int32),
        host[raw_at:end],
    )
    placed.stream.copy_(encoded.stream, non_blocking=True)
    placed.starts.copy_(encoded.starts, non_blocking=True)
    placed.raw.copy_(encoded.raw, non_blocking=True)
    return placed


def _checked(chunk: torch.Tensor, encoded: Encoded | None, lookup: torch.Tensor) -> bool:
    """Whether `encoded` decodes back to `chunk`, checked on the device while
    the original is still there: a coder fault keeps the piece raw (and is
    logged) instead of reaching a wake."""
    if encoded is None:
        return False
    decoded = torch.empty_like(chunk)
    exponent_codec.decode_into(encoded, decoded, lookup)
    if torch.equal(decoded, chunk):
        return True
    logger.error(
        "graph-sleep: a coded backup piece (%d bytes) did not decode to its original; "
        "it is kept raw. Please report this with your GPU, driver, torch and Triton versions.",
        chunk.numel(),
    )
    return False


def back_up(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> CodedBackup:
    """Queues copies of every device range into its host range, coded where
    that pays and the coded piece decodes back to the original. One code table
    for the whole allocation (its weights share their shape of distribution);
    the copies run on the current stream. Coding needs device memory for its
    scratch (a few hundred MiB): without it, the rest is backed up raw, so that
    a sleep on a full GPU still frees it."""
    histogram = [0] * 256
    try:
        for device, _ in pairs:
            usable = device[: device.numel() // 2 * 2].view(torch.int16)
            for value, count in enumerate(exponent_codec.exponent_histogram(usable)):
                histogram[value] += count
    except torch.OutOfMemoryError as error:
        _short_of_memory(error)
        histogram = [0] * 256
    coding = any(histogram)
    if not coding:
        histogram[0] = 1  # nothing to code: every piece stays raw
    table = exponent_codec.build_table(histogram)
    host_lookup = table.decoder_tensor(torch.device("cpu"))
    lookup = host_lookup.to(pairs[0][0].device)
    encoder = table.encoder_tensors(pairs[0][0].device)
    pieces: list[_Piece] = []
    for index, (device, host) in enumerate(pairs):
        for offset in range(0, device.numel(), PIECE_BYTES):
            chunk = device[offset : offset + PIECE_BYTES]
            room = host[offset : offset + chunk.numel()]
            placed = None
            if coding and chunk.numel() % 2 == 0:
                try:
                    encoded = exponent_codec.encode(chunk, table, encoder)
                    placed = _place(room, encoded) if _checked(chunk, encoded, lookup) else None
                except torch.OutOfMemoryError as error:
                    _short_of_memory(error)
                    coding = False
            if placed is None:
                room.copy_(chunk, non_blocking=True)
            raw = room if placed is None else None
            pieces.append(_Piece(index, offset, chunk.numel(), placed, raw))
    return CodedBackup(table, host_lookup, pieces)


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
            device = pairs[piece.pair][0][piece.offset : piece.offset + piece.size]
            if piece.coded is None:
                device.copy_(piece.raw, non_blocking=True)
            else:
                if self._restorer is None:
                    self._restorer = self._start(device.device)
                self._restorer.add(piece.coded, device)

    def _start(self, device: torch.device) -> exponent_codec.Restorer:
        # The decoder tables in one copy, before the first coded piece: one
        # table per allocation, made at the sleep.
        coded = [
            backup
            for backup in self._backups
            if any(piece.coded is not None for piece in backup.pieces)
        ]
        tables = {backup.table: backup.lookup for backup in coded}
        stacked = torch.stack(list(tables.values())).to(device)
        lookups = dict(zip(tables, stacked, strict=True))
        pieces = [
            piece.coded for backup in coded for piece in backup.pieces if piece.coded is not None
        ]
        return exponent_codec.Restorer(pieces, lookups, device)
