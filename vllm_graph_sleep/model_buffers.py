"""The model's buffers a level-2 sleep keeps on the host, copied at once.

vLLM's Worker.sleep saves every buffer of the model before a level-2 sleep
(the weights go, and a reload does not bring back buffers such as the rotary
tables and the attention scales) with `buffer.cpu().clone()`: a synchronous
copy into pageable memory and a second copy, per buffer; a Llama 8B has 129
of them (four scalar scales per attention layer and the rotary table, 1 MiB
in all). `save` gathers them on their device into a few contiguous chunks,
copies each chunk into one pinned staging buffer without waiting, and waits
once; the wake copies them back as vLLM does, from these host tensors.

Why gathered: one asynchronous copy per buffer (9f1e411) still took 3.8-7.4
ms of the 8B's level-2 sleeps, the most of what they spend outside the
allocator (lease 16, docs/results/sleep-speed-h100.md); for 129 such buffers
on an H100, 2.9-3.0 ms per save against 0.9 ms gathered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Where each chunk and each buffer copied alone starts in the staging buffer:
# every dtype can be viewed there (view(dtype) needs an offset that is a
# multiple of its item size).
_ALIGNMENT = 64
# At most this much device memory per gathered chunk, taken from torch's cache
# for the time of one copy (each chunk's is free for the next once queued: one
# stream orders them); a larger buffer is copied by itself.
_CHUNK_BYTES = 8 << 20


def save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> a host copy of each of `model.named_buffers()`, with its
    dtype, shape and contents, as vLLM's `buffer.cpu().clone()` gives it;
    those of strided buffers are views into one staging buffer (pinned where
    CUDA is), gathered per device into chunks, copied into it
    asynchronously and waited for before returning."""
    buffers = list(model.named_buffers())
    strided = [(name, buffer) for name, buffer in buffers if buffer.layout == torch.strided]
    placed, total = _place(strided)
    staging = _staging_buffer(total)
    for chunk, offset, size in placed:
        _copy_chunk(chunk, staging[offset : offset + size])
    for device in {buffer.device for _, buffer in strided if buffer.device.type == "cuda"}:
        torch.cuda.synchronize(device)
    saved = {
        name: staging[offset : offset + size].view(buffer.dtype).reshape(buffer.shape)
        for chunk, start, _ in placed
        for name, buffer, offset, size in _members(chunk, start)
    }
    # Sparse and other layouts: as vLLM copies them.
    return {
        name: saved[name] if name in saved else buffer.cpu().clone() for name, buffer in buffers
    }


# A chunk: (name, buffer) pairs copied with one copy, in order, each right
# after the one before (see _place).
_Chunk = list[tuple[str, torch.Tensor]]


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


def _place(strided: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[_Chunk, int, int]], int]:
    """(chunk, offset in the staging buffer, bytes) of each chunk, and the
    staging buffer's size. Chunks hold buffers of one device, larger item
    sizes first: item sizes are powers of two, so each buffer starts at a
    multiple of its own (the chunk starts at _ALIGNMENT)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, buffer in sorted(strided, key=lambda pair: -pair[1].element_size()):
        by_device.setdefault(buffer.device, []).append((name, buffer))
    chunks: list[tuple[_Chunk, int]] = []  # (chunk, bytes)
    for members in by_device.values():
        chunk: _Chunk = []
        size = 0
        for name, buffer in members:
            if chunk and size + _nbytes(buffer) > _CHUNK_BYTES:
                chunks.append((chunk, size))
                chunk, size = [], 0
            chunk.append((name, buffer))
            size += _nbytes(buffer)
        if chunk:
            chunks.append((chunk, size))
    placed, total = [], 0
    for chunk, size in chunks:
        placed.append((chunk, total, size))
        total += -(-size // _ALIGNMENT) * _ALIGNMENT
    return placed, total


def _members(chunk: _Chunk, start: int) -> Iterator[tuple[str, torch.Tensor, int, int]]:
    """(name, buffer, offset in the staging buffer, bytes) of each buffer of
    `chunk`, placed at `start`."""
    offset = start
    for name, buffer in chunk:
        yield name, buffer, offset, _nbytes(buffer)
        offset += _nbytes(buffer)


def _copy_chunk(chunk: _Chunk, target: torch.Tensor) -> None:
    """Queues the bytes of `chunk`'s buffers, one after another, into
    `target`: gathered on their device and copied at once; one by one where
    the device has no room for the gathered copy (the sleep goes on)."""
    flat = [buffer.detach().reshape(-1).view(torch.uint8) for _, buffer in chunk]
    if len(flat) > 1:
        try:
            target.copy_(torch.cat(flat), non_blocking=True)
            return
        except torch.OutOfMemoryError:
            pass
    offset = 0
    for data in flat:
        target[offset : offset + data.numel()].copy_(data, non_blocking=True)
        offset += data.numel()


def _staging_buffer(size: int) -> torch.Tensor:
    """Pinned where CUDA is, so that the copies into it are asynchronous;
    pageable where pinning fails (each copy then waits for itself, as
    vLLM's do): the sleep goes on either way."""
    if torch.cuda.is_available():
        try:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            pass
    return torch.empty(size, dtype=torch.uint8)


@contextmanager
def hidden(model: object) -> Iterator[None]:
    """Inside, `model.named_buffers()` yields nothing: vLLM's Worker.sleep
    then saves no buffer of its own (`save` has)."""
    shadowed = model.__dict__.get("named_buffers", _NOTHING)

    def named_buffers(*args, **kwargs):
        return iter(())

    model.__dict__["named_buffers"] = named_buffers
    try:
        yield
    finally:
        if shadowed is _NOTHING:
            del model.__dict__["named_buffers"]
        else:
            model.__dict__["named_buffers"] = shadowed


_NOTHING = object()
