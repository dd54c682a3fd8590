"""benchmarks/pinning.py on the CPU: the order of the modes and the summary (its
exit without a GPU: tests/unit/test_live_benchmarks.py)."""

from benchmarks import pinning


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
