"""Breakable CUDA graphs that break where vLLM marks them, whatever the import order.

vLLM 0.26 reads VLLM_USE_BREAKABLE_CUDAGRAPH at two moments. When a module that
defines a graph break point is imported, `eager_break_during_capture`
(vllm/compilation/breakable_cudagraph.py) wraps the op only if the variable is
set then; when a model runner is built, it captures breakable graphs if the
variable is set then. A process that imported vLLM's attention layers before the
variable was set (a test that sets it with monkeypatch, as upstream's
`test_sleep_cudagraph_pool[breakable]` does; a notebook; a second engine; a
model vLLM turns it on for in VllmConfig.__post_init__) and forks its engine
(vLLM's default) captures attention inside its breakable graphs with the
capture's dummy metadata: the first request fails with an illegal memory access,
stock vLLM 0.26 too (docs/results/trust-h200.md).

`mark_break_points` closes that gap as each worker starts: with the variable in
effect there, it applies vLLM's own decorator again to every op of BREAK_POINTS
that was imported unmarked, and points every reference the worker will call
through at the result: the defining module's or class's attribute, the same
function imported by value into other vLLM modules, and the torch custom op's
kernel (vLLM's direct_register_custom_op hands the function to the dispatcher
by value, so an attribute swap alone would leave `torch.ops.vllm.<op>` unbroken).
The worker then runs exactly what it would have run had the variable been set
before the import. Modules imported later are decorated by vLLM itself, with
the variable set.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

BREAKABLE_ENV = "VLLM_USE_BREAKABLE_CUDAGRAPH"
#: The qualified name of the function vLLM's decorator returns for a break point.
BREAK_POINT_WRAPPER = "eager_break_during_capture.<locals>.wrapper"
DECORATOR_MODULE = "vllm.compilation.breakable_cudagraph"
#: The architectures for which VllmConfig.__post_init__ sets the variable itself
#: (vLLM 0.26.0, vllm/config/vllm.py), unless it is already in the environment.
AUTO_BREAKABLE_ARCHITECTURES = (
    "DeepseekV4ForCausalLM",
    "DeepSeekV4MTPModel",
    "InklingForCausalLM",
    "InklingForConditionalGeneration",
    "MiniMaxM3SparseForCausalLM",
    "MiniMaxM3SparseForConditionalGeneration",
)


@dataclass(frozen=True)
class BreakPoint:
    """A function vLLM decorates with eager_break_during_capture: `qualname` in
    `module` (a module function or a method), and the torch custom op it is
    registered as, if any (namespace vllm)."""

    module: str
    qualname: str
    op: str | None = None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


#: Every use of eager_break_during_capture in vLLM 0.26.0
#: (tests/unit/test_breakable_order.py checks this list against vLLM's source).
BREAK_POINTS = (
    BreakPoint(
        "vllm.model_executor.layers.attention.attention",
        "unified_attention_with_output",
        "unified_attention_with_output",
    ),
    BreakPoint(
        "vllm.model_executor.layers.attention.mla_attention",
        "unified_mla_attention_with_output",
        "unified_mla_attention_with_output",
    ),
    BreakPoint(
        "vllm.model_executor.layers.sparse_attn_indexer",
        "sparse_attn_indexer",
        "sparse_attn_indexer",
    ),
    # Registered as an op by vllm._aiter_ops, on ROCm with AITER only.
    BreakPoint(
        "vllm.v1.attention.ops.rocm_aiter_mla_sparse",
        "rocm_aiter_sparse_attn_indexer",
        "rocm_aiter_sparse_attn_indexer",
    ),
    BreakPoint("vllm.models.deepseek_v4.attention", "DeepseekV4Attention.attention_impl"),
    BreakPoint(
        "vllm.models.deepseek_v32.nvidia.attention", "DeepseekV32Attention._fused_attention"
    ),
    BreakPoint("vllm.models.inkling.nvidia.attention", "InklingAttention._attention"),
    BreakPoint("vllm.models.minimax_m3.nvidia.model", "MiniMaxM3SparseAttention._run_attention"),
    BreakPoint("vllm.models.minimax_m3.amd.model", "MiniMaxM3SparseAttention._run_attention"),
)

#: What to do where the plugin cannot mark a break point (a vLLM other than 0.26.0).
FIX = (
    "set VLLM_USE_BREAKABLE_CUDAGRAPH before anything imports vLLM's attention layers, or start "
    "workers with VLLM_WORKER_MULTIPROC_METHOD=spawn"
)

#: Holds our kernels for the re-marked ops: torch keeps a registration only as
#: long as its Library lives.
_op_library: Any = None


def is_break_point(fn: Any) -> bool:
    """Whether `fn` is what vLLM's eager_break_during_capture returns for a break point."""
    code = getattr(fn, "__code__", None)
    decorator = sys.modules.get(DECORATOR_MODULE)
    return (
        code is not None
        and decorator is not None
        and code.co_qualname == BREAK_POINT_WRAPPER
        and code.co_filename == decorator.__file__
    )


