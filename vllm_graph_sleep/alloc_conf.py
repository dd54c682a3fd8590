"""Keeping torch's expandable segments off inside our memory pools.

Expandable segments and a pluggable-allocator MemPool do not mix: sleep then
frees nothing (pytorch/pytorch#147851, vllm-project/vllm#11743). Writing only
"expandable_segments:False" to torch would reset the user's other allocator
options, so we rewrite the user's whole setting with just that option flipped,
and put the original string back afterwards. Nothing is written when the user
did not turn expandable segments on. The setting is process-wide, so nested
and concurrent uses count: only the last one out puts the user's string back
(an inner pool must not turn expandable segments on while an outer one, or a
graph capture, still allocates).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_KEY = "expandable_segments"
_lock = threading.Lock()
_holders = 0  # open expandable_segments_off() contexts that changed the setting


def user_alloc_conf() -> str:
    """The allocator setting torch reads (c10/cuda/CUDAAllocatorConfig.h): the
    first of PYTORCH_CUDA_ALLOC_CONF, on ROCm PYTORCH_HIP_ALLOC_CONF, and
    PYTORCH_ALLOC_CONF that is set (even to an empty string)."""
    names = ["PYTORCH_CUDA_ALLOC_CONF"]
    if torch.version.hip is not None:
        names.append("PYTORCH_HIP_ALLOC_CONF")
    names.append("PYTORCH_ALLOC_CONF")
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return value
    return ""


def split_options(conf: str) -> list[str]:
    """Splits "a:1,b:[x:1,y:2]" at top-level commas only."""
    options, depth, start = [], 0, 0
    for index, char in enumerate(conf):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            options.append(conf[start:index])
            start = index + 1
    options.append(conf[start:])
    return [option.strip() for option in options if option.strip()]


def _is_expandable_option(option: str) -> bool:
    return option.partition(":")[0].strip() == _KEY


def expandable_segments_enabled(conf: str) -> bool:
    return any(
        _is_expandable_option(option) and option.partition(":")[2].strip().lower() == "true"
        for option in split_options(conf)
    )


def with_expandable_segments_off(conf: str) -> str:
    kept = [option for option in split_options(conf) if not _is_expandable_option(option)]
    return ",".join([*kept, f"{_KEY}:False"])


@contextmanager
def expandable_segments_off() -> Iterator[None]:
    global _holders
    conf = user_alloc_conf()
    if not expandable_segments_enabled(conf):
        yield
        return
    with _lock:
        if _holders == 0:
            torch.cuda.memory._set_allocator_settings(with_expandable_segments_off(conf))
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                torch.cuda.memory._set_allocator_settings(conf)
