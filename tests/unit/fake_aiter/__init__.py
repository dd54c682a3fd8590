"""A fake `aiter` package for CPU tests.

It is a fake because AITER needs ROCm and an AMD GPU, and neither is available
to these tests. It mirrors the real module path,
aiter.dist.device_communicators.custom_all_reduce.CustomAllreduce, the real
constructor signature (group, device, max_size=..., enable_register_for_capturing=True)
and the real names and parameters of the methods vLLM 0.26.0 reaches:
custom_all_reduce, all_reduce, capture, should_custom_ar, custom_fused_ar_rms,
fused_ar_rms, fused_ar_rms_per_group_quant, custom_fused_qknorm_ar and
fused_qknorm_ar. Their capture-time choice of the registered path follows AITER
(read from ROCm/aiter's custom_all_reduce.py); the kernels are replaced by a
record of each launch and of the graph inputs AITER would IPC-register when
capture() exits.

Two variants:
- custom_all_reduce.py: an AITER with ROCm/aiter#2075's
  enable_register_for_capturing and the per-group FP8 launcher (ROCm/aiter#2823);
- custom_all_reduce_old.py: an older AITER without the keyword and without the
  per-group launcher.

vLLM imports AITER lazily, inside AiterCustomAllreduce.__init__ and
build_supports_per_group_quant, so installing the fake before constructing the
wrapper is enough. install() loads a fresh copy of the chosen variant, so
nothing recorded leaks between tests, and puts it with its parent packages into
sys.modules through pytest's monkeypatch, which takes them out again.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

MODULE = "aiter.dist.device_communicators.custom_all_reduce"
_HERE = Path(__file__).parent


def install(monkeypatch, *, old: bool = False) -> types.ModuleType:
    """Puts the fake into sys.modules and returns its custom_all_reduce module."""
    path = _HERE / ("custom_all_reduce_old.py" if old else "custom_all_reduce.py")
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    parents = {}
    for name in ("aiter", "aiter.dist", "aiter.dist.device_communicators"):
        package = types.ModuleType(name)
        package.__path__ = []  # a package, so submodule imports resolve
        parents[name] = package
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.setitem(sys.modules, MODULE, module)
    spec.loader.exec_module(module)
    parents["aiter"].dist = parents["aiter.dist"]
    parents["aiter.dist"].device_communicators = parents["aiter.dist.device_communicators"]
    parents["aiter.dist.device_communicators"].custom_all_reduce = module
    parents["aiter"].__version__ = module.FAKE_VERSION
    return module
