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
allocator (lease 16, docs/results/archive/sleep-speed-h100-2026-12-07.md); for 129 such buffers
on an H100, 2.9-3.0 ms per save against 0.9 ms gathered. In the engine the
save still took 4.5-9.7 ms of the 8B's level-2 sleeps, 6.4-12.1 ms outside the
allocator, most of it before the device's wait (lease 18): the log line times
each step of it, and the layout (places, staging buffer, host views) is kept
from one save to the next, so that a run's first save (layout made) and the
later ones (layout kept) say what making it costs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from vllm_graph_sleep.units import format_bytes

logger = logging.getLogger("vllm.graph_sleep")

# Where each chunk starts in the staging buffer: every dtype can be viewed
# there (view(dtype) needs an offset that is a multiple of its item size).
_ALIGNMENT = 64
# At most this much device memory per gathered chunk, taken from torch's cache
# for the time of one copy (each chunk's is free for the next once queued: one
# stream orders them); a larger buffer is copied by itself.
_CHUNK_BYTES = 8 << 20


# A buffer's place in the staging buffer: (name, buffer, offset, bytes).
_Placed = tuple[str, torch.Tensor, int, int]


def save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> a host copy of each of `model.named_buffers()`, with its
    dtype, shape and contents, as vLLM's `buffer.cpu().clone()` gives it;
    those of strided buffers are views into one staging buffer (pinned where
    CUDA is), gathered per device into chunks, copied into it
    asynchronously and waited for before returning.

    The staging buffer, the buffers' places in it and their host views are
    kept for the model's next save while its buffers are the same tensors at
    the same addresses, shapes and strides: that save copies into the same
    host memory, which vLLM's wake has read back by then (one level-2 sleep
    at a time; a failed sleep's save is taken again by its retry)."""
    started = time.perf_counter()
    buffers = list(_unhidden(model.named_buffers)())
    strided = [(name, buffer) for name, buffer in buffers if buffer.layout == torch.strided]
    key = tuple(
        (name, buffer.device, buffer.dtype, buffer.data_ptr(), buffer.shape, buffer.stride())
        for name, buffer in strided
    )
    layout = _layouts.get(model)
    kept = layout is not None and layout.key == key
    placed = time.perf_counter()
    if not kept:
        layout = _lay_out(key, strided)
        _layouts[model] = layout
    staged = time.perf_counter()
    for chunk, flat in zip(layout.chunks, layout.flat, strict=True):
        _copy_chunk(chunk, flat, layout.staging)
    queued = time.perf_counter()
    # The wait also covers whatever the device still had queued before the save.
    for device in {buffer.device for _, buffer in strided if buffer.device.type == "cuda"}:
        torch.cuda.synchronize(device)
    waited = time.perf_counter()
    # Sparse and other layouts: as vLLM copies them.
    result = {
        name: layout.views[name] if name in layout.views else buffer.cpu().clone()
        for name, buffer in buffers
    }
    # Its own line: this runs in the worker, outside the allocator's sleep and
    # its log line, and was the most of that outside time (leases 16 and 18).
    # In lease 18, 2.4-6.8 ms of it went before the wait: the phases say where.
    laps = (started, placed, staged, queued, waited, time.perf_counter())
    logger.info(
        "graph-sleep level-2 sleep: saved the model's %d buffers (%s) in %d chunk(s) in %.1f ms "
        "(%s; listed %.1f ms, placed and staging buffer %.1f ms, copies queued %.1f ms, "
        "waiting for the device %.1f ms, host views %.1f ms)",
        len(buffers),
        format_bytes(sum(_nbytes(buffer) for _, buffer in buffers)),
        len(layout.chunks),
        1000 * (laps[-1] - laps[0]),
        "layout kept" if kept else "layout made",
        *(1000 * (end - begin) for begin, end in itertools.pairwise(laps)),
    )
    return result


