"""The allocator on a real GPU: one fresh process per test.

Memory is checked two ways: the allocator's own bookkeeping (exact) and the
driver's free memory / NVML (what another process can really use).

With GRAPH_SLEEP_TEST_EXTENSION pointing at the rocm-on-cuda build
(tests/rocm_shim/), the same tests run the allocator's ROCm path on an NVIDIA GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from tests.utils import cuda_only, fresh_process, requires_gpu
from vllm_graph_sleep.allocator import (
    GRAPH_TAG,
    SETTLE_AFTER_SLEEP_ENV,
    GraphSleepAllocator,
    WakeUpError,
)

pytestmark = requires_gpu


def _rocm_on_cuda_build() -> bool:
    extension = sys.modules.get("vllm_graph_sleep._cumem")  # loaded by conftest when chosen
    return extension is not None and hasattr(
        ctypes.CDLL(extension.__file__), "hip_shim_steal_next_freed_range"
    )


rocm_on_cuda_only = pytest.mark.skipif(
    not _rocm_on_cuda_build(),
    reason="needs the rocm-on-cuda test build (GRAPH_SLEEP_TEST_EXTENSION, tests/rocm_shim/)",
)
#: The CUDA path of the allocator: not on ROCm, nor on the rocm-on-cuda build,
#: whose shim keeps freed ranges reserved in the driver (AMD's answer to a
#: reservation by address, emulated; see tests/rocm_shim/).
cuda_path_only = pytest.mark.skipif(
    torch.version.hip is not None or _rocm_on_cuda_build(),
    reason="the allocator's CUDA path (this build takes the ROCm path)",
)

MIB = 1 << 20
GIB = 1 << 30
POISON = 0xA5


def manager() -> GraphSleepAllocator:
    return GraphSleepAllocator.get_instance()


def nvml_used_bytes() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used
    finally:
        pynvml.nvmlShutdown()


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch already loaded (no second copy)."""
    torch.cuda.init()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        pytest.skip("torch's libcudart is not loaded as a shared library")
    return ctypes.CDLL(sorted(paths)[0])


@contextmanager
def poisoned_remaps(alloc: GraphSleepAllocator, value: int = POISON):
    """Fills every freshly mapped range with `value` before wake continues, so
    that dropped memory cannot come back right by luck."""
    driver = alloc.driver
    original, original_run = driver.create_and_map, driver.create_and_map_run

    def create_map_and_poison(device, size, address, handle):
        original(device, size, address, handle)
        driver.device_bytes(device, address, size).fill_(value)
        torch.cuda.synchronize(device)

    def create_map_run_and_poison(device, members):
        original_run(device, members)
        for size, address, _ in members:
            driver.device_bytes(device, address, size).fill_(value)
        torch.cuda.synchronize(device)

    driver.create_and_map = create_map_and_poison
    driver.create_and_map_run = create_map_run_and_poison
    try:
        yield
    finally:
        driver.create_and_map, driver.create_and_map_run = original, original_run


def allocation_of(alloc: GraphSleepAllocator, tensor: torch.Tensor):
    pointer = tensor.data_ptr()
    (found,) = [a for a in alloc.allocations.values() if a.address <= pointer < a.address + a.size]
    return found


def overlaps(tensor: torch.Tensor, address: int, size: int) -> bool:
    start = tensor.data_ptr()
    return start < address + size and address < start + tensor.nbytes


def allocator_library(alloc: GraphSleepAllocator) -> ctypes.CDLL:
    library = ctypes.CDLL(alloc.driver.library_path())
    library.my_malloc.restype = ctypes.c_void_p
    library.my_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    library.my_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return library


def reserve_elsewhere(address: int, size: int, alignment: int = 0) -> int:
    """What another mapping in this process gets when it asks the CUDA driver
    for [address, address + size): the address it was given (then freed)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemAddressReserve.argtypes = [
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_uint64,
        ctypes.c_ulonglong,
    ]
    cuda.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    got = ctypes.c_uint64()
    assert cuda.cuMemAddressReserve(ctypes.byref(got), size, alignment, address, 0) == 0
    assert cuda.cuMemAddressFree(got.value, size) == 0
    return got.value


def entries(alloc: GraphSleepAllocator, tag: str) -> dict[int, int]:
    return {a.address: a.size for a in alloc.allocations.values() if a.tag == tag and a.mapped}


@fresh_process
def test_sleep_frees_memory_for_real_and_another_process_can_use_it():
    alloc = manager()
    torch.cuda.init()
    free_before_alloc, _ = torch.cuda.mem_get_info()
    pool_bytes = free_before_alloc - 6 * GIB
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.empty(pool_bytes, dtype=torch.uint8, device="cuda")
    kv[:MIB].fill_(1)
    mapped = alloc.mapped_bytes()
    assert mapped >= pool_bytes

    free_awake, _ = torch.cuda.mem_get_info()
    nvml_awake = nvml_used_bytes()
    alloc.sleep(offload_tags=())
    free_asleep, _ = torch.cuda.mem_get_info()
    assert alloc.mapped_bytes() == 0
    assert free_asleep - free_awake >= mapped
    if nvml_awake is not None:
        assert nvml_awake - nvml_used_bytes() >= mapped

    # Without the release another process could not get even a tenth of this.
    want = int(pool_bytes * 0.9)
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import torch; x = torch.ones({want}, dtype=torch.uint8, device='cuda'); "
            "print(x.numel() * int(x[-1]))",
        ],
        capture_output=True,
        text=True,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert int(child.stdout.strip()) == want

    alloc.wake_up()
    assert alloc.mapped_bytes() == mapped
    kv[:MIB].fill_(2)
    assert int(kv[:MIB].sum()) == 2 * MIB


@fresh_process
def test_offloaded_tags_come_back_bit_exact_at_the_same_addresses():
    alloc = manager()
    with alloc.use_memory_pool("weights"):
        weights = torch.randint(0, 255, (256 * MIB,), dtype=torch.uint8, device="cuda")
    with alloc.use_memory_pool("runtime"):
        runtime = torch.randn(1 << 20, device="cuda")
    with alloc.use_memory_pool("kv_cache"):
        torch.empty(512 * MIB, dtype=torch.uint8, device="cuda")
    expected_weights, expected_runtime = weights.clone(), runtime.clone()  # outside any pool
    pointers = (weights.data_ptr(), runtime.data_ptr())

    for _ in range(3):
        alloc.sleep(offload_tags=("weights", "runtime"))
        assert alloc.mapped_bytes() == 0
        with poisoned_remaps(alloc):
            alloc.wake_up()
        assert (weights.data_ptr(), runtime.data_ptr()) == pointers
        assert torch.equal(weights, expected_weights)
        assert torch.equal(runtime, expected_runtime)


@cuda_path_only  # ROCm holds each sleeping range with a placeholder: no runs there
@fresh_process
def test_neighbouring_weights_wake_as_one_run_that_each_sleep_gives_back_whole():
    alloc = manager()
    torch.cuda.init()
    with alloc.use_memory_pool("weights"):
        weights = [
            torch.randint(0, 255, (size * MIB,), dtype=torch.uint8, device="cuda")
            for size in (64, 96, 160, 200)
        ]
    expected = [w.clone() for w in weights]
    records = [allocation_of(alloc, w) for w in weights]
    assert len({r.address for r in records}) == len(weights)
    # Reserved one right after the other: neighbours.
    ordered = sorted(records, key=lambda r: r.address)
    assert all(a.address + a.size == b.address for a, b in itertools.pairwise(ordered))
    free_awake, _ = torch.cuda.mem_get_info()
    for cycle in range(3):
        alloc.sleep(offload_tags=("weights",))
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_asleep - free_awake >= sum(r.size for r in records)
        with poisoned_remaps(alloc):
            alloc.wake_up()
        # Every wake maps them with one allocation and one mapping.
        runs = {id(r.run) for r in records}
        assert len(runs) == 1 and records[0].run is not None, cycle
        assert all(torch.equal(w, e) for w, e in zip(weights, expected, strict=True))
        weights[0].add_(1)
        expected[0].add_(1)

    # A weight torch frees while the others stay mapped keeps its bytes on the
    # device (said by all_mapped_bytes) until the next sleep gives the run back.
    freed_address, freed_size = records[1].address, records[1].size
    mapped_before = alloc.all_mapped_bytes()
    del weights[1], expected[1], records[1]
    torch.cuda.empty_cache()
    assert freed_address not in alloc.allocations
    assert alloc.all_mapped_bytes() == mapped_before
    alloc.sleep(offload_tags=("weights",))
    assert alloc.all_mapped_bytes() == 0
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_awake >= sum(r.size for r in records) + freed_size
    alloc.wake_up()
    assert all(torch.equal(w, e) for w, e in zip(weights, expected, strict=True))

    # Dropped (level 2) and woken: a run again, the bytes given back each time.
    alloc.sleep(offload_tags=())
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep - free_awake >= sum(r.size for r in records) + freed_size
    alloc.wake_up()
    assert records[1].run is not None and records[1].run is records[2].run
    weights[0].fill_(7)
    assert int(weights[0][-1]) == 7


def test_an_allocation_of_1_gib_or_more_starts_at_a_multiple_of_1_gib_and_wakes_there():
    """The driver releases a range aligned so about 10% faster (issue 38)."""
    alloc = manager()
    with alloc.use_memory_pool("kv_cache"):
        large = torch.empty(1536 * MIB, dtype=torch.uint8, device="cuda")
    start = large.data_ptr()
    assert start % GIB == 0, f"the allocation starts at {start:#x}"
    alloc.sleep(offload_tags=())
    assert alloc.mapped_bytes("kv_cache") == 0
    alloc.wake_up()
    assert large.data_ptr() == start
    large.fill_(3)
    torch.cuda.synchronize()
    assert bool((large == 3).all())


def capture_into_graph_pool(alloc, weight, x, with_capture_time_state):
    """Captures out = relu(x @ weight) * 2 (+ bias) into the cudagraph pool.

    With `with_capture_time_state`, `bias` is allocated during capture but only
    written after it: replays read it without writing it, so it needs a backup.
    The graph holds it, as a backend holds the state it builds at capture (a
    block torch has allocated is backed up; one freed during capture is
    scratch, written by every replay before it is read).
    """
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.relu(x @ weight)  # warm up cuBLAS outside capture
    torch.cuda.current_stream().wait_stream(stream)
    bias = None
    # Captured on the warmed-up stream, whose cuBLAS workspace torch made outside
    # every pool (torch.cuda.graph's own side stream would get one in the pool).
    with alloc.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool.id, stream=stream):
        if with_capture_time_state:
            bias = torch.empty(x.shape[0], weight.shape[1], device=x.device)
        out = torch.relu(x @ weight) * 2
        if bias is not None:
            out = out + bias
    if bias is not None:
        bias.fill_(0.5)
    graph.capture_time_state = bias
    return graph, out


def expected_output(x, weight, with_capture_time_state):
    out = torch.relu(x @ weight) * 2
    return out + 0.5 if with_capture_time_state else out


def matmul_operands(alloc):
    """The graphs' weight (in the weights pool) and input."""
    with alloc.use_memory_pool("weights"):
        weight = torch.randn(1024, 1024, device="cuda")
    return weight, torch.randn(64, 1024, device="cuda")


