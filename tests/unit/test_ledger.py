"""The memory ledger on the CPU: its arithmetic, the driver queries with their
libraries absent or faked, a ledger across a sleep of the faked VMM layer, and
the "ledger while asleep" rows of the bench report (printed, in results.json and
in tools/render_results.py's Markdown) for three configurations side by side."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.unit.fake_vmm import DEFAULT_STACK, FakeVmmDriver
from vllm_graph_sleep import device_query, ledger_fields
from vllm_graph_sleep import ledger as ledger_module
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.bench import ledger_table, report

MiB = 2**20
ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "data" / "bench-results-fixture.json"
THREADS = 132 * 2048  # an H200's resident threads

# -- arithmetic -------------------------------------------------------------------


def test_unattributed_is_used_minus_the_known_summed_fields():
    fields = {name: (i + 1) * MiB for i, name in enumerate(ledger_fields.SUMMED)}
    fields["nccl_buffers"] = None  # unknown: left out of the sum, not counted as 0 by mistake
    fields.update(nvml_used=1000 * MiB, cublas_workspaces=500 * MiB, instantiated_graphs=7)
    attributed, unattributed = ledger_fields.balance(fields)
    known = sum(v for k, v in fields.items() if k in ledger_fields.SUMMED and v is not None)
    assert attributed == known  # informative fields are not added
    assert unattributed == 1000 * MiB - known
    assert ledger_fields.balance({**fields, "nvml_used": None}) == (known, None)
    # An estimate that overshoots shows as a negative rest, not as zero.
    assert ledger_fields.balance({"nvml_used": MiB, "nccl_buffers": 2 * MiB})[1] == -MiB


def test_cublas_workspace_config_and_nccl_estimates(monkeypatch):
    assert ledger_module.workspace_config_bytes(":4096:8") == 32 * MiB
    assert ledger_module.workspace_config_bytes(":4096:2:16:8") == 8 * MiB + 128 * 1024
    assert ledger_module.workspace_config_bytes("4096") is None
    assert ledger_module.workspace_config_bytes(":a:b") is None

    monkeypatch.delenv("NCCL_BUFFSIZE", raising=False)
    monkeypatch.delenv("NCCL_MAX_NCHANNELS", raising=False)
    assert ledger_module.nccl_estimate(1) == (None, "TP=1: no NCCL communicator")
    size, how = ledger_module.nccl_estimate(2)
    assert size == 4 * MiB * ledger_module.NCCL_ASSUMED_CHANNELS and "assumed" in how
    monkeypatch.setenv("NCCL_BUFFSIZE", str(MiB))
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "8")
    size, how = ledger_module.nccl_estimate(4)
    assert size == MiB * 8 * 3 and "NCCL_MAX_NCHANNELS" in how


# -- driver queries -----------------------------------------------------------------


def test_missing_libraries_give_none_not_errors(monkeypatch):
    def no_library(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert device_query.driver_library.__wrapped__() is None
    monkeypatch.setattr(device_query, "driver_library", lambda: None)
    assert device_query.context_limit(0, "stack") is None

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails

    def no_gpu(device):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_gpu)
    assert device_query.used_bytes(0) == (None, None)


class FakeCuda:
    """libcuda.so.1's cuCtxGetLimit, answering from a table."""

    def __init__(self, limits: dict[int, int], status: int = 0):
        self.limits = limits
        self.status = status

    def cuCtxGetLimit(self, value, which):  # noqa: N802
        value._obj.value = self.limits[which]
        return self.status


def test_context_limits_through_the_driver_library(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    cuda = FakeCuda({0: 1024, 1: MiB, 2: 8 * MiB})
    monkeypatch.setattr(device_query, "driver_library", lambda: ("cuda", cuda))
    limits = {w: device_query.context_limit(0, w) for w in device_query.LIMITS}
    assert limits == {"stack": 1024, "printf_fifo": MiB, "malloc_heap": 8 * MiB}
    cuda.status = 201  # CUDA_ERROR_INVALID_CONTEXT
    assert device_query.context_limit(0, "stack") is None


def fake_nvml(pids: dict[int, int | None], device_used: int) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: uuid
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda handle: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in pids.items()
    ]
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=device_used)
    return nvml


