"""The device layer's contract (vllm_graph_sleep.memory.driver.DeviceDriver):
the GPU driver and the CPU fake both implement every call of it with the same
parameters, and the allocator's code calls nothing of a driver beyond it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tests.unit.fake_vmm import FakeVmmDriver
from vllm_graph_sleep._native import VmmDriver
from vllm_graph_sleep.memory.driver import DeviceDriver

ROOT = Path(__file__).resolve().parents[2]
CALLS = sorted(
    name
    for name, member in vars(DeviceDriver).items()
    if inspect.isfunction(member) and not name.startswith("_")
)


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


@pytest.mark.parametrize("implementation", [VmmDriver, FakeVmmDriver])
def test_both_drivers_implement_every_call_of_the_protocol(implementation):
    assert len(CALLS) > 20
    missing = [name for name in CALLS if not callable(getattr(implementation, name, None))]
    assert missing == []
    differing = {
        name: _parameters(getattr(implementation, name))
        for name in CALLS
        if _parameters(getattr(implementation, name)) != _parameters(getattr(DeviceDriver, name))
    }
    assert differing == {}


def _driver_calls(path: Path) -> set[str]:
    """Attributes the module reads of `self._driver`, `self.driver` or `driver`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "driver") or (
            isinstance(owner, ast.Attribute)
            and owner.attr in ("_driver", "driver")
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "self"
        ):
            names.add(node.attr)
    return names


def test_the_allocator_uses_no_driver_call_outside_the_protocol():
    modules = [ROOT / "vllm_graph_sleep" / "allocator.py"]
    modules += sorted((ROOT / "vllm_graph_sleep" / "memory").glob("*.py"))
    used = set().union(*(_driver_calls(path) for path in modules))
    assert {"create_and_map", "unmap_and_release", "register_callbacks"} <= used
    assert used - set(CALLS) == set()
