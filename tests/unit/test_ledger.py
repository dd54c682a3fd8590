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
from vllm_graph_sleep.sampler_scratch import SAMPLER_MODULE
from vllm_graph_sleep.units import MiB

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
def faked_worker(monkeypatch, install_allocator):
    """A worker of our allocator on the faked VMM layer, with the driver queries
    answered by it (the stack limit) and by fixed figures (the rest)."""
    driver = FakeVmmDriver(capacity=1 << 30)
    manager = GraphSleepAllocator(driver)
    install_allocator(manager)
    limits = {"printf_fifo": MiB, "malloc_heap": 8 * MiB}

    def limit(device, which):
        return driver.stack_limit(device) if which == "stack" else limits[which]

    monkeypatch.setattr(device_query, "context_limit", limit)
    monkeypatch.setattr(device_query, "resident_threads", lambda device: THREADS)
    monkeypatch.setattr(device_query, "used_bytes", lambda device: (2048 * MiB, "nvml process"))
    monkeypatch.setattr(ledger_module, "_vllm_cumem_mapped", lambda: 0)
    monkeypatch.setattr(ledger_module, "_torch_outside_pools", lambda segments: 20 * MiB)
    monkeypatch.setattr(ledger_module, "cudagraphs_captured", lambda: 67)
    monkeypatch.setattr(ledger_module, "_tp_size", lambda: 2)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    for tag, size in (("weights", 64 * MiB), ("kv_cache", 256 * MiB), ("cudagraph", 32 * MiB)):
        with manager.allocation_tag(tag):
            driver.malloc(size)
    return manager


def test_the_ledger_says_what_the_last_sleep_copied_and_kept(faked_worker):
    faked_worker.sleep(offload_tags=("weights",))
    first = ledger_module.ledger(0, [])
    assert (first["host_backup_copied"], first["host_backup_kept"]) == (64 * MiB, 0)
    faked_worker.wake_up()
    faked_worker.sleep(offload_tags=("weights",))
    again = ledger_module.ledger(0, [])
    assert (again["host_backup_copied"], again["host_backup_kept"]) == (0, 64 * MiB)


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


def row_cells(table: str, label: str) -> list[str]:
    """The cells after `label` in the printed table's row of that label."""
    row = next(line for line in table.splitlines() if line.startswith(label))
    return row[len(label) :].split()


def test_ledger_rows_side_by_side_for_three_configs(recorded):
    table = report.format_table(recorded)
    assert ledger_table.NOTE in table
    assert ledger_table.WORKSPACE_NOTE not in table  # no workspace rows in these results

    def cells(label: str) -> list[str]:
        return row_cells(table, label)

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

    monkeypatch.setattr(ledger_module, "sleep_allocator_addresses", lambda: {0x1000})
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


# -- what torch holds outside the pools ---------------------------------------------

AUX, CURRENT = 0x7F, 0x5A  # stream handles


class FakeBuffer:
    """A WorkspaceManager buffer: where it starts and its bytes, as a tensor says."""

    def __init__(self, address: int, nbytes: int):
        self.address = address
        self.nbytes = nbytes

    def data_ptr(self) -> int:
        return self.address


def block(address: int, size: int, state: str = "active_allocated") -> dict:
    return {"address": address, "size": size, "state": state}


def segment(address: int, stream: int, *blocks: dict) -> dict:
    total = sum(b["size"] for b in blocks)
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {
        "address": address,
        "total_size": total,
        "allocated_size": allocated,
        "stream": stream,
        "blocks": list(blocks),
    }


@pytest.fixture
def vllm_workspace(faked_worker, monkeypatch):
    """vLLM's WorkspaceManager with a buffer per ubatch (the second unused), its
    aux stream, and the probe thread's current stream; one sleep pool segment."""
    from vllm.utils import torch_utils
    from vllm.v1.worker import workspace

    buffers = [FakeBuffer(0x10_0000, 6 * MiB), None, FakeBuffer(0x1_0000_0000, 3 * MiB)]
    manager = types.SimpleNamespace(_current_workspaces=buffers)
    monkeypatch.setattr(workspace, "_manager", manager)
    monkeypatch.setattr(torch_utils, "_aux_stream", types.SimpleNamespace(cuda_stream=AUX))
    current = types.SimpleNamespace(cuda_stream=CURRENT)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(ledger_module, "sleep_allocator_addresses", lambda: {0x1_0000_0000})
    return manager


