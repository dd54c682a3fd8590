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
ATTENTION_OPS = {
    "vllm.model_executor.layers.attention.attention": "unified_attention_with_output",
    "vllm.model_executor.layers.attention.mla_attention": "unified_mla_attention_with_output",
}
#: What the decorator returns when it makes an op a break point.
BREAK_POINT_WRAPPER = "eager_break_during_capture.<locals>.wrapper"


def attention_ops_without_break_points() -> list[str]:
    """Attention ops already imported in this process that would not break a
    breakable graph (modules not imported yet will decide when they are)."""
    missing = []
    for module_name, op_name in ATTENTION_OPS.items():
        module = sys.modules.get(module_name)
        op = getattr(module, op_name, None)
        if op is None:
            continue
        code = getattr(op, "__code__", None)
        if code is None or code.co_qualname != BREAK_POINT_WRAPPER:
            missing.append(f"{module_name}.{op_name}")
    return missing


def check_attention_breaks(vllm_config: Any) -> None:
    """Raises RuntimeError if this engine will capture breakable graphs with an
    attention op that was imported before VLLM_USE_BREAKABLE_CUDAGRAPH was set."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    mode = vllm_config.compilation_config.cudagraph_mode
    if not is_breakable_cudagraph_enabled() or mode is None:
        return
    if not mode.has_piecewise_cudagraphs():
        return  # FULL graphs capture attention whole, on purpose
    missing = attention_ops_without_break_points()
    if missing:
        raise RuntimeError(
            "VLLM_USE_BREAKABLE_CUDAGRAPH=1, but this process imported "
            f"{', '.join(missing)} before it was set, so vLLM 0.26 would capture attention "
            "inside its breakable CUDA graphs and fail at the first request with an illegal "
            "memory access (stock vLLM too). Set VLLM_USE_BREAKABLE_CUDAGRAPH before anything "
            "imports vLLM's attention layers, or start workers with "
            "VLLM_WORKER_MULTIPROC_METHOD=spawn."
        )