def replayed_capture(alloc, weight, x, with_capture_time_state):
    """capture_into_graph_pool, replayed once: (graph, out, what out must hold)."""
    graph, out = capture_into_graph_pool(alloc, weight, x, with_capture_time_state)
    graph.replay()
    return graph, out, expected_output(x, weight, with_capture_time_state)


@fresh_process
def test_graph_pool_is_backed_up_and_replays_after_any_wake():
    alloc = manager()
    weight, x = matmul_operands(alloc)
    reference_weight = weight.clone()
    graph, out = capture_into_graph_pool(alloc, weight, x, with_capture_time_state=True)
    graph_entries = entries(alloc, GRAPH_TAG)
    assert sum(graph_entries.values()) > 0

    x.copy_(torch.randn_like(x))
    graph.replay()
    expected = expected_output(x, weight, True)
    assert torch.equal(out, expected)

    # Full wake.
    alloc.sleep(offload_tags=("weights", GRAPH_TAG))
    assert alloc.mapped_bytes() == 0
    with poisoned_remaps(alloc):
        alloc.wake_up()
    graph.replay()
    assert torch.equal(out, expected)

    # A wake naming only kv_cache brings the graph pool back, in place.
    alloc.sleep(offload_tags=("weights", GRAPH_TAG))
    with poisoned_remaps(alloc):
        alloc.wake_up(["kv_cache"])
    assert entries(alloc, GRAPH_TAG) == graph_entries
    assert alloc.mapped_bytes("weights") == 0
    with poisoned_remaps(alloc):
        alloc.wake_up(["weights"])
    assert torch.equal(weight, reference_weight)
    graph.replay()
    assert torch.equal(out, expected)


@fresh_process
def test_graph_scratch_is_left_out_of_the_backup_and_replays_exact():
    alloc = manager()
    weight, x = matmul_operands(alloc)
    graph, out, expected = replayed_capture(alloc, weight, x, with_capture_time_state=True)
    held = out.numel() * out.element_size() + graph.capture_time_state.numel() * 4
    for _ in range(3):
        alloc.sleep(offload_tags=("weights", GRAPH_TAG))
        usage = alloc.usage_by_tag()[GRAPH_TAG]
        # What the graph keeps is backed up; the matmul's freed temporary is not.
        assert held <= usage["backed_up"] < held + (1 << 20)
        assert usage["dropped"] >= x.shape[0] * weight.shape[1] * 4
        with poisoned_remaps(alloc):
            alloc.wake_up()
        graph.replay()
        assert torch.equal(out, expected)


@fresh_process
def test_dropped_graph_pool_replays_when_the_graph_writes_all_it_reads():
    alloc = manager()
    weight, x = matmul_operands(alloc)
    graph, out, expected = replayed_capture(alloc, weight, x, with_capture_time_state=False)
    assert torch.equal(out, expected)

    for _ in range(3):
        alloc.sleep(offload_tags=("weights",))  # the graph pool is dropped
        assert alloc.usage_by_tag()[GRAPH_TAG]["dropped"] > 0
        with poisoned_remaps(alloc):
            alloc.wake_up()
        # Zeroed on ROCm (the rocm-on-cuda build included), stale elsewhere.
        stale = 0 if alloc.zero_on_wake else POISON
        assert bool((out.view(torch.uint8) == stale).all())
        graph.replay()
        assert torch.equal(out, expected)


def in_use_outside_the_graph_pool(alloc, *streams) -> dict[int, int]:
    """Bytes in use per torch segment of `streams` that is not in the graph pool."""
    in_graph_pool = {segment["address"] for segment in alloc.graph_pool_segments()}
    handles = {stream.cuda_stream for stream in streams}
    return {
        segment["address"]: segment["allocated_size"]
        for segment in torch.cuda.memory_snapshot()
        if segment["stream"] in handles
        and segment["address"] not in in_graph_pool
        and segment["allocated_size"] > 0
    }


def recorded_graph_sleep_logs() -> list[logging.LogRecord]:
    """The allocator's log records from now on, its INFO lines included
    whatever this process set."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("vllm.graph_sleep")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return records


def replays_exactly_and_every_sleep_releases_the_workspaces(alloc, graph, out, expected, records):
    """Three sleeps (weights backed up) and poisoned wakes: the graph replays
    exactly after each, no warning is logged, and each sleep's INFO line says
    torch's cuBLAS workspaces were released."""
    for _ in range(3):
        alloc.sleep(offload_tags=("weights",))
        with poisoned_remaps(alloc):
            alloc.wake_up()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    sleeps = [
        r.getMessage()
        for r in records
        if r.levelno == logging.INFO and r.getMessage().startswith("graph-sleep sleep:")
    ]
    assert len(sleeps) == 3 and all("cuBLAS workspaces released" in line for line in sleeps)