def held_segments() -> list[dict]:
    """torch's segments: the buffer of ubatch 2 in a sleep pool's segment, that of
    ubatch 0 outside (in a block a little larger), a 32 MiB block on each of the
    current and the aux stream, ten small live tensors, and a freed block and a
    block freed while another stream still used it, both larger than any live one."""
    small = [block(0x4000_0000 + i * MiB, (i + 1) * 64 * 1024) for i in range(10)]
    return [
        segment(0x1_0000_0000, 0, block(0x1_0000_0000, 4 * MiB)),
        segment(
            0x10_0000, 0, block(0x10_0000, 6 * MiB + 512), block(0x70_0000, 99 * MiB, "inactive")
        ),
        segment(0x2000_0000, CURRENT, block(0x2000_0000, 32 * MiB)),
        segment(0x3000_0000, AUX, block(0x3000_0000, 32 * MiB)),
        segment(0x4000_0000, 0, *small, block(0x5000_0000, 50 * MiB, "active_pending_free")),
        segment(0x6000_0000, AUX, block(0x6000_0000, 5 * MiB)),
    ]


def test_vllm_workspace_inside_and_outside_the_pools(vllm_workspace):
    fields = ledger_module.ledger(0, held_segments())
    assert fields["vllm_workspace"] == 9 * MiB
    assert fields["vllm_workspace_outside_pools"] == 6 * MiB  # ubatch 2's is in a sleep pool
    assert fields["current_stream"] == "0x5a" and fields["vllm_aux_stream"] == "0x7f"
    # Inside torch's memory like the cuBLAS workspaces: shown beside, never added.
    for name in ("vllm_workspace", "vllm_workspace_outside_pools"):
        assert name in ledger_fields.INFORMATIVE and name not in ledger_fields.SUMMED
    # A buffer in no segment torch lists is not counted as outside.
    without = ledger_module.ledger(0, [])
    assert without["vllm_workspace"] == 9 * MiB and without["vllm_workspace_outside_pools"] == 0
    vllm_workspace._current_workspaces = [None]  # no ubatch asked for one yet
    assert ledger_module.ledger(0, held_segments())["vllm_workspace"] == 0


def test_largest_live_blocks_outside_the_pools_are_named(vllm_workspace):
    fields = ledger_module.ledger(0, held_segments())
    largest = fields["torch_outside_pools_largest_blocks"]
    assert largest[:4] == [
        {
            "size": 32 * MiB,
            "stream": "0x5a",
            "what": "a cuBLAS workspace's size, on the current stream",
        },
        {
            "size": 32 * MiB,
            "stream": "0x7f",
            "what": "a cuBLAS workspace's size, on vLLM's aux stream",
        },
        {"size": 6 * MiB + 512, "stream": "0x0", "what": "vLLM workspace buffer of ubatch 0"},
        {"size": 5 * MiB, "stream": "0x7f", "what": "on vLLM's aux stream"},
    ]
    # Then the largest of the small ones, unnamed, up to eight in all: freed
    # blocks and the sleep pool's are not among them.
    assert largest[4:] == [{"size": s * 64 * 1024, "stream": "0x0"} for s in (10, 9, 8, 7)]
    json.dumps(fields)
    # A workspace buffer of a cuBLAS workspace's size is named by its address alone.
    known = ledger_module.KnownMemory({0: FakeBuffer(0x10_0000, 32 * MiB)}, (), 32 * MiB, {})
    assert known.what(0x10_0000, 32 * MiB, "0x0") == "vLLM workspace buffer of ubatch 0"


