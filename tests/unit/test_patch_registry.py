"""The patch list and the patch files agree, every patch follows the rules, and
each process applies only the patches of the vLLM modules it imports."""

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_graph_sleep import patches
from vllm_graph_sleep.patches._wrap import is_wrapped

PATCH_DIR = Path(patches.__file__).parent
ROOT = PATCH_DIR.parents[1]
HEADER_FIELDS = ("Patch: vllm.", "Verified against vLLM 0.26.0", "Why:", "Remove when:")


def test_every_patch_file_is_listed_and_every_listed_patch_exists():
    files = {p.stem for p in PATCH_DIR.glob("*.py") if not p.stem.startswith("_")}
    assert files == set(patches.PATCHES)


@pytest.mark.parametrize("name", patches.PATCHES)
def test_patch_module_has_header_and_apply(name):
    module = importlib.import_module(f"vllm_graph_sleep.patches.{name}")
    doc = " ".join((module.__doc__ or "").split())
    for field in HEADER_FIELDS:
        assert field in doc, f"{name}: header lacks {field!r}"
    # Named after the vLLM module it changes, which is the module it waits for.
    patched = doc.split("Patch: ", 1)[1].split(" ", 1)[0]
    assert patched == patches.PATCHES[name]
    assert patched.removeprefix("vllm.").replace(".", "_") == name
    assert importlib.util.find_spec(patched) is not None, f"{patched} is not a vLLM module"
    assert callable(module.apply) and not inspect.signature(module.apply).parameters


def _patch_modules_imported_by(path: Path) -> set[str]:
    """The patch modules (entries of PATCHES) that `path` imports by name."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        imported.update(
            name.removeprefix("vllm_graph_sleep.patches.")
            for name in names
            if name.removeprefix("vllm_graph_sleep.patches.") in patches.PATCHES
        )
    return imported


def test_nothing_imports_a_patch_module_but_the_patch_index():
    # Patches wire, feature modules implement: removing a patch must never break
    # another module. Another module that needs a patch applied asks the index.
    index = PATCH_DIR / "__init__.py"
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported)
        for path in sorted((ROOT / "vllm_graph_sleep").rglob("*.py"))
        if path != index and (imported := _patch_modules_imported_by(path))
    }
    assert offenders == {}


def test_the_committed_patch_reference_is_what_the_headers_render():
    spec = importlib.util.spec_from_file_location(
        "patch_reference", ROOT / "tools" / "patch_reference.py"
    )
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    page = reference.render()
    for name, module in patches.PATCHES.items():
        header = importlib.import_module(f"vllm_graph_sleep.patches.{name}").__doc__
        assert f"## {name}\n" in page and f"`{module}`" in page
        assert inspect.cleandoc(header) in page
    assert (ROOT / "docs" / "patches.md").read_text() == page, (
        "docs/patches.md is stale: run python tools/patch_reference.py"
    )


def test_apply_is_idempotent():
    from vllm.v1.worker import gpu_worker

    patches.apply("v1_worker_gpu_worker")
    first = (gpu_worker.Worker.init_device, gpu_worker.get_mem_allocator_instance)
    patches.apply("v1_worker_gpu_worker")
    patches.install()
    assert (gpu_worker.Worker.init_device, gpu_worker.get_mem_allocator_instance) == first


def test_kv_init_split_is_wired_into_both_model_runners():
    from vllm.v1.worker import gpu_model_runner, gpu_worker
    from vllm.v1.worker.gpu import attn_utils

    for name in ("v1_worker_gpu_worker", "v1_worker_gpu_attn_utils", "v1_worker_gpu_model_runner"):
        patches.apply(name)
    assert is_wrapped(gpu_worker.Worker._maybe_get_memory_pool_context)
    assert is_wrapped(attn_utils._allocate_kv_cache)  # V2, looked up as a module global
    assert is_wrapped(gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors)  # V1


_PROCESS = """
import json, sys
import vllm.engine.arg_utils  # an API server has this when vLLM loads the plugins
from vllm.plugins import load_general_plugins
from vllm_graph_sleep.patches import PATCHES
from vllm_graph_sleep.patches._wrap import is_wrapped