@fresh_process
def test_a_side_stream_the_graph_forks_onto_gets_its_workspaces_in_the_pool_and_they_go():
    """vLLM's aux stream (MoE shared experts): eager work there before the first
    capture made its cuBLAS workspace outside every pool, as the capture
    stream's did. What graph_capture does with offload on drops them and makes
    both streams' in the graph pool before the warm-up, which forks onto the
    side stream eagerly (without that, its workspace would be made outside
    again); a sleep can then release torch's workspaces, and the graph still
    replays exactly after every wake."""
    alloc = manager()
    records = recorded_graph_sleep_logs()
    weight, x = matmul_operands(alloc)
    capture, side = torch.cuda.Stream(), torch.cuda.Stream()
    # The first live graph of a process has torch make the default generator's
    # graph-safe RNG state (two 8-byte tensors) on its capture stream, outside
    # every pool, until the last graph goes (1024 bytes in use on the H200, run
    # 7), as it does in an engine. A graph held for the whole test puts it on
    # `capture` before anything else; nothing may be added to what is in use
    # outside the graph pool on the two streams then.
    rng_state_holder = torch.cuda.CUDAGraph()
    with torch.cuda.graph(rng_state_holder, stream=capture):
        torch.zeros(1, device="cuda").add_(1)
    in_use_before = in_use_outside_the_graph_pool(alloc, capture, side)
    assert sum(in_use_before.values()) <= 1024
    for stream in (capture, side):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.relu(x @ weight)
    torch.cuda.synchronize()

    def forward():
        routed = torch.relu(x @ weight)
        side.wait_stream(capture)
        with torch.cuda.stream(side):
            shared = (x @ weight) * 2
        capture.wait_stream(side)
        return routed + shared

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture):
        alloc.create_blas_workspaces_in_graph_pool(side_streams=[side])
        forward()  # the warm-up
        with alloc.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool.id, stream=capture):
            out = forward()
    assert {capture.cuda_stream, side.cuda_stream} <= alloc.trusted_streams()
    graph_segments = alloc.graph_pool_segments()
    assert any(s["stream"] == side.cuda_stream and s["allocated_size"] > 0 for s in graph_segments)
    graph.replay()
    expected = torch.relu(x @ weight) + (x @ weight) * 2
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert in_use_outside_the_graph_pool(alloc, capture, side) == in_use_before

    replays_exactly_and_every_sleep_releases_the_workspaces(alloc, graph, out, expected, records)


@fresh_process
def test_a_graph_captured_on_torchs_own_stream_still_lets_a_sleep_release_the_workspaces():
    """Model runner V2 captures its FULL graphs with torch.cuda.graph and no
    stream: on torch's default capture stream, which has no workspace of ours.
    The first graph of a process has torch make its graph-safe RNG state on its
    capture stream, outside every pool; what graph_capture does with offload on
    puts that state on vLLM's capture stream first, so nothing of torch's stays
    outside the graph pool on torch's stream, a sleep can release the
    workspaces, and the graph replays exactly after every wake."""
    alloc = manager()
    records = recorded_graph_sleep_logs()
    weight, x = matmul_operands(alloc)
    vllms_stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(vllms_stream):
        alloc.create_blas_workspaces_in_graph_pool()
        torch.relu(x @ weight)  # the warm-up
        with alloc.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool.id):
            out = torch.relu(x @ weight) * 2
    torchs_stream = torch.cuda.graph.default_capture_stream
    assert torchs_stream is not None
    assert in_use_outside_the_graph_pool(alloc, torchs_stream) == {}
    graph.replay()
    expected = torch.relu(x @ weight) * 2
    torch.cuda.synchronize()
    assert torch.equal(out, expected)

    replays_exactly_and_every_sleep_releases_the_workspaces(alloc, graph, out, expected, records)


@fresh_process
def test_plain_capture_without_our_pool_is_unaffected():
    alloc = manager()
    weight, x = matmul_operands(alloc)
    torch.relu(x @ weight)
    ours_before = set(alloc.allocations)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.relu(x @ weight) * 2
    assert set(alloc.allocations) == ours_before
    assert not entries(alloc, GRAPH_TAG)

    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    graph.replay()
    assert torch.equal(out, torch.relu(x @ weight) * 2)


@pytest.mark.parametrize("zero_on_wake", [True, False], ids=["zeroing", "no-zeroing"])
@fresh_process
def test_poisoned_remap_reads_zero_only_when_zeroing(zero_on_wake):
    alloc = manager()
    alloc.zero_on_wake = zero_on_wake
    with alloc.use_memory_pool("weights"):
        backed = torch.full((8 * MIB,), 7, dtype=torch.uint8, device="cuda")
    with alloc.use_memory_pool("kv_cache"):
        dropped = torch.full((8 * MIB,), 7, dtype=torch.uint8, device="cuda")
    alloc.sleep(offload_tags=("weights",))
    with poisoned_remaps(alloc):
        alloc.wake_up()
    assert bool((backed == 7).all())
    assert bool((dropped == (0 if zero_on_wake else POISON)).all())


@cuda_only
@pytest.mark.parametrize("variant", ["memset-then-sync", "memset-on-blocking-capture-stream"])
@fresh_process
def test_a_memset_in_the_mapping_path_breaks_capture(variant):
    """Why create_and_map must never memset: mapping runs inside graph capture.

    A zero-fill that is complete before the memory is used needs a synchronize,
    which is illegal during capture; and a plain memset on the legacy stream
    invalidates any capture on a blocking stream (the ROCm failure upstream).
    On torch's non-blocking capture streams a bare legacy memset does not fail,
    but it is then unordered with the graph's own work, so it is no fix either.
    """
    alloc = manager()
    runtime = cudart()
    runtime.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    codes = []

    def malloc_then_memset(device, size, address, handle):
        alloc.table.on_malloc(device, size, address, handle)
        codes.append(runtime.cudaMemset(ctypes.c_void_p(address), 0, ctypes.c_size_t(size)))
        if variant == "memset-then-sync":
            codes.append(runtime.cudaDeviceSynchronize())

    capture_kwargs = {}
    if variant == "memset-on-blocking-capture-stream":
        stream = ctypes.c_void_p()
        assert runtime.cudaStreamCreate(ctypes.byref(stream)) == 0  # default flags: blocking
        capture_kwargs["stream"] = torch.cuda.ExternalStream(stream.value)

    x = torch.randn(256, 256, device="cuda")
    torch.relu(x @ x)
    torch.cuda.synchronize()
    alloc.driver.register_callbacks(malloc_then_memset, alloc.table.on_free)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="captur"):
        with alloc.cudagraph_pool() as pool:
            with torch.cuda.graph(graph, pool=pool.id, **capture_kwargs):
                torch.relu(x @ x)
    assert any(code != 0 for code in codes)


@cuda_only
@fresh_process
def test_legacy_ipc_export_of_pool_memory_fails():
    """Why custom all-reduce must not register graph buffers from our pool."""
    alloc = manager()
    runtime = cudart()
    runtime.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    with alloc.use_memory_pool("weights"):
        ours = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    plain = torch.empty(4 * MIB, dtype=torch.uint8, device="cuda")
    handle = ctypes.create_string_buffer(64)
    assert runtime.cudaIpcGetMemHandle(handle, ctypes.c_void_p(plain.data_ptr())) == 0
    assert runtime.cudaIpcGetMemHandle(handle, ctypes.c_void_p(ours.data_ptr())) != 0


