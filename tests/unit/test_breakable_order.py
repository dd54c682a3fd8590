"""Breakable CUDA graphs break where vLLM marks them, whatever was imported before
VLLM_USE_BREAKABLE_CUDAGRAPH was set: as a worker starts with the variable in
effect, the ops vLLM imported unmarked become vLLM's own break points (module
attribute, copies imported by value, and the torch op's kernel). Stock vLLM 0.26
captures them inside its breakable graphs then, and fails at the first request
with an illegal memory access (measured on an H200, docs/results/trust-h200.md).

Each case runs in a fresh interpreter: what it imports and marks is process-wide.
"Breaks" means what vLLM's capture does with the op: the op is called with a
capture open and the capture ends its graph segment before the op runs; only the
CUDA graph calls of that capture are replaced, so that it runs on a CPU.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_graph_sleep.breakable_order import (
    AUTO_BREAKABLE_ARCHITECTURES,
    BREAK_POINTS,
    BREAKABLE_ENV,
)

ROOT = Path(__file__).resolve().parents[2]

_PRELUDE = """
import json, os, sys
from types import SimpleNamespace
import torch
from tests.unit.force_cpu_platform import force_cpu_platform
force_cpu_platform()
import vllm.model_executor.layers.attention.attention as attention
import vllm.model_executor.layers.attention.mla_attention as mla_attention
import vllm.model_executor.layers.sparse_attn_indexer as sparse_attn_indexer
import vllm.models.deepseek_v4.attention as deepseek_v4
import vllm._aiter_ops as aiter_ops  # imports rocm_aiter_sparse_attn_indexer by value
from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
from vllm_graph_sleep import breakable_order
from vllm_graph_sleep.patches import apply
apply("v1_worker_gpu_worker")
from vllm.v1.worker.gpu_worker import Worker


class SegmentEnded(Exception):
    pass


class CpuCapture(BreakableCUDAGraphCapture):
    # vLLM's capture with its CUDA graph calls replaced: ending a segment (what a
    # break point does before running its op) is reported.
    def _end_segment(self):
        raise SegmentEnded


def breaks(call):
    capture = CpuCapture()
    capture._capturing = True
    BreakableCUDAGraphCapture._tls.active = capture
    try:
        call()
    except SegmentEnded:
        return True
    except Exception:  # the op itself ran, inside the capture (no attention context here)
        return False
    finally:
        BreakableCUDAGraphCapture._tls.active = None
    return False


e = torch.empty(0)  # 0-size: vLLM's break point takes no weak reference of it
LAYER = "model.layers.0.attn"
CALLS = {
    "attention op": lambda: torch.ops.vllm.unified_attention_with_output(e, e, e, e, LAYER),
    "attention function": lambda: attention.unified_attention_with_output(e, e, e, e, LAYER),
    "mla op": lambda: torch.ops.vllm.unified_mla_attention_with_output(e, e, e, e, LAYER),
    "indexer function": lambda: sparse_attn_indexer.sparse_attn_indexer(e, LAYER, e),
    "deepseek_v4 method": lambda: deepseek_v4.DeepseekV4Attention.attention_impl(None, e),
}


def state():
    return {name: breaks(call) for name, call in CALLS.items()}


def objects():
    return [
        id(attention.unified_attention_with_output),
        id(mla_attention.unified_mla_attention_with_output),
        id(vars(deepseek_v4.DeepseekV4Attention)["attention_impl"]),
        id(aiter_ops.rocm_aiter_sparse_attn_indexer),
    ]


def start_worker():
    # A worker as vLLM starts it (graph offload off); vLLM's own init_device then
    # stops for want of a GPU, after the plugin's part ran.
    model = SimpleNamespace(enable_sleep_mode=True, enforce_eager=False)
    config = SimpleNamespace(
        additional_config={}, model_config=model,
        compilation_config=SimpleNamespace(cudagraph_mode=None),
    )
    try:
        Worker.init_device(SimpleNamespace(vllm_config=config))
    except AttributeError as error:
        assert "device_config" in str(error), error


report = {"imported_unmarked": state()}
"""


def _run(program: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != BREAKABLE_ENV}
    env.update(VLLM_PLUGINS="graph_sleep", VLLM_LOGGING_LEVEL="ERROR")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + program],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


ALL_BREAK = {
    "attention op": True,
    "attention function": True,
    "mla op": True,
    "indexer function": True,
    "deepseek_v4 method": True,
}
NONE_BREAK = dict.fromkeys(ALL_BREAK, False)


@pytest.mark.slow
def test_variable_set_after_the_imports_breaks_in_a_forked_and_an_in_process_worker():
    report = _run(
        """
os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"  # as upstream's test: monkeypatch.setenv
report["set_late"] = state()
read, write = os.pipe()
child = os.fork()
if child == 0:  # a forked engine's worker (vLLM's default)
    start_worker()
    os.write(write, json.dumps({"state": state(), "copy_marked": (
        aiter_ops.rocm_aiter_sparse_attn_indexer
        is sys.modules["vllm.v1.attention.ops.rocm_aiter_mla_sparse"].rocm_aiter_sparse_attn_indexer
    ), "again": breakable_order.mark_break_points()}).encode())
    os._exit(0)
