"""Skips tests marked `distributed(num_gpus=N)` on machines with fewer GPUs, and
loads a chosen build of the allocator extension when GRAPH_SLEEP_TEST_EXTENSION
names one (the ROCm path on CUDA: see tests/rocm_shim/)."""

import ctypes
import importlib.util
import sys

import pytest
import torch

from vllm_graph_sleep.settings import TEST_EXTENSION

#: Path of a built `_cumem*.so` to use instead of the installed one.
EXTENSION_ENV = TEST_EXTENSION.name


def _load_chosen_extension(path: str) -> None:
    """Imports `path` as vllm_graph_sleep._cumem, so that VmmDriver (which
    imports that name) and torch's pluggable allocator (which opens its
    __file__) both use it. Fresh-process tests load it again in the child."""
    if torch.version.hip is None:  # CUDA-driver builds leave cu* to the loaded libcuda
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    spec = importlib.util.spec_from_file_location("vllm_graph_sleep._cumem", path)
    if spec is None:
        raise pytest.UsageError(f"{EXTENSION_ENV}={path!r} is not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["vllm_graph_sleep._cumem"] = module


def pytest_configure(config):
    path = TEST_EXTENSION.read()
    if path:
        _load_chosen_extension(path)


def pytest_report_header(config):
    extension = sys.modules.get("vllm_graph_sleep._cumem")
    if extension is not None:
        return f"allocator extension: {extension.__file__} (platform {extension.platform})"
    return None


def pytest_collection_modifyitems(config, items):
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("distributed")
        if marker is None:
            continue
        needed = marker.kwargs.get("num_gpus", marker.args[0] if marker.args else 2)
        if visible < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPUs, {visible} visible"))


@pytest.fixture
def install_allocator():
    """install_allocator(a) makes `a` (None: no allocator) the process's
    GraphSleepAllocator until the test ends; later calls stack on earlier ones."""
    import contextlib

    from vllm_graph_sleep.allocator import GraphSleepAllocator

    with contextlib.ExitStack() as stack:
        yield lambda allocator: stack.enter_context(GraphSleepAllocator.installed(allocator))
