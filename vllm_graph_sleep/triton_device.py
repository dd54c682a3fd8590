"""Triton launches a kernel on the current device and its current stream,
whatever device the kernel's tensors are on. A process with memory on several
GPUs (a test harness, one process driving an engine per GPU) would otherwise
run a kernel over cuda:1's memory from cuda:0. Our kernels' callers say where."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch


def launching_on(device: torch.device) -> AbstractContextManager[Any]:
    """Inside, `device` is the current CUDA device (and its stream the current
    stream), so a Triton launch goes there; for another kind of device (the
    interpreter's CPU tensors) nothing changes."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
