"""Shared mechanics of our patches: feature detection and idempotent wrapping."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from vllm_graph_sleep.vllm_version import VERIFIED_VLLM, vllm_version

_MARK = "__vllm_graph_sleep_original__"


class IncompatibleVllmError(RuntimeError):
    pass


def require(
    owner: Any,
    name: str,
    *,
    where: str,
    parameters: tuple[str, ...] = (),
    may_be_none: bool = False,
) -> Any:
    """Returns owner.name, or raises naming the symbol and the vLLM version when it
    is missing (None counts as missing unless `may_be_none`: a module global not
    set yet) or lacks the parameters the patch relies on."""
    if not hasattr(owner, name) or (getattr(owner, name) is None and not may_be_none):
        raise IncompatibleVllmError(
            f"vllm-graph-sleep: {where}.{name} not found in vLLM {vllm_version()} "
            f"(verified against {VERIFIED_VLLM})"
        )
    target = getattr(owner, name)
    if parameters:
        original = getattr(target, _MARK, target)
        present = inspect.signature(original).parameters
        missing = [p for p in parameters if p not in present]
        if missing:
            raise IncompatibleVllmError(
                f"vllm-graph-sleep: {where}.{name} in vLLM {vllm_version()} lacks parameter(s) "
                f"{missing} (verified against {VERIFIED_VLLM})"
            )
    return target


def is_wrapped(function: Any) -> bool:
    return hasattr(function, _MARK)


def original_of(function: Any) -> Any:
    return getattr(function, _MARK, function)


def wrap_function(
    owner: Any, name: str, make: Callable[[Callable], Callable], *, where: str
) -> None:
    """Replaces owner.name by make(original), once. Works for plain functions and
    methods; staticmethods and classmethods keep their kind."""
    raw = inspect.getattr_static(owner, name, None)
    require(owner, name, where=where)
    if isinstance(raw, staticmethod | classmethod):
        inner = raw.__func__
        if is_wrapped(inner):
            return
        wrapper = functools.wraps(inner)(make(inner))
        setattr(wrapper, _MARK, inner)
        setattr(owner, name, type(raw)(wrapper))
        return
    if is_wrapped(raw):
        return
    wrapper = functools.wraps(raw)(make(raw))
    setattr(wrapper, _MARK, raw)
    setattr(owner, name, wrapper)