@fresh_process
def test_wake_while_memory_is_held_elsewhere_rolls_back_and_retries():
    alloc = manager()
    with alloc.use_memory_pool("weights"):
        weights = torch.randint(0, 255, (512 * MIB,), dtype=torch.uint8, device="cuda")
    expected = weights.clone()
    free_now, _ = torch.cuda.mem_get_info()
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.empty(free_now - 8 * GIB, dtype=torch.uint8, device="cuda")
    alloc.sleep(offload_tags=("weights",))

    free_asleep, _ = torch.cuda.mem_get_info()
    blocker = torch.empty(free_asleep - 4 * GIB, dtype=torch.uint8, device="cuda")
    free_blocked, _ = torch.cuda.mem_get_info()
    with pytest.raises(WakeUpError, match="out of memory") as raised:
        alloc.wake_up()
    assert isinstance(raised.value, RuntimeError)
    assert alloc.mapped_bytes() == 0
    assert alloc.usage_by_tag()["weights"]["backed_up"] == 512 * MIB
    # The weights mapping made before kv_cache failed was given back.
    assert torch.cuda.mem_get_info()[0] >= free_blocked - 64 * MIB

    del blocker
    torch.cuda.empty_cache()
    alloc.wake_up()
    assert torch.equal(weights, expected)
    kv[-MIB:].fill_(3)
    assert int(kv[-MIB:].sum()) == 3 * MIB


@fresh_process
def test_driver_errors_surface_as_runtime_errors_and_do_not_poison_the_allocator():
    alloc = manager()
    with alloc.use_memory_pool("weights"):
        first = torch.ones(MIB, device="cuda")
    allocation = alloc.allocations[first.data_ptr()]
    with pytest.raises(RuntimeError, match=r"^(cu|hip)Mem\w+ failed: "):
        alloc.driver.create_and_map(
            allocation.device, allocation.size, allocation.address, allocation.handle
        )

    library = allocator_library(alloc)
    assert library.my_malloc(1 << 60, 0, None) is None  # no such memory anywhere
    assert "failed" in alloc.driver.last_error()

    with alloc.use_memory_pool("weights"):
        second = torch.full((MIB,), 2.0, device="cuda")
    assert second.data_ptr() in alloc.allocations
    assert float(second.sum()) == 2.0 * MIB
    assert float(first.sum()) == float(MIB)


@fresh_process
def test_nested_pool_gets_its_own_segments_and_routing_returns():
    alloc = manager()
    with alloc.use_memory_pool("runtime") as outer:
        state = torch.ones(MIB, dtype=torch.uint8, device="cuda")
        with alloc.use_memory_pool("kv_cache") as inner:
            kv = torch.full((8 * MIB,), 2, dtype=torch.uint8, device="cuda")
        more_state = torch.ones(MIB, dtype=torch.uint8, device="cuda")
    owned = len(alloc.allocations)
    outside = torch.ones(MIB, dtype=torch.uint8, device="cuda")
    assert len(alloc.allocations) == owned, "routing to our pools leaked past the context"

    def segment_of(tensor: torch.Tensor, pool: torch.cuda.MemPool) -> bool:
        return any(
            s["address"] <= tensor.data_ptr() < s["address"] + s["total_size"]
            for s in pool.snapshot(include_traces=False)
        )

    assert segment_of(kv, inner) and not segment_of(kv, outer)
    assert segment_of(state, outer) and segment_of(more_state, outer)
    assert not segment_of(state, inner) and not segment_of(more_state, inner)
    assert set(entries(alloc, "kv_cache").values()) and set(entries(alloc, "runtime").values())
    alloc.sleep(offload_tags=("runtime",))
    alloc.wake_up(["kv_cache"])
    torch.cuda.synchronize()
    assert bool((state == 1).all()) and bool((more_state == 1).all())
    assert int(outside.sum()) == MIB


@fresh_process
def test_probe_sees_a_graph_captured_outside_our_pool_and_not_one_inside():
    from vllm_graph_sleep.probe import foreign_pool_bytes

    def foreign() -> int:
        return foreign_pool_bytes(torch.cuda.memory_snapshot(), set(manager().allocations))

    alloc = manager()
    static = torch.zeros(MIB, device="cuda")
    inside = torch.cuda.CUDAGraph()
    with alloc.cudagraph_pool() as pool, torch.cuda.graph(inside, pool=pool.id):
        inside_out = static * 2
    assert alloc.mapped_bytes(GRAPH_TAG) > 0 and foreign() == 0
    outside = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outside):  # a fresh private pool, as an escaped capture site gets
        outside_out = static * 3
    assert foreign() >= static.nbytes
    del inside_out, outside_out


@fresh_process
def test_a_failed_my_malloc_logs_the_drivers_reason_once_per_call(capfd):
    """Torch turns our nullptr into its generic out-of-memory error; the driver's
    reason must still reach the log, with the size and the device."""
    alloc = manager()
    library = allocator_library(alloc)
    capfd.readouterr()
    assert library.my_malloc(1 << 60, 0, None) is None
    reason = alloc.driver.last_error()
    assert re.match(r"(cu|hip)Mem\w+ failed: \S", reason), reason
    logged = [line for line in capfd.readouterr().err.splitlines() if "my_malloc" in line]
    line = f"[vllm_graph_sleep] my_malloc of {1 << 60} bytes on device 0 failed: {reason}"
    assert logged == [line]

    with pytest.raises(torch.OutOfMemoryError):
        with alloc.use_memory_pool("weights"):
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    logged = [line for line in capfd.readouterr().err.splitlines() if "my_malloc" in line]
    assert logged, "torch's out-of-memory error came without the driver's reason"
    assert all(re.search(r"on device 0 failed: (cu|hip)Mem\w+ failed: \S", line) for line in logged)


def assert_a_sleeping_range_is_held(alloc: GraphSleepAllocator, reserve) -> None:
    """Sleeps one weights allocation: while asleep, another reservation asking
    for its range or part of it (`reserve(address, size)` returns the
    address it got) and allocations of ours and torch's land elsewhere; wake
    maps the same address with its contents."""
    with alloc.use_memory_pool("weights"):
        weights = torch.randint(0, 255, (64 * MIB,), dtype=torch.uint8, device="cuda")
    expected, pointer = weights.clone(), weights.data_ptr()
    held = allocation_of(alloc, weights)
    alloc.sleep(offload_tags=("weights",))
    assert alloc.mapped_bytes() == 0

    assert reserve(held.address, held.size) != held.address
    assert reserve(held.address + 2 * MIB, 2 * MIB) != held.address + 2 * MIB
    with alloc.use_memory_pool("kv_cache"):
        ours = torch.empty(held.size, dtype=torch.uint8, device="cuda")
    theirs = torch.empty(held.size, dtype=torch.uint8, device="cuda")
    assert not overlaps(ours, held.address, held.size)
    assert not overlaps(theirs, held.address, held.size)

    alloc.wake_up()
    assert weights.data_ptr() == pointer
    assert torch.equal(weights, expected)


@cuda_path_only  # asks the CUDA driver directly; the ROCm path's twin is below
@fresh_process
def test_nothing_else_can_take_a_sleeping_range_and_wake_gets_it_back(capfd):
    """While asleep the range is held (on CUDA by the arena chunk it came
    from, on ROCm by an empty placeholder reservation), so no other mapping
    can take it before wake. Freeing a sleeping allocation gives its range
    back to its chunk: nothing else can take it while the chunk lives, and the
    extension does not hand it out again."""
    alloc = manager()
    library = allocator_library(alloc)
    # Control: on this driver a free range goes to whoever asks for it.
    free_range = reserve_elsewhere(0, 8 * MIB)
    assert reserve_elsewhere(free_range, 8 * MIB) == free_range

    assert_a_sleeping_range_is_held(alloc, reserve_elsewhere)

    asleep = library.my_malloc(8 * MIB, 0, None)
    alloc.sleep(offload_tags=())
    capfd.readouterr()
    library.my_free(asleep, 8 * MIB, 0, None)
    assert "[vllm_graph_sleep]" not in capfd.readouterr().err
    assert asleep not in alloc.allocations
    assert reserve_elsewhere(asleep, 8 * MIB) != asleep
    after = library.my_malloc(8 * MIB, 0, None)
    assert after is not None and after != asleep
    library.my_free(after, 8 * MIB, 0, None)


