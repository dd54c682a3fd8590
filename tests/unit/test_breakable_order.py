"""The worker stops an engine whose breakable graphs would capture attention:
vLLM's attention modules imported before VLLM_USE_BREAKABLE_CUDAGRAPH was set
(stock vLLM 0.26 then fails at the first request, measured on an H200). The
attention ops here are decorated by vLLM's own eager_break_during_capture."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from vllm_graph_sleep.breakable_order import (
    ATTENTION_MODULE,
    ATTENTION_OPS,
    MLA_MODULE,
    check_attention_breaks,
)


def attention_module(monkeypatch, name: str, breakable_at_import: bool) -> None:
    """Puts a module named like vLLM's attention module in sys.modules, whose op
    vLLM's decorator wrapped with the variable as it was at import."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1" if breakable_at_import else "0")

    def op(output):
        return None

    module = types.ModuleType(name)
    setattr(module, ATTENTION_OPS[name], eager_break_during_capture(op))
    monkeypatch.setitem(sys.modules, name, module)


def engine(mode: str, use_mla: bool = False):
    from vllm.config.compilation import CUDAGraphMode

    return SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode]),
        model_config=SimpleNamespace(use_mla=use_mla),
    )


@pytest.mark.parametrize(("name", "use_mla"), [(ATTENTION_MODULE, False), (MLA_MODULE, True)])
def test_attention_imported_before_the_variable_stops_a_breakable_engine(
    monkeypatch, name, use_mla
):
    attention_module(monkeypatch, name, breakable_at_import=False)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        with pytest.raises(RuntimeError, match=f"imported {name}.* before it was set"):
            check_attention_breaks(engine(mode, use_mla))


def test_only_the_attention_op_the_model_runs_counts(monkeypatch):
    """An MLA model breaks its graphs at the MLA op: the other attention
    module, imported too early, does not stop it (and the other way round)."""
    attention_module(monkeypatch, ATTENTION_MODULE, breakable_at_import=False)
    attention_module(monkeypatch, MLA_MODULE, breakable_at_import=True)
    check_attention_breaks(engine("PIECEWISE", use_mla=True))
    with pytest.raises(RuntimeError, match=ATTENTION_MODULE):
        check_attention_breaks(engine("PIECEWISE", use_mla=False))


def test_attention_imported_with_the_variable_set_passes(monkeypatch):
    attention_module(monkeypatch, ATTENTION_MODULE, breakable_at_import=True)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    check_attention_breaks(engine("PIECEWISE"))


def test_no_breakable_graphs_no_check(monkeypatch):
    attention_module(monkeypatch, ATTENTION_MODULE, breakable_at_import=False)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    check_attention_breaks(engine("PIECEWISE"))
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    check_attention_breaks(engine("FULL"))  # FULL graphs hold attention whole, on purpose
    check_attention_breaks(engine("NONE"))


def test_attention_not_imported_yet_decides_later(monkeypatch):
    for name in ATTENTION_OPS:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    check_attention_breaks(engine("PIECEWISE"))