def test_used_bytes_per_process_else_per_device(monkeypatch):
    properties = types.SimpleNamespace(uuid="0123-abcd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    mine = os.getpid()
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({mine: 3 * MiB, 1: MiB}, 9 * MiB))
    assert device_query.used_bytes(0) == (3 * MiB, "nvml process")
    # Another PID namespace, or no per-process accounting: the device's figure.
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({1: MiB, mine + 1: None}, 9 * MiB))
    assert device_query.used_bytes(0) == (9 * MiB, "nvml device")


# -- the ledger -----------------------------------------------------------------


def test_ledger_without_a_gpu_has_none_fields_and_says_why():
    fields = ledger_module.ledger(0, [])
    for name in ("nvml_used", "stack_reservation", "printf_fifo", "malloc_heap", "cuda_modules"):
        assert fields[name] is None and fields["unavailable"][name]
    assert fields["unattributed"] is None
    assert fields["attributed"] == ledger_fields.balance(fields)[0]
    json.dumps(fields)  # it travels over HTTP as JSON


@pytest.fixture
def faked_worker(monkeypatch):
    """A worker of our allocator on the faked VMM layer, with the driver queries
    answered by it (the stack limit) and by fixed figures (the rest)."""
    driver = FakeVmmDriver(capacity=1 << 30)
    manager = GraphSleepAllocator(driver)
    monkeypatch.setattr(GraphSleepAllocator, "_instance", manager)
    limits = {"printf_fifo": MiB, "malloc_heap": 8 * MiB}

    def limit(device, which):
        return driver.stack_limit(device) if which == "stack" else limits[which]

    monkeypatch.setattr(device_query, "context_limit", limit)
    monkeypatch.setattr(device_query, "resident_threads", lambda device: THREADS)
    monkeypatch.setattr(device_query, "used_bytes", lambda device: (2048 * MiB, "nvml process"))
    monkeypatch.setattr(ledger_module, "_vllm_cumem_mapped", lambda: 0)
    monkeypatch.setattr(ledger_module, "_torch_outside_pools", lambda segments: 20 * MiB)
    monkeypatch.setattr(ledger_module, "_graphs", lambda: 67)
    monkeypatch.setattr(ledger_module, "_tp_size", lambda: 2)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    for tag, size in (("weights", 64 * MiB), ("kv_cache", 256 * MiB), ("cudagraph", 32 * MiB)):
        with manager.allocation_tag(tag):
            driver.malloc(size)
    return manager


def test_ledger_across_a_sleep_of_our_allocator(faked_worker):
    awake = ledger_module.ledger(0, [])
    assert awake["our_pools_mapped"] == 352 * MiB
    assert awake["stack_reservation"] == DEFAULT_STACK * THREADS  # 264 MiB
    faked_worker.sleep(offload_tags=("weights",))
    asleep = ledger_module.ledger(0, [])
    assert asleep["our_pools_mapped"] == 0
    assert asleep["stack_limit_per_thread"] == 0 and asleep["stack_reservation"] == 0
    assert asleep["instantiated_graphs"] == 67
    assert asleep["cublas_workspaces"] == 32 * MiB
    assert set(asleep["estimated"]) == {"cublas_workspaces", "nccl_buffers"}
    summed = 0 + MiB + 8 * MiB + 0 + 0 + 20 * MiB + asleep["nccl_buffers"]
    assert asleep["attributed"] == summed
    assert asleep["unattributed"] == 2048 * MiB - summed


def test_a_field_that_raises_is_none_with_its_reason(faked_worker, monkeypatch):
    def broken(segments):
        raise RuntimeError("snapshot failed")

    monkeypatch.setattr(ledger_module, "_torch_outside_pools", broken)
    fields = ledger_module.ledger(0, [])
    assert fields["torch_reserved_outside_pools"] is None
    assert fields["unavailable"]["torch_reserved_outside_pools"] == "RuntimeError: snapshot failed"
    assert fields["unattributed"] == fields["nvml_used"] - fields["attributed"]


# -- the bench report -------------------------------------------------------------


@pytest.fixture
def recorded() -> dict:
    return report.read_json(FIXTURE)