def test_the_workspace_of_the_installed_vllm_is_read_where_it_keeps_it(monkeypatch):
    """The private symbols the ledger reads, against the vLLM installed here (the
    fakes above stand in for it elsewhere): its WorkspaceManager on the CPU."""
    from vllm.v1.worker import workspace

    monkeypatch.setattr(workspace, "_manager", None)
    assert ledger_module.vllm_workspace_buffers() == {}  # not made yet
    workspace.init_workspace_manager(torch.device("cpu"))
    (view,) = workspace.current_workspace_manager().get_simultaneous(((1000,), torch.float32))
    buffers = ledger_module.vllm_workspace_buffers()
    assert list(buffers) == [0] and buffers[0].nbytes >= 4000
    assert buffers[0].data_ptr() == view.data_ptr()
    # The aux stream's symbol is there too (None: no MoE layer made it here).
    assert ledger_module._vllm_aux_stream() is None


def test_vllm_workspace_missing_from_vllm_says_which_symbol(vllm_workspace, monkeypatch):
    import vllm
    from vllm.utils import torch_utils
    from vllm.v1.worker import workspace

    monkeypatch.delattr(workspace, "_manager")
    monkeypatch.delattr(torch_utils, "_aux_stream")
    fields = ledger_module.ledger(0, held_segments())
    reason = f"LookupError: vLLM {vllm.__version__} has no vllm.v1.worker.workspace._manager"
    assert fields["vllm_workspace"] is None and fields["vllm_workspace_outside_pools"] is None
    assert fields["unavailable"]["vllm_workspace"] == reason
    assert fields["unavailable"]["vllm_workspace_outside_pools"] == reason
    assert "_aux_stream" in fields["unavailable"]["vllm_aux_stream"]
    # The blocks are still listed; the 32 MiB one on the aux stream is no longer named by it.
    blocks = fields["torch_outside_pools_largest_blocks"]
    assert blocks[1] == {"size": 32 * MiB, "stream": "0x7f", "what": "a cuBLAS workspace's size"}

    monkeypatch.setitem(sys.modules, "vllm.v1.worker.workspace", None)  # no such module
    fields = ledger_module.ledger(0, held_segments())
    assert fields["unavailable"]["vllm_workspace"] == (
        f"LookupError: vLLM {vllm.__version__} has no vllm.v1.worker.workspace"
    )


def test_vllm_aux_stream_not_made_yet(vllm_workspace, monkeypatch):
    from vllm.utils import torch_utils

    monkeypatch.setattr(torch_utils, "_aux_stream", None)
    fields = ledger_module.ledger(0, held_segments())
    assert fields["vllm_aux_stream"] is None
    assert "made no aux stream" in fields["unavailable"]["vllm_aux_stream"]
    assert fields["vllm_workspace"] == 9 * MiB  # the rest is unaffected


def test_vllm_workspace_rows_in_the_table(recorded):
    attributed = "asleep L1: attributed (MiB)"
    before = row_cells(report.format_table(recorded), attributed)
    for step in recorded["configs"][0]["steps"]:
        for worker in step["asleep_report"]:
            worker["ledger"] = {
                **worker["ledger"],
                "vllm_workspace": 96 * MiB,
                "vllm_workspace_outside_pools": 64 * MiB,
            }
    table = report.format_table(recorded)
    assert row_cells(table, "asleep L1: vllm workspace (MiB)") == ["96", "-", "-"]
    assert row_cells(table, "asleep L1: vllm workspace outside pools (MiB)") == ["64", "-", "-"]
    assert f"{ledger_table.NOTE} {ledger_table.WORKSPACE_NOTE}" in table
    assert row_cells(table, attributed) == before  # inside torch's memory: not added
    assert "largest blocks" not in table  # JSON only


# -- vLLM's sampler scratch -----------------------------------------------------------

GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)
VOCAB = 128256  # Llama 3's
SCRATCH, SCRATCH_BYTES = 0x7000_0000, 132 * VOCAB * 4  # an H200's SMs x float32 rows: 65 MiB
TABLES = (0x7400_0000, 0x7400_1000)


