"""`vllm-graph-sleep bench` and `doctor` on the CPU.

- bench: argument handling; the `vllm serve` command and environment of each
  configuration; the table and plot writers on recorded data
  (tests/unit/data/bench-results-fixture.json, fixture numbers shaped after
  docs/results/sleep-memory-h200.json, not a measurement); the no-GPU exit (in a
  subprocess: one line, no traceback); and the whole driver loop against
  tests/unit/fake_vllm_server.py with a fake NVML, including a server that does
  not start, one that dies, one that is never healthy, tokens that differ after
  a wake, and a server that is not deterministic (it differs from itself before
  any sleep, which the verdict names).
- doctor: vLLM's own `vllm serve` parser with the plugin registered, judged for
  CUDA and ROCm plans and for the machine it runs on (no GPU here).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.unit import fake_aiter
from tests.unit.fake_vllm_server import IDLE
from vllm_graph_sleep import cli, config, doctor
from vllm_graph_sleep.allocator import HOST_BUFFERS_ENV, SWITCH_ENVS
from vllm_graph_sleep.bench import (
    charts,
    estimate,
    floor,
    gpu,
    model_info,
    phases,
    plot,
    report,
    runner,
    server,
)
from vllm_graph_sleep.bench.client import Client
from vllm_graph_sleep.bench.plot import write_plot
from vllm_graph_sleep.bench.server import PROBE_EXTENSION, ServerError, serve_command, server_env
from vllm_graph_sleep.bench.settings import ALL_CONFIGS, BenchSettings
from vllm_graph_sleep.request_gate import ASLEEP_WAIT_ENV, MAX_HELD_ENV
from vllm_graph_sleep.units import MiB

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "bench-results-fixture.json"
FAKE_SERVER = Path(__file__).parent / "fake_vllm_server.py"


def bench_settings(argv: list[str]) -> BenchSettings:
    return cli.settings_from(cli.build_parser().parse_args(["bench", *argv]))


# -- bench: arguments ------------------------------------------------------------


def test_bench_defaults():
    s = bench_settings([])
    assert s.model is None and s.model_kind == "llama"
    assert (s.tp, s.cycles, s.gpu_memory_utilization) == (1, 2, 0.3)
    assert s.levels == (1, 2)
    assert s.wakes == ("full", "staged")
    assert s.configs == ("ours", "stock_graphs", "stock_eager")
    assert s.out is None and s.serve_args == ()
    # The start-time comparison with warm caches is asked for (--warm-starts 2):
    # the starts are what a run's time goes to.
    assert s.warm_starts == 0
    assert s.start_rounds == 0
    assert s.floor is True


def test_bench_takes_the_8b_class_model_kind():
    assert bench_settings(["--model-kind", "llama_8b"]).model_kind == "llama_8b"


def test_bench_lists_take_commas_and_spaces_keep_order_and_drop_repeats(tmp_path):
    s = bench_settings(
        [
            "--model",
            str(tmp_path),
            "--tp",
            "2",
            "--cycles",
            "5",
            "--levels",
            "2,1",
            "--configs",
            "stock_eager",
            "ours,stock_eager",
            "--wakes",
            "staged",
            "--gpu-memory-utilization",
            "0.5",
            "--serve-args",
            "--dtype bfloat16 --block-size 32",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert s.model == str(tmp_path)
    assert (s.tp, s.cycles, s.gpu_memory_utilization) == (2, 5, 0.5)
    assert s.levels == (1, 2)
    assert s.configs == ("stock_eager", "ours")
    assert s.wakes == ("staged",)
    assert s.serve_args == ("--dtype", "bfloat16", "--block-size", "32")
    assert s.out == tmp_path / "o"
    assert s.steps()[:3] == [(0, 1, "staged"), (0, 2, "staged"), (1, 1, "staged")]
    assert len(s.steps()) == 5 * 2


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--levels", "3"], "'3' is not one of 1, 2"),
        (["--configs", "ours,vanilla"], "'vanilla' is not one of ours, stock_graphs, stock_eager"),
        (["--wakes", "lazy"], "'lazy' is not one of full, staged"),
        (["--tp", "0"], "must be at least 1"),
        (["--cycles", "0"], "must be at least 1"),
        (["--warm-starts", "-1"], "must be 0 or more"),
        (["--start-rounds", "-2"], "must be 0 or more"),
        (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--model-kind", "gpt"], "invalid choice"),
        (["--serve-args", "--chat-template 'x"], "No closing quotation"),
        (["--start-timeout", "-5"], "must be a number of seconds above 0"),
        (["--start-timeout", "nan"], "must be a number of seconds above 0"),
        (["--start-timeout", "inf"], "must be a number of seconds above 0"),
        (["--decode-tokens", "1"], "must be at least 2"),
    ],
)
def test_bench_rejects_bad_arguments(argv, complaint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", *argv])
    assert exit_info.value.code == cli.EXIT_USAGE
    assert complaint in capsys.readouterr().err


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli.main([]) == cli.EXIT_USAGE
    assert "{bench,doctor}" in capsys.readouterr().out


def test_bench_model_dir_must_be_a_model(tmp_path):
    settings = BenchSettings(model=str(tmp_path / "missing"))
    with pytest.raises(runner.BenchError, match="not a model directory"):
        runner.resolve_model(settings, print)


def test_the_bench_makes_its_model_in_a_child_process(tmp_path, monkeypatch):
    from vllm_graph_sleep.testing import models

    # In this process it would keep the GPU busy (a large kind is drawn there).
    monkeypatch.setattr(models, "make_model", lambda *a, **k: pytest.fail("made in the bench"))
    path = runner.resolve_model(BenchSettings(cache_dir=tmp_path), print)
    assert path == str((tmp_path / "llama").resolve()) and models.is_complete(path, "llama")
    (tmp_path / "qwen3_moe").mkdir()
    (tmp_path / "qwen3_moe" / "notes.txt").write_text("mine")  # not a folder it may replace
    with pytest.raises(runner.BenchError, match="making the qwen3_moe model failed .exit 1.: "):
        runner.resolve_model(BenchSettings(cache_dir=tmp_path, model_kind="qwen3_moe"), print)


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_serve_command_per_config(config):
    command = serve_command(
        config, "/m", 8123, tp=2, gpu_memory_utilization=0.4, max_model_len=512, extra=("--x",)
    )
    assert command[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    text = " ".join(command)
    for expected in (
        "--port 8123",
        "--enable-sleep-mode",
        "--tensor-parallel-size 2",
        "--gpu-memory-utilization 0.4",
        "--max-model-len 512",
        f"--worker-extension-cls {PROBE_EXTENSION}",
    ):
        assert expected in text
    assert ("--sleep-mode-offload-cudagraph" in command) == config.startswith("ours")
    assert ("--enforce-eager" in command) == (config == "stock_eager")
    assert command[-1] == "--x"


@pytest.mark.parametrize("config", ALL_CONFIGS)
def test_serve_command_is_what_vllm_serve_parses(config):
    """The arguments go through vLLM 0.26's own `vllm serve` parser (plugin on)."""
    command = serve_command(
        config, "/m", 8123, tp=1, gpu_memory_utilization=0.3, max_model_len=1024
    )
    with doctor._parsable_without_gpu(doctor.detect_platform()):
        engine_args = doctor.parse_serve_args(command[4:])
    assert engine_args.model == "/m"
    assert engine_args.enable_sleep_mode is True
    assert engine_args.worker_extension_cls == PROBE_EXTENSION
    assert (engine_args.max_model_len, engine_args.seed) == (1024, 0)
    assert engine_args.enforce_eager is (config == "stock_eager")
    flag = (engine_args.additional_config or {}).get("sleep_mode_offload_cudagraph", False)
    assert flag is config.startswith("ours")


def test_probe_extension_is_importable_by_its_qualified_name():
    import importlib

    from vllm.v1.worker.gpu_worker import Worker

    module, name = PROBE_EXTENSION.rsplit(".", 1)
    extension = getattr(importlib.import_module(module), name)
    methods = [a for a in dir(extension) if not a.startswith("__")]
    assert methods == ["graph_sleep_memory_report"]
    assert not any(hasattr(Worker, m) for m in methods)  # vLLM asserts this at start


