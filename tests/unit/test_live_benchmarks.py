"""benchmarks/wake_pressure.py and benchmarks/serve_soak.py on the CPU: their whole
driver loops against tests/unit/fake_vllm_server.py (a fake, not vLLM: it models
the memory of each tag, the level-2 weight loss, and a wake that answers 500
without changing anything when another process holds the memory it needs) with
tests/unit/fake_gpu_hog.py as the second process and a fake NVML, plus the pure
parts (how much memory a wake stage needs, how the second process takes memory,
the soak's flatness figures) and the no-GPU exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import serve_soak, wake_pressure
from tests.unit.fake_vllm_server import IDLE, SIZES, TOTAL
from vllm_graph_sleep.bench import gpu, live
from vllm_graph_sleep.deep_sleep import RESTORE_HEADROOM
from vllm_graph_sleep.units import MiB

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
FAKE_SERVER = HERE / "fake_vllm_server.py"
FAKE_HOG = HERE / "fake_gpu_hog.py"
MARGIN = 64 * MiB


class FakeMemory:
    """NVML stand-in: the whole fake GPU, the server's bytes plus the second process's."""

    gpus = ["Fake GPU"]

    def __init__(self, used: Path, pressure: Path):
        self.files = (used, pressure)

    def used(self) -> list[int]:
        total = 0
        for path, default in zip(self.files, (IDLE, 0), strict=True):
            try:
                total += int(path.read_text())
            except (OSError, ValueError):
                total += default
        return [total]


class Fake:
    def __init__(self, tmp_path: Path, pressure: bool = True):
        self.used = tmp_path / "used"
        self.pressure = tmp_path / "pressure"
        self.out = tmp_path / "out.json"
        self.memory = FakeMemory(self.used, self.pressure)
        self.server_pressure = pressure
        self.lines: list[str] = []

    def command_for(self, port: int) -> list[str]:
        command = [sys.executable, str(FAKE_SERVER), "--port", str(port), "--config", "ours"]
        command += ["--used-file", str(self.used)]
        if self.server_pressure:
            command += ["--pressure-file", str(self.pressure)]
        return command

    def hog_command(self, margin_mib: int) -> list[str]:
        return [
            sys.executable,
            str(FAKE_HOG),
            "--used-file",
            str(self.used),
            "--pressure-file",
            str(self.pressure),
            "--margin",
            str(margin_mib * MiB),
        ]

    def argv(self, *extra: str) -> list[str]:
        return ["--out", str(self.out), "--model", "fake-model-dir", "--max-tokens", "4", *extra]

    def pressure_run(self, *extra: str) -> dict:
        args = wake_pressure.parse_args(self.argv(*extra))
        return wake_pressure.run(
            args,
            self.memory,
            self.command_for,
            self.hog_command(args.hog_margin_mib),
            "fake",
            self.lines.append,
        )

    def soak_run(self, *extra: str) -> dict:
        args = serve_soak.parse_args(self.argv(*extra))
        return serve_soak.run(args, self.memory, self.command_for, "fake", self.lines.append)

    def written(self) -> dict:
        return json.loads(self.out.read_text())

    def assert_all_stopped(self, results: dict) -> None:
        assert results["server_exit_code"] is not None
        assert not self.used.exists()  # the fake server removes it when it exits
        assert not self.pressure.exists()  # every second process gave its memory back


@pytest.fixture
def fake(tmp_path) -> Fake:
    return Fake(tmp_path)


# -- wake under pressure ---------------------------------------------------------------

PRESSURE_CASE_KEYS = {
    "level": int,
    "wake": str,
    "status": int,
    "still_sleeping": bool,
    "retry_status": int,
    "retry_exact": bool,
    "server_alive": bool,
    "backups_intact": bool,
    "pressure": bool,
    "need_mib": float,
    "free_under_hog_mib": float,
    "left_behind_mib": float,
    "log_errors": list,
    "problems": list,
    "ok": bool,
}


def test_pressure_every_case_is_refused_then_retried_exactly(fake):
    results = fake.pressure_run()
    assert results == fake.written()
    assert results["ok"] is True, [c["problems"] for c in results["cases"]]
    assert results["stable_without_sleep"] is True
    assert [(c["level"], c["wake"]) for c in results["cases"]] == list(wake_pressure.CASES)
    for case in results["cases"]:
        for key, kind in PRESSURE_CASE_KEYS.items():
            assert isinstance(case[key], kind), (key, case)
        assert case["status"] == 500 and case["retry_status"] == 200
        assert case["still_sleeping"] and case["backups_intact"] and case["retry_exact"]
        assert case["free_under_hog_mib"] == 64.0
        assert any("fake out of memory" in line for line in case["log_errors"])
        assert case["left_behind_mib"] == 0.0
        # The first stage of a staged wake needs weights and graphs, not the KV cache.
        want = (
            sum(SIZES.values()) if case["wake"] == "full" else SIZES["weights"] + SIZES["cudagraph"]
        )
        assert case["need_mib"] == want / MiB
        if case["wake"] == "staged":
            assert (case["kv_status"], case["kv_retry_status"]) == (500, 200)
            assert case["kv_still_sleeping"] and case["kv_backups_intact"]
            assert case["kv_need_mib"] == SIZES["kv_cache"] / MiB
    environment = results["environment"]
    assert environment["gpu_name"] == "Fake GPU" and environment["vllm"] == "0.26.0"
    assert results["reference"] and len(results["reference"]) == len(results["prompts"])
    assert "case 4/4: level 2, staged wake" in "\n".join(fake.lines)
    fake.assert_all_stopped(results)


def test_pressure_with_deep_sleep_refuses_the_restore_and_stays_checkpointed(fake):
    # Issue 39: a checkpointed engine's first wake finds no room for the
    # restore, answers 503 and stays asleep and checkpointed; the retry after
    # the second process left restores and wakes, exactly; a staged case's
    # kv_cache stage is an ordinary refused wake of the restored engine.
    results = fake.pressure_run("--checkpoint")
    assert results["ok"] is True, [c["problems"] for c in results["cases"]]
    for case in results["cases"]:
        assert case["checkpointed"] is True
        assert case["status"] == 503 and case["retry_status"] == 200
        assert case["still_sleeping"] and case["still_checkpointed"] and case["retry_exact"]
        assert case["need_mib"] == RESTORE_HEADROOM / MiB and case["pressure"] is True
        assert "backups_intact" not in case
        if case["wake"] == "staged":
            assert (case["kv_status"], case["kv_retry_status"]) == (500, 200)
            assert case["kv_backups_intact"]
    fake.assert_all_stopped(results)


def test_pressure_wrong_tokens_after_retry_fail_the_run(fake, monkeypatch):
    monkeypatch.setenv("FAKE_CORRUPT", "1")
    results = fake.pressure_run()
    assert results["ok"] is False
    assert [c["retry_exact"] for c in results["cases"]] == [False] * 4
    for case in results["cases"]:
        assert case["mismatch"]["first_token"] == 0
        assert case["problems"] == [f"tokens after the retried wake differ: {case['mismatch']}"]
    fake.assert_all_stopped(results)


def test_pressure_a_wake_that_succeeds_under_pressure_fails_the_case(tmp_path):
    fake = Fake(tmp_path, pressure=False)  # this server ignores the other process
    results = fake.pressure_run()
    assert results["ok"] is False
    for case in results["cases"]:
        assert case["status"] == 200
        assert (
            "first wake under pressure answered 200 (no error); want an HTTP error"
            in (case["problems"])
        )
        if case["wake"] == "full":
            assert "first wake: still_sleeping is False, want True" in case["problems"]
    fake.assert_all_stopped(results)


def test_pressure_a_half_done_refused_wake_is_reported(fake, monkeypatch):
    monkeypatch.setenv("FAKE_NO_ROLLBACK", "1")
    results = fake.pressure_run()
    assert results["ok"] is False
    first = results["cases"][0]
    assert first["status"] == 500 and first["backups_intact"] is False
    assert (
        "first wake: the allocator's report changed across the refused wake" in (first["problems"])
    )
    assert first["report_before"]["weights"]["mapped"] == 0
    assert first["report_after"]["weights"]["mapped"] == SIZES["weights"]
    fake.assert_all_stopped(results)


def test_pressure_too_large_margin_is_not_pressure(fake):
    results = fake.pressure_run("--hog-margin-mib", "100000")
    first = results["cases"][0]
    assert first["pressure"] is False
    assert any("no pressure (lower --hog-margin-mib)" in p for p in first["problems"])
    assert results["ok"] is False


def test_pressure_server_that_dies_is_recorded_and_stopped(fake, monkeypatch):
    monkeypatch.setenv("FAKE_DIE_ON_SLEEP", "1")
    results = fake.pressure_run()
    written = fake.written()
    assert written["ok"] is False and "POST /sleep?level=1 failed" in written["error"]
    assert len(written["cases"]) == 1 and written["cases"][0]["ok"] is False
    assert written["server_exit_code"] == 7 == results["server_exit_code"]


def test_pressure_time_limit_stops_the_server_and_writes_the_file(fake, monkeypatch):
    monkeypatch.setenv("FAKE_START_DELAY", "60")
    results = fake.pressure_run("--timeout", "2")
    assert fake.written() == results
    assert results["ok"] is False and "time limit of 2 s" in results["error"]
    assert results["cases"] == []
    fake.assert_all_stopped(results)


def test_wake_need_per_stage():
    # The awake tags of docs/results/archive/bench-h200.json (ours, one H200).
    tags = {
        "weights": {"mapped": 240 * MiB},
        "runtime": {"mapped": 2 * MiB},
        "kv_cache": {"mapped": 42256 * MiB},
        "cudagraph": {"mapped": 152 * MiB},
    }
    assert wake_pressure.wake_need(tags, "full") == (240 + 2 + 42256 + 152) * MiB
    assert wake_pressure.wake_need(tags, "weights") == (240 + 2 + 152) * MiB
    assert wake_pressure.wake_need(tags, "kv_cache") == 42256 * MiB


class FakeDevice:
    """Free memory as torch's caching allocator spends it (c10 CUDACachingAllocator:
    a request up to 1 MiB takes a 2 MiB block, one below 10 MiB a 20 MiB block,
    a larger one its size rounded up to 2 MiB), with no block above `largest`."""

    def __init__(self, free: int, largest: int):
        self.free_bytes = free
        self.largest = largest
        self.blocks: list[int] = []

    def free(self) -> int:
        return self.free_bytes

    def allocate(self, size: int) -> None:
        if size <= MiB:
            block = 2 * MiB
        elif size < 10 * MiB:
            block = 20 * MiB
        else:
            block = -(-size // (2 * MiB)) * 2 * MiB
        if block > self.free_bytes or block > self.largest:
            raise MemoryError
        self.free_bytes -= block
        self.blocks.append(block)


@pytest.mark.parametrize("largest", [TOTAL, 300 * MiB, 30 * MiB])
@pytest.mark.parametrize("extra", [0, 5 * MiB, 9 * MiB, 1000 * MiB + 3 * MiB])
def test_take_memory_leaves_about_the_margin(largest, extra):
    device = FakeDevice(free=140_000 * MiB + extra, largest=largest)
    held = wake_pressure.take_memory(device.free, device.allocate, MARGIN, MemoryError)
    assert MARGIN <= device.free_bytes < MARGIN + 10 * MiB + 2 * MiB
    assert held == sum(device.blocks)


def test_hog_reports_what_it_holds_in_the_line_the_driver_reads(monkeypatch, capsys):
    # hog_main's torch calls on the CPU: free memory from a fake device whose
    # failures are torch's out-of-memory error; stdin already closed.
    import io

    import torch

    device = FakeDevice(free=2000 * MiB + 7 * MiB, largest=300 * MiB)

    def allocate(size, dtype, device_name):
        assert (dtype, device_name) == (torch.uint8, "cuda")
        try:
            device.allocate(size)
        except MemoryError:
            raise torch.OutOfMemoryError("fake") from None

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (device.free(), TOTAL))
    monkeypatch.setattr(torch, "empty", lambda size, dtype, device: allocate(size, dtype, device))
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert wake_pressure.main(["hog", str(MARGIN)]) == 0
    words = capsys.readouterr().out.split()
    assert words[0] == wake_pressure.READY and len(words) == 4
    held, before, after = map(int, words[1:])
    assert (held, before, after) == (sum(device.blocks), 2007 * MiB, device.free_bytes)
    assert MARGIN <= after < MARGIN + 12 * MiB


def test_take_memory_with_nothing_to_take():
    device = FakeDevice(free=MARGIN + 9 * MiB, largest=TOTAL)
    assert wake_pressure.take_memory(device.free, device.allocate, MARGIN, MemoryError) == 0
    assert device.blocks == []


# -- soak ------------------------------------------------------------------------------

SOAK_CYCLE_KEYS = {
    "cycle": int,
    "level": int,
    "wake": str,
    "asleep_mib": float,
    "awake_mib": float,
    "host_rss_mib": float,
    "host_rss_asleep_mib": float,
    "exact": bool,
}


def test_soak_cycles_alternate_and_stay_exact_and_flat(fake):
    results = fake.soak_run("--cycles", "5")
    assert results == fake.written()
    assert results["ok"] is True and results["cycles"] == 5
    cycles = results["results"]
    assert [(c["level"], c["wake"]) for c in cycles] == [
        (1, "full"),
        (2, "staged"),
        (1, "staged"),
        (2, "full"),
        (1, "full"),
    ]
    for record in cycles:
        for key, kind in SOAK_CYCLE_KEYS.items():
            assert isinstance(record[key], kind), (key, record)
        # The fake's layout: everything of ours leaves the GPU asleep.
        assert record["asleep_mib"] == (IDLE + 400 * MiB) / MiB
        assert record["awake_mib"] == record["asleep_mib"] + sum(SIZES.values()) / MiB
        assert record["asleep_mapped_mib"] == 0
        assert record["host_rss_mib"] > 5  # the fake server's Python process
        assert any(
            "fake_vllm_server" in name or "python" in name
            for name in record["host_rss_by_process_mib"]
        )
    summary = results["summary"]
    assert summary["all_exact"] and summary["cycles_done"] == 5
    for key in ("asleep_mib", "awake_mib"):
        assert summary[key]["flat"] is True and summary[key]["max_dev_mib"] == 0
    assert "host_rss_mib" in summary and summary["host_rss_mib"]["flat"] in (True, False)
    text = "\n".join(fake.lines)
    assert "cycle 5/5 L1 full" in text and "NVML asleep: cycle 1 900.0 MiB" in text
    fake.assert_all_stopped(results)


def test_soak_with_every_sleep_checkpointed_holds_nothing_asleep(fake):
    # Issue 39's 100 cycles through vllm serve with deep sleep: the fake's
    # checkpointed server holds nothing over the idle GPU, and is not probed.
    results = fake.soak_run("--cycles", "4", "--checkpoint")
    assert results["ok"] is True
    for record in results["results"]:
        assert record["asleep_mib"] == IDLE / MiB
        assert record["asleep_mapped_mib"] is None and record["host_backup_mib"] is None
        assert record["exact"] is True and record["is_sleeping_awake"] is False
        assert record["checkpointed_asleep"] is True
    assert results["summary"]["asleep_mib"]["flat"] is True
    assert results["summary"]["sleep_state_wrong_cycles"] == []
    fake.assert_all_stopped(results)


def test_soak_counts_a_deep_sleep_that_is_not_checkpointed_as_a_wrong_state():
    records = [
        {"cycle": 1, "is_sleeping_asleep": True, "is_sleeping_awake": False},
        {
            "cycle": 2,
            "is_sleeping_asleep": True,
            "is_sleeping_awake": False,
            "checkpointed_asleep": True,
        },
        {
            "cycle": 3,
            "is_sleeping_asleep": True,
            "is_sleeping_awake": False,
            "checkpointed_asleep": False,
        },
    ]
    assert serve_soak.summarize(records, 16)["sleep_state_wrong_cycles"] == [3]


def test_soak_wrong_tokens_are_reported_per_cycle(fake, monkeypatch):
    monkeypatch.setenv("FAKE_CORRUPT", "1")
    results = fake.soak_run("--cycles", "2")
    assert results["ok"] is False
    assert [c["exact"] for c in results["results"]] == [False, False]
    assert results["summary"]["inexact_cycles"] == [1, 2]
    assert "DIFFERS" in "\n".join(fake.lines)
    fake.assert_all_stopped(results)


def test_soak_server_that_dies_keeps_what_was_measured(fake, monkeypatch):
    monkeypatch.setenv("FAKE_DIE_ON_SLEEP", "1")
    results = fake.soak_run("--cycles", "3")
    written = fake.written()
    assert written["ok"] is False and "POST /sleep?level=1 failed" in written["error"]
    assert written["results"] == [] and written["reference"]
    assert written["summary"]["cycles_done"] == 0 and results["server_exit_code"] == 7


def records(key: str, values: list[float]) -> list[dict]:
    return [
        {"cycle": n, "level": 1 if n % 2 else 2, key: value}
        for n, value in enumerate(values, start=1)
    ]


def test_flatness_measures_from_cycle_two():
    flat = serve_soak.flatness(records("asleep_mib", [1000, 900, 901, 899, 900]), "asleep_mib", 2)
    assert flat["cycle1_mib"] == 1000 and flat["cycle2_mib"] == 900
    assert (flat["max_dev_mib"], flat["spread_mib"], flat["drift_mib"]) == (1, 2, 0)
    assert flat["flat"] is True

    growing = serve_soak.flatness(records("x", [50, 10, 11, 12, 13, 14]), "x", 2)
    assert growing["flat"] is False
    assert (growing["max_dev_mib"], growing["worst_cycle"], growing["drift_mib"]) == (4, 6, 4)
    # Level 2 (even cycles) sits 3 MiB above level 1, steadily: not drift per level.
    steady = serve_soak.flatness(records("x", [0, 103, 100, 103, 100, 103]), "x", 2)
    assert steady["flat"] is False and steady["max_dev_by_level_mib"] == {"1": 0, "2": 0}

    assert serve_soak.flatness(records("x", [5]), "x", 2) == {
        "tolerance_mib": 2,
        "cycle1_mib": 5,
        "flat": None,
    }


# -- exit status through main ----------------------------------------------------------


@pytest.mark.parametrize("corrupt", [False, True])
def test_main_exit_status(fake, monkeypatch, corrupt):
    if corrupt:
        monkeypatch.setenv("FAKE_CORRUPT", "1")
    monkeypatch.setattr(gpu, "NvmlMemory", lambda count: fake.memory)
    monkeypatch.setattr(live, "real_command", lambda args, model: fake.command_for)
    monkeypatch.setattr(
        wake_pressure, "hog_command", lambda args: fake.hog_command(args.hog_margin_mib)
    )
    want = 1 if corrupt else 0
    assert wake_pressure.main(fake.argv()) == want
    assert fake.written()["ok"] is not corrupt
    assert serve_soak.main([*fake.argv(), "--cycles", "2"]) == want
    assert fake.written()["ok"] is not corrupt


@pytest.mark.parametrize(
    "script",
    [
        "wake_pressure.py",
        "serve_soak.py",
        "pinning.py",
        "asleep_memory_history.py",
        "fingerprint_speed.py",
        "release_speed.py",
    ],
)
def test_without_gpu_exit_2_with_one_line(tmp_path, script):
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on a GPU machine too.
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--out", str(tmp_path / "o.json")],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing to run" in lines[0], result.stderr
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_a_live_benchmark_refuses_a_timeout_that_would_set_no_limit(timeout, capsys):
    """--timeout 0 set no timer at all (setitimer's 0 turns it off), and -1
    raised a traceback from setitimer."""
    import argparse

    from vllm_graph_sleep.bench import live

    parser = argparse.ArgumentParser()
    live.add_arguments(parser, default_timeout=60)
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", "o.json", "--timeout", timeout])
    assert "must be a number of seconds above 0" in capsys.readouterr().err
