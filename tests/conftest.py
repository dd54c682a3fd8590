"""Skips tests marked `distributed(num_gpus=N)` on machines with fewer GPUs."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        marker = item.get_closest_marker("distributed")
        if marker is None:
            continue
        needed = marker.kwargs.get("num_gpus", marker.args[0] if marker.args else 2)
        if visible < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} GPUs, {visible} visible"))
