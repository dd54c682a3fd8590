"""tests.utils.fresh_process, the wrapper that runs a GPU test in a process of
its own, on the CPU: the child's outcome is the test's, a skip included
(review, 2026-12-06: a child that skipped exits 0 and was reported passed)."""

from __future__ import annotations

import subprocess
import sys

from tests.utils import ROOT

CHILD_TESTS = """
import pytest

from tests.utils import fresh_process


@fresh_process
def test_skips():
    pytest.skip("libcudart is not loaded")


@fresh_process
def test_passes():
    assert True  # the wrapper's outcome is what is tested here


@fresh_process
def test_fails():
    assert 1 == 2
"""


def test_the_childs_skip_pass_and_failure_are_the_tests_own(tmp_path):
    tests = ROOT / "tests" / "unit" / f"_fresh_process_probe_{tmp_path.name}.py"
    tests.write_text(CHILD_TESTS)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tests)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        tests.unlink()
    summary = run.stdout.strip().splitlines()[-1]
    assert "1 failed, 1 passed, 1 skipped" in summary, run.stdout[-3000:]
    assert "in its own process: libcudart is not loaded" in run.stdout
