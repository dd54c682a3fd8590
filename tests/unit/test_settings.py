"""The switches, declared once in vllm_graph_sleep/settings.py: the reference
page is generated from the declaration, no runtime module names a switch of
ours on its own, and the settings read at the edge are the declared defaults
when nothing is set."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_layering import PACKAGE, _module_name, layer_of
from vllm_graph_sleep import settings

ROOT = Path(__file__).resolve().parents[2]


def test_the_environment_page_is_the_generated_one():
    page = (ROOT / "docs" / "environment.md").read_text()
    assert page == settings.environment_reference(), (
        "docs/environment.md is stale: python -m vllm_graph_sleep.settings > docs/environment.md"
    )
    for switch in settings.SWITCHES:
        assert f"| `{switch.name}` |" in page


def test_the_user_guide_links_the_reference_and_lists_no_switch_table_of_its_own():
    guide = (ROOT / "docs" / "user-guide.md").read_text()
    assert "(environment.md)" in guide
    for switch in settings.SWITCHES:
        assert f"| `{switch.name}` |" not in guide


def _names_a_switch(path: Path) -> list[str]:
    return [
        node.value
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith(settings.PREFIX)
        and node.value.removeprefix(settings.PREFIX).isupper()
        and node.value not in settings.NOT_READ_BY_SERVERS
    ]


def test_no_runtime_module_but_settings_names_a_switch():
    """Below testing and the bench, a switch's name comes from its declaration."""
    offenders = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        module = _module_name(path)
        if module != "settings" and layer_of(module) <= layer_of("doctor"):
            names = _names_a_switch(path)
            if names:
                offenders[module] = names
    assert offenders == {}


def test_nothing_set_gives_the_declared_defaults():
    assert settings.AllocatorSettings.from_environ({}) == settings.AllocatorSettings()
    assert settings.GateSettings.from_environ({}) == settings.GateSettings()
    for blank in ("", "  "):
        empty = {switch.name: blank for switch in settings.SWITCHES}
        assert settings.AllocatorSettings.from_environ(empty) == settings.AllocatorSettings()
        assert settings.GateSettings.from_environ(empty) == settings.GateSettings()
        for switch in settings.TEST_SWITCHES:
            assert switch.read({switch.name: blank}) == switch.read({})


@pytest.mark.parametrize("switch", settings.SWITCHES, ids=lambda switch: switch.name)
def test_every_switch_refuses_a_typo_naming_itself(switch):
    with pytest.raises(ValueError, match=switch.name):
        switch.read({switch.name: "maybe"})


def test_the_yes_no_spellings():
    for yes in settings.YES_VALUES:
        assert settings.RELEASE_STACK.read({settings.RELEASE_STACK.name: f" {yes.upper()} "})
    for no in settings.NO_VALUES:
        assert settings.RELEASE_STACK.read({settings.RELEASE_STACK.name: no}) is False
    with pytest.raises(ValueError) as refused:
        settings.RELEASE_STACK.read({settings.RELEASE_STACK.name: "2"})
    assert str(refused.value) == (
        "VLLM_GRAPH_SLEEP_RELEASE_STACK='2' is not a yes/no value: yes is 1/true/yes/on, "
        "no is 0/false/no/off"
    )


def test_the_test_suites_switches_read_their_values_and_refuse_others_by_name():
    assert settings.TEST_CYCLES.read({}) == 10
    assert settings.TEST_CYCLES.read({"GRAPH_SLEEP_TEST_CYCLES": " 3 "}) == 3
    assert settings.TEST_CYCLES.read({"GRAPH_SLEEP_TEST_CYCLES": " "}) == 10  # empty: the default
    for bad in ("abc", "-5", "0", "2.5", "\u00b2"):
        with pytest.raises(ValueError, match=f"GRAPH_SLEEP_TEST_CYCLES={bad!r}: expected"):
            settings.TEST_CYCLES.read({"GRAPH_SLEEP_TEST_CYCLES": bad})
    assert settings.TEST_VLLM_DEFAULTS.read({}) is False
    assert settings.TEST_VLLM_DEFAULTS.read({"GRAPH_SLEEP_TEST_VLLM_DEFAULTS": ""}) is False
    for yes in settings.YES_VALUES:
        assert settings.TEST_VLLM_DEFAULTS.read({"GRAPH_SLEEP_TEST_VLLM_DEFAULTS": yes}) is True
    for no in settings.NO_VALUES:
        assert settings.TEST_VLLM_DEFAULTS.read({"GRAPH_SLEEP_TEST_VLLM_DEFAULTS": no}) is False
    with pytest.raises(ValueError, match="GRAPH_SLEEP_TEST_VLLM_DEFAULTS='2' is not a yes/no"):
        settings.TEST_VLLM_DEFAULTS.read({"GRAPH_SLEEP_TEST_VLLM_DEFAULTS": "2"})
    assert settings.TEST_TIMEOUT.read({}) == 900.0
    assert settings.TEST_TIMEOUT.read({"GRAPH_SLEEP_TEST_TIMEOUT": "200"}) == 200.0
    assert settings.TEST_TIMEOUT.read({"GRAPH_SLEEP_TEST_TIMEOUT": ""}) == 900.0
    for bad in ("soon", "0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match=f"GRAPH_SLEEP_TEST_TIMEOUT={bad!r}: expected"):
            settings.TEST_TIMEOUT.read({"GRAPH_SLEEP_TEST_TIMEOUT": bad})
    assert settings.TEST_LOG.read({}) is None and settings.TEST_EXTENSION.read({}) is None


def test_no_module_of_the_package_but_settings_names_a_test_suite_switch():
    offenders = [
        _module_name(path)
        for path in sorted((ROOT / PACKAGE).rglob("*.py"))
        if _module_name(path) != "settings" and "GRAPH_SLEEP_TEST_" in path.read_text()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("GRAPH_SLEEP_TEST_")
    ]
    assert offenders == []