@dataclasses.dataclass
class _Layout:
    """Where one model's strided buffers go in its staging buffer."""

    key: tuple
    chunks: list[list[_Placed]]
    # Per chunk, each buffer's bytes as a flat view, or None where the buffer
    # is not contiguous (its flat copy is made at each save).
    flat: list[list[torch.Tensor | None]]
    staging: torch.Tensor
    views: dict[str, torch.Tensor]


# Per model: the layout of its last save (gone with the model).
_layouts: weakref.WeakKeyDictionary[torch.nn.Module, _Layout] = weakref.WeakKeyDictionary()


def _lay_out(key: tuple, strided: list[tuple[str, torch.Tensor]]) -> _Layout:
    chunks, total = _place(strided)
    staging = _staging_buffer(total)
    return _Layout(
        key=key,
        chunks=chunks,
        flat=[
            [_flat(buffer) if buffer.is_contiguous() else None for _, buffer, _, _ in chunk]
            for chunk in chunks
        ],
        staging=staging,
        views={
            name: staging[offset : offset + size].view(buffer.dtype).reshape(buffer.shape)
            for chunk in chunks
            for name, buffer, offset, size in chunk
        },
    )


def _flat(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.detach().reshape(-1).view(torch.uint8)


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGNMENT) * _ALIGNMENT


def _place(strided: list[tuple[str, torch.Tensor]]) -> tuple[list[list[_Placed]], int]:
    """The chunks, each a run of buffers of one device placed one right after
    another from an offset of _ALIGNMENT, and the staging buffer's size.
    Larger item sizes go first: item sizes are powers of two, so each buffer
    starts at a multiple of its own."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, buffer in sorted(strided, key=lambda pair: -pair[1].element_size()):
        by_device.setdefault(buffer.device, []).append((name, buffer))
    chunks: list[list[_Placed]] = []
    total = 0
    for members in by_device.values():
        chunk: list[_Placed] = []
        offset = total  # where the next buffer goes
        for name, buffer in members:
            size = _nbytes(buffer)
            if chunk and offset + size - chunk[0][2] > _CHUNK_BYTES:
                chunks.append(chunk)
                chunk, offset = [], _aligned(offset)
            chunk.append((name, buffer, offset, size))
            offset += size
        chunks.append(chunk)
        total = _aligned(offset)
    return chunks, total


def _copy_chunk(
    chunk: list[_Placed], kept: list[torch.Tensor | None], staging: torch.Tensor
) -> None:
    """Queues the bytes of `chunk`'s buffers (`kept`: their flat views, None
    where one is made now) into their places in `staging`: gathered on their
    device and copied at once; one by one where the device has no room for
    the gathered copy (the sleep goes on)."""
    flat = [
        view if view is not None else _flat(buffer)
        for view, (_, buffer, _, _) in zip(kept, chunk, strict=True)
    ]
    if len(flat) > 1:
        _, _, start, _ = chunk[0]
        _, _, last, size = chunk[-1]
        try:
            staging[start : last + size].copy_(torch.cat(flat), non_blocking=True)
            return
        except torch.OutOfMemoryError:
            pass
    for data, (_, _, offset, size) in zip(flat, chunk, strict=True):
        staging[offset : offset + size].copy_(data, non_blocking=True)


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

    # For `save` inside: the model's own (a wrapper's too, such as vLLM's
    # CUDAGraphWrapper around a drafter, which forwards it to the model).
    named_buffers.unhidden = model.named_buffers
    model.__dict__["named_buffers"] = named_buffers
    try:
        yield
    finally:
        if shadowed is _NOTHING:
            del model.__dict__["named_buffers"]
        else:
            model.__dict__["named_buffers"] = shadowed


_NOTHING = object()


def _unhidden(named_buffers):
    """`named_buffers` as it was before `hidden` shadowed it, if it did."""
    return getattr(named_buffers, "unhidden", named_buffers)
