"""The allocator extension's arena and runs (csrc/cumem_allocator.cpp) on a
machine without a GPU: the real CUDA build over a fake of the driver calls it
imports (tests/fake_cuda/fake_libcuda.cpp, which says what it models and where
that comes from). Each scenario of tests/fake_cuda/scenarios.py runs in a
process of its own, since the extension keeps process-wide state."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_graph_sleep

FAKE_CUDA = Path(__file__).resolve().parent.parent / "fake_cuda"
SCENARIOS = [
    "neighbours_in_one_reservation",
    "a_chunk_goes_back_once_done_and_its_ranges_are_freed",
    "a_run_maps_once_and_the_last_member_out_gives_it_all_back",
    "a_member_freed_inside_its_run_keeps_its_memory_until_the_run_ends",
    "a_run_the_driver_will_not_release_stays_mapped_and_members_rejoin",
    "refused_runs_change_nothing",
    "a_refused_map_over_a_mapped_range_changes_nothing",
    "a_range_whose_unmap_failed_is_not_given_back",
    "what_refused_frees_left_is_counted_and_a_retry_gives_it_back",
    "a_run_its_last_free_could_not_end_is_held_until_a_retry_or_a_member_rejoins",
    "members_freed_on_other_threads_while_a_sleep_unmaps",
]
# Run on the rocm-on-cuda build (the ROCm code path over tests/rocm_shim), built here.
ROCM_SCENARIOS = ["rocm_a_reservation_whose_free_was_refused_is_tried_again"]
# What a scenario may write to stderr (the extension reports what has no caller
# to raise to there): every other "[vllm_graph_sleep]" line fails it.
EXPECTED_REPORTS = {
    "a_range_whose_unmap_failed_is_not_given_back": [r"my_free: cuMemUnmap failed: out of memory"],
    "what_refused_frees_left_is_counted_and_a_retry_gives_it_back": [
        r"my_free: cuMemUnmap failed: out of memory",
        r"my_free: cuMemRelease failed: out of memory",
    ],
    "a_run_its_last_free_could_not_end_is_held_until_a_retry_or_a_member_rejoins": [
        r"my_free: cuMemUnmap failed: out of memory",
        r"my_free: cuMemUnmap failed: out of memory",
    ],
    "rocm_a_reservation_whose_free_was_refused_is_tried_again": [
        r"my_free: hipMemAddressFree failed: out of memory",
        r"my_free: hipMemAddressFree failed: out of memory",
    ],
}


def _cuda_build() -> str:
    spec = importlib.util.find_spec("vllm_graph_sleep._cumem")
    if spec is None or spec.origin is None:
        pytest.skip("the allocator extension is not built (pip install -e .)")
    # Only the build of the package these tests import (an editable install of
    # another checkout would answer with that one's).
    if Path(spec.origin).parent != Path(vllm_graph_sleep.__file__).parent:
        pytest.skip(f"the extension found ({spec.origin}) is not this checkout's build")
    return spec.origin


def _cuda_header_dir() -> str:
    try:
        import nvidia
    except ImportError:
        pytest.skip("no cuda.h: the nvidia-cuda-runtime wheel is not installed")
    # Where CMakeLists.txt finds it for the build.
    found = sorted(glob.glob(os.path.join(nvidia.__path__[0], "*", "include", "cuda.h")))
    if not found:
        pytest.skip("no cuda.h in the nvidia wheels")
    return os.path.dirname(found[0])


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory) -> str:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler for the fake driver")
    library = tmp_path_factory.mktemp("fake_cuda") / "libfakecuda.so"
    subprocess.run(
        [compiler, "-std=c++17", "-shared", "-fPIC", "-O1", "-Wall", "-Werror",
         f"-I{_cuda_header_dir()}", "-o", str(library), str(FAKE_CUDA / "fake_libcuda.cpp")],
        check=True,
    )  # fmt: skip
    return str(library)


@pytest.fixture(scope="module")
def rocm_on_cuda_build(tmp_path_factory) -> str:
    """The allocator's ROCm code path over tests/rocm_shim, compiled as
    CMakeLists.txt's rocm-on-cuda target does (no GPU or ROCm needed)."""
    import sysconfig

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler for the rocm-on-cuda build")
    root = FAKE_CUDA.parent.parent
    extension = tmp_path_factory.mktemp("rocm_on_cuda") / "_cumem.so"
    subprocess.run(
        [compiler, "-std=c++17", "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror",
         "-fno-exceptions", "-DUSE_ROCM", f"-I{root / 'tests' / 'rocm_shim'}",
         f"-I{_cuda_header_dir()}", f"-I{sysconfig.get_paths()['include']}",
         "-o", str(extension), str(root / "csrc" / "cumem_allocator.cpp")],
        check=True,
    )  # fmt: skip
    return str(extension)


@pytest.mark.parametrize("scenario", ROCM_SCENARIOS)
def test_rocm_scenario_on_the_fake_driver(fake_driver, rocm_on_cuda_build, scenario):
    _run_scenario(fake_driver, rocm_on_cuda_build, scenario)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenario_on_the_fake_driver(fake_driver, scenario):
    _run_scenario(fake_driver, _cuda_build(), scenario)


def _run_scenario(fake_driver: str, extension: str, scenario: str) -> None:
    result = subprocess.run(
        [sys.executable, str(FAKE_CUDA / "scenarios.py"), fake_driver, extension, scenario],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "undefined symbol: hip" in result.stderr:
        pytest.skip("the installed extension is a ROCm build")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [line for line in result.stderr.splitlines() if "[vllm_graph_sleep]" in line]
    expected = EXPECTED_REPORTS.get(scenario, [])
    assert len(reports) == len(expected), reports
    for line, pattern in zip(reports, expected, strict=True):
        assert re.search(pattern, line), line
