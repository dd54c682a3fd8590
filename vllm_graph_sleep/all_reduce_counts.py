"""Captured all-reduces of vLLM's custom all-reduce, counted by the path they took.

While graph offload is active, the custom all-reduce patch
(patches/distributed_device_communicators_custom_all_reduce.py) shadows a
communicator's all_reduce inside capture() with `counting`, which counts the
calls made while the stream is really capturing, by `registered`. The worker
probe reads them: evidence on a GPU that every captured all-reduce took the
copy-in path, and that there were some.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_CAPTURED = "_graph_sleep_captured_all_reduces"
_NO_CAPTURES = {"copy_in": 0, "registered": 0}


def captured_all_reduces(communicator) -> dict[str, int]:
    """Captured all-reduces of this communicator while graph offload was active:
    {"copy_in": n, "registered": m}."""
    return dict(getattr(communicator, _CAPTURED, _NO_CAPTURES))


def counting(all_reduce: Callable) -> Callable:
    """`all_reduce` (a communicator's bound method), counting its calls while
    the stream is capturing on that communicator."""

    def counted(inp: torch.Tensor, *, out=None, registered: bool = False):
        if torch.cuda.is_current_stream_capturing():
            counts = all_reduce.__self__.__dict__.setdefault(_CAPTURED, dict(_NO_CAPTURES))
            counts["registered" if registered else "copy_in"] += 1
        return all_reduce(inp, out=out, registered=registered)

    return counted