def breakable_enabled() -> bool:
    """vLLM's own answer, as its model runners read it in this process."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled

    return is_breakable_cudagraph_enabled()


def _owner_and_name(point: BreakPoint) -> tuple[Any, str] | None:
    """The module or class that holds the function, and its attribute name;
    None when the module is not imported in this process."""
    module = sys.modules.get(point.module)
    if module is None:
        return None
    *path, name = point.qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            break
    if owner is None or name not in vars(owner):
        raise RuntimeError(
            f"vllm-graph-sleep: {point.name} not found in this vLLM (verified against vLLM "
            f"0.26.0), so the plugin cannot make it a break point of breakable CUDA graphs: {FIX}"
        )
    return owner, name


def unmarked_break_points() -> list[BreakPoint]:
    """The break points imported in this process that are not vLLM's wrapper."""
    unmarked = []
    for point in BREAK_POINTS:
        found = _owner_and_name(point)
        if found is not None and not is_break_point(vars(found[0])[found[1]]):
            unmarked.append(point)
    return unmarked


def _override_op(op: str, kernel: Any) -> bool:
    """Makes `kernel` what torch.ops.vllm.<op> runs on this platform's dispatch
    key, if vLLM registered that op here; returns whether it did."""
    global _op_library
    import torch
    from vllm.platforms import current_platform

    key = current_platform.dispatch_key
    if not hasattr(torch.ops.vllm, op):
        return False
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm::{op}", key):
        return False
    if _op_library is None:
        _op_library = torch.library.Library("vllm", "IMPL")
    with warnings.catch_warnings():
        # torch warns that a kernel is overridden: that is the point here.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        _op_library.impl(op, kernel, dispatch_key=key, allow_override=True)
    return True


def _rebind_imported_copies(original: Any, marked: Any) -> None:
    """Points every vLLM module global bound to `original` (a `from ... import`)
    at `marked`."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("vllm"):
            continue
        namespace = getattr(module, "__dict__", None)
        if not namespace:
            continue
        for attribute, value in list(namespace.items()):
            if value is original:
                setattr(module, attribute, marked)


def mark_break_points() -> list[str]:
    """With breakable graphs enabled in this process, makes every break point
    that was imported unmarked the one vLLM's decorator gives now; returns the
    names it marked (none when the variable is off or the imports came after it)."""
    if not breakable_enabled():
        return []
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture

    marked_names = []
    for point in unmarked_break_points():
        owner, name = _owner_and_name(point)
        original = vars(owner)[name]
        marked = eager_break_during_capture(original)
        if not is_break_point(marked):
            raise RuntimeError(
                f"vllm-graph-sleep: vLLM's eager_break_during_capture did not make {point.name} "
                "a break point with VLLM_USE_BREAKABLE_CUDAGRAPH=1 (verified against vLLM 0.26.0), "
                f"so its breakable CUDA graphs would capture it: {FIX}"
            )
        setattr(owner, name, marked)
        if isinstance(owner, ModuleType):
            _rebind_imported_copies(original, marked)
        if point.op is not None:
            _override_op(point.op, marked)
        marked_names.append(point.name)
    return marked_names


def captures_breakable_graphs(cudagraph_mode: Any) -> bool:
    """Whether an engine in this (resolved) graph mode captures breakable
    graphs: VLLM_USE_BREAKABLE_CUDAGRAPH and piecewise graphs. FULL graphs
    capture attention whole, on purpose."""
    if not breakable_enabled() or cudagraph_mode is None:
        return False
    return cudagraph_mode.has_piecewise_cudagraphs()


def capture_report(worker: Any = None) -> dict[str, Any]:
    """What this worker's breakable graphs hold (for collective_rpc): per
    captured batch shape, graph segments and eager breaks; and which imported
    break points are vLLM's wrapper."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper

    captures = [
        entry.capture
        for wrapper in list(BreakableCUDAGraphWrapper._all_instances)
        for entry in wrapper.entries.values()
        if entry.capture is not None
    ]
    imported = [point for point in BREAK_POINTS if point.module in sys.modules]
    unmarked = {point.name for point in unmarked_break_points()}
    return {
        "breakable_enabled": breakable_enabled(),
        "captures": len(captures),
        "graph_segments": sum(c.num_graphs for c in captures),
        "eager_breaks": sum(c.num_eager_breaks for c in captures),
        "break_points": {point.name: point.name not in unmarked for point in imported},
    }
