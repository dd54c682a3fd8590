"""Expandable segments are switched off inside our pools without touching the
user's other allocator options."""

import pytest
import torch

from vllm_graph_sleep import alloc_conf


@pytest.fixture
def writes(monkeypatch):
    recorded = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", recorded.append)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    return recorded


def test_split_respects_brackets():
    conf = "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2],expandable_segments:True"
    assert alloc_conf.split_options(conf) == [
        "max_split_size_mb:128",
        "roundup_power2_divisions:[256:1,512:2]",
        "expandable_segments:True",
    ]


def test_other_options_survive_the_flip(monkeypatch, writes):
    user = "roundup_power2_divisions:[256:1,512:2], expandable_segments:True,max_split_size_mb:64"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
    with alloc_conf.expandable_segments_off():
        assert writes == [
            "roundup_power2_divisions:[256:1,512:2],max_split_size_mb:64,expandable_segments:False"
        ]
    assert writes[-1] == user


def test_nothing_is_written_when_expandable_segments_are_off(monkeypatch, writes):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:False")
    with alloc_conf.expandable_segments_off():
        pass
    assert writes == []


def test_generic_variable_is_read_and_an_empty_cuda_one_shadows_it(monkeypatch, writes):
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert alloc_conf.expandable_segments_enabled(alloc_conf.user_alloc_conf())
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert not alloc_conf.expandable_segments_enabled(alloc_conf.user_alloc_conf())


@pytest.mark.parametrize("hip", [None, "6.4"])
def test_the_hip_variable_is_read_on_rocm_only_between_the_two_others(monkeypatch, writes, hip):
    """torch's order (c10/cuda/CUDAAllocatorConfig.h); torch.version.hip says ROCm."""
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setenv("PYTORCH_HIP_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    with alloc_conf.expandable_segments_off():
        pass
    assert writes == (
        [] if hip is None else ["expandable_segments:False", "expandable_segments:True"]
    )
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert alloc_conf.user_alloc_conf() == ""


def test_setting_is_restored_when_the_body_raises(monkeypatch, writes):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(KeyError), alloc_conf.expandable_segments_off():
        raise KeyError("boom")
    assert writes[-1] == "expandable_segments:True"


def test_nested_pools_keep_expandable_segments_off_until_the_outermost_exits(monkeypatch, writes):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    off = "expandable_segments:False"
    with alloc_conf.expandable_segments_off():
        with alloc_conf.expandable_segments_off():
            assert writes == [off]
        assert writes == [off]  # the outer pool (or a capture) still allocates
    assert writes == [off, "expandable_segments:True"]
