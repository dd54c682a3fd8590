"""Triton's CPU interpreter for the exponent codec's kernels, in this process.

TRITON_INTERPRET=1 makes `triton.jit` return an `InterpretedFunction` instead
of a `JITFunction`, and Triton reads it when a function is defined (triton
3.6: runtime/jit.py; its one other read is for constexpr functions, which the
codec has none of): setting it means a fresh process that imports Triton and
the codec again. `interpret_codec` makes the same change to what is already
defined instead: each `JITFunction` of the codec and of triton.language is
replaced, for the test, by the `InterpretedFunction` that the decorator would
have made of the same Python function, so that the kernels run the same code
with the interpreter's numpy semantics as under TRITON_INTERPRET=1.

The interpreter's cost is its steps (each a few numpy calls, whatever their
width): a lane kernel takes SYMBOLS_PER_LANE steps per program, so the tests
use short lanes and wide programs; the histogram's programs keep their 64K
words, in 4 blocks instead of 32.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import triton
import triton.experimental.gluon  # noqa: F401 - imported by the launcher, once; see below
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction

from vllm_graph_sleep import exponent_codec


def interpret_codec(
    monkeypatch: pytest.MonkeyPatch, symbols_per_lane: int, lanes_per_program: int
) -> None:
    # Gluon, imported at the first launch, takes triton.language's functions
    # and wants them JITFunctions unless TRITON_INTERPRET is set: imported
    # above, before anything is replaced.
    language = [m for name, m in sys.modules.items() if name.startswith("triton.language")]
    interpreted: dict[int, InterpretedFunction] = {}
    for module in [exponent_codec, *language]:
        for name, value in list(vars(module).items()):
            if isinstance(value, triton.runtime.JITFunction):
                if id(value) not in interpreted:
                    interpreted[id(value)] = InterpretedFunction(value.fn)
                monkeypatch.setattr(module, name, interpreted[id(value)])
    monkeypatch.setattr(InterpretedFunction, "__call__", _call_and_unpatch)
    # Each integer add, sub and mul also computes its overflow check, whose
    # result only feeds a device_assert, dropped without debug (triton 3.6:
    # language/semantic.py): a third of the interpreter's time, for nothing.
    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        unchecked = dataclasses.replace(builder.options, sanitize_overflow=False)
        monkeypatch.setattr(builder, "options", unchecked)
    monkeypatch.setattr(exponent_codec, "SYMBOLS_PER_LANE", symbols_per_lane)
    monkeypatch.setattr(exponent_codec, "LANES_PER_PROGRAM", lanes_per_program)
    words_per_program = exponent_codec.HISTOGRAM_BLOCK * exponent_codec.HISTOGRAM_BLOCKS_PER_PROGRAM
    monkeypatch.setattr(exponent_codec, "HISTOGRAM_BLOCKS_PER_PROGRAM", 4)
    monkeypatch.setattr(exponent_codec, "HISTOGRAM_BLOCK", words_per_program // 4)


_call = InterpretedFunction.__call__


def _call_and_unpatch(function: InterpretedFunction, *args, **kwargs):
    """A call of one interpreted function from another (tl.sum from a kernel),
    which lets triton.language's builtins go back to what they were when it
    returns: Triton's own leaves those of the modules the callee sees (its
    `core`, where the kernel sees `tl`) patched for the interpreter, for the
    rest of the process, which only a process that interprets everything can
    live with (the compile tests here would fail after them). A codec helper
    (`_symbol`) sees what its kernel sees, which the launch patched already:
    it runs as it is, without patching the same builtins over again."""
    if function.fn.__globals__ is vars(exponent_codec):
        return function.rewrite()(*args, **kwargs)
    scopes = []
    patch = interpreter._patch_lang

    def patch_and_keep(fn):
        scopes.append(patch(fn))
        return scopes[-1]

    interpreter._patch_lang = patch_and_keep
    try:
        return _call(function, *args, **kwargs)
    finally:
        interpreter._patch_lang = patch
        for scope in reversed(scopes):
            scope.restore()