@cuda_path_only  # ROCm reserves each range on its own
@fresh_process
def test_an_arena_chunk_goes_back_to_the_driver_once_it_is_done_and_its_ranges_are_freed():
    """The CUDA path hands ranges out of large reservations one after another
    and never twice, so that a wake can map neighbouring weights at once
    (issue 38). A chunk that hands out no more ranges and has none out is
    freed: address space freed by torch comes back to the driver.

    Whether a chunk is free is asked of the driver with a reservation as
    large as the ranges, hinted at the chunk's start: on driver 580 a hint of
    8 MiB there is never honoured, one of 32 GiB aligned to 1 GiB is once the
    chunk is gone (lease 19, docs/results/archive/sleep-speed-h100-2026-12-07.md)."""
    alloc = manager()
    library = allocator_library(alloc)
    free_bytes, _ = torch.cuda.mem_get_info()
    size = min(32 * GIB, free_bytes // 2 // GIB * GIB)
    assert size >= GIB

    def hand_out_and_free() -> int:
        # Maps its memory and gives it back: only the address space adds up.
        address = library.my_malloc(size, 0, None)
        assert address is not None
        library.my_free(address, size, 0, None)
        return address

    def chunk_is_free(start: int) -> bool:
        return reserve_elsewhere(start, size, GIB) == start

    # In a fresh process the first range opens the first chunk.
    first = library.my_malloc(8 * MIB, 0, None)
    library.my_free(first, 8 * MIB, 0, None)
    assert not chunk_is_free(first)  # it still hands out ranges
    # Until a newer chunk hands out ranges: then the first is given back.
    calls, newest = 0, first
    while not chunk_is_free(first):
        newest = hand_out_and_free()
        calls += 1
        assert calls * size <= 1024 * GIB, "the first chunk was never given back"
    assert calls > 1
    # The call that opened the newest chunk got its start.
    assert not chunk_is_free(newest)

    # A range still out keeps its chunk after a newer one took over, and
    # freeing it gives the chunk back.
    kept = library.my_malloc(8 * MIB, 0, None)
    for _ in range(calls):  # as many as the first chunk took: past this one
        hand_out_and_free()
    assert not chunk_is_free(newest)
    library.my_free(kept, 8 * MIB, 0, None)
    assert chunk_is_free(newest)


@rocm_on_cuda_only
@fresh_process
def test_on_the_rocm_path_the_placeholder_keeps_the_range_from_other_reservations():
    """The ROCm path frees the range itself at sleep (AMD returns VRAM only
    then) and holds it with an empty placeholder: another reservation asking
    for that address, or any allocation, lands elsewhere, and wake maps the
    same address with its contents."""
    alloc = manager()
    assert alloc.driver.is_rocm()
    library = allocator_library(alloc)
    library.hip_shim_reserve_elsewhere.restype = ctypes.c_ulonglong
    library.hip_shim_reserve_elsewhere.argtypes = [ctypes.c_ulonglong, ctypes.c_size_t]
    # Control: a range the allocator freed goes to the next one who asks for it.
    free_range = library.my_malloc(8 * MIB, 0, None)
    library.my_free(free_range, 8 * MIB, 0, None)
    assert library.hip_shim_reserve_elsewhere(free_range, 8 * MIB) == free_range

    assert_a_sleeping_range_is_held(alloc, library.hip_shim_reserve_elsewhere)


@rocm_on_cuda_only
@fresh_process
def test_a_lost_placeholder_fails_the_wake_cleanly_and_a_retry_succeeds(capfd):
    """If another thread takes the range between sleep's free and its
    placeholder, sleep still completes, wake fails without mapping anything,
    and succeeds at the same address once the range is free again."""
    alloc = manager()
    assert alloc.driver.is_rocm() and alloc.zero_on_wake  # the ROCm path, chosen by the build
    library = ctypes.CDLL(alloc.driver.library_path())
    library.hip_shim_return_stolen_range.restype = ctypes.c_ulonglong
    expected = torch.randint(0, 255, (64 * MIB,), dtype=torch.uint8, device="cuda")
    with alloc.use_memory_pool("weights"):
        weights = torch.empty_like(expected)  # the one allocation of ours: the one stolen
    weights.copy_(expected)
    pointer = weights.data_ptr()
    (held,) = alloc.allocations.values()

    capfd.readouterr()
    library.hip_shim_steal_next_freed_range()
    alloc.sleep(offload_tags=("weights",))
    assert f"sleep of {held.address:#x} holds no placeholder" in capfd.readouterr().err
    with pytest.raises(WakeUpError, match="is taken by another mapping"):
        alloc.wake_up()
    assert alloc.mapped_bytes() == 0
    assert alloc.usage_by_tag()["weights"]["backed_up"] == held.size

    assert library.hip_shim_return_stolen_range() == held.address
    alloc.wake_up()
    assert weights.data_ptr() == pointer
    assert torch.equal(weights, expected)


@fresh_process
def test_a_pool_hands_back_free_segments_when_its_context_exits():
    """Dead memory of a load (bf16 weights quantized online, repacked MoE
    weights) is not kept mapped, nor copied to host at every sleep."""
    alloc = manager()
    with alloc.use_memory_pool("weights"):
        weights = torch.full((8 * MIB,), 7, dtype=torch.uint8, device="cuda")
        scratch = torch.ones(64 * MIB, dtype=torch.uint8, device="cuda")
        later = torch.ones(32 * MIB, dtype=torch.uint8, device="cuda")
        del scratch
    free_after_exit = torch.cuda.mem_get_info()[0]
    assert alloc.mapped_bytes("weights") < 64 * MIB, "the free 64 MiB segment stayed mapped"
    del later  # freed after the context: handed back before the next sleep backs it up
    alloc.sleep(offload_tags=("weights",))
    assert alloc.host_bytes() < 32 * MIB
    assert torch.cuda.mem_get_info()[0] >= free_after_exit + 8 * MIB
    alloc.wake_up()
    torch.cuda.synchronize()
    assert bool((weights == 7).all())


@fresh_process
def test_gemma4_centroid_graphs_land_in_our_pool_and_replay_after_sleep():
    """vLLM 0.26's own Gemma4Proposer._setup_centroids_cuda_graphs, run on a
    stand-in drafter (random centroid weights), inside load_model's weights pool."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.gemma4 import Gemma4Proposer

    from vllm_graph_sleep import config
    from vllm_graph_sleep.patches import v1_spec_decode_gemma4
    from vllm_graph_sleep.probe import foreign_pool_bytes

    v1_spec_decode_gemma4.apply()
    config.mark_active()
    alloc = manager()
    hidden, vocab = 256, 4096

    class MaskedEmbedding:
        hidden_size = hidden

        @staticmethod
        def get_top_tokens(states, lm_head):
            return torch.topk(states.float() @ lm_head.float().t(), k=4, dim=-1).indices

    with alloc.use_memory_pool("weights"):
        lm_head = torch.randn(vocab, hidden, dtype=torch.bfloat16, device="cuda")
        drafter = SimpleNamespace(
            model=SimpleNamespace(
                masked_embedding=MaskedEmbedding(), _get_full_lm_head_weight=lambda: lm_head
            ),
            dtype=torch.bfloat16,
            device=torch.device("cuda"),
            _centroids_graphs={},
            _centroids_inputs={},
            _centroids_outputs={},
        )
        Gemma4Proposer._setup_centroids_cuda_graphs(drafter)
    graph_bytes = alloc.mapped_bytes(GRAPH_TAG)
    assert graph_bytes > 0
    assert foreign_pool_bytes(torch.cuda.memory_snapshot(), set(alloc.allocations)) == 0

    alloc.sleep(offload_tags=("weights", GRAPH_TAG))
    assert alloc.mapped_bytes() == 0
    alloc.wake_up()
    for size, graph in drafter._centroids_graphs.items():
        states = torch.randn(size, hidden, dtype=torch.bfloat16, device="cuda")
        drafter._centroids_inputs[size].copy_(states)
        graph.replay()
        expected = MaskedEmbedding.get_top_tokens(states, lm_head)
        assert torch.equal(drafter._centroids_outputs[size], expected), size


@fresh_process
def test_sleep_releases_the_stack_reservation_and_graphs_replay_after_wake():
    """The context's per-thread stack reservation is lowered while asleep and
    back before wake returns: a replay with too little stack would fail."""
    alloc = manager()
    driver = alloc.driver
    static = torch.ones(MIB, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with alloc.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool.id):
        out = static * 2 + 1
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    limit = driver.stack_limit(device)
    pool_bytes = alloc.mapped_bytes()
    free_before = torch.cuda.mem_get_info()[0]
    alloc.sleep(offload_tags=(GRAPH_TAG,))
    assert driver.stack_limit(device) == 0
    freed = torch.cuda.mem_get_info()[0] - free_before
    print(f"stack limit {limit} B/thread; sleep freed {freed / MIB:.1f} MiB, pool {pool_bytes}")
    assert freed > pool_bytes + 64 * MIB, "the stack reservation was not given back"
    alloc.wake_up()
    assert driver.stack_limit(device) == limit
    static.fill_(3)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((out == 7).all())


@fresh_process
def test_an_engine_shut_down_asleep_leaves_the_next_one_its_stack_and_its_leftovers_mapped():
    """Issue 34, item 3: shutdown while asleep gives the stack limit back and
    stops the settle thread; what the engine left referenced (as vLLM's rotary
    caches are) is mapped back with its contents when the next engine starts,
    whose first sleep lowers the stack again and whose graphs replay."""
    from vllm_graph_sleep.patches.v1_worker_gpu_worker import orphan_leftovers

    alloc = manager()
    driver = alloc.driver
    device = torch.cuda.current_device()
    limit = driver.stack_limit(device)
    with alloc.use_memory_pool("weights"):
        rope = torch.full((MIB,), 7.0, device="cuda")
        dead = torch.ones(64 * MIB, dtype=torch.uint8, device="cuda")
    alloc.sleep(offload_tags=("weights",))
    assert driver.stack_limit(device) == 0
    alloc.release_pools()  # Worker.shutdown, asleep
    del dead
    assert driver.stack_limit(device) == limit
    assert not [t for t in threading.enumerate() if t.name == "graph-sleep-settle"]

    orphan_leftovers(alloc)  # the next engine's init_device
    assert float(rope.sum()) == 7.0 * MIB
    with alloc.use_memory_pool("weights"):
        weights = torch.full((MIB,), 2.0, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with alloc.cudagraph_pool() as pool, torch.cuda.graph(graph, pool=pool.id):
        out = weights * rope
    torch.cuda.synchronize()
    alloc.sleep(offload_tags=("weights", GRAPH_TAG))
    assert driver.stack_limit(device) == 0, "the next engine's first sleep kept the stack"
    assert float(rope.sum()) == 7.0 * MIB  # set apart: its sleeps leave it mapped
    alloc.wake_up()
    assert driver.stack_limit(device) == limit
    weights.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((out == 21.0).all())


@fresh_process
def test_the_driver_probe_maps_nothing_for_good_and_a_sleep_makes_it_from_its_thread(caplog):
    """probe_mapping gives back all it maps, also from a thread that never
    touched the device; after a sleep the allocator's thread probes twice and
    the wake's log line says so (what it paid is printed, not asserted)."""
    alloc = manager()
    driver = alloc.driver
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    failures = []

    def probe_from_a_new_thread():
        try:
            driver.probe_mapping(device)
        except Exception as error:  # reported below, in the test's thread
            failures.append(error)

    thread = threading.Thread(target=probe_from_a_new_thread)
    thread.start()
    thread.join()
    driver.probe_mapping(device)
    assert failures == [] and torch.cuda.mem_get_info()[0] == free_before
    with pytest.raises(RuntimeError, match=r"^(cu|hip)\w+ failed: "):
        driver.probe_mapping(torch.cuda.device_count() + 7)

    with alloc.use_memory_pool("kv_cache"):
        kv = torch.ones(GIB, dtype=torch.uint8, device="cuda")
    with alloc.use_memory_pool("weights"):
        weights = torch.full((MIB,), 5.0, device="cuda")
    alloc.sleep(offload_tags=("weights",))
    time.sleep(0.5)
    with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
        alloc.wake_up()
    (line,) = [r.getMessage() for r in caplog.records if "wake_up" in r.getMessage()]
    print(line)
    assert re.search(r"2 driver probe\(s\) while asleep, \d+\.\d ms;", line), line
    assert float(weights.sum()) == 5.0 * MIB and kv.numel() == GIB


def test_a_process_that_exits_during_a_driver_probe_waits_for_it_and_exits_cleanly(tmp_path):
    """The probe thread's exit hook on a real driver: the script ends while the
    thread is inside a probe (held there after the real probe returns), and the
    interpreter waits for it instead of tearing the context down under it."""
    marks = tmp_path / "marks"
    script = f"""
import pathlib, time, torch
from vllm_graph_sleep._native import VmmDriver
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.settle import Settler

marks = pathlib.Path({str(marks)!r})
driver = VmmDriver()

def probe_then_linger(device):
    with marks.open("a") as f:
        f.write("began\\n")
    driver.probe_mapping(device)
    time.sleep(0.4)
    with marks.open("a") as f:
        f.write("ended\\n")

alloc = GraphSleepAllocator(driver, settler=Settler(probe_then_linger))
with alloc.use_memory_pool("weights"):
    weights = torch.ones(1 << 30, dtype=torch.uint8, device="cuda")
alloc.sleep(offload_tags=("weights",))
time.sleep(0.2)  # the first probe (at 50 ms) is under way when the script ends
"""
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert marks.read_text() == "began\nended\n", child.stderr[-2000:]


@fresh_process
def test_coded_weight_backups_come_back_bit_exact_in_two_thirds_of_the_bytes(caplog):
    """VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS on a real GPU: the compiled coder and
    decoder, the wake's two-stream pipeline, poisoned remaps, three cycles."""
    alloc = manager()
    alloc.compress_backups = True
    generator = torch.Generator("cuda").manual_seed(0)
    source = (torch.randn(96 * MIB, generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
    noise_source = torch.randint(0, 256, (8 * MIB,), dtype=torch.uint8, device="cuda")
    with alloc.use_memory_pool("weights"):
        weights = torch.empty_like(source)  # 192 MiB: three pieces
        noise = torch.empty_like(noise_source)
    weights.copy_(source)
    noise.copy_(noise_source)
    for _ in range(3):
        with caplog.at_level(logging.INFO, logger="vllm.graph_sleep"):
            alloc.sleep(offload_tags=("weights",))
        (line,) = [r.getMessage() for r in caplog.records if "graph-sleep sleep" in r.getMessage()]
        caplog.clear()
        print(line)
        allocation = allocation_of(alloc, weights)
        assert allocation.coded is not None, line
        assert allocation.coded.coded_bytes < 0.7 * allocation.backup_bytes(), line
        with poisoned_remaps(alloc):
            alloc.wake_up()
        assert torch.equal(weights, source) and torch.equal(noise, noise_source)


@fresh_process
@pytest.mark.parametrize("lane, bits", [(-1, -3 * 32), (0, 32)], ids=["under", "over"])
def test_a_count_that_disagrees_with_the_encoder_is_kept_raw(monkeypatch, caplog, lane, bits):
    """The compiled coder with a count kernel that under-reports the last
    lane's bits (the check decoded up to the bound and passed; the wake read
    zeros past the total) or over-reports a lane's: every piece is kept raw,
    logged, and comes back bit-exact (issue 34, item 1)."""
    from vllm_graph_sleep import coded_backup, exponent_codec

    alloc = manager()
    alloc.compress_backups = True
    alloc.prepare_backup_kernels(torch.device("cuda", torch.cuda.current_device()))
    real_count_lanes = exponent_codec.count_lanes

    def count_wrong(words, lengths, lane_bits):
        real_count_lanes(words, lengths, lane_bits)
        lane_bits[lane] += bits

    monkeypatch.setattr(exponent_codec, "count_lanes", count_wrong)
    generator = torch.Generator("cuda").manual_seed(5)
    source = (torch.randn(64 * MIB, generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
    with alloc.use_memory_pool("weights"):
        weights = torch.empty_like(source)  # 128 MiB: two pieces
    weights.copy_(source)
    with caplog.at_level(logging.ERROR, logger="vllm.graph_sleep"):
        alloc.sleep(offload_tags=("weights",))
    pieces = allocation_of(alloc, weights).coded.pieces
    assert len(pieces) == 128 * MIB // coded_backup.PIECE_BYTES
    assert all(piece.coded is None for piece in pieces)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == len(pieces), errors
    assert all("(1 lanes did not end where their counts said" in error for error in errors), errors
    with poisoned_remaps(alloc):
        alloc.wake_up()
    assert torch.equal(weights, source)


def hold_all_free_memory_but(keep: int, smallest: int = 16 * MIB) -> list[torch.Tensor]:
    """Takes device memory from torch's own pool until less than `keep` +
    `smallest` is free, never below `keep`: torch rounds a request over 10 MiB
    to 2 MiB (a smaller one can take a 20 MiB block)."""
    held, size = [], GIB
    while size >= smallest:
        if torch.cuda.mem_get_info()[0] - keep < size:
            size //= 2
            continue
        try:
            held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            size //= 2
    return held


@fresh_process
def test_a_coded_wake_fits_in_exactly_what_the_sleep_freed(monkeypatch):
    """The decoder's two staging slots (about 86 MiB for 64 MiB pieces) are
    taken while the KV cache is still unmapped and given back before it maps:
    a coded wake needs no more free memory than the sleep freed, as a raw one
    (issue 34, item 11)."""
    # No driver probe while asleep: its passing mapping would be counted out
    # of what the sleep freed (a wake stops the probe before it maps).
    monkeypatch.setenv(SETTLE_AFTER_SLEEP_ENV, "0")
    alloc = manager()
    alloc.compress_backups = True
    alloc.prepare_backup_kernels(torch.device("cuda", torch.cuda.current_device()))
    generator = torch.Generator("cuda").manual_seed(3)
    source = (torch.randn(512 * MIB, generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
    with alloc.use_memory_pool("weights"):
        weights = torch.empty_like(source)  # 1 GiB: 16 pieces
    weights.copy_(source)
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_awake = torch.cuda.mem_get_info()[0]
    alloc.sleep(offload_tags=("weights",))
    assert allocation_of(alloc, weights).coded is not None
    freed = torch.cuda.mem_get_info()[0] - free_awake
    assert freed >= weights.nbytes + kv.nbytes
    # Mapping back takes the driver a few MiB more than the sleep's release
    # returned, raw or coded (on an H200 a raw wake of these allocations failed
    # with 1 MiB over what the sleep freed and succeeded with 7): 16-32 MiB over
    # is room for that and far from the staging's 86 MiB, which the wake needed
    # on top before it gave the staging back first.
    blocker = hold_all_free_memory_but(freed + 16 * MIB)
    free_blocked = torch.cuda.mem_get_info()[0]
    assert freed + 16 * MIB <= free_blocked < freed + 32 * MIB
    alloc.wake_up()
    # The checks below take device memory of their own (torch.equal's result).
    del blocker
    assert torch.equal(weights, source)
    kv[-MIB:].fill_(4)
    assert int(kv[-MIB:].sum()) == 4 * MIB


@fresh_process
def test_a_weight_allocation_of_4_gib_is_coded_without_compiling_after_the_warm_up():
    """A size of 2**31 or more is passed to Triton as i64 whatever
    do_not_specialize says: the histogram kernel took a second variant at the
    first sleep of an engine with a 4 GiB weight allocation, after the
    warm-up (issue 34, item 10). Counted in Triton's cache of each kernel."""
    from vllm_graph_sleep import exponent_codec

    alloc = manager()
    alloc.compress_backups = True
    device = torch.cuda.current_device()
    alloc.prepare_backup_kernels(torch.device("cuda", device))  # the worker's warm-up
    kernels = {
        name: getattr(exponent_codec, name)
        for name in ("_histogram_kernel", "_count_kernel", "_encode_kernel", "_decode_kernel")
    }

    def variants() -> dict[str, int]:
        return {name: len(kernel.device_caches[device][0]) for name, kernel in kernels.items()}

    warmed_up = variants()
    assert all(warmed_up.values()), warmed_up
    with alloc.use_memory_pool("weights"):
        weights = torch.empty(2 << 30, dtype=torch.bfloat16, device="cuda")  # 4 GiB
    weights.normal_(0, 0.02, generator=torch.Generator("cuda").manual_seed(4))
    expected = weights.clone()
    alloc.sleep(offload_tags=("weights",))
    coded = allocation_of(alloc, weights).coded
    assert coded is not None and all(piece.coded is not None for piece in coded.pieces)
    alloc.wake_up()
    assert torch.equal(weights, expected)
    assert variants() == warmed_up


CUDA_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost: page-locked host memory
CUDA_ERROR_INVALID_VALUE = 1


class PointerAttributes(ctypes.Structure):
    """cudaPointerAttributes as of CUDA 12/13: 88 bytes with its reserved
    words (https://docs.nvidia.com/cuda/cuda-runtime-api/structcudaPointerAttributes.html),
    plus slack for fields a later runtime adds. A 64-byte buffer here let the
    runtime write past it, and the test process crashed later (H200 run 6)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("device_pointer", ctypes.c_void_p),
        ("host_pointer", ctypes.c_void_p),
        ("reserved", ctypes.c_long * 8),
        ("slack", ctypes.c_byte * 256),
    ]


def is_registered_host_memory(runtime: ctypes.CDLL, address: int) -> bool:
    """What the CUDA runtime says of `address`: page-locked host memory or not."""
    attributes = PointerAttributes()
    error = runtime.cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(address))
    if error == CUDA_ERROR_INVALID_VALUE:  # how some runtimes answer for unknown memory
        runtime.cudaGetLastError()
        return False
    assert error == 0, f"cudaPointerGetAttributes failed: {error}"
    return attributes.type == CUDA_MEMORY_TYPE_HOST


@fresh_process
def test_host_buffers_are_registered_at_their_size_until_their_last_view_dies(monkeypatch):
    """The driver's host buffers: exactly the size asked for, page-locked with
    cudaHostRegister (not torch's pinned allocator), right bytes both ways with
    the allocator's asynchronous copies, and unregistered once their last view
    is gone, not before."""
    from vllm_graph_sleep._native import VmmDriver, registered_host_memory

    monkeypatch.delenv("VLLM_GRAPH_SLEEP_HOST_BUFFERS", raising=False)
    runtime = cudart()
    driver = VmmDriver()
    size = 20 * MIB + 123
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
    torch_pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    registered = registered_host_memory()[0]
    host = driver.host_buffer(size)
    address = host.data_ptr()
    assert host.numel() == size
    assert host.is_pinned()
    assert is_registered_host_memory(runtime, address)
    assert registered_host_memory()[0] - registered >= size
    assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == torch_pinned

    host.copy_(data, non_blocking=True)
    torch.cuda.synchronize()
    back = torch.empty_like(data)
    back.copy_(host[:], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, data)

    tail = host[MIB:]
    del host
    assert is_registered_host_memory(runtime, address + MIB)  # the view holds it
    assert int(tail[-1]) == int(data[-1])
    del tail
    assert is_registered_host_memory(runtime, address)  # until the next release point
    driver.release_dropped_host_buffers()
    assert not is_registered_host_memory(runtime, address)
    assert registered_host_memory()[0] == registered
    # A kernel launch: torch's check after it raises any error left pending.
    data.add_(1)
    torch.cuda.synchronize()


@fresh_process
def test_a_refused_registration_falls_back_and_leaves_no_error_for_the_next_kernel(monkeypatch):
    """A registration the runtime refuses (here: pages registered already)
    gives a buffer from torch's pinned allocator, one warning, and no error
    left pending for torch's check after the next kernel launch to raise."""
    from vllm_graph_sleep import _native

    taken = _native._anonymous_mapping(MIB)
    view = torch.frombuffer(taken, dtype=torch.uint8)
    assert int(torch.cuda.cudart().cudaHostRegister(view.data_ptr(), MIB, 0)) == 0
    monkeypatch.setattr(_native, "_anonymous_mapping", lambda size: taken)
    monkeypatch.delenv("VLLM_GRAPH_SLEEP_HOST_BUFFERS", raising=False)
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    logging.getLogger("vllm.graph_sleep").addHandler(handler)
    driver = _native.VmmDriver()
    host = driver.host_buffer(MIB)
    again = driver.host_buffer(MIB)
    assert len(warnings) == 1
    # The runtime's own name: hipErrorHostMemoryAlreadyRegistered on ROCm.
    assert re.search(r"(cuda|hip)ErrorHostMemoryAlreadyRegistered", warnings[0].getMessage())
    for buffer in (host, again):
        assert buffer.is_pinned() and buffer.data_ptr() != view.data_ptr()
    assert torch.cuda.host_memory_stats()["allocated_bytes.current"] >= 2 * MIB
    torch.ones(16, device="cuda").add_(1)
    torch.cuda.synchronize()
    assert int(torch.cuda.cudart().cudaHostUnregister(view.data_ptr())) == 0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (torch.equal says a NaN differs from itself)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@fresh_process
@pytest.mark.parametrize(
    "coded, recode_min_bytes",
    [(False, None), (True, None), (True, 0)],
    ids=["raw", "coded", "coded_again"],
)
def test_a_flipped_bit_in_a_kept_backup_is_copied_again_and_the_wake_is_exact(
    coded, recode_min_bytes, monkeypatch
):
    """Issue 38 on a real GPU: the Triton fingerprints, a sleep that copies
    nothing unchanged since the last wake, one flipped bit (in a NaN's
    payload) copied again (its 1 MiB block raw, its 64 MiB piece coded:
    copied raw, too few bytes to code again, or, with no such bound, coded
    again), poisoned remaps so that nothing comes back right by luck."""
    from vllm_graph_sleep import coded_backup
    from vllm_graph_sleep.coded_backup import PIECE_BYTES
    from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES

    if recode_min_bytes is not None:
        monkeypatch.setattr(coded_backup, "RECODE_MIN_BYTES", recode_min_bytes)
    alloc = manager()
    alloc.compress_backups = coded
    assert alloc.keeps_unchanged_backups
    generator = torch.Generator("cuda").manual_seed(1)
    source = (torch.randn(64 * MIB, generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
    source.view(torch.int16)[5] = 0x7FC0  # a quiet NaN
    with alloc.use_memory_pool("weights"):
        weights = [torch.empty_like(source) for _ in range(2)]  # 128 MiB each
    for tensor in weights:
        tensor.copy_(source)
    size = allocation_of(alloc, weights[0]).backup_bytes()
    alloc.sleep(offload_tags=("weights",))
    assert alloc.last_backup().copied == {"weights": 2 * size}
    for _ in range(2):
        with poisoned_remaps(alloc):
            alloc.wake_up()
        assert all(same_bits(tensor, source) for tensor in weights)
        alloc.sleep(offload_tags=("weights",))
        assert alloc.last_backup().copied == {"weights": 0}
        assert alloc.last_backup().kept == {"weights": 2 * size}
    with poisoned_remaps(alloc):
        alloc.wake_up()
    weights[1].view(torch.int16)[5] ^= 0x0001  # the NaN's payload, one bit
    expected = weights[1].clone()
    assert not same_bits(expected, source)
    alloc.sleep(offload_tags=("weights",))
    assert alloc.last_backup().copied == {"weights": PIECE_BYTES if coded else BLOCK_BYTES}
    if coded:
        pieces = allocation_of(alloc, weights[1]).coded.pieces
        assert [piece.coded is not None for piece in pieces] == [
            recode_min_bytes == 0,
            True,
        ]
    with poisoned_remaps(alloc):
        alloc.wake_up()
    assert same_bits(weights[0], source)
    assert same_bits(weights[1], expected)


@fresh_process
@pytest.mark.parametrize("coded", [False, True], ids=["raw", "coded"])
def test_a_backup_made_ahead_is_kept_by_the_first_sleep_and_the_wake_is_exact(coded):
    """Issue 38 on a real GPU: the backup the worker makes once warm-up is
    done (back_up_ahead) leaves the weights mapped and untouched, and the
    first sleep keeps it whole; a bit flipped after it is copied again."""
    from vllm_graph_sleep.coded_backup import PIECE_BYTES
    from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES

    alloc = manager()
    alloc.compress_backups = coded
    generator = torch.Generator("cuda").manual_seed(3)
    source = (torch.randn(64 * MIB, generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
    with alloc.use_memory_pool("weights"):
        weights = [torch.empty_like(source) for _ in range(2)]  # 128 MiB each
    for tensor in weights:
        tensor.copy_(source)
    size = allocation_of(alloc, weights[0]).backup_bytes()
    assert alloc.back_up_ahead(("weights",)).copied == {"weights": 2 * size}
    assert all(same_bits(tensor, source) for tensor in weights)
    assert (allocation_of(alloc, weights[0]).coded is not None) == coded
    weights[1].view(torch.int16)[7] ^= 0x0100  # one bit, after the backup
    expected = [tensor.clone() for tensor in weights]
    alloc.sleep(offload_tags=("weights",))
    assert alloc.last_backup().copied == {"weights": PIECE_BYTES if coded else BLOCK_BYTES}
    assert alloc.last_backup().kept == {
        "weights": 2 * size - (PIECE_BYTES if coded else BLOCK_BYTES)
    }
    with poisoned_remaps(alloc):
        alloc.wake_up()
    assert all(same_bits(got, want) for got, want in zip(weights, expected, strict=True))


@fresh_process
@pytest.mark.parametrize("coded", [False, True], ids=["raw", "coded"])
def test_after_a_level_2_sleep_and_a_reload_only_what_changed_is_copied(coded):
    """Issue 38 on a real GPU: a level-2 sleep keeps the host buffers (and
    their fingerprints) of the level-1 sleep before it; the wake maps the
    weights back without them (poisoned here, as a fresh mapping's contents
    are undefined); after the reload writes the same weights but one bit, the
    level-1 sleep copies that bit's block (its piece, coded) into the same
    buffer, and its wake is exact."""
    from vllm_graph_sleep.coded_backup import PIECE_BYTES
    from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES

    alloc = manager()
    alloc.compress_backups = coded
    generator = torch.Generator("cuda").manual_seed(2)
    source = (torch.randn(64 * MIB, generator=generator, device="cuda") * 0.02).to(torch.bfloat16)
    with alloc.use_memory_pool("weights"):
        weights = torch.empty_like(source)  # 128 MiB: two coded pieces
    weights.copy_(source)
    alloc.sleep(offload_tags=("weights",))
    with poisoned_remaps(alloc):
        alloc.wake_up()
    host = allocation_of(alloc, weights).host
    alloc.sleep(offload_tags=())  # level 2
    assert allocation_of(alloc, weights).host is host
    with poisoned_remaps(alloc):
        alloc.wake_up()
    assert not same_bits(weights, source)  # nothing restored from the kept buffer
    weights.copy_(source)  # the reload
    weights.view(torch.int16)[7] ^= 0x0100
    expected = weights.clone()
    alloc.sleep(offload_tags=("weights",))
    assert alloc.last_backup().copied == {"weights": PIECE_BYTES if coded else BLOCK_BYTES}
    assert allocation_of(alloc, weights).host is host
    with poisoned_remaps(alloc):
        alloc.wake_up()
    assert same_bits(weights, expected)
