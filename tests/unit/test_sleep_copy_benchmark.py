"""benchmarks/sleep_copy.py on the CPU: the summary rows the results page
renders (the measurement itself needs a GPU)."""

import importlib.util
from pathlib import Path

from benchmarks import sleep_copy

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("render_results", ROOT / "tools/render_results.py")
render_results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_results)


def mode_result(plain_s: float) -> dict:
    cases = (*sleep_copy.SLEEP_CASES, "level_2", "plain")
    return {
        "median_s": {case: plain_s * (1 + index / 10) for index, case in enumerate(cases)},
        "copied_bytes": {"changed": 8 << 30, "unchanged": 0, "quarter": 2 << 30},
        "exact": True,
    }


def test_a_row_per_mode_and_case_with_its_ratio_to_the_plain_copy():
    report = {
        "command": "python benchmarks/sleep_copy.py --out x.json",
        "raw": mode_result(0.15),
        "coded": {"error": "Triton could not compile"},
    }
    report["results"] = rows = sleep_copy.summary_rows(report, ["raw", "coded"])
    raw = {row["case"]: row for row in rows if row["mode"] == "raw"}
    assert list(raw) == [*sleep_copy.SLEEP_CASES, "level_2", "plain"]
    assert raw["changed"] == {
        "mode": "raw",
        "case": "changed",
        "median_ms": 150.0,
        "over_plain": round(0.15 / (0.15 * 1.5), 3),
        "copied_mib": 8192.0,
        "exact": True,
    }
    assert raw["plain"]["over_plain"] == 1.0 and raw["after_level_2"]["copied_mib"] is None
    assert [row for row in rows if row["mode"] == "coded"] == [
        {"mode": "coded", "case": "error", "median_ms": None}
    ]
    assert render_results.is_generic_bench(report)