class FakeTensor:
    """A tensor of the sampler's caches: its device, and its storage's address and bytes."""

    def __init__(self, address: int, nbytes: int, device: torch.device = GPU0):
        self.device = device
        self.storage = types.SimpleNamespace(data_ptr=lambda: address, nbytes=lambda: nbytes)

    def untyped_storage(self) -> types.SimpleNamespace:
        return self.storage


@pytest.fixture
def sampler_caches(vllm_workspace, monkeypatch) -> types.ModuleType:
    """vLLM's Triton sampler module as sampling on GPUs 0 and 1 leaves it: on GPU 0
    a scratch buffer for bfloat16 logits and a second entry viewing the same
    storage, and the two lookup tables; on GPU 1 a buffer and its tables."""
    module = types.ModuleType(SAMPLER_MODULE)
    module._TRITON_BUFFER_CACHE = {
        (GPU0, torch.bfloat16, VOCAB): FakeTensor(SCRATCH, SCRATCH_BYTES),
        (GPU0, torch.float16, VOCAB): FakeTensor(SCRATCH, SCRATCH_BYTES),
        (GPU1, torch.bfloat16, VOCAB): FakeTensor(0x9_0000_0000, SCRATCH_BYTES, GPU1),
    }
    module._TRITON_TABLE_CACHE = {
        GPU0: tuple(FakeTensor(address, 4096) for address in TABLES),
        GPU1: tuple(FakeTensor(0x9_1000_0000 + i * 4096, 4096, GPU1) for i in range(2)),
    }
    monkeypatch.setitem(sys.modules, SAMPLER_MODULE, module)
    return module


def scratch_segments() -> list[dict]:
    """held_segments() and the sampler's scratch of GPU 0 outside the sleep pools:
    its buffer in a block of its own, its tables in one segment."""
    return [
        *held_segments(),
        segment(SCRATCH, 0, block(SCRATCH, SCRATCH_BYTES)),
        segment(TABLES[0], 0, *(block(address, 4096) for address in TABLES)),
    ]


def test_sampler_scratch_of_this_gpu_each_storage_once(sampler_caches):
    fields = ledger_module.ledger(0, scratch_segments())
    # GPU 1's are not this ledger's; the second entry's storage is the first's.
    assert fields["vllm_sampler_scratch"] == SCRATCH_BYTES + 2 * 4096
    assert "vllm_sampler_scratch" not in fields["unavailable"]
    assert ledger_module.ledger(1, [])["vllm_sampler_scratch"] == SCRATCH_BYTES + 2 * 4096
    # Inside torch's memory like vLLM's workspace: shown beside, never added.
    assert "vllm_sampler_scratch" in ledger_fields.INFORMATIVE
    assert "vllm_sampler_scratch" not in ledger_fields.SUMMED
    sampler_caches._TRITON_BUFFER_CACHE.clear()  # as our sleep leaves them
    sampler_caches._TRITON_TABLE_CACHE.clear()
    emptied = ledger_module.ledger(0, scratch_segments())
    assert emptied["vllm_sampler_scratch"] == 0
    assert emptied["attributed"] == fields["attributed"]


def test_sampler_vllm_never_imported_holds_nothing_and_stays_unimported(
    vllm_workspace, monkeypatch
):
    import vllm

    monkeypatch.delitem(sys.modules, SAMPLER_MODULE, raising=False)
    fields = ledger_module.ledger(0, held_segments())
    assert fields["vllm_sampler_scratch"] == 0
    assert "vllm_sampler_scratch" not in fields["unavailable"]
    assert SAMPLER_MODULE not in sys.modules  # Triton was not pulled in for it
    # A vLLM without the module: unavailable, not 0.
    monkeypatch.setitem(sys.modules, SAMPLER_MODULE, None)
    fields = ledger_module.ledger(0, held_segments())
    assert fields["vllm_sampler_scratch"] is None
    assert fields["unavailable"]["vllm_sampler_scratch"] == (
        f"LookupError: vLLM {vllm.__version__} has no {SAMPLER_MODULE}"
    )