def test_ledger_rows_side_by_side_for_three_configs(recorded):
    table = report.format_table(recorded)
    assert ledger_table.NOTE in table
    lines = table.splitlines()

    def cells(label: str) -> list[str]:
        row = next(line for line in lines if line.startswith(label))
        return row[len(label) :].split()

    assert cells("asleep L1: stack reservation (MiB)") == ["0", "264", "264"]
    assert cells("asleep L1: torch reserved outside pools (MiB)") == ["20", "170", "20"]
    assert cells("asleep L2: instantiated graphs") == ["67", "67", "0"]
    assert cells("asleep L1: cublas workspaces (MiB)") == ["~32", "~32", "~32"]
    used, attributed, rest = (
        cells(f"asleep L1: {field} (MiB)") for field in ("nvml used", "attributed", "unattributed")
    )
    assert [int(u) - int(a) for u, a in zip(used, attributed, strict=True)] == list(map(int, rest))
    # Fields no configuration could read are left out of the table.
    assert "cuda modules" not in table and "nccl buffers" not in table


def test_ledger_is_in_results_json(recorded, tmp_path):
    report.write_json(recorded, tmp_path / "results.json")
    written = json.loads((tmp_path / "results.json").read_text())
    for name in ("ours", "stock_graphs", "stock_eager"):
        per_gpu = written["summary"][name]["ledger_asleep"]["1"]
        assert len(per_gpu) == 1 and per_gpu[0]["unattributed"] is not None


def test_ledger_rows_survive_missing_figures(recorded):
    ours = recorded["configs"][0]
    for step in ours["steps"]:
        step["asleep_report"] = [{**step["asleep_report"][0], "ledger": None}]
    eager = recorded["configs"][2]
    for step in eager["steps"]:
        step["asleep_report"][0]["ledger"] = {"nvml_used": None, "unavailable": {"x": "y"}}
    recorded["configs"][1]["steps"][-1]["asleep_report"] = None  # probe unavailable
    names, rows = report.ledger_rows(recorded)
    assert names == ["ours", "stock_graphs", "stock_eager"]
    row = next(r for r in rows if r[0] == "asleep L1: stack reservation (MiB)")
    assert row[1:] == ["-", "264", "-"]
    report.format_table(recorded)
    # Without any ledger (older results), no ledger section at all.
    for record in recorded["configs"]:
        for step in record["steps"]:
            for worker in step["asleep_report"] or []:
                worker.pop("ledger", None)
    assert report.ledger_rows(recorded)[1] == []
    assert ledger_table.NOTE not in report.format_table(recorded)


def test_render_results_shows_the_same_ledger_rows(recorded):
    spec = importlib.util.spec_from_file_location(
        "render_results", ROOT / "tools" / "render_results.py"
    )
    render_results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_results)
    recorded = {**recorded, "summary": report.summarize_all(recorded)}
    lines = render_results.render_bench_run("run.json", recorded, {}).lines
    assert ledger_table.NOTE in lines
    row = next(line for line in lines if line.startswith("| asleep L1: stack reservation (MiB) |"))
    assert [cell.strip() for cell in row.strip("|").split("|")][1:] == ["0", "264", "264"]


def test_torch_memory_outside_the_pools_by_stream(faked_worker, monkeypatch):
    from vllm_graph_sleep import probe

    monkeypatch.setattr(probe, "sleep_allocator_addresses", lambda: {0x1000})
    segments = [
        {"address": 0x1000, "total_size": 64 * MiB, "allocated_size": 64 * MiB, "stream": 0},
        {"address": 0x9000, "total_size": 20 * MiB, "allocated_size": 2 * MiB, "stream": 0},
        {"address": 0xA000, "total_size": 2 * MiB, "allocated_size": 2 * MiB, "stream": 0},
        {"address": 0xB000, "total_size": 34 * MiB, "allocated_size": 34 * MiB, "stream": 0x7F},
    ]
    fields = ledger_module.ledger(0, segments)
    assert fields["torch_outside_pools_by_stream"] == {
        "0x7f": {"reserved": 34 * MiB, "allocated": 34 * MiB, "segments": 1},
        "0x0": {"reserved": 22 * MiB, "allocated": 4 * MiB, "segments": 2},
    }
    # Detail only: the summed field is the same memory, counted once.
    assert "torch_outside_pools_by_stream" not in ledger_fields.SUMMED
