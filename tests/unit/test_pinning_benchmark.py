"""benchmarks/pinning.py on the CPU: the order of the modes and the summary."""

import os
import subprocess
import sys
from pathlib import Path

from benchmarks import pinning

SCRIPT = Path(pinning.__file__)


def test_every_mode_takes_every_place_over_as_many_repeats():
    orders = [pinning.rotated(pinning.MODES, repeat) for repeat in range(len(pinning.MODES))]
    for place in range(len(pinning.MODES)):
        assert sorted(order[place] for order in orders) == sorted(pinning.MODES)
    assert all(sorted(order) == sorted(pinning.MODES) for order in orders)


def test_medians_leave_out_runs_that_failed():
    runs = [
        {"mode": "register", "ok": True, "alloc_s": 0.1, "total_s": 0.2, "pinned_mib": 240},
        {"mode": "register", "ok": True, "alloc_s": 0.3, "total_s": 0.4, "pinned_mib": 240},
        {"mode": "register", "ok": True, "alloc_s": 0.2, "total_s": 0.9, "pinned_mib": 240},
        {"mode": "torch-sync", "ok": False, "error": "out of memory"},
    ]
    assert pinning.medians(runs) == {
        "register": {"alloc_s": 0.2, "total_s": 0.4, "pinned_mib": 240}
    }


def test_without_gpu_exit_2_with_one_line(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on a GPU machine too.
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "o.json")],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing to run" in lines[0], result.stderr
    assert not (tmp_path / "o.json").exists()
