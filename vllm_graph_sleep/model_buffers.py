"""The model's buffers a level-2 sleep keeps on the host, copied at once.

vLLM's Worker.sleep saves every buffer of the model before a level-2 sleep
(the weights go, and a reload does not bring back buffers such as the rotary
tables and the attention scales) with `buffer.cpu().clone()`: a synchronous
copy into pageable memory and a second copy, per buffer; a Llama 8B has 129
of them (four scales per attention layer and the rotary table). The 8B's
level-2 sleeps spent 4.8-7.3 ms in the worker outside the allocator, against
0.9-1.0 ms at level 1, and saving the buffers is the one step there that only
level 2 takes (docs/results/sleep-speed-h100.md, lease 12). `save` queues one
asynchronous copy per buffer into one pinned staging buffer and waits once;
the wake copies them back as vLLM does, from these host tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Where each buffer starts in the staging buffer: every dtype can be viewed
# there (view(dtype) needs an offset that is a multiple of its item size).
_ALIGNMENT = 64


def save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name -> a host copy of each of `model.named_buffers()`, with its
    dtype, shape and contents, as vLLM's `buffer.cpu().clone()` gives it;
    those of strided buffers are views into one staging buffer (pinned where
    CUDA is), copied into it asynchronously and waited for before returning."""
    buffers = list(model.named_buffers())
    placed, total = [], 0  # (name, buffer, offset, bytes) of the strided ones
    for name, buffer in buffers:
        if buffer.layout == torch.strided:
            size = buffer.numel() * buffer.element_size()
            placed.append((name, buffer, total, size))
            total += -(-size // _ALIGNMENT) * _ALIGNMENT
    staging = _staging_buffer(total)
    saved: dict[str, torch.Tensor] = {}
    for name, buffer, offset, size in placed:
        target = staging[offset : offset + size]
        target.copy_(buffer.detach().reshape(-1).view(torch.uint8), non_blocking=True)
        saved[name] = target.view(buffer.dtype).reshape(buffer.shape)
    for device in {buffer.device for _, buffer, _, _ in placed if buffer.device.type == "cuda"}:
        torch.cuda.synchronize(device)
    # Sparse and other layouts: as vLLM copies them.
    return {
        name: saved[name] if name in saved else buffer.cpu().clone() for name, buffer in buffers
    }


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