before = sorted(t for t in PATCHES.values() if t in sys.modules)
load_general_plugins()
report = {
    "imported_before_load": before,
    "imported_after_load": sorted(t for t in PATCHES.values() if t in sys.modules),
}
# vLLM reads VLLM_USE_BREAKABLE_CUDAGRAPH when this module is imported: a plugin
# that imported it at load would fix that choice before a test sets the variable.
report["attention_imported"] = "vllm.model_executor.layers.attention.attention" in sys.modules
from vllm.engine.arg_utils import EngineArgs
report["flag_added"] = is_wrapped(EngineArgs.add_cli_args)
from vllm.config import VllmConfig
report["hash_patched"] = is_wrapped(VllmConfig.compute_hash)
from vllm.v1.worker import gpu_worker, gpu_model_runner  # what a worker imports next
from vllm.distributed.device_communicators import custom_all_reduce
from vllm.distributed import parallel_state
report["worker_patched"] = [
    is_wrapped(parallel_state.GroupCoordinator.graph_capture),
    is_wrapped(gpu_worker.Worker.init_device),
    is_wrapped(gpu_worker.get_mem_allocator_instance),
    is_wrapped(gpu_model_runner.GPUModelRunner.initialize_kv_cache_tensors),
    is_wrapped(custom_all_reduce.CustomAllreduce.custom_all_reduce),
]
print("REPORT " + json.dumps(report))
"""


def _report_of(program: str) -> dict:
    """Runs `program` in a fresh process as vLLM would load the plugin there and
    returns the JSON it prints after "REPORT "."""
    env = {**os.environ, "VLLM_PLUGINS": "graph_sleep", "VLLM_LOGGING_LEVEL": "ERROR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


@pytest.mark.slow
def test_each_process_patches_only_what_it_imports():
    """In a fresh process, as vLLM loads it: the plugin imports none of the vLLM
    modules it patches except the one already there, and a worker module
    imported later comes back patched."""
    report = _report_of(_PROCESS)
    # arg_utils brings the config module and parallel_state with it; the plugin adds none.
    assert report["imported_before_load"] == [
        "vllm.config.vllm",
        "vllm.distributed.parallel_state",
        "vllm.engine.arg_utils",
    ]
    assert report["imported_after_load"] == report["imported_before_load"]
    assert not report["attention_imported"]
    assert report["flag_added"] and report["hash_patched"]
    assert report["worker_patched"] == [True, True, True, True, True]


_NESTED_FINDER = """
import importlib.abc, importlib.util, json, sys
from vllm.plugins import load_general_plugins
from vllm_graph_sleep.patches._wrap import is_wrapped

load_general_plugins()
TARGET = "vllm.v1.worker.gpu_worker"
searches = []


class SearchesAgain(importlib.abc.MetaPathFinder):
    # What a profiler's or a tracer's import hook does: look the module up
    # again through every finder, ours included, from inside a search.
    def find_spec(self, name, path, target=None):
        if name != TARGET or searches:
            return None
        searches.append(name)
        return importlib.util.find_spec(name)


# Right behind our finder: ours asks it while searching itself.
ours = next(i for i, f in enumerate(sys.meta_path) if type(f).__name__ == "_PatchOnImport")
sys.meta_path.insert(ours + 1, SearchesAgain())
from vllm.v1.worker import gpu_worker

