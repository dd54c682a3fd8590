"""A weight reload or transfer leaves the garbage collector's heap frozen
again, as vLLM leaves it after warm-up, while graph offload is on (CPU)."""

from __future__ import annotations

import gc

import pytest

from tests.unit.force_cpu_platform import force_cpu_platform

force_cpu_platform()

from vllm.v1.worker import gpu_worker  # noqa: E402

from vllm_graph_sleep.patches import v1_worker_gpu_worker  # noqa: E402
from vllm_graph_sleep.patches._wrap import is_wrapped  # noqa: E402


class Node:
    """An object the gc tracks, in a cycle as model objects often are."""

    def __init__(self) -> None:
        self.me = self


def _tracked(obj: object) -> bool:
    """Whether a collection would scan `obj` (frozen objects are not)."""
    return any(candidate is obj for candidate in gc.get_objects())


@pytest.fixture
def unfreeze_after():
    gc.unfreeze()  # whatever ran before starts nothing frozen here
    yield
    gc.unfreeze()  # what vLLM's Worker.shutdown does: the test process goes on


@pytest.mark.usefixtures("unfreeze_after")
@pytest.mark.parametrize("active", [True, False])
def test_weight_reloads_refreeze_the_gc_heap_when_graph_offload_is_on(monkeypatch, active):
    monkeypatch.setattr(v1_worker_gpu_worker.config, "is_active", lambda: active)
    made = []
    garbage = []

    def reload(worker):
        made.append(Node())
        garbage.append(Node())  # dropped before the call returns: a cycle to collect
        del garbage[:]
        return "reloaded"

    wrapped = v1_worker_gpu_worker._wrap_refreeze_gc_heap(reload)
    assert wrapped(object()) == "reloaded"
    # Frozen with graph offload on (the collection before the freeze took the
    # garbage, so nothing dead is frozen); stock behaviour with it off.
    assert _tracked(made[0]) is not active
    assert (gc.get_freeze_count() > 0) is active


@pytest.mark.usefixtures("unfreeze_after")
def test_a_failed_reload_freezes_nothing(monkeypatch):
    monkeypatch.setattr(v1_worker_gpu_worker.config, "is_active", lambda: True)

    def reload(worker):
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        v1_worker_gpu_worker._wrap_refreeze_gc_heap(reload)(object())
    assert gc.get_freeze_count() == 0


def test_both_are_wrapped_on_vllms_worker():
    v1_worker_gpu_worker.apply()
    for name in ("reload_weights", "finish_weight_update"):
        assert is_wrapped(getattr(gpu_worker.Worker, name)), name
