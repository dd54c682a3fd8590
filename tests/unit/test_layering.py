"""Imports go one way: tests/ and benchmarks/ use the package; the package and
benchmarks/ never import tests/ (engine helpers both need live in
vllm_graph_sleep.testing)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
