"""Imports go one way.

Across the repository: tests/ and benchmarks/ use the package; the package and
benchmarks/ never import tests/ (engine helpers both need live in
vllm_graph_sleep.testing).

Inside the package, layer by layer (issue 36): settings -> mechanism -> facade
-> gate/policy/backend -> patches -> diagnostics -> testing/bench -> cli. A
module imports only modules of its own layer or of the layers before it, and
no two modules import each other, directly or around a circle. Every import
counts, a lazy one inside a function or under TYPE_CHECKING too: a lazy import
hides a circle, it does not break it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "vllm_graph_sleep"

#: Layers in import order; a module belongs to the first entry that names it
#: or a package above it (the longest prefix wins).
LAYERS: dict[str, int] = {
    # 0: every switch, declared once; the byte units every layer formats with
    "settings": 0,
    "units": 0,
    # 1: mechanisms: torch, the extension and our settings, never vLLM
    "memory": 1,
    "_native": 1,
    "alloc_conf": 1,
    "settle": 1,
    "coded_backup": 1,
    "exponent_codec": 1,
    "cuda_checkpoint": 1,
    "gil_handoffs": 1,
    "triton_device": 1,
    # 2: the facade
    "allocator": 2,
    # 3: gate, policy, backend
    "config": 3,
    "backend": 3,
    "rank_sleep": 3,
    "request_gate": 3,
    "engine_watch": 3,
    "executor_sleep": 3,
    "sampler_scratch": 3,
    "breakable_order": 3,
    # features the patches wire in (they may read vLLM)
    "vllm_version": 3,
    "all_reduce_counts": 3,
    "aiter_all_reduce": 3,
    "rpc_request_validation": 3,
    "utility_results": 3,
    "earlier_pools": 3,
    "deep_sleep": 3,
    "deep_sleep_http": 3,
    "model_buffers": 3,
    # 4: patches, and the plugin's entry point that applies them
    "patches": 4,
    "": 4,
    # 5: diagnostics
    "device_query": 5,
    "ledger_fields": 5,
    "ledger": 5,
    "probe": 5,
    "doctor": 5,
    # 6: testing and the bench
    "testing": 6,
    "bench": 6,
    # 7: the command line
    "cli": 7,
}
LAYER_NAMES = (
    "settings",
    "mechanism",
    "facade",
    "gate/policy/backend",
    "patches",
    "diagnostics",
    "testing/bench",
    "cli",
)


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("folder", ["vllm_graph_sleep", "benchmarks", "tools"])
def test_nothing_outside_tests_imports_tests(folder):
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "tests" in _imported_roots(path)
    ]
    assert offenders == []


# -- the package's own module graph ------------------------------------------


def _module_name(path: Path, root: Path = ROOT / PACKAGE) -> str:
    """'ledger', 'memory.routing', 'patches' (a package), '' (the package itself)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_graph(root: Path = ROOT / PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (names relative to the
    package, as _module_name gives them). `from package import name` counts
    as an import of the submodule `name` where one exists."""
    modules = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [t if _relative(t) in modules else node.module for t in targets]
            else:
                assert not isinstance(node, ast.ImportFrom), f"{path}: relative import"
                continue
            imported.update(
                _relative(t) for t in targets if t == PACKAGE or t.startswith(PACKAGE + ".")
            )
        graph[name] = imported - {name}
    return graph


def _relative(dotted: str) -> str:
    return dotted.removeprefix(PACKAGE).removeprefix(".")


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> int | None:
    for prefix in sorted(layers, key=len, reverse=True):
        if module == prefix or (prefix and module.startswith(prefix + ".")):
            return layers[prefix]
    return None


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS) -> set:
    """(importer, imported) pairs where the imported module is in a later layer."""
    return {
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if layer_of(target, layers) > layer_of(module, layers)
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import each other around a circle, sorted
    (Tarjan's strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_every_module_of_the_package_has_a_layer():
    assert [m for m in sorted(package_graph()) if layer_of(m) is None] == []


def test_no_import_circle_in_the_package():
    assert circles(package_graph()) == []


def test_imports_flow_from_settings_to_cli():
    found = upward_imports(package_graph())
    described = sorted(
        f"{module} ({LAYER_NAMES[layer_of(module)]}) imports {target} "
        f"({LAYER_NAMES[layer_of(target)]})"
        for module, target in found
    )
    assert described == []


def test_mechanisms_and_the_facade_never_import_vllm():
    offenders = [
        module
        for module, path in (
            (_module_name(path), path) for path in sorted((ROOT / PACKAGE).rglob("*.py"))
        )
        if layer_of(module) in (0, 1, 2) and "vllm" in _imported_roots(path)
    ]
    assert offenders == []


# -- the checker itself, on module graphs made for it -------------------------


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / PACKAGE


def test_the_checker_finds_an_upward_import_even_a_lazy_one(tmp_path):
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "settings.py": "",
            "memory/__init__.py": "",
            # a mechanism that reaches up to a patch, inside a function
            "memory/routing.py": (
                "from vllm_graph_sleep import settings\n\n"
                "def route():\n    from vllm_graph_sleep.patches import _wrap\n"
            ),
            "patches/__init__.py": "",
            "patches/_wrap.py": "import vllm_graph_sleep.settings\n",
        },
    )
    graph = package_graph(package)
    assert graph["memory.routing"] == {"settings", "patches._wrap"}
    assert graph["patches._wrap"] == {"settings"}
    assert upward_imports(graph) == {("memory.routing", "patches._wrap")}
    assert circles(graph) == []


def test_the_checker_finds_a_circle_through_a_lazy_import(tmp_path):
    package = _write(
        tmp_path,
        {
            "__init__.py": "",
            "probe.py": "from vllm_graph_sleep.ledger import ledger\n",
            "ledger.py": "def ledger():\n    from vllm_graph_sleep.probe import addresses\n",
            "doctor.py": "from vllm_graph_sleep import probe\n",
        },
    )
    graph = package_graph(package)
    assert upward_imports(graph) == set()  # all three are diagnostics
    assert circles(graph) == [["ledger", "probe"]]


#: Issue 36's "no class over about 400 lines": the facade is the largest.
MAX_CLASS_LINES = 410


def test_no_class_of_the_package_is_over_about_400_lines():
    long = {
        f"{path.relative_to(ROOT)}:{node.name}": node.end_lineno - node.lineno + 1
        for path in sorted((ROOT / PACKAGE).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    }
    assert long == {}