print("REPORT " + json.dumps({
    "nested_search_ran": searches == [TARGET],
    "patched": is_wrapped(gpu_worker.Worker.init_device),
}))
"""


@pytest.mark.slow
def test_an_import_hook_that_searches_again_still_gets_a_patched_module():
    """Another finder that re-enters the import system for a module we wait for
    (found by a profiling hook: our finder raised KeyError and the engine did
    not start) gets the module patched once."""
    assert _report_of(_NESTED_FINDER) == {"nested_search_ran": True, "patched": True}


_FOUND_FIRST = """
import importlib.util, json
from vllm.plugins import load_general_plugins
from vllm_graph_sleep.patches._wrap import is_wrapped

load_general_plugins()
TARGET = "vllm.v1.worker.gpu_worker"
found = importlib.util.find_spec(TARGET) is not None  # an availability check, no import
from vllm.v1.worker import gpu_worker

print("REPORT " + json.dumps({
    "found": found,
    "patched": is_wrapped(gpu_worker.Worker.init_device),
}))
"""


@pytest.mark.slow
def test_a_module_looked_up_before_its_import_still_comes_back_patched():
    """A bare importlib.util.find_spec finds the module without executing it;
    the import after it must still apply the patches."""
    assert _report_of(_FOUND_FIRST) == {"found": True, "patched": True}


def test_a_module_whose_patch_failed_is_patched_again_at_its_next_import(tmp_path, monkeypatch):
    """A patch that raises (IncompatibleVllmError) fails that import; a later
    import of the module (a retry, or a caller that caught the error) must
    not get it unpatched, with no error."""
    import importlib
    import sys

    from vllm_graph_sleep import patches
    from vllm_graph_sleep.patches._wrap import IncompatibleVllmError

    target = "graph_sleep_probe_target"
    (tmp_path / f"{target}.py").write_text("patched = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []

    def apply(name):
        calls.append(name)
        if len(calls) == 1:
            raise IncompatibleVllmError(f"{target}.thing not found in vLLM 0.0")
        sys.modules[target].patched = True

    monkeypatch.setattr(patches, "apply", apply)
    finder = patches._PatchOnImport({target: ["probe"]})
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    with pytest.raises(IncompatibleVllmError):
        importlib.import_module(target)
    assert target not in sys.modules and finder.waiting == {target: ["probe"]}
    module = importlib.import_module(target)
    monkeypatch.delitem(sys.modules, target)
    assert module.patched and calls == ["probe", "probe"] and finder.waiting == {}


def test_a_vllm_with_its_own_offload_field_is_refused_naming_it(monkeypatch):
    """vLLM is expected to gain a field of this name (0.33+): our __init__
    would take its keyword and our option hide its own, silently."""
    import dataclasses

    from vllm.engine import arg_utils

    from vllm_graph_sleep.patches import engine_arg_utils
    from vllm_graph_sleep.patches._wrap import IncompatibleVllmError

    @dataclasses.dataclass
    class EngineArgsWithTheField:
        sleep_mode_offload_cudagraph: bool = False

    monkeypatch.setattr(arg_utils, "EngineArgs", EngineArgsWithTheField)
    with pytest.raises(
        IncompatibleVllmError, match=r"EngineArgs has a field sleep_mode_offload_cudagraph"
    ):
        engine_arg_utils.apply()


def test_require_counts_none_as_missing_unless_told_a_global_may_be_unset(monkeypatch):
    from types import SimpleNamespace

    from vllm.utils import torch_utils

    from vllm_graph_sleep.patches import distributed_parallel_state
    from vllm_graph_sleep.patches._wrap import IncompatibleVllmError, require

    owner = SimpleNamespace(unset=None)
    with pytest.raises(IncompatibleVllmError, match=r"where\.unset not found in vLLM"):
        require(owner, "unset", where="where")
    assert require(owner, "unset", where="where", may_be_none=True) is None
    with pytest.raises(IncompatibleVllmError, match=r"where\.absent not found in vLLM"):
        require(owner, "absent", where="where", may_be_none=True)
    monkeypatch.delattr(torch_utils, "_aux_stream")
    with pytest.raises(IncompatibleVllmError, match=r"torch_utils\._aux_stream not found"):
        distributed_parallel_state.apply()
