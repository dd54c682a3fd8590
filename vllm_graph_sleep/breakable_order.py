"""Stops an engine whose breakable graphs would capture attention.

vLLM 0.26 reads VLLM_USE_BREAKABLE_CUDAGRAPH at two moments: when its attention
layer modules are imported (eager_break_during_capture, in
vllm/compilation/breakable_cudagraph.py, turns the attention ops into graph
break points only if the variable is set then) and when a model runner is
built (it then captures breakable graphs). A process that imported those
modules before setting the variable, and then forks its engine (vLLM's default),
captures attention inside its breakable graphs with the capture's dummy
metadata: the first generation fails with "an illegal memory access", stock
vLLM 0.26 as well as with graph offload (measured on an H200,
docs/results/trust-h200.md, benchmarks/upstream_sequence.py --late-env
--import-attention-first). The worker checks for that mismatch as it starts, so
the engine fails at once with the cause instead of at the first request.
"""

from __future__ import annotations

import sys
from typing import Any

#: The attention ops vLLM 0.26 decorates with eager_break_during_capture.
ATTENTION_MODULE = "vllm.model_executor.layers.attention.attention"
MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
ATTENTION_OPS = {
    ATTENTION_MODULE: "unified_attention_with_output",
    MLA_MODULE: "unified_mla_attention_with_output",
}
#: What the decorator returns when it makes an op a break point.
BREAK_POINT_WRAPPER = "eager_break_during_capture.<locals>.wrapper"


def attention_op_without_break_point(use_mla: bool) -> str | None:
    """The name of the attention op this model runs (MLA or not) if it is
    already imported in this process and is not a break point of breakable
    graphs (a module not imported yet decides when it is); else None."""
    module_name = MLA_MODULE if use_mla else ATTENTION_MODULE
    op = getattr(sys.modules.get(module_name), ATTENTION_OPS[module_name], None)
    if op is None:
        return None
    code = getattr(op, "__code__", None)
    if code is not None and code.co_qualname == BREAK_POINT_WRAPPER:
        return None
    return f"{module_name}.{ATTENTION_OPS[module_name]}"


def captures_breakable_graphs(cudagraph_mode: Any) -> bool:
    """Whether an engine in this (resolved) graph mode captures breakable
    graphs: VLLM_USE_BREAKABLE_CUDAGRAPH and piecewise graphs. FULL graphs
    capture attention whole, on purpose."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    if not is_breakable_cudagraph_enabled() or cudagraph_mode is None:
        return False
    return cudagraph_mode.has_piecewise_cudagraphs()


def check_attention_breaks(vllm_config: Any) -> None:
    """Raises RuntimeError if this engine will capture breakable graphs with an
    attention op that was imported before VLLM_USE_BREAKABLE_CUDAGRAPH was set."""
    if not captures_breakable_graphs(vllm_config.compilation_config.cudagraph_mode):
        return
    unbroken = attention_op_without_break_point(vllm_config.model_config.use_mla)
    if unbroken:
        raise RuntimeError(
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1, but this process imported "
            f"{unbroken} before it was set, so vLLM 0.26 would capture attention "
            "inside its breakable CUDA graphs and fail at the first request with an illegal "
            "memory access (stock vLLM too). Set VLLM_USE_BREAKABLE_CUDAGRAPH before anything "
            "imports vLLM's attention layers, or start workers with "
            "VLLM_WORKER_MULTIPROC_METHOD=spawn."
        )