def test_sampler_caches_missing_from_vllm_say_which_symbol(sampler_caches, monkeypatch):
    import vllm

    monkeypatch.delattr(sampler_caches, "_TRITON_TABLE_CACHE")
    fields = ledger_module.ledger(0, scratch_segments())
    assert fields["vllm_sampler_scratch"] is None
    assert fields["unavailable"]["vllm_sampler_scratch"] == (
        f"LookupError: vLLM {vllm.__version__} has no {SAMPLER_MODULE}._TRITON_TABLE_CACHE"
    )
    # The blocks are still listed, the scratch's no longer named.
    assert fields["torch_outside_pools_largest_blocks"][0] == {
        "size": SCRATCH_BYTES,
        "stream": "0x0",
    }
    assert fields["vllm_workspace"] == 9 * MiB  # the rest is unaffected


def test_sampler_scratch_is_named_among_the_largest_blocks(sampler_caches):
    largest = ledger_module.ledger(0, scratch_segments())["torch_outside_pools_largest_blocks"]
    assert largest[0] == {
        "size": SCRATCH_BYTES,
        "stream": "0x0",
        "what": "vLLM's top-k/top-p sampler scratch",
    }
    assert largest[1]["what"] == "a cuBLAS workspace's size, on the current stream"
    # The tables are named as well, by address, in a segment of their own.
    known = ledger_module.KnownMemory({}, {SCRATCH, *TABLES}, None, {})
    assert known.what(TABLES[1], 4096, "0x0") == "vLLM's top-k/top-p sampler scratch"
    assert known.what(TABLES[1] + 4096, 4096, "0x0") is None


def test_the_sampler_scratch_of_the_installed_vllm_is_read_where_it_keeps_it(monkeypatch):
    """The private symbols the ledger reads, against the vLLM installed here (the
    fakes above stand in for it elsewhere): its module imports on a CPU machine,
    Triton disabled, and CPU tensors stand in its caches for a GPU's."""
    sampler = importlib.import_module(SAMPLER_MODULE)
    assert ledger_module.vllm_sampler_scratch() == []  # nothing sampled with it here
    cpu = torch.device("cpu")
    buffer, tables = torch.empty(4, 8), (torch.empty(16), torch.empty(16))
    monkeypatch.setitem(sampler._TRITON_BUFFER_CACHE, (cpu, torch.float32, 8), buffer)
    monkeypatch.setitem(sampler._TRITON_BUFFER_CACHE, (cpu, torch.float16, 8), buffer[:2])
    monkeypatch.setitem(sampler._TRITON_TABLE_CACHE, cpu, tables)
    tensors = ledger_module.vllm_sampler_scratch()
    assert len(tensors) == 4 and tensors[0] is buffer and tensors[2:] == list(tables)
    assert ledger_module.sampler_scratch_storages(tensors, cpu) == {
        buffer.data_ptr(): 128,  # the view of it counted once
        tables[0].data_ptr(): 64,
        tables[1].data_ptr(): 64,
    }
    # Tensors on the CPU are no GPU's.
    assert ledger_module.ledger(0, [])["vllm_sampler_scratch"] == 0


def test_sampler_scratch_rows_in_the_table(recorded):
    attributed = "asleep L1: attributed (MiB)"
    before = row_cells(report.format_table(recorded), attributed)
    for name, held in (("ours", 0), ("stock_graphs", SCRATCH_BYTES)):
        record = next(r for r in recorded["configs"] if r["config"] == name)
        for step in record["steps"]:
            for worker in step["asleep_report"]:
                worker["ledger"] = {**worker["ledger"], "vllm_sampler_scratch": held}
    table = report.format_table(recorded)
    # stock_eager's ledgers are older than the field: no figure.
    assert row_cells(table, "asleep L1: vllm sampler scratch (MiB)") == ["0", "65", "-"]
    assert f"{ledger_table.NOTE} {ledger_table.SAMPLER_NOTE}" in table
    assert ledger_table.WORKSPACE_NOTE not in table
    assert row_cells(table, attributed) == before  # inside torch's memory: not added