os.close(write)
report["forked_worker"] = json.loads(os.read(read, 1 << 16))
os.waitpid(child, 0)
report["parent_after_fork"] = state()
start_worker()  # an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
report["in_process_worker"] = state()
report["capture_report"] = breakable_order.capture_report()
print("REPORT " + json.dumps(report))
"""
    )
    # vLLM 0.26 decides at import: the variable set later changes nothing by itself.
    assert report["imported_unmarked"] == NONE_BREAK
    assert report["set_late"] == NONE_BREAK
    forked = report["forked_worker"]
    assert forked["state"] == ALL_BREAK
    assert forked["copy_marked"]  # vllm._aiter_ops's copy is the marked function too
    assert forked["again"] == []  # marked once; a second engine finds nothing to do
    assert report["parent_after_fork"] == NONE_BREAK  # the fork's marks stay in the fork
    assert report["in_process_worker"] == ALL_BREAK
    assert report["capture_report"]["breakable_enabled"]
    points = report["capture_report"]["break_points"]
    assert points and all(points.values()), points


@pytest.mark.slow
def test_with_the_variable_off_a_worker_changes_nothing():
    report = _run(
        """
before = objects()
start_worker()
report["after_worker"] = state()
report["same_objects"] = objects() == before
report["op_library"] = breakable_order._op_library is not None
print("REPORT " + json.dumps(report))
"""
    )
    assert report["imported_unmarked"] == NONE_BREAK
    assert report["after_worker"] == NONE_BREAK
    assert report["same_objects"]
    assert not report["op_library"]  # no torch kernel registered


@pytest.mark.slow
def test_an_architecture_vllm_turns_breakable_graphs_on_for_breaks_after_attention_imports(
    tmp_path,
):
    """VllmConfig.__post_init__ sets the variable for DeepseekV4ForCausalLM (and
    the other AUTO_BREAKABLE_ARCHITECTURES), after attention was imported."""
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"})
    )
    report = _run(
        f"""
from vllm.config import ModelConfig, VllmConfig
model_config = ModelConfig(model={str(tmp_path)!r}, skip_tokenizer_init=True, max_model_len=512)
report["variable_before"] = os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH")
VllmConfig(model_config=model_config)
report["variable_after"] = os.environ.get("VLLM_USE_BREAKABLE_CUDAGRAPH")
report["after_config"] = state()
start_worker()
report["after_worker"] = state()
print("REPORT " + json.dumps(report))
"""
    )
    assert report["variable_before"] is None and report["variable_after"] == "1"
    assert report["after_config"] == NONE_BREAK
    assert report["after_worker"] == ALL_BREAK


def _vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).parent


def _decorated_in(path: Path) -> list[str]:
    """Qualified names of the functions decorated with eager_break_during_capture."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [ast.unparse(d) for d in child.decorator_list]
                if any(n.endswith("eager_break_during_capture") for n in names):
                    found.append(prefix + child.name)

    visit(ast.parse(path.read_text()), "")
    return found


def test_break_points_are_every_use_of_vllms_decorator():
    root = _vllm_root()
    in_source = set()
    for path in root.rglob("*.py"):
        if "eager_break_during_capture" not in path.read_text(errors="ignore"):
            continue
        module = ".".join(("vllm", *path.relative_to(root).with_suffix("").parts))
        in_source.update((module, name) for name in _decorated_in(path))
    assert in_source == {(point.module, point.qualname) for point in BREAK_POINTS}


def _registrations(op: str) -> list[str]:
    """The op_func of every direct_register_custom_op(op_name=op, ...) in vLLM."""
    funcs = []
    for path in _vllm_root().rglob("*.py"):
        text = path.read_text(errors="ignore")
        if f'op_name="{op}"' not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "direct_register_custom_op":
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if keywords.get("op_name") == repr(op):
                    funcs.append(keywords.get("op_func"))
    return funcs


@pytest.mark.parametrize("point", [p for p in BREAK_POINTS if p.op], ids=lambda p: p.op)
def test_each_op_is_registered_under_its_name_with_the_decorated_function(point):
    """The op whose kernel the plugin replaces runs exactly that function."""
    assert _registrations(point.op) == [point.qualname]


def test_the_architectures_are_the_ones_vllm_turns_breakable_graphs_on_for():
    tree = ast.parse((_vllm_root() / "config" / "vllm.py").read_text())
    lists = [
        {element.value for element in node.elts}
        for node in ast.walk(tree)
        if isinstance(node, ast.Tuple)
        and node.elts
        and all(isinstance(element, ast.Constant) for element in node.elts)
        and any(element.value == "DeepseekV4ForCausalLM" for element in node.elts)
    ]
    assert lists == [set(AUTO_BREAKABLE_ARCHITECTURES)]