def test_server_env_turns_dev_mode_on_and_keeps_the_rest():
    env = server_env({"NCCL_NVLS_ENABLE": "0", "VLLM_USE_FLASHINFER_SAMPLER": "1"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "1"  # a value the user set is kept
    assert server_env({})["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_the_bench_forks_its_engine_cores_unless_told_otherwise():
    assert server.with_forked_engine_core({})[server.MULTIPROC_METHOD] == "fork"
    kept = server.with_forked_engine_core({server.MULTIPROC_METHOD: "spawn", "A": "1"})
    assert kept == {server.MULTIPROC_METHOD: "spawn", "A": "1"}


def test_server_env_keeps_flashinfer_all_reduce_off_multicast_where_it_is_off():
    assert server_env({"NCCL_NVLS_ENABLE": "0"})["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "trtllm"
    assert "VLLM_FLASHINFER_ALLREDUCE_BACKEND" not in server_env({})
    assert "VLLM_FLASHINFER_ALLREDUCE_BACKEND" not in server_env({"NCCL_NVLS_ENABLE": "1"})
    chosen = {"NCCL_NVLS_ENABLE": "0", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "mnnvl"}
    assert server_env(chosen)["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "mnnvl"


def test_visible_gpu_ids():
    assert gpu.visible_gpu_ids({}) is None
    assert gpu.visible_gpu_ids({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gpu.visible_gpu_ids({"CUDA_VISIBLE_DEVICES": "2, GPU-abc"}) == ["2", "GPU-abc"]


# -- bench: report and plot on recorded data ----------------------------------------


@pytest.fixture
def recorded() -> dict:
    return report.read_json(FIXTURE)


def table_row(out: str, label: str) -> list[str]:
    """The cells after `label` in the printed table, split at spaces."""
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label) :].split()


def test_summary_of_recorded_data(recorded):
    summary = report.summarize_all(recorded)
    assert list(summary) == ["ours", "stock_graphs", "stock_eager"]
    ours, stock = summary["ours"], summary["stock_graphs"]
    assert ours["asleep_mib"]["1"] == [pytest.approx(1104)]
    assert stock["asleep_mib"]["1"] == [pytest.approx(1256)]
    assert summary["stock_eager"]["asleep_mib"]["2"] == [pytest.approx(964)]
    assert ours["tags_awake_mib"]["cudagraph"] == [pytest.approx(152)]
    assert "cudagraph" not in stock["tags_awake_mib"]
    assert ours["host_backup_mib"] == {"1": [pytest.approx(392)], "2": [pytest.approx(152)]}
    assert stock["host_backup_mib"] == {}
    assert ours["sleep_ms"]["1"] == pytest.approx(236)
    assert set(ours["wake_ms"]) == {"1 full", "1 staged", "2 full", "2 staged"}
    assert ours["reload_ms"] == pytest.approx(210)
    assert ours["exact"] == [4, 4]


def test_later_level_1_sleeps_are_told_apart_by_the_cycle_before_them():
    # Issue 38 holds each kind against stock's: after a level-1 cycle a sleep
    # keeps the backups that did not change; after a level-2 cycle and a reload
    # it compares with the buffers level 2 kept. The bench's order: L1, L1, L2,
    # L2, then again.
    levels = [1, 1, 2, 2, 1, 1, 2, 2]
    seconds = [0.700, 0.060, 0.050, 0.040, 0.150, 0.070, 0.050, 0.040]
    steps = [{"level": lv, "sleep_s": s} for lv, s in zip(levels, seconds, strict=True)]
    kinds = report.sleeps_ms_by_kind(steps)
    assert kinds["first"] == pytest.approx(700)
    assert kinds["level 1 after a wake"] == pytest.approx(65)  # steps 2 and 6
    assert kinds["level 1 after level 2"] == pytest.approx(150)  # step 5
    assert report.sleeps_ms_by_kind([]) == {
        "first": None,
        "level 1 after a wake": None,
        "level 1 after level 2": None,
    }
    # A run at level 2 only has no later level-1 sleep of either kind.
    only_two = report.sleeps_ms_by_kind([{"level": 2, "sleep_s": 0.1}] * 3)
    assert only_two["level 1 after a wake"] is None and only_two["first"] == pytest.approx(100)


def test_the_engines_own_sleep_times_are_told_apart_like_the_clients():
    # vLLM logs each sleep's own time ("It took ... to fall asleep"): issue 38
    # reads ours against stock's there too, without the HTTP round trip.
    levels = [1, 1, 2, 2, 1, 1, 2, 2]
    steps = [{"level": lv, "sleep_s": 1.0, "wake": "full", "wake_s": 0.1} for lv in levels]
    engine = [0.500, 0.014, 0.015, 0.016, 0.020, 0.012, 0.017, 0.019]
    summary = report._sleeps_in_engine(steps, engine)
    # 14, 20, 12: the run's first (500, pinning its buffers) is a row of its own.
    assert summary["sleep_engine_ms"]["1"] == pytest.approx(14)
    assert summary["sleep_engine_ms"]["2"] == pytest.approx(16.5)
    kinds = summary["sleep_engine_ms_by_kind"]
    assert kinds["first"] == pytest.approx(500)
    assert kinds["level 1 after a wake"] == pytest.approx(13)  # steps 2 and 6
    assert kinds["level 1 after level 2"] == pytest.approx(20)
    # A log without a line for every step (an older file, a failed sleep) gives none.
    assert report._sleeps_in_engine(steps, engine[:-1]) == {}
    assert report._sleeps_in_engine(steps, None) == {}


def test_the_sleeps_vllm_logged_are_read_from_its_log_in_order(tmp_path):
    from vllm_graph_sleep.bench.server import Server

    log = tmp_path / "server.log"
    server = Server("x", ["true"], {}, log)
    assert server.sleeps_in_engine() == []  # no log yet
    log.write_text(
        "(EngineCore pid=1) INFO 12-06 05:44:01 [v1_executor_abstract.py:47] "
        "It took 0.099830 seconds to fall asleep.\n"
        "(APIServer pid=2) INFO 12-06 05:44:01 [api_router.py:38] wake up the engine\n"
        "(EngineCore pid=1) INFO 12-06 05:44:02 [abstract.py:345] It took 0.023 seconds to "
        "wake up tags ['weights'].\n"
        "(EngineCore pid=1) INFO 12-06 05:44:02 [v1_executor_abstract.py:47] "
        "It took 0.013835 seconds to fall asleep.\n"
    )
    assert server.sleeps_in_engine() == [0.09983, 0.013835]


def _allocator_line(seconds: float, rank: str = "EngineCore pid=1") -> str:
    # As GraphSleepAllocator.sleep logs it (an H100 8B run's, shortened).
    return (
        f"({rank}) INFO 12-06 17:35:48 [allocator.py:476] graph-sleep sleep: backed up "
        "cudagraph 0 B, runtime 2.00 MiB, weights 13.07 GiB (copied 9.00 MiB, kept 13.07 GiB "
        "unchanged); dropped kv_cache 9.62 GiB; stack limit per thread device 0 1024 -> 0 B; "
        f"cuBLAS workspaces released; {seconds:.3f} s (graph pool claimed 0.1 ms, "
        "waiting for the kv_cache's release on its thread (32 allocations, 10.3 ms there) 0.0 ms)\n"
    )


def _engine_line(seconds: float) -> str:
    return (
        "(EngineCore pid=1) INFO 12-06 17:35:49 [v1_executor_abstract.py:52] "
        f"It took {seconds:.6f} seconds to fall asleep.\n"
    )


def test_the_allocators_part_of_each_sleep_is_read_from_the_log(tmp_path):
    from vllm_graph_sleep.bench.server import Server

    log = tmp_path / "server.log"
    server = Server("x", ["true"], {}, log)
    assert server.sleeps_in_allocator() == []  # no log yet
    log.write_text(
        _allocator_line(3.300)
        + _engine_line(3.303521)
        # Two ranks: the slower one's is the sleep's.
        + _allocator_line(0.028, "Worker_TP0 pid=3")
        + _allocator_line(0.031, "Worker_TP1 pid=4")
        + _engine_line(0.033912)
    )
    assert server.sleeps_in_allocator() == [3.3, 0.031]
    # Stock logs no line of ours: nothing, rather than figures of the wrong sleeps.
    log.write_text(_engine_line(0.2838) + _engine_line(0.0361))
    assert server.sleeps_in_allocator() == []


def _ahead_line(seconds: float, who: str = "EngineCore pid=1") -> str:
    # As the worker logs it (lease 24's bench, docs/results/h100-2026-12-07h.tar.gz).
    return (
        f"({who}) INFO 12-07 21:35:01 [backups.py:653] graph-sleep: backed up weights "
        "240.00 MiB ahead (weights coded: 240.00 MiB in 158.84 MiB); a sleep copies only what "
        f"changes from now on; {seconds:.3f} s (backup of 15 allocations: waiting for the "
        "device 1.0 ms, host buffers 55.1 ms, coding (15 allocations whole) 31.8 ms)\n"
    )


def test_the_backup_at_the_engines_start_is_read_from_the_log(tmp_path):
    from vllm_graph_sleep.bench.server import Server

    log = tmp_path / "server.log"
    server = Server("x", ["true"], {}, log)
    assert server.backup_ahead_s() is None  # no log yet
    log.write_text(_ahead_line(2.677, "Worker_TP0 pid=3") + _ahead_line(2.9, "Worker_TP1 pid=4"))
    assert server.backup_ahead_s() == 2.9  # the slower rank's
    # Switched off, failed, or stock: no such line.
    log.write_text(
        "(EngineCore pid=1) INFO graph-sleep: weights 240.00 MiB not backed up ahead: backups "
        "are not kept (VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY is on); the first sleep backs it up\n"
        "(EngineCore pid=1) WARNING graph-sleep: backing up weights 240.00 MiB ahead failed "
        "(boom); the first sleep backs it up\n" + _engine_line(0.2838)
    )
    assert server.backup_ahead_s() is None


def test_the_table_sets_the_backup_at_start_beside_stocks_first_pinning(recorded):
    ours = next(c for c in recorded["configs"] if c["config"] == "ours")
    ours["backup_ahead_s"] = 0.090
    table = report.format_table(recorded)
    row = next(line for line in table.splitlines() if line.startswith("weights backed up at"))
    cells = [cell.strip() for cell in row.split("  ") if cell.strip()]
    assert cells[1] == "90" and cells[2:] == ["-", "-"]  # stock backs nothing up ahead
    lines = table.splitlines()
    after = lines[lines.index(row) + 1]  # stock's pinning, where the file has it; then sleeps
    assert after.startswith(("pinning in the first sleep", "sleep L1, median"))
    # Files recorded before carry no such figure, and show no such row.
    ours.pop("backup_ahead_s")
    assert "weights backed up at" not in report.format_table(recorded)


def test_a_sleeps_time_is_split_into_the_allocators_and_the_rest():
    levels = [1, 1, 2, 2, 1, 1, 2, 2]
    steps = [{"level": lv, "sleep_s": 1.0, "wake": "full", "wake_s": 0.1} for lv in levels]
    engine = [3.3035, 0.0339, 0.0346, 0.0441, 0.0672, 0.0616, 0.0268, 0.0355]
    allocator = [3.300, 0.032, 0.028, 0.034, 0.065, 0.060, 0.021, 0.027]
    summary = report._sleeps_in_allocator(steps, engine, allocator)
    # Medians after the first sleep: L1 of 32, 65, 60; L2 of 28, 34, 21, 27.
    assert summary["sleep_allocator_ms"]["1"] == pytest.approx(60)
    assert summary["sleep_allocator_ms"]["2"] == pytest.approx(27.5)
    assert summary["sleep_outside_allocator_ms"]["1"] == pytest.approx(1.9)
    assert summary["sleep_outside_allocator_ms"]["2"] == pytest.approx(7.55)
    assert report._sleeps_in_allocator(steps, engine, allocator[:-1]) == {}
    assert report._sleeps_in_allocator(steps, engine, []) == {}
    assert report._sleeps_in_allocator(steps, None, allocator) == {}


def test_the_table_shows_the_allocators_part_for_ours_only(recorded):
    ours = next(c for c in recorded["configs"] if c["config"] == "ours")
    steps = ours["steps"]
    ours["sleeps_in_engine_s"] = [0.030 + 0.001 * i for i in range(len(steps))]
    ours["sleeps_in_allocator_s"] = [0.025 + 0.001 * i for i in range(len(steps))]
    table = report.format_table(recorded)
    row = next(line for line in table.splitlines() if line.startswith("sleep L1 outside our"))
    cells = row.split("  ")
    assert "5.0" in row and cells[-1].strip() == "-"  # stock: no line of ours
    assert "sleep L1 in our allocator (its log line)" in table
    # Files recorded before carry no such figure, and show no such row.
    for record in recorded["configs"]:
        record.pop("sleeps_in_allocator_s", None)
    assert "in our allocator" not in report.format_table(recorded)


def test_table_of_recorded_data(recorded):
    table = report.format_table(recorded)
    lines = table.splitlines()
    assert lines[0].split() == ["ours", "(graph", "offload)", "stock,", "graphs", "stock,", "eager"]
    row = next(line for line in lines if line.startswith("asleep L1, over idle GPU"))
    assert "1104 (0.88x)" in row and "964 (0.77x)" in row
    assert "tag cudagraph, awake (MiB)" in table
    assert "bit-exact after wake" in table and "4/4" in table
    # Recorded before the bench repeated its reference: no row, as such files always showed.
    assert "same tokens twice before any sleep" not in table
    assert report.not_repeatable(recorded) == []
    assert "ratios: against stock, graphs" in table
    assert report.not_exact(recorded) == []


def test_table_ratios_fall_back_to_stock_eager_and_flag_differences(recorded):
    recorded["configs"] = [c for c in recorded["configs"] if c["config"] != "stock_graphs"]
    recorded["configs"][0]["steps"][1]["bit_exact"] = False
    table = report.format_table(recorded)
    assert "ratios: against stock, eager" in table
    assert "3/4 DIFFER" in table
    assert report.not_exact(recorded) == ["ours"]


def differs_from_itself(record: dict) -> None:
    mismatch = {"prompt": 0, "first_token": 18, "got": []}
    record["reference_repeat"] = {"bit_exact": False, "mismatch": mismatch}


def test_a_server_that_differs_from_itself_but_not_after_a_wake_passes_with_a_warning(
    recorded, capsys
):
    ours, stock_graphs, _ = recorded["configs"]
    ours["reference_repeat"] = {"bit_exact": True}
    differs_from_itself(stock_graphs)
    table = report.format_table(recorded)
    assert table_row(table, "same tokens twice before any sleep") == ["yes", "NO", "-"]
    assert report.not_repeatable(recorded) == ["stock_graphs"]
    assert cli.bench_verdict(recorded) == 0
    assert capsys.readouterr().err == (
        "vllm-graph-sleep bench: warning: stock_graphs gave different tokens for the same "
        "prompts twice before any sleep (not deterministic on this model) but the same after "
        "every wake; on such a server a difference after wake would not show corruption by "
        "sleep\n"
    )


def test_the_verdict_names_only_the_servers_that_differ_from_themselves(recorded, capsys):
    ours, stock_graphs, _ = recorded["configs"]
    ours["reference_repeat"] = {"bit_exact": True}
    differs_from_itself(stock_graphs)
    for record in (ours, stock_graphs):
        record["steps"][0]["bit_exact"] = False
    assert cli.bench_verdict(recorded) == cli.EXIT_NOT_EXACT
    err = capsys.readouterr().err
    assert "warning" not in err
    assert _failure_line(err) == (
        "vllm-graph-sleep bench: tokens after wake differ from before the first sleep in: "
        "ours, stock_graphs; of these, stock_graphs also gave different tokens for the same "
        "prompts twice before any sleep (not deterministic on this model), so its differences "
        "after wake neither show nor rule out corruption by sleep"
    )


def test_plot_of_recorded_data(recorded, tmp_path):
    png = write_plot(recorded, tmp_path / "memory.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def _bar_heights(ax) -> list[float]:
    return [round(patch.get_height(), 3) for patch in ax.patches]


def test_the_asleep_chart_shows_each_configuration_and_level_and_the_floor(recorded):
    summary = report.summarize_all(recorded)
    with_floor = {
        **recorded,
        "floor": {"what": floor.WHAT, "baseline_used_bytes": [0], "used_bytes": [455 * MiB]},
    }
    for results, floor_drawn in ((recorded, False), (with_floor, True)):
        (ax,) = charts.asleep_figure(results).axes
        # Level 1 for every configuration, then level 2, in the table's order.
        want = [summary[name]["asleep_mib"][level][0] for level in "12" for name in summary]
        assert _bar_heights(ax) == [round(v, 3) for v in want]
        assert [t.get_text() for t in ax.get_xticklabels()] == [
            "ours (graph offload)",
            "stock, graphs",
            "stock, eager",
        ]
        floors = [line for line in ax.lines if list(line.get_ydata()) == [455.0, 455.0]]
        assert bool(floors) == floor_drawn
        texts = [t.get_text() for t in ax.texts]
        assert any(t.startswith(charts.FLOOR_LABEL) for t in texts) == floor_drawn


def test_the_wake_chart_shows_the_level_1_wakes_full_and_staged(recorded):
    summary = report.summarize_all(recorded)
    (ax,) = charts.wake_figure(recorded).axes
    want = [summary[name]["wake_ms"][key] for key in ("1 full", "1 staged") for name in summary]
    assert _bar_heights(ax) == [round(v, 3) for v in want]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "full wake",
        "staged: weights, then kv_cache",
    ]


def test_a_run_of_one_level_and_one_wake_mode_charts_what_it_has(recorded):
    for record in recorded["configs"]:
        record["steps"] = [s for s in record["steps"] if (s["level"], s["wake"]) == (1, "full")]
    (asleep,) = charts.asleep_figure(recorded).axes
    (wake,) = charts.wake_figure(recorded).axes
    assert len(asleep.patches) == len(wake.patches) == 3
    assert [t.get_text() for t in wake.get_legend().get_texts()] == ["full wake"]


def two_gpus(results: dict) -> dict:
    """The recorded single-GPU run as if tp were 2 (GPU 1 holds 10 MiB more)."""
    extra = 10 * MiB

    def widen(values: list) -> list:
        return [values[0], values[0] + extra]

    results["settings"]["tp"] = 2
    results["host"]["gpus"] = ["NVIDIA H200", "NVIDIA H200"]
    for record in results["configs"]:
        for key in ("baseline_used_bytes", "awake_used_bytes", "after_stop_used_bytes"):
            record[key] = [record[key][0]] * 2
        record["awake_report"] = record["awake_report"] * 2
        record["samples"]["used_bytes"] = [
            record["samples"]["used_bytes"][0],
            [u + extra for u in record["samples"]["used_bytes"][0]],
        ]
        for step in record["steps"]:
            step["asleep_used_bytes"] = widen(step["asleep_used_bytes"])
            step["awake_used_bytes"] = widen(step["awake_used_bytes"])
            step["asleep_report"] = step["asleep_report"] * 2
    return results


def test_table_and_plot_per_gpu(recorded, tmp_path):
    results = two_gpus(recorded)
    summary = report.summarize_all(results)["ours"]
    assert summary["asleep_mib"]["1"] == [pytest.approx(1104), pytest.approx(1114)]
    assert summary["tags_awake_mib"]["cudagraph"] == [pytest.approx(152)] * 2
    table = report.format_table(results)
    assert "asleep L1, over idle GPU (MiB) gpu0" in table
    assert "asleep L1, over idle GPU (MiB) gpu1" in table
    assert write_plot(results, tmp_path / "two.png").stat().st_size > 30_000


def test_decode_fastest_run_reads_the_fastest_of_each_series(recorded):
    results = json.loads(json.dumps(recorded))
    ours = results["configs"][0]
    # Five runs where one is slowed down by something else on the host: the medians
    # move with it, the fastest runs do not.
    ours["decode_after"] = {
        "tokens": 129,
        "one_token_s": [0.010, 0.012, 0.008, 0.030, 0.011],
        "all_tokens_s": [0.300, 0.450, 0.264, 0.500, 0.420],
        "tokens_per_s": 128 / (0.420 - 0.011),
    }
    summary = report.summarize_all(results)["ours"]
    assert summary["decode_tps_fastest"]["after"] == pytest.approx(128 / (0.264 - 0.008))
    assert summary["decode_tps"]["after"] == pytest.approx(128 / 0.409)
    ours["decode_after"]["all_tokens_s"] = [0.005] * 5  # not slower than one token: no figure
    assert report.summarize_all(results)["ours"]["decode_tps_fastest"]["after"] is None
    del ours["decode_after"]
    assert "decode after last wake, fastest run (tok/s)" in report.format_table(results)


def test_report_option_redraws_a_recorded_file(tmp_path, capsys):
    assert cli.main(["bench", "--report", str(FIXTURE), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "asleep L1, over idle GPU (MiB)" in out
    assert (tmp_path / "bench-results-fixture.png").stat().st_size > 20_000
    # The charts beside the memory plot, where tools/render_results.py links them.
    stem = tmp_path / "bench-results-fixture"
    charts_drawn = [Path(f"{stem}.png"), Path(f"{stem}.asleep.png"), Path(f"{stem}.wake.png")]
    assert all(png.read_bytes()[:4] == b"\x89PNG" for png in charts_drawn)
    assert "plots:   " + ", ".join(map(str, charts_drawn)) in out
    assert (tmp_path / "bench-results-fixture.table.txt").read_text().startswith(" ")


def test_report_option_merges_runs_of_different_configs(recorded, tmp_path, capsys):
    first, second = dict(recorded), dict(recorded)
    first["configs"] = recorded["configs"][:1]
    second["configs"] = recorded["configs"][1:]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for part, path in zip([first, second], paths, strict=True):
        report.write_json(part, path)
    assert cli.main(["bench", "--report", *map(str, paths)]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [c["config"] for c in merged["configs"]] == ["ours", "stock_graphs", "stock_eager"]
    assert merged["merged_from"] == [str(p) for p in paths]
    assert "1104 (0.88x)" in capsys.readouterr().out
    assert all((tmp_path / f"merged{end}").exists() for end in (".png", ".asleep.png", ".wake.png"))
    assert cli.main(["bench", "--report", str(paths[0]), str(paths[0])]) == cli.EXIT_USAGE
    assert "'ours' is in more than one file" in capsys.readouterr().err


def test_merged_runs_keep_the_start_rounds_of_every_file(recorded):
    first, second = dict(recorded), dict(recorded)
    first["configs"], second["configs"] = recorded["configs"][:1], recorded["configs"][1:2]
    first["start_rounds"] = [{"round": 1, "config": "ours", "start_s": 60.0}]
    second["start_rounds"] = [{"round": 1, "config": "stock_graphs", "start_s": 55.0}]
    merged = runner.merge([first, second], ["a", "b"])
    assert [e["config"] for e in merged["start_rounds"]] == ["ours", "stock_graphs"]
    rounds = {n: s["start_rounds"]["start_s"] for n, s in report.summarize_all(merged).items()}
    assert rounds == {"ours": 60.0, "stock_graphs": 55.0}
    assert "start_rounds" not in runner.merge([recorded], ["a"])


@pytest.mark.parametrize("text", [json.dumps({"schema": "something-else"}), "[1, 2]", "3"])
def test_report_option_refuses_other_json(tmp_path, capsys, text):
    other = tmp_path / "x.json"
    other.write_text(text)
    assert cli.main(["bench", "--report", str(other)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vllm-graph-sleep bench: --report {other}: {other}: not a bench result")
    assert "\n" not in err


def test_report_option_writes_into_a_new_out_folder(tmp_path, capsys):
    out = tmp_path / "new" / "folder"
    assert cli.main(["bench", "--report", str(FIXTURE), "--out", str(out)]) == 0
    assert (out / "bench-results-fixture.table.txt").is_file()


def test_bench_out_that_cannot_be_a_folder_stops_with_one_line(fake_bench, tmp_path, capsys):
    argv, out = fake_bench
    taken = tmp_path / "a-file"
    taken.write_text("")
    code = cli.main([str(taken) if arg == str(out) else arg for arg in argv])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_FAILED and err.startswith(f"vllm-graph-sleep bench: --out {taken}:")
    assert "\n" not in err


def test_bench_model_that_is_not_a_model_stops_before_anything_is_written(
    fake_bench, tmp_path, capsys
):
    argv, out = fake_bench
    at = argv.index("--model") + 1
    argv[at] = str(tmp_path / "missing")
    assert cli.main(argv) == cli.EXIT_FAILED
    assert "not a model directory" in capsys.readouterr().err
    assert not out.exists()


# -- bench: the no-GPU path, in a subprocess ------------------------------------------


def test_bench_without_gpu_stops_with_one_line(tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU, so this holds on a GPU machine too.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "vllm_graph_sleep.cli", "bench", "--out", str(tmp_path / "o")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == cli.EXIT_FAILED
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("vllm-graph-sleep bench: no NVIDIA GPU")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()  # stopped before anything was made


def test_bench_reads_none_of_the_test_suites_switches():
    # The bench imports testing.models; the test suite's switches are read at
    # their first use there, so values the tests would refuse do not stop it.
    env = {
        **os.environ,
        "GRAPH_SLEEP_TEST_CYCLES": "abc",
        "GRAPH_SLEEP_TEST_VLLM_DEFAULTS": "maybe",
        "GRAPH_SLEEP_TEST_TIMEOUT": "soon",
    }
    for argv in (["bench", "--help"], ["--help"]):
        result = subprocess.run(
            [sys.executable, "-m", "vllm_graph_sleep.cli", *argv],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr


# -- bench: the driver loop against a fake server ---------------------------------------


class FakeMemory:
    """NVML stand-in: the fake server writes its simulated used bytes to a file."""

    gpus = ["Fake GPU"]

    def __init__(self, path: Path):
        self.path = path

    def used(self) -> list[int]:
        try:
            return [int(self.path.read_text())]
        except (OSError, ValueError):
            return [IDLE]


FLOOR_MIB = 300


def fake_floor_child(used: Path, code: str = "") -> list[str]:
    """Stands in for the floor's child: holds FLOOR_MIB in the fake NVML until its
    standard input closes (or runs `code` instead, to fail)."""
    hold = (
        f"import pathlib, sys; p = pathlib.Path({str(used)!r}); "
        f"p.write_text(str({IDLE} + {FLOOR_MIB * MiB})); print('warming up'); "
        f"print({floor.STACK!r} + ' 1024 0'); "
        f"print({floor.HOLDING!r}, flush=True); sys.stdin.readline(); p.unlink()"
    )
    return [sys.executable, "-c", code or hold]


@pytest.fixture
def fake_bench(tmp_path, monkeypatch):
    """Routes `vllm-graph-sleep bench` to the fake server and the fake NVML."""
    used = tmp_path / "used"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def command(name, model_dir, port, settings):
        return [sys.executable, str(FAKE_SERVER), "--port", str(port), "--config", name]

    def fake_command(name, model_dir, port, settings):
        return command(name, model_dir, port, settings) + ["--used-file", str(used)]

    monkeypatch.setattr(runner, "real_command", fake_command)
    # vllm_graph_sleep.testing sets spawn for the engine tests when imported: the
    # bench's own default (fork) is what these tests check.
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setattr(gpu, "NvmlMemory", lambda count: FakeMemory(used))
    monkeypatch.setattr(floor, "floor_command", lambda gpus: fake_floor_child(used))
    out = tmp_path / "out"
    argv = ["bench", "--model", str(model), "--out", str(out), "--cycles", "1"]
    argv += ["--decode-tokens", "8", "--max-tokens", "4"]
    return argv, out


def test_the_warm_up_and_a_model_made_on_the_cpu_run_beside_the_floor_without_a_gpu(
    fake_bench, monkeypatch, tmp_path
):
    # Both children start before the floor's and see no GPU (CUDA hidden), so
    # the floor still measures a GPU nothing else of the bench's holds.
    argv, out = fake_bench
    at = argv.index("--model")
    argv = [*argv[:at], "--cache-dir", str(tmp_path / "cache"), *argv[at + 2 :]]
    seen = {name: tmp_path / f"{name}.env" for name in ("model", "warm-up")}

    def records(path):
        seen_as = "os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')"
        return f"import os, pathlib; pathlib.Path({str(path)!r}).write_text({seen_as})"

    monkeypatch.setattr(
        runner, "model_command", lambda kind, target: [sys.executable, "-c", records(seen["model"])]
    )
    monkeypatch.setattr(model_info, "_INSPECT", records(seen["warm-up"]))
    measure = floor.measure
    running = {}

    def floor_measure(memory, env=None):
        deadline = time.monotonic() + 30
        while not all(p.exists() for p in seen.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        running.update({name: p.exists() for name, p in seen.items()})
        return measure(memory, env)

    monkeypatch.setattr(floor, "measure", floor_measure)
    assert cli.main(argv) == 0
    assert running == {"model": True, "warm-up": True}
    assert {name: p.read_text() for name, p in seen.items()} == {"model": "", "warm-up": ""}
    results = json.loads((out / "results.json").read_text())
    assert results["model"] == str((tmp_path / "cache" / "llama").resolve())
    assert results["model_info_warm"] == "done" and "error" not in results["floor"]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is not running
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("stop", ["interrupt", "floor_fails"])
def test_a_bench_stopped_before_its_first_server_leaves_no_child_running(
    fake_bench, monkeypatch, tmp_path, stop
):
    """SIGTERM (a KeyboardInterrupt in bench) or a failure while the floor is
    measured: the model's maker (a large kind draws on the GPU) and the
    model-info warm-up must not outlive the run."""
    argv, _ = fake_bench
    at = argv.index("--model")
    argv = [*argv[:at], "--cache-dir", str(tmp_path / "cache"), *argv[at + 2 :]]
    pids = {name: tmp_path / f"{name}.pid" for name in ("model", "warm-up")}

    def sleeps(path):
        writes_pid = f"pathlib.Path({str(path)!r}).write_text(str(os.getpid()))"
        return f"import os, pathlib, time; {writes_pid}; time.sleep(60)"

    monkeypatch.setattr(
        runner, "model_command", lambda kind, target: [sys.executable, "-c", sleeps(pids["model"])]
    )
    monkeypatch.setattr(model_info, "_INSPECT", sleeps(pids["warm-up"]))

    def floor_measure(memory, env=None):
        deadline = time.monotonic() + 30
        while not all(p.exists() and p.read_text() for p in pids.values()):
            assert time.monotonic() < deadline, "the children did not start"
            time.sleep(0.05)
        if stop == "interrupt":
            raise KeyboardInterrupt
        raise runner.BenchError("the floor's child failed")

    monkeypatch.setattr(floor, "measure", floor_measure)
    try:
        assert cli.main(argv) != 0
        assert {name: _running(int(p.read_text())) for name, p in pids.items()} == {
            "model": False,
            "warm-up": False,
        }
    finally:
        for path in pids.values():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(path.read_text()), signal.SIGKILL)


def test_the_bench_warms_the_models_architecture_before_the_first_server(fake_bench, monkeypatch):
    argv, out = fake_bench
    model = argv[argv.index("--model") + 1]
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump({"architectures": ["SomeForCausalLM"]}, f)
    seen = out.parent / "warmed"
    monkeypatch.setattr(
        model_info,
        "_INSPECT",
        f"import sys; open({str(seen)!r}, 'w').write(sys.argv[1])",
    )
    assert cli.main(argv) == 0
    assert seen.read_text() == "SomeForCausalLM"
    results = json.loads((out / "results.json").read_text())
    assert results["model_info_warm"] == "done"
    table = (out / "table.txt").read_text()
    assert "and vLLM's model-info cache warmed before the first" in table


def test_bench_end_to_end_against_the_fake_server(fake_bench, capsys):
    argv, out = fake_bench
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "asleep L1, over idle GPU (MiB)" in captured.out
    assert "[ours] 4/4 level 2, staged wake" in captured.err  # progress
    assert "[stock_eager] reference tokens repeat before any sleep: yes" in captured.err
    assert table_row(captured.out, "same tokens twice before any sleep") == ["yes"] * 3
    assert "  measured again, still before (tok/s)" in captured.out
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == report.SCHEMA
    by_name = {c["config"]: c for c in results["configs"]}
    assert list(by_name) == ["ours", "stock_graphs", "stock_eager"]
    for record in by_name.values():
        assert [(s["level"], s["wake"]) for s in record["steps"]] == [
            (1, "full"),
            (1, "staged"),
            (2, "full"),
            (2, "staged"),
        ]
        assert all(s["bit_exact"] and s["is_sleeping_asleep"] for s in record["steps"])
        # Asleep from the sleep's answer to the wake's call: at least one memory reading apart.
        assert all(s["asleep_s"] >= 0.1 for s in record["steps"])
        # The reference and its repeat each ran after a prefix cache reset, as after a wake.
        assert record["reference_repeat"] == {"bit_exact": True}
        assert record["prefix_cache_reset"] == {"before_reference": True, "before_repeat": True}
        server_log = (out / f"{record['config']}.server.log").read_text()
        assert server_log.count('"POST /reset_prefix_cache ') == 2
        # Only the warm-up sends every prompt in one request; the reference, its repeat,
        # the check after each of the 4 wakes (and decode) send one request per prompt.
        shapes = re.findall(r"completion of (\d+) prompt", server_log)
        prompts = len(results["settings"]["prompts"])
        assert shapes[0] == str(prompts) and set(shapes[1:]) == {"1"}
        assert len(shapes) - 1 >= (2 + 4) * prompts
        assert record["decode_before_again"]["tokens_per_s"] > 0
        assert not any(s["is_sleeping_awake"] for s in record["steps"])
        assert all(s["is_sleeping_staged"] for s in record["steps"] if s["wake"] == "staged")
        assert record["after_stop_used_bytes"] == [IDLE]
        assert record["server_exit_code"] is not None
        assert record["awake_report"][0]["tags"]["weights"]["mapped"] == 200 * MiB
        assert record["samples"]["t"] and record["events"][0]["kind"] == "ready"
        server_log = (out / f"{record['config']}.server.log").read_text()
        assert server_log.startswith("$ ")
        # By default one start per configuration, the measured one, its engine core forked.
        assert record["warm_up_start_s"] == [] and not list(out.glob("*.warm-start-*"))
        assert "fake-vllm: engine core started by fork" in server_log
        assert record["log"] == str(out / f"{record['config']}.server.log")
        assert record["ready_t"] <= record["start_s"] + 0.2
        # vLLM's own figure for its engine core, read from the server log.
        compile_s = 0.0 if record["config"] == "stock_eager" else 1.25
        assert record["engine_init"] == {"engine_init_s": 6.5, "compile_s": compile_s}
    assert "engine core init, vLLM's log (s)" in captured.out
    assert "engine start: each configuration's first start in this run" in captured.out
    assert results["engine_core_start"] == "fork"
    # Said before it starts, how long the run will take; recorded with how long it took.
    assert "this run takes about" in captured.err.splitlines()[1]
    assert "3 configuration(s), 3 `vllm serve` start(s)" in captured.err
    assert results["estimate_s"] == round(estimate.estimate_s(bench_settings(argv[1:]), False), 1)
    assert 0 < results["duration_s"] < 600
    assert f"measured in {estimate.minutes(results['duration_s'])}" in captured.err
    # The floor, measured once before the first server, and let go before it started.
    assert results["floor"]["used_bytes"] == [IDLE + FLOOR_MIB * MiB]
    assert results["floor"]["baseline_used_bytes"] == [IDLE]
    assert results["floor"]["stack_limit_before_after"] == [[1024, 0]]
    assert by_name["ours"]["baseline_used_bytes"] == [IDLE]
    assert f"{floor.WHAT}): {FLOOR_MIB} MiB over the idle GPU" in captured.out
    summary = results["summary"]
    assert all(min(summary[c]["asleep_before_wake_ms"].values()) >= 100 for c in by_name)
    assert "asleep before the wake, L2 (ms)" in captured.out
    assert summary["ours"]["asleep_mib"]["1"] == [400]  # graphs offloaded
    assert summary["stock_graphs"]["asleep_mib"]["1"] == [900]  # graphs stay
    assert summary["ours"]["tags_awake_mib"]["cudagraph"] == [500]
    # Pinned host memory as torch holds it (powers of two), and the first sleep's pinning.
    assert "pinned host memory at L1 (MiB)" in captured.out
    assert summary["ours"]["pinned_host_mib"]["1"] == [4 + 1024]  # 700 MiB backed up
    assert summary["stock_graphs"]["pinned_host_mib"]["1"] == [4 + 256]  # 200 MiB of weights
    for name in by_name:
        assert summary[name]["first_sleep_pinning_ms"] == [pytest.approx(50)]
    # The probe's ledger at every sleep, side by side: ours gives the stack back.
    assert "asleep L1: stack reservation (MiB)" in captured.out
    stacks = [summary[c]["ledger_asleep"]["1"][0]["stack_reservation"] for c in by_name]
    assert stacks == [0, 264 * MiB, 264 * MiB]
    for png in ("memory.png", "asleep.png", "wake.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plots:   {out / 'memory.png'}, {out / 'asleep.png'}, {out / 'wake.png'}" in (
        captured.out
    )
    assert (out / "table.txt").read_text() in captured.out


def test_the_switches_the_servers_inherit_are_recorded_and_printed(fake_bench, capsys, monkeypatch):
    # A run with coded weight backups measures something else than one without:
    # its results and its table say so.
    from vllm_graph_sleep.allocator import SWITCH_ENVS

    argv, out = fake_bench
    for name in SWITCH_ENVS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS", "1")
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_HOST_BUFFERS", "torch")
    assert cli.main([*argv, "--configs", "ours"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["switches"] == {
        "VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS": "1",
        "VLLM_GRAPH_SLEEP_HOST_BUFFERS": "torch",
    }
    assert (
        "switches: VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1, VLLM_GRAPH_SLEEP_HOST_BUFFERS=torch"
        in capsys.readouterr().out
    )


def test_recording_the_switches_leaves_torch_out_of_the_benchs_own_process():
    # Importing torch there was most of the 3.5 s run 17 spent between the warm-up
    # and its first server on the H200.
    code = (
        "import sys\n"
        "from vllm_graph_sleep.bench import runner\n"
        "assert runner.switches_set({'VLLM_GRAPH_SLEEP_HOST_BUFFERS': 'torch'})\n"
        "sys.exit('torch' in sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_ours_with_coded_and_raw_backups_are_configurations_of_their_own(
    fake_bench, capsys, monkeypatch
):
    # Coded backups trade a little sleep for a faster wake: one bench runs ours
    # both ways beside stock, the switch set for each server alone.
    from vllm_graph_sleep.allocator import COMPRESS_BACKUPS_ENV, SWITCH_ENVS
    from vllm_graph_sleep.bench.server import CONFIG_ENV

    assert CONFIG_ENV["ours_coded"] == {COMPRESS_BACKUPS_ENV: "1"}
    assert CONFIG_ENV["ours_raw"] == {COMPRESS_BACKUPS_ENV: "0"}
    argv, out = fake_bench
    for name in SWITCH_ENVS:
        monkeypatch.delenv(name, raising=False)
    assert cli.main([*argv, "--configs", "ours,ours_coded,ours_raw,stock_graphs"]) == 0
    captured = capsys.readouterr().out
    header = captured.splitlines()[0]
    assert "ours, coded backups" in header and "ours, raw backups" in header
    assert table_row(captured, "bit-exact after wake") == ["4/4"] * 4
    results = json.loads((out / "results.json").read_text())
    configs = ["ours", "ours_coded", "ours_raw", "stock_graphs"]
    assert [c["config"] for c in results["configs"]] == configs
    assert "switches" not in captured and results["switches"] == {}
    logs = {name: (out / f"{name}.server.log").read_text() for name in configs[:3]}
    assert "weight backups coded" in logs["ours"] and "weight backups coded" in logs["ours_coded"]
    assert "weight backups raw" in logs["ours_raw"]


def test_ours_with_every_sleep_checkpointed_is_a_configuration_of_its_own(fake_bench, capsys):
    # Issue 39: ours_deep asks for the driver's checkpoint at every sleep; asleep
    # the fake then holds nothing over the idle GPU, and the probe is not asked.
    argv, out = fake_bench
    assert cli.main([*argv, "--configs", "ours,ours_deep,stock_graphs"]) == 0
    captured = capsys.readouterr().out
    assert "ours, checkpointed" in captured.splitlines()[0]
    assert table_row(captured, "bit-exact after wake") == ["4/4"] * 3
    results = json.loads((out / "results.json").read_text())
    deep = next(c for c in results["configs"] if c["config"] == "ours_deep")
    ours = next(c for c in results["configs"] if c["config"] == "ours")
    assert all(s["asleep_used_bytes"] == [IDLE] for s in deep["steps"])  # one per GPU
    assert all(s["asleep_used_bytes"][0] > IDLE for s in ours["steps"])
    assert all(s["asleep_report"] is None and s["is_sleeping_asleep"] for s in deep["steps"])
    assert all(s["asleep_report"] for s in ours["steps"])


@pytest.mark.parametrize(
    ("status", "body", "answer"),
    [
        (200, b'{"success": true}', True),
        (200, b'{"success": false}', False),  # vLLM still held blocks
        (404, b'{"detail": "Not Found"}', "POST /reset_prefix_cache answered 404"),
        (200, b"", 'POST /reset_prefix_cache answered None, not {"success": ...}'),
    ],
)
def test_client_reset_prefix_cache(status, body, answer):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            assert self.path == "/reset_prefix_cache"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = Client(f"http://127.0.0.1:{server.server_port}", "ours", lambda: "server log: x")
        if isinstance(answer, bool):
            assert client.reset_prefix_cache() is answer
        else:
            with pytest.raises(ServerError, match=answer) as raised:
                client.reset_prefix_cache()
            assert str(raised.value).startswith("[ours] ")
            assert str(raised.value).endswith("; server log: x")
    finally:
        server.shutdown()
        server.server_close()


def test_a_health_answer_without_a_valid_status_line_is_waited_past(tmp_path):
    """A /health poll whose answer is no HTTP (a broken status line: an
    HTTPException, not an OSError) is one more "not healthy yet", as a refused
    connection is, not a traceback out of the bench."""
    from vllm_graph_sleep.bench.server import Server

    class Handler(BaseHTTPRequestHandler):
        polls = 0

        def do_GET(self):  # noqa: N802
            Handler.polls += 1
            if Handler.polls == 1:
                self.wfile.write(b"not http at all\r\n\r\n")
                return
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    server = Server("x", [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "l")
    server.start(f"http://127.0.0.1:{http.server_port}")
    try:
        assert server.wait_healthy(timeout=30) < 30
        assert Handler.polls == 2
    finally:
        server.process.kill()
        server.process.wait()
        http.shutdown()
        http.server_close()


def test_engine_init_is_read_from_vllms_log_the_slowest_core_counts(tmp_path):
    from vllm_graph_sleep.bench.server import Server

    log = tmp_path / "server.log"
    server = Server("x", ["true"], {}, log)
    assert server.engine_init() is None  # no log yet
    line = "init engine (profile, create kv cache, warmup model) took {} s{}\n"
    log.write_text(line.format("13.61", " (compilation: 2.13 s)") + line.format("6.29", ""))
    assert server.engine_init() == {"engine_init_s": 13.61, "compile_s": 2.13}
    # With an encoder vLLM names the parts after the total.
    encoder = " (compilation: 20.10 s \u2014 language_model: 12.00 s, encoder: 8.10 s)"
    log.write_text(line.format("31.50", encoder))
    assert server.engine_init() == {"engine_init_s": 31.5, "compile_s": 20.1}


def test_a_floor_that_cannot_be_measured_is_said_and_the_bench_goes_on(
    fake_bench, monkeypatch, capsys
):
    argv, out = fake_bench
    failing = fake_floor_child(
        Path("unused"), "print('CUDA error: no device'); raise SystemExit(4)"
    )
    monkeypatch.setattr(floor, "floor_command", lambda gpus: failing)
    assert cli.main([*argv, "--configs", "ours", "--levels", "1"]) == 0
    line = "not measured: the floor's child process exited with code 4: CUDA error: no device"
    assert line in capsys.readouterr().out
    assert "error" in json.loads((out / "results.json").read_text())["floor"]


def test_a_floor_child_that_never_gets_ready_is_stopped_after_the_timeout(tmp_path, monkeypatch):
    used = tmp_path / "used"
    waits = fake_floor_child(used, "import sys; print('loading CUDA'); sys.stdin.readline()")
    monkeypatch.setattr(floor, "floor_command", lambda gpus: waits)
    started = time.monotonic()
    measured = floor.measure(FakeMemory(used), timeout=1)
    assert measured["error"] == "the floor's child process not ready after 1 s"
    assert time.monotonic() - started < 15  # stopped, not waited for


def test_a_floor_child_saying_nonsense_is_an_error_not_a_crash(tmp_path, monkeypatch):
    says = fake_floor_child(tmp_path / "used", f"print({floor.STACK!r} + ' lots')")
    monkeypatch.setattr(floor, "floor_command", lambda gpus: says)
    measured = floor.measure(FakeMemory(tmp_path / "used"), timeout=30)
    assert measured["error"].startswith("the floor's child process said")


def test_the_floor_waits_until_its_child_has_given_the_memory_back(tmp_path, monkeypatch):
    # The driver frees an exited process's memory a moment later.
    used = tmp_path / "used"
    frees_later = f"import time, pathlib; time.sleep(1.5); pathlib.Path({str(used)!r}).unlink()"
    lags = (
        f"import pathlib, subprocess, sys; p = pathlib.Path({str(used)!r}); "
        f"p.write_text(str({IDLE} + {FLOOR_MIB * MiB})); print({floor.HOLDING!r}, flush=True); "
        f"sys.stdin.readline(); subprocess.Popen([sys.executable, '-c', {frees_later!r}])"
    )
    monkeypatch.setattr(floor, "floor_command", lambda gpus: fake_floor_child(used, lags))
    memory = FakeMemory(used)
    assert floor.measure(memory)["used_bytes"] == [IDLE + FLOOR_MIB * MiB]
    assert memory.used() == [IDLE]  # back before the first server's baseline


def test_bench_without_matplotlib_says_how_to_get_the_plots_in_one_line(
    fake_bench, monkeypatch, capsys
):
    argv, out = fake_bench
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert cli.main([*argv, "--configs", "ours", "--levels", "1", "--no-floor"]) == 0
    printed = capsys.readouterr().out
    (line,) = [line for line in printed.splitlines() if line.startswith("plots:")]
    assert line == f"plots:   {plot.MATPLOTLIB_MISSING}"
    assert "pip install 'vllm-graph-sleep[bench]'" in line
    assert (out / "results.json").is_file() and (out / "table.txt").is_file()
    assert not list(out.glob("*.png"))
    # A recorded run's table still prints, with the same line instead of the plots.
    assert cli.main(["bench", "--report", str(out / "results.json")]) == 0
    assert "plots:   matplotlib is not installed" in capsys.readouterr().out


def test_bench_without_the_floor(fake_bench, capsys):
    argv, out = fake_bench
    assert cli.main([*argv, "--configs", "ours", "--levels", "1", "--no-floor"]) == 0
    assert "floor (" not in capsys.readouterr().out
    assert "floor" not in json.loads((out / "results.json").read_text())


def test_bench_without_warm_starts_measures_the_first_start(fake_bench, capsys):
    argv, out = fake_bench
    assert cli.main([*argv, "--configs", "ours", "--warm-starts", "0"]) == 0
    assert "engine start, first of the run" not in capsys.readouterr().out
    (record,) = json.loads((out / "results.json").read_text())["configs"]
    assert record["warm_up_start_s"] == []
    assert not list(out.glob("*.warm-start-*"))


def test_bench_warm_starts_measure_the_start_with_warm_caches(fake_bench, capsys):
    argv, out = fake_bench
    argv += ["--configs", "ours", "stock_eager", "--levels", "1", "--no-floor"]
    assert cli.main([*argv, "--warm-starts", "2"]) == 0
    captured = capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    for record in results["configs"]:
        # Two warm-up starts per configuration, each with its own log, before the measured one.
        assert len(record["warm_up_start_s"]) == 2 and min(record["warm_up_start_s"]) > 0
        for number in (1, 2):
            warm_log = out / f"{record['config']}.warm-start-{number}.server.log"
            assert warm_log.read_text().startswith("$ ")
        assert record["log"] == str(out / f"{record['config']}.server.log")
        # Samples and events count from the measured start, not from the warm-up's.
        assert record["ready_t"] <= record["start_s"] + 0.2
    assert "engine start, first of the run (s)" in captured.out
    assert "engine start: after 2 warm-up start(s) of the same configuration" in captured.out
    assert "2 configuration(s), 6 `vllm serve` start(s)" in captured.err


def test_bench_says_what_a_starting_server_does_while_it_waits(fake_bench, monkeypatch, capsys):
    argv, out = fake_bench
    monkeypatch.setattr(server, "PROGRESS_EVERY_S", 0.2)
    monkeypatch.setenv("FAKE_START_DELAY", "1.5")
    argv += ["--configs", "ours", "--levels", "1", "--wakes", "full", "--no-floor"]
    assert cli.main(argv) == 0
    waits = [line for line in capsys.readouterr().err.splitlines() if "waiting for" in line]
    # The fake logs vLLM's "init engine ... took" line, then keeps /health at 503.
    assert len(waits) >= 3, waits
    assert all(
        re.search(r"\] \[ours\] waiting for /health: \d+ s \(vLLM: starting the HTTP server\)$", w)
        for w in waits
    ), waits


VLLM_START = """\
$ python -m vllm.entrypoints.cli.main serve /m --port 1
(APIServer pid=1) INFO 12-01 22:21:12 [api_utils.py:273] non-default args: {'model': '/m'}
(APIServer pid=1) INFO 12-01 22:21:12 [model.py:623] Resolved architecture: LlamaForCausalLM
(EngineCore pid=2) INFO 12-01 22:21:27 [core.py:116] Initializing a V1 LLM engine (v0.26.0) with
(EngineCore pid=2) INFO 12-01 22:21:29 [model_runner.py:284] Loading model from scratch...
(EngineCore pid=2) INFO 12-01 22:21:31 [model_runner.py:305] Model loading took 0.19 GiB and 2.4 s
(EngineCore pid=2) INFO 12-01 22:21:43 [monitor.py:53] torch.compile took 11.57 s in total
(EngineCore pid=2) INFO 12-01 22:21:45 [gpu_worker.py:560] Available KV cache memory: 41.26 GiB
(EngineCore pid=2) INFO 12-01 22:21:47 [model_runner.py:747] Graph capturing finished in 2 secs
(EngineCore pid=2) INFO 12-01 22:21:59 [core.py:340] init engine (profile, create kv cache, \
warmup model) took 27.85 s (compilation: 11.57 s)
(APIServer pid=1) INFO:     Application startup complete.
"""


def test_the_phase_of_a_server_log_is_that_of_its_last_known_line():
    lines = VLLM_START.splitlines()
    seen = [phases.phase_of("\n".join(lines[: n + 1])) for n in range(len(lines))]
    assert seen == [
        phases.IMPORTING,
        "inspecting the model",
        "starting the engine core",
        "initializing the engine",
        "loading the weights",
        "first forward pass (torch.compile unless eager)",
        "profiling memory",
        "allocating the KV cache, capturing CUDA graphs",
        "warming up kernels (Triton JIT)",
        "starting the HTTP server",
        "answering /health",
    ]
    # Lines a phase does not know leave the phase as it was; the V1 runner's load line counts.
    resolved = "\n".join(lines[:3])
    assert phases.phase_of(resolved + "\nsomething else\n") == "starting the engine core"
    assert phases.phase_of("[gpu_model_runner.py] Starting to load model /m...") == (
        "loading the weights"
    )


def test_the_phase_of_a_log_not_written_yet_is_the_import(tmp_path):
    assert phases.phase_of_log(tmp_path / "none.log") == phases.IMPORTING


def test_the_estimate_counts_every_start_and_step():
    default = bench_settings([])
    assert estimate.server_starts(default) == 3
    base = estimate.estimate_s(default, model_to_make=False)
    # The model is made beside the floor and the model-info warm-up.
    prepared = max(estimate.FLOOR_S, estimate.MODEL_INFO_S, estimate.MODEL_S)
    assert estimate.estimate_s(default, model_to_make=True) - base == prepared - max(
        estimate.FLOOR_S, estimate.MODEL_INFO_S
    )
    large = bench_settings(["--model-kind", "llama_8b"])  # drawn on the GPU, after the floor
    assert estimate.preparation_s(large, True) == max(
        estimate.MODEL_INFO_S, estimate.FLOOR_S + estimate.MODEL_S
    )
    # ours compiles; stock with graphs loads what it compiled; eager compiles nothing.
    assert estimate.starts_s(default) == (
        estimate.COMPILING_START_S + estimate.START_S + estimate.EAGER_START_S + 3 * estimate.STOP_S
    )
    warm = bench_settings(["--warm-starts", "2", "--start-rounds", "1"])
    assert estimate.server_starts(warm) == 12
    assert estimate.starts_s(warm) - estimate.starts_s(default) == 3 * (
        2 * estimate.START_S + estimate.EAGER_START_S + 3 * estimate.STOP_S
    )
    assert estimate.estimate_s(warm, False) - base == (
        estimate.starts_s(warm) - estimate.starts_s(default)
    )
    one = bench_settings(["--configs", "ours", "--cycles", "1", "--no-floor"])
    fixed, per_step = estimate.OTHER_MEASURE_S
    assert estimate.estimate_s(one, False) == (
        estimate.MODEL_INFO_S + estimate.COMPILING_START_S + estimate.STOP_S + fixed + 4 * per_step
    )
    assert "3 `vllm serve` start(s) of about 55 s each" in estimate.describe(default, True)
    assert [estimate.minutes(s) for s in (44.6, 60, 245.2)] == ["45 s", "1 min 00 s", "4 min 05 s"]


def test_bench_start_rounds_alternate_and_report_medians(fake_bench, capsys):
    argv, out = fake_bench
    argv += ["--configs", "ours", "stock_graphs", "--levels", "1", "--no-floor"]
    assert cli.main([*argv, "--warm-starts", "0", "--start-rounds", "2"]) == 0
    printed = capsys.readouterr()
    table = printed.out
    assert "[stock_graphs] start round 2 of 2" in printed.err
    rounds = json.loads((out / "results.json").read_text())["start_rounds"]
    # Every configuration takes every place: the order turns from round to round.
    assert [(e["round"], e["config"]) for e in rounds] == [
        (1, "ours"),
        (1, "stock_graphs"),
        (2, "stock_graphs"),
        (2, "ours"),
    ]
    assert all(e["start_s"] > 0 and e["engine_init"]["engine_init_s"] == 6.5 for e in rounds)
    assert (out / "stock_graphs.start-round-2.server.log").is_file()
    assert "engine start, median of 2 alternating (s)" in table
    assert "engine core init, median of 2 alternating (s)" in table


def test_bench_start_round_that_fails_is_recorded_and_reported(fake_bench, monkeypatch, capsys):
    argv, out = fake_bench
    healthy_once = runner.real_command

    def fails_in_the_rounds(name, model_dir, port, settings):
        if (out / "ours.server.log").is_file():  # the configuration's own run is over
            return [sys.executable, "-c", "import sys; sys.exit(5)"]
        return healthy_once(name, model_dir, port, settings)

    monkeypatch.setattr(runner, "real_command", fails_in_the_rounds)
    argv += ["--configs", "ours", "--levels", "1", "--no-floor", "--warm-starts", "0"]
    assert cli.main([*argv, "--start-rounds", "1"]) == cli.EXIT_FAILED
    assert "[ours] vllm serve exited with code 5 before it was healthy" in _one_line_failure(capsys)
    (entry,) = json.loads((out / "results.json").read_text())["start_rounds"]
    assert entry["config"] == "ours" and "exited with code 5" in entry["error"]


def test_bench_without_start_rounds_shows_no_alternating_rows(fake_bench, capsys):
    argv, out = fake_bench
    assert cli.main([*argv, "--configs", "ours", "--levels", "1", "--no-floor"]) == 0
    assert "alternating" not in capsys.readouterr().out
    assert "start_rounds" not in json.loads((out / "results.json").read_text())


def _one_line_failure(capsys) -> str:
    return _failure_line(capsys.readouterr().err)


def _failure_line(err: str) -> str:
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("vllm-graph-sleep bench: ")
    return last


@pytest.mark.parametrize(
    ("warm_starts", "first_log"), [("0", "ours.server.log"), ("2", "ours.warm-start-1.server.log")]
)
def test_bench_server_that_does_not_start(fake_bench, monkeypatch, capsys, warm_starts, first_log):
    argv, out = fake_bench
    monkeypatch.setattr(
        runner,
        "real_command",
        lambda *a: [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"],
    )
    assert cli.main([*argv, "--warm-starts", warm_starts]) == cli.EXIT_FAILED
    line = _one_line_failure(capsys)
    log = out / first_log  # the first start is the one that failed
    assert "[ours] vllm serve exited with code 3 before it was healthy" in line
    assert line.endswith(f"server log: {log}")
    assert "no such model" in log.read_text()
    partial = json.loads((out / "results.json").read_text())
    assert partial["configs"][0]["error"] in line
    assert partial["duration_s"] > 0  # the time so far, recorded with what was measured
    assert (
        partial["configs"][0]["log"] == str(log) and partial["configs"][0]["warm_up_start_s"] == []
    )


def test_bench_server_that_dies_is_reported_and_stopped(fake_bench, monkeypatch, capsys):
    argv, out = fake_bench
    monkeypatch.setenv("FAKE_DIE_ON_SLEEP", "1")
    assert cli.main(argv) == cli.EXIT_FAILED
    line = _one_line_failure(capsys)
    assert "[ours] POST /sleep?level=1 failed" in line
    assert line.endswith(f"server log: {out / 'ours.server.log'}")


def test_bench_server_never_healthy_is_killed(fake_bench, monkeypatch, capsys):
    argv, out = fake_bench
    monkeypatch.setenv("FAKE_START_DELAY", "60")
    assert cli.main([*argv, "--start-timeout", "1"]) == cli.EXIT_FAILED
    line = _one_line_failure(capsys)
    assert "[ours] vllm serve was not healthy after 1 s (--start-timeout)" in line
    record = json.loads((out / "results.json").read_text())["configs"][0]
    assert record["server_exit_code"] is not None  # stopped, not left running


def test_bench_engine_that_fails_to_start_is_reported_without_waiting(
    fake_bench, monkeypatch, capsys
):
    argv, out = fake_bench
    monkeypatch.setenv("FAKE_ENGINE_FAILS", "1")
    started = time.monotonic()
    assert cli.main([*argv, "--start-timeout", "120"]) == cli.EXIT_FAILED
    assert time.monotonic() - started < 60
    line = _one_line_failure(capsys)
    assert "[ours] vllm serve's engine failed to start: RuntimeError: Worker failed" in line
    assert line.endswith(f"server log: {out / 'ours.server.log'}")
    record = json.loads((out / "results.json").read_text())["configs"][0]
    assert record["server_exit_code"] is not None  # stopped, not left hanging


def test_bench_tokens_that_differ_fail_the_run(fake_bench, monkeypatch, capsys):
    argv, out = fake_bench
    monkeypatch.setenv("FAKE_CORRUPT", "1")
    assert cli.main([*argv, "--configs", "ours", "--levels", "1"]) == cli.EXIT_NOT_EXACT
    printed = capsys.readouterr()
    assert table_row(printed.out, "same tokens twice before any sleep") == ["yes"]
    assert "warning" not in printed.err
    line = _failure_line(printed.err)
    assert line.endswith("differ from before the first sleep in: ours")
    record = json.loads((out / "results.json").read_text())["configs"][0]
    assert record["reference_repeat"] == {"bit_exact": True}
    step = record["steps"][0]
    assert step["bit_exact"] is False and step["mismatch"]["first_token"] == 0


def test_bench_server_that_is_not_deterministic_is_named_in_the_verdict(
    fake_bench, monkeypatch, capsys
):
    argv, out = fake_bench
    monkeypatch.setenv("FAKE_NONDETERMINISTIC", "1")
    argv += ["--configs", "ours", "stock_graphs", "--levels", "1", "--no-floor"]
    assert cli.main(argv) == cli.EXIT_NOT_EXACT
    printed = capsys.readouterr()
    assert "[ours] reference tokens repeat before any sleep: NO (prompt 0, token 3)" in printed.err
    assert table_row(printed.out, "same tokens twice before any sleep") == ["NO", "NO"]
    assert table_row(printed.out, "bit-exact after wake") == ["0/2", "DIFFER", "0/2", "DIFFER"]
    line = _failure_line(printed.err)
    assert line.endswith(
        "differ from before the first sleep in: ours, stock_graphs; of these, ours, "
        "stock_graphs also gave different tokens for the same prompts twice before any sleep "
        "(not deterministic on this model), so their differences after wake neither show nor "
        "rule out corruption by sleep"
    )
    for record in json.loads((out / "results.json").read_text())["configs"]:
        assert record["reference_repeat"]["bit_exact"] is False
        assert record["reference_repeat"]["mismatch"]["first_token"] == 3
        # Still as strict after a wake: every step against the reference.
        assert not any(step["bit_exact"] for step in record["steps"])


@pytest.mark.parametrize("refused", [2, 100])
def test_a_refused_prefix_cache_reset_is_retried_then_said(
    fake_bench, monkeypatch, capsys, refused
):
    """vLLM refuses a reset while blocks are held: the bench asks again, and says
    so when it never got one."""
    from vllm_graph_sleep.bench import scenario

    argv, out = fake_bench
    monkeypatch.setattr(scenario, "PREFIX_CACHE_RESET_RETRY_S", 0.0)
    monkeypatch.setenv("FAKE_RESETS_REFUSED", str(refused))
    argv += ["--configs", "ours", "--levels", "1", "--no-floor"]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().err
    record = json.loads((out / "results.json").read_text())["configs"][0]
    asks = (out / "ours.server.log").read_text().count('"POST /reset_prefix_cache ')
    attempts = scenario.PREFIX_CACHE_RESET_ATTEMPTS
    if refused < attempts:
        assert record["prefix_cache_reset"] == {"before_reference": True, "before_repeat": True}
        assert asks == refused + 2 and "prefix cache not reset" not in printed
    else:
        assert record["prefix_cache_reset"] == {"before_reference": False, "before_repeat": False}
        assert asks == 2 * attempts
        assert f"prefix cache not reset after {attempts} attempts" in printed


# -- doctor ----------------------------------------------------------------------------


def run_doctor(capsys, *argv: str) -> tuple[int, str]:
    code = doctor.main(list(argv))
    return code, capsys.readouterr().out


def line_of(out: str, label: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(label))


ACTIVE = ("m", "--enable-sleep-mode", "--sleep-mode-offload-cudagraph")


@pytest.fixture(autouse=True)
def _clean_doctor_env(monkeypatch):
    for name in (
        "NCCL_GRAPH_REGISTER",
        "NCCL_NVLS_ENABLE",
        "VLLM_FLASHINFER_ALLREDUCE_BACKEND",
        "VLLM_ROCM_USE_AITER",
        "VLLM_PLUGINS",
        "VLLM_USE_V2_MODEL_RUNNER",
        "VLLM_SERVER_DEV_MODE",
    ):
        monkeypatch.delenv(name, raising=False)
    for name in (*SWITCH_ENVS, HOST_BUFFERS_ENV, ASLEEP_WAIT_ENV, MAX_HELD_ENV):
        monkeypatch.delenv(name, raising=False)


def test_doctor_split_args():
    assert doctor.split_args(["serve", "m", "--platform", "rocm", "-tp", "2"]) == (
        "rocm",
        ["m", "-tp", "2"],
        False,
    )
    assert doctor.split_args(["--platform=cuda", "--help"]) == ("cuda", [], True)
    assert doctor.split_args(["m"]) == (None, ["m"], False)
    with pytest.raises(doctor.DoctorUsageError, match="choose one of"):
        doctor.split_args(["--platform", "tpu"])
    with pytest.raises(doctor.DoctorUsageError, match="needs a value"):
        doctor.split_args(["--platform"])


def test_doctor_active_on_cuda(capsys):
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE, "-tp", "2")
    assert code == 0, out
    assert line_of(out, "graph offload").split()[2] == "ACTIVE:"
    assert "keeps cudagraph, default, runtime, weights; drops kv_cache" in line_of(out, "  level 1")
    assert "keeps cudagraph, default, runtime; drops kv_cache, weights" in line_of(out, "  level 2")
    assert "0 (set by the plugin" in line_of(out, "NCCL_GRAPH_REGISTER")
    assert "copy-in under capture" in line_of(out, "custom all-reduce")
    assert "vllm 0.26.0" in line_of(out, "versions")
    assert line_of(out, "verdict").split()[-1] == "OK"


def test_doctor_additional_config_turns_it_on_too(capsys):
    extra = '{"sleep_mode_offload_cudagraph": true}'
    code, out = run_doctor(
        capsys, "--platform", "cuda", "m", "--enable-sleep-mode", "--additional-config", extra
    )
    assert code == 0 and "ACTIVE" in line_of(out, "graph offload")


def test_doctor_not_requested_is_stock_and_fine(capsys):
    code, out = run_doctor(capsys, "--platform", "cuda", "m", "--enable-sleep-mode")
    assert code == 0
    assert "not requested" in line_of(out, "graph offload")
    assert "CUDA graphs stay on the GPU (stock)" in line_of(out, "  level 1")
    assert "unset: NCCL's default" in line_of(out, "NCCL_GRAPH_REGISTER")


def test_doctor_flag_without_sleep_mode(capsys):
    code, out = run_doctor(capsys, "--platform", "cuda", "m", "--sleep-mode-offload-cudagraph")
    assert code == 1
    assert "OFF: sleep mode is off" in line_of(out, "graph offload")
    assert "fix: add --enable-sleep-mode" in out
    assert "CANNOT WORK" in line_of(out, "verdict")


def test_doctor_flag_with_enforce_eager(capsys):
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE, "--enforce-eager")
    assert code == 1
    assert line_of(out, "CUDA graphs").split()[2:] == ["off:", "--enforce-eager"]
    assert "fix: drop --enforce-eager" in out
    for level in ("  level 1", "  level 2"):
        assert "no CUDA graphs" in line_of(out, level)
        assert "stay on the GPU" not in line_of(out, level)


@pytest.mark.parametrize(
    "args",
    [
        ("-O0", "-cc.cudagraph_mode=PIECEWISE"),  # PIECEWISE needs compilation; -O0 has none
        ("--compilation-config", '{"mode": 0}'),
    ],
)
def test_doctor_follows_vllms_resolution_of_graphs(capsys, args):
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE, *args)
    assert code == 1, out
    assert "vLLM resolves cudagraph_mode to NONE" in line_of(out, "CUDA graphs")
    assert line_of(out, "graph offload").split()[2] == "OFF:"


def test_doctor_full_decode_only_needs_no_compilation(capsys):
    code, out = run_doctor(
        capsys, "--platform", "cuda", *ACTIVE, "-O0", "-cc.cudagraph_mode=FULL_DECODE_ONLY"
    )
    assert code == 0, out
    assert "ACTIVE" in line_of(out, "graph offload")


def test_doctor_explicit_no_flag_wins_over_additional_config(capsys):
    extra = '{"sleep_mode_offload_cudagraph": true}'
    code, out = run_doctor(
        capsys,
        "--platform",
        "cuda",
        "m",
        "--enable-sleep-mode",
        "--additional-config",
        extra,
        "--no-sleep-mode-offload-cudagraph",
    )
    assert code == 0
    assert "not requested" in line_of(out, "graph offload")


def test_doctor_names_a_missing_model_folder(capsys, tmp_path):
    code, out = run_doctor(
        capsys, "--platform", "cuda", str(tmp_path / "nope"), "--enable-sleep-mode"
    )
    assert code == 1
    assert f"model '{tmp_path / 'nope'}': no such file or folder" in out
    code, out = run_doctor(capsys, "--platform", "cuda", str(tmp_path), "--enable-sleep-mode")
    assert code == 0, out


@pytest.mark.parametrize(
    ("args", "fix"),
    [
        (("-cc.cudagraph_mode=none",), "drop cudagraph_mode NONE"),
        (("-O0",), "use -O1 or higher"),
        # At the default -O2 it is the compilation mode that turns graphs off.
        (("-cc", '{"mode": 0, "cudagraph_mode": "PIECEWISE"}'), "use compilation mode 3"),
    ],
)
def test_doctor_flag_with_graphs_off_otherwise(capsys, args, fix):
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE, *args)
    assert code == 1 and f"fix: {fix}" in out


def test_doctor_fix_names_everything_that_keeps_the_flag_from_working(capsys):
    args = ("m", "--sleep-mode-offload-cudagraph", "--enforce-eager")
    code, out = run_doctor(capsys, "--platform", "cuda", *args)
    assert code == 1 and "fix: add --enable-sleep-mode; drop --enforce-eager" in out


def test_doctor_plans_rocm_with_vllm_custom_all_reduce(capsys):
    code, out = run_doctor(capsys, "--platform", "rocm", *ACTIVE, "-tp", "8")
    assert code == 0, out
    assert line_of(out, "platform").split()[1] == "rocm"
    mode = line_of(out, "custom all-reduce")
    assert "vLLM custom all-reduce, copy-in under capture" in mode and "QuickReduce" in mode


def test_doctor_plans_rocm_with_aiter(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    code, out = run_doctor(capsys, "--platform", "rocm", *ACTIVE, "-tp", "2")
    assert "AITER custom all-reduce, copy-in under capture" in line_of(out, "custom all-reduce")
    if "aiter" not in sys.modules:
        assert code == 0
        assert "AITER is not installed here" in line_of(out, "warning")
    fake_aiter.install(monkeypatch)
    code, out = run_doctor(capsys, "--platform", "rocm", *ACTIVE, "-tp", "2")
    assert code == 0, out
    fake_aiter.install(monkeypatch, old=True)
    code, out = run_doctor(capsys, "--platform", "rocm", *ACTIVE, "-tp", "2")
    assert code == 1
    assert "no enable_register_for_capturing" in out
    assert "fix: upgrade AITER (amd-aiter), or add --disable-custom-all-reduce" in out


def test_doctor_disable_custom_all_reduce(capsys):
    code, out = run_doctor(
        capsys, "--platform", "cuda", *ACTIVE, "-tp", "2", "--disable-custom-all-reduce"
    )
    assert code == 0
    assert "disabled by --disable-custom-all-reduce" in line_of(out, "custom all-reduce")


@pytest.mark.parametrize(
    ("environ", "tp", "warned"),
    [
        ({"NCCL_NVLS_ENABLE": "0"}, "2", True),
        ({"NCCL_NVLS_ENABLE": "0", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}, "2", False),
        ({"NCCL_NVLS_ENABLE": "0"}, "1", False),
        ({}, "2", False),
    ],
)
def test_doctor_warns_about_flashinfer_multicast_where_it_is_off(
    capsys, monkeypatch, environ, tp, warned
):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE, "-tp", tp)
    assert code == 0
    warning = "set VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm"
    assert (warning in out) == warned, out


@pytest.mark.parametrize(
    ("mode", "v2_env", "warned"),
    [
        ("FULL", None, True),
        ("FULL", "1", True),
        ("FULL", "0", True),  # model runner V1: wrong tokens too (fourth run)
        ("FULL_AND_PIECEWISE", None, False),
        ("FULL_DECODE_ONLY", "0", False),
        ("PIECEWISE", None, False),
    ],
)
def test_doctor_warns_about_full_mode_on_either_model_runner(
    capsys, monkeypatch, mode, v2_env, warned
):
    if v2_env is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_env)
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE, "-cc.cudagraph_mode", mode)
    assert code == 0
    assert ("cudagraph_mode FULL gives wrong tokens in vLLM 0.26" in out) == warned, out


@pytest.mark.parametrize(
    ("mode", "env", "plugins", "expected"),
    [
        ("PIECEWISE", "1", None, "on (VLLM_USE_BREAKABLE_CUDAGRAPH=1): graphs break at the ops"),
        ("FULL_AND_PIECEWISE", "1", None, "on (VLLM_USE_BREAKABLE_CUDAGRAPH=1): graphs break"),
        ("FULL", "1", None, "on (VLLM_USE_BREAKABLE_CUDAGRAPH=1), but cudagraph_mode FULL"),
        ("PIECEWISE", "0", None, "off (VLLM_USE_BREAKABLE_CUDAGRAPH='0')"),
        ("PIECEWISE", None, None, "off (VLLM_USE_BREAKABLE_CUDAGRAPH unset)"),
        ("PIECEWISE", "1", "other", "on (VLLM_USE_BREAKABLE_CUDAGRAPH=1), without the plugin"),
    ],
)
def test_doctor_says_which_breakable_graph_case_a_command_line_is_in(
    capsys, monkeypatch, mode, env, plugins, expected
):
    """Only without the plugin does the import order still matter (its warning)."""
    if env is None:
        monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", env)
    if plugins is not None:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE, "-cc.cudagraph_mode", mode)
    assert code == (0 if plugins is None else 1), out
    assert line_of(out, "breakable graphs").split(None, 2)[2].startswith(expected), out
    warned = "must be in effect before the process that starts the engine imports" in out
    assert warned == (plugins is not None), out


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (None, "on (vLLM turns VLLM_USE_BREAKABLE_CUDAGRAPH on for DeepseekV4ForCausalLM)"),
        ("0", "off: VLLM_USE_BREAKABLE_CUDAGRAPH='0' opts out of what vLLM turns on for Deep"),
    ],
)
def test_doctor_knows_the_architectures_vllm_turns_breakable_graphs_on_for(
    capsys, monkeypatch, tmp_path, env, expected
):
    if env is None:
        monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", env)
    (tmp_path / "config.json").write_text('{"architectures": ["DeepseekV4ForCausalLM"]}')
    code, out = run_doctor(
        capsys, "--platform", "cuda", str(tmp_path), *ACTIVE[1:], "-cc.cudagraph_mode", "PIECEWISE"
    )
    assert code == 0, out
    assert line_of(out, "breakable graphs").split(None, 2)[2].startswith(expected), out


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", "1 (from your environment, kept; WARNING"),
        ("0", "0 (from your environment, as the plugin wants)"),
    ],
)
def test_doctor_keeps_an_explicit_nccl_value(capsys, monkeypatch, value, expected):
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", value)
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 0
    assert expected in line_of(out, "NCCL_GRAPH_REGISTER")
    assert os.environ["NCCL_GRAPH_REGISTER"] == value  # the doctor changes nothing


def test_doctor_says_an_empty_nccl_value_is_replaced(capsys, monkeypatch):
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "")
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 0 and "0 (set by the plugin before NCCL starts" in line_of(
        out, "NCCL_GRAPH_REGISTER"
    )


def test_doctor_reads_the_plugins_variables_as_the_worker_will(capsys, monkeypatch):
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 0 and "none of the plugin's variables set" in line_of(out, "environment")
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_STACK", "0")
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_HOST_BUFFERS", "torch")
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 0, out
    assert line_of(out, "environment").split(None, 1)[1] == (
        "VLLM_GRAPH_SLEEP_HOST_BUFFERS='torch', VLLM_GRAPH_SLEEP_RELEASE_STACK='0'"
    )
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_STAK", "0")  # misspelt: read by nobody
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 0 and "VLLM_GRAPH_SLEEP_RELEASE_STAK is not a variable of this plugin" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
def test_doctor_for_both_platforms_says_a_warning_of_both_once(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S", "x")
    code, out = run_doctor(capsys, *ACTIVE)
    assert code == 0, out
    assert out.count("VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S='x': expected seconds") == 1, out


@pytest.mark.parametrize(
    ("name", "value", "stopping_args", "harmless_args"),
    [
        # The allocator's variables stop a worker with graph offload active only.
        ("VLLM_GRAPH_SLEEP_RELEASE_STACK", "ture", ACTIVE, ("m", "--enable-sleep-mode")),
        ("VLLM_GRAPH_SLEEP_HOST_BUFFERS", "pinned", ACTIVE, ("m",)),
    ],
)
def test_doctor_refuses_a_value_the_worker_would_refuse(
    capsys, monkeypatch, name, value, stopping_args, harmless_args
):
    monkeypatch.setenv(name, value)
    code, out = run_doctor(capsys, "--platform", "cuda", *stopping_args)
    assert code == 1, out
    assert f"fix: set {name} to an accepted value, or unset it" in out
    code, out = run_doctor(capsys, "--platform", "cuda", *harmless_args)
    assert code == 0, out
    assert f"{name}={value!r}" in line_of(out, "warning")
    assert "read only while graph offload is active; not here" in line_of(out, "warning")


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("VLLM_GRAPH_SLEEP_ASLEEP_WAIT_S", "expected seconds >= 0"),
        ("VLLM_GRAPH_SLEEP_MAX_HELD_REQUESTS", "expected a whole number >= 0"),
    ],
)
def test_doctor_checks_the_gate_switches_where_the_server_reads_them(
    capsys, monkeypatch, name, says
):
    monkeypatch.setenv(name, "-1")
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 0 and "read only in dev mode; not here" in line_of(out, "warning")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 1 and f"{name}='-1': {says}" in out


def test_doctor_vllm_plugins_without_ours(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 1 and "fix: add graph_sleep to VLLM_PLUGINS, or unset it" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
def test_doctor_on_this_gpu_less_machine_answers_for_cuda_and_rocm(capsys):
    code, out = run_doctor(capsys, *ACTIVE, "-tp", "2")
    assert code == 0, out
    here = config.platform_name(doctor.detect_platform())
    assert f"cuda and rocm (this machine: {here}, so answered for both" in line_of(out, "platform")
    assert "ACTIVE" in line_of(out, "graph offload")
    assert "QuickReduce" not in line_of(out, "custom all-reduce (cuda)")
    assert "QuickReduce" in line_of(out, "custom all-reduce (rocm)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
def test_doctor_detected_platform_on_a_gpu_less_machine(capsys):
    code, out = run_doctor(capsys, "--platform", "detected", *ACTIVE)
    assert code == 1
    here = config.platform_name(doctor.detect_platform())
    assert line_of(out, "platform").split()[1:3] == [here, "(detected"]
    assert f"platform {here} is neither CUDA nor ROCm" in line_of(out, "graph offload")
    assert "add --platform cuda or --platform rocm" in out


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (("m", "--no-such-vllm-flag"), "unrecognized arguments: --no-such-vllm-flag"),
        (("m", "--compilation-config", "{bad"), "Invalid JSON"),
        (("m", "-tp", "0"), "tensor_parallel_size: Input should be greater than or equal to 1"),
        # Our flag in the JSON, misspelt: the plugin's EngineArgs patch refuses it.
        (
            ("m", "--additional-config", '{"sleep_mode_offload_cudagraph": "ture"}'),
            "'ture'} is not a yes/no value: use true or false",
        ),
    ],
)
def test_doctor_rejects_what_vllm_serve_rejects_in_one_line(capsys, argv, error):
    code = doctor.main(["--platform", "cuda", *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("vllm-graph-sleep doctor: vllm serve would reject")
    assert error in captured.err


def test_doctor_names_a_config_file_it_cannot_read_in_one_line(capsys, tmp_path):
    code = doctor.main(["--platform", "cuda", "m", "--config", str(tmp_path / "none.yaml")])
    captured = capsys.readouterr()  # vLLM logs its own line about the file too
    assert code == 2 and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("vllm-graph-sleep doctor: vllm serve would reject")
    assert "No such file or directory" in captured.err and "none.yaml" in captured.err


def test_doctor_advises_installing_from_the_checkout_only(capsys, monkeypatch):
    monkeypatch.setattr(doctor.importlib.metadata, "entry_points", lambda group: [])
    code, out = run_doctor(capsys, "--platform", "cuda", *ACTIVE)
    assert code == 1
    assert "pip install -e <this repository>" in out and "pip install vllm-graph-sleep" not in out


def test_doctor_help(capsys):
    code, out = run_doctor(capsys, "--help")
    assert code == 0 and out.startswith("usage: vllm-graph-sleep doctor")


def test_doctor_plans_for_rocm_alone_in_a_fresh_process():
    """--platform rocm as a newcomer runs it, with nothing imported before it
    (in one process with other tests, the CUDA plan had imported what the ROCm
    plan's VllmConfig needs, and hid a traceback)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU: so on a GPU machine too
    result = subprocess.run(
        [sys.executable, "-m", "vllm_graph_sleep.cli", "doctor", "--platform", "rocm"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "platform             rocm (planned with --platform" in result.stdout
    assert "verdict" in result.stdout


@pytest.mark.slow
def test_doctor_command_line_is_quiet_and_clean():
    result = subprocess.run(
        [sys.executable, "-m", "vllm_graph_sleep.cli", "doctor", "--platform", "cuda", *ACTIVE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("vllm-graph-sleep doctor\n")
    assert "ACTIVE" in result.stdout
    assert "Traceback" not in result.stderr


def test_freed_by_a_sleep_is_measured_before_it_and_the_wake_maps_back_apart():
    """Review, 2026-12-06: "freed" was read after the wake, before requests
    grew torch's cache again, so it left out what the sleep emptied."""
    steps = [
        {
            "level": 1,
            "wake": "full",
            "sleep_s": 0.1,
            "wake_s": 0.1,
            "asleep_report": None,
            "before_sleep_used_bytes": [1000 * MiB],
            "asleep_used_bytes": [100 * MiB],
            "awake_used_bytes": [900 * MiB],
        },
    ]
    summary = report.summarize({"baseline_used_bytes": [0], "steps": steps})
    assert summary["freed_mib"]["1"] == [900] and summary["mapped_back_mib"]["1"] == [800]
    del steps[0]["before_sleep_used_bytes"]  # an older file: no such figure
    summary = report.summarize({"baseline_used_bytes": [0], "steps": steps})
    assert "1" not in summary["freed_mib"] and summary["mapped_back_mib"]["1"] == [800]


# -- review, 2026-12-06: what an interrupted or misbehaving run leaves -------------


def test_a_second_interrupt_while_a_server_stops_still_kills_it(tmp_path, monkeypatch):
    """vLLM stuck in its teardown ignores SIGTERM; the user presses Ctrl-C again."""
    from vllm_graph_sleep.bench.server import Server

    ignores = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)"
    server = Server("x", [sys.executable, "-c", ignores], dict(os.environ), tmp_path / "x.log")
    server.start("http://127.0.0.1:1")
    time.sleep(1.0)  # its handler is in place
    wait = server.process.wait

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(server.process, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        server.stop()
    assert wait(timeout=10) == -signal.SIGKILL


def test_an_interrupted_configuration_keeps_what_it_measured(fake_bench, monkeypatch, capsys):
    from vllm_graph_sleep.bench import scenario

    argv, out = fake_bench
    step = scenario.Scenario._step

    def interrupted_second_step(self, cycle, level, wake, reference):
        if self.name == "stock_graphs" and len(self.record.get("steps", [])) == 1:
            raise KeyboardInterrupt
        return step(self, cycle, level, wake, reference)

    monkeypatch.setattr(scenario.Scenario, "_step", interrupted_second_step)
    assert cli.main([*argv, "--configs", "ours", "stock_graphs", "--no-floor"]) == 130
    saved = json.loads((out / "results.json").read_text())
    assert [c["config"] for c in saved["configs"]] == ["ours", "stock_graphs"]
    interrupted = saved["configs"][1]
    assert len(interrupted["steps"]) == 1 and interrupted["error"] == "KeyboardInterrupt"


def _one_answer_server(answer: bytes) -> int:
    """A port where one request gets `answer` as it is, then the connection closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve():
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(answer)
        connection.close()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def test_an_answer_cut_short_is_a_server_error_in_one_line():
    port = _one_answer_server(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"is_sl')
    client = Client(f"http://127.0.0.1:{port}", "ours", lambda: "log", 5)
    with pytest.raises(ServerError, match=r"GET /is_sleeping failed: IncompleteRead"):
        client.is_sleeping()


def test_a_completion_with_too_few_tokens_is_a_server_error_not_a_match():
    """Token lists are compared after every wake: empty ones would be equal."""
    body = json.dumps({"choices": [{"index": 0, "token_ids": [], "text": ""}]}).encode()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    client = Client(f"http://127.0.0.1:{_one_answer_server(answer)}", "ours", lambda: "log", 5)
    client.model_id = "m"
    with pytest.raises(ServerError, match=r"gave \[0\] tokens for 1 prompt\(s\), 4 each asked"):
        client.complete(["a prompt"], 4)


def test_a_sleep_that_did_nothing_fails_the_run_though_the_tokens_match(
    fake_bench, monkeypatch, capsys
):
    """A server that answers /sleep 200 and keeps serving gives the reference's
    tokens after every 'wake': /is_sleeping is what tells."""
    argv, out = fake_bench
    monkeypatch.setattr(Client, "sleep", lambda self, level, checkpoint=False: 0.01)
    assert cli.main([*argv, "--configs", "ours", "--no-floor"]) == cli.EXIT_FAILED
    assert "/is_sleeping did not say asleep after every sleep" in capsys.readouterr().err
    steps = json.loads((out / "results.json").read_text())["configs"][0]["steps"]
    assert all(s["bit_exact"] and s["is_sleeping_asleep"] is False for s in steps)


def test_an_older_file_without_is_sleeping_answers_has_no_such_verdict(recorded):
    for record in recorded["configs"]:
        for step in record["steps"]:
            step.pop("is_sleeping_asleep", None)
            step.pop("is_sleeping_awake", None)
    assert report.not_told_asleep(recorded) == []
    assert all(s["told_asleep"] is None for s in report.summarize_all(recorded).values())
