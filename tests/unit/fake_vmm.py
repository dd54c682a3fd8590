"""A CPU stand-in for `vllm_graph_sleep._native.VmmDriver`.

It behaves like the real VMM layer where the manager's correctness depends on
it: a device of fixed capacity (other processes and torch's own pool can take
part of it), mapping an already mapped range or unmapping an unmapped one is a
driver error, touching unmapped memory is an illegal address, and freshly
mapped memory holds stale bytes (not zeros) unless something writes it.
`malloc`/`free` play the role of my_malloc/my_free in csrc/cumem_allocator.cpp,
calling the same callbacks.

Pools follow torch 2.11's caching allocator where the manager relies on it: a
segment whose tensor died stays cached in its pool; once nobody holds the pool
(the MemPool object is gone) its free segments go back through my_free, at once
and at every later empty_cache (`release_cached_memory`). Failures of the
driver calls can be injected (`fail`), one call at a time.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from contextlib import contextmanager

import torch

from tests.unit import fingerprint_reference

STALE_BYTE = 0x5A
PAGE = 2 << 20
DEFAULT_STACK = 1024  # bytes per thread, what an H200 context starts with
BLAS_WORKSPACE = 32 << 20  # torch's cuBLAS workspace on an H200
LT_WORKSPACE = 1 << 20  # and its cuBLASLt one


class FakePool:
    """Stands in for torch.cuda.MemPool: the segments torch put there."""

    def __init__(self, driver: FakeVmmDriver):
        self.id = (0, id(self))
        self.segments: list[int] = []
        self._driver = driver
        # What ~MemPool does: the pool becomes freeable and its free segments go.
        weakref.finalize(self, driver._pool_dropped, self.segments)

    def snapshot(self, include_traces: bool = True) -> list[dict]:
        segments = []
        for address in self.segments:
            segment = {
                "address": address,
                "allocated_size": (
                    0 if address in self._driver.cached else self._driver.memory[address].numel()
                ),
            }
            # torch lists every block: one per segment here unless a test says more.
            size = self._driver.memory[address].numel()
            state = "inactive" if address in self._driver.cached else "active_allocated"
            segment["blocks"] = [
                {"address": address + offset, "size": size, "state": state}
                for offset, size, state in self._driver.blocks.get(address, [(0, size, state)])
            ]
            segments.append(segment)
        return segments


class _Graph:
    """Stands in for a torch.cuda.CUDAGraph."""


class FakeVmmDriver:
    def __init__(self, capacity: int = 1 << 30, rocm: bool = False):
        self.capacity = capacity
        self.rocm = rocm
        self.codes_by_default = False
        self.occupied_elsewhere = 0
        self.memory: dict[int, torch.Tensor] = {}  # address -> mapped bytes
        self.map_calls: list[int] = []
        # create_and_map_run: each call's addresses, and address -> its run
        # while the run lives ({"sizes": address -> bytes, "in_use": addresses,
        # "held": address -> the bytes of a member out of use}).
        self.run_calls: list[list[int]] = []
        self.run_refusal = (
            "cuMemMap failed: invalid argument"  # what fail("create_and_map_run") says
        )
        self.run_of: dict[int, dict] = {}
        self.probes: list[int] = []  # devices probed (probe_mapping), in order
        self.unmap_calls: list[int] = []
        self.sync_calls = 0
        # ("fingerprinted", bytes), ("synchronized", device), ("unmapped", address), in order
        self.timeline: list[tuple[str, int]] = []
        self.fingerprinted_bytes = 0
        self.routing: list[FakePool] = []  # pools allocations go to, as torch sees it
        # Weak: a log must not keep a dropped pool alive.
        self.routing_log: list[tuple[str, weakref.ref]] = []
        self._next_address = 0x7F0000000000
        self.current_stream = 0  # what torch.cuda.current_stream() would be
        self.workspaces: dict[int, dict[str, int]] = {}  # stream -> {"blas"|"lt": address}
        self.lt_path = True  # False: torch's addmm skips cuBLASLt (DISABLE_ADDMM_CUDA_LT=1)
        self.segment_streams: dict[int, int] = {}  # our segment -> its stream, if not 0
        # torch's own segments: (address, stream, bytes in use)
        self.outside_segments: list[tuple[int, int, int]] = []
        self.blas_releases = 0
        # segment -> [(offset, bytes, state)] torch's blocks there, where a test says
        self.blocks: dict[int, list[tuple[int, int, str]]] = {}
        self._on_malloc = None
        self._on_free = None
        # Handles my_free deleted: the extension's Allocation is gone, and a
        # create_and_map with one reads freed memory (caught here, undefined there).
        self.freed_handles: set[int] = set()
        self.cached: set[int] = set()  # segments whose tensor died, still in their pool
        self._freeable: list[list[int]] = []  # segment lists of dropped pools
        self.failures: dict[str, int] = {}  # call -> how many calls succeed before it fails
        self.failing_addresses: dict[str, int] = {}  # call -> the address whose next call fails
        self.refused_frees: dict[int, torch.Tensor] = {}  # address -> what a refused free left
        self.unmap_threads: dict[int, str] = {}  # address -> the thread that last unmapped it
        self.stack_limits: dict[int, int] = {}  # device -> per-thread stack bytes
        self.cache_calls: list[str] = []  # in order: "collect" (garbage), "empty" (torch's cache)
        # torch's graph-safe RNG state: (segment, stream), while a live graph holds it
        self.generator_state: tuple[int, int] | None = None
        self.generator_holds: list[bool] = []  # hold_generator_graph_state calls: pool routed?
        # Device memory torch's own pool holds for an object (`torch_allocates`),
        # cached after it dies until release_cached_memory: (holder, bytes).
        self.torch_held: list[tuple[weakref.ref, int]] = []

    def fail(self, call: str, after: int = 0, address: int | None = None) -> None:
        """The (after+1)-th next call of `call` raises like the driver would;
        with `address`, the next unmap_and_release of that address (whatever
        thread makes it: a sleep releases a cleared KV cache on its own)."""
        if address is None:
            self.failures[call] = after
        else:
            self.failing_addresses[call] = address

    def _maybe_fail(self, call: str, message: str, address: int | None = None) -> None:
        if address is not None and self.failing_addresses.get(call) == address:
            del self.failing_addresses[call]
            raise RuntimeError(message)
        if call not in self.failures:
            return
        if self.failures[call] == 0:
            del self.failures[call]
            raise RuntimeError(message)
        self.failures[call] -= 1

    # -- VmmDriver interface ---------------------------------------------

    def register_callbacks(self, on_malloc, on_free) -> None:
        self._on_malloc, self._on_free = on_malloc, on_free

    def create_and_map(self, device: int, size: int, address: int, handle: int) -> None:
        if handle in self.freed_handles:
            raise AssertionError(f"create_and_map of {address:#x}: my_free deleted its allocation")
        self._maybe_fail("create_and_map", "cuMemCreate failed: out of memory")
        run = self.run_of.get(address)
        if run is not None:  # back in use in its run, with its bytes
            if address in run["in_use"]:
                raise RuntimeError("create_and_map failed: the range is already mapped")
            self.memory[address] = run["held"].pop(address)
            run["in_use"].add(address)
            self.map_calls.append(address)
            return
        if address in self.memory:
            raise RuntimeError("cuMemMap failed: invalid argument (range already mapped)")
        if self.used_bytes() + size > self.capacity:
            raise RuntimeError("cuMemCreate failed: out of memory")
        self.memory[address] = torch.full((size,), STALE_BYTE, dtype=torch.uint8)
        self.map_calls.append(address)

    def create_and_map_run(self, device: int, members: list[tuple[int, int, int]]) -> None:
        self._maybe_fail("create_and_map_run", self.run_refusal)
        if self.rocm:
            raise RuntimeError("map_run failed: not on this platform")
        for (size, address, _), (_, following, _) in itertools.pairwise(members):
            if address + size != following:
                raise RuntimeError("map_run failed: the ranges are not free neighbours")
        if any(address in self.memory or address in self.run_of for _, address, _ in members):
            raise RuntimeError("map_run failed: the ranges are not free neighbours")
        if self.used_bytes() + sum(size for size, _, _ in members) > self.capacity:
            raise RuntimeError("cuMemCreate failed: out of memory")
        # "refused": its last member's free was refused (held until it ends)
        run = {"sizes": {}, "in_use": set(), "held": {}, "refused": False}
        for size, address, _ in members:
            self.memory[address] = torch.full((size,), STALE_BYTE, dtype=torch.uint8)
            self.map_calls.append(address)
            run["sizes"][address] = size
            run["in_use"].add(address)
            self.run_of[address] = run
        self.run_calls.append([address for _, address, _ in members])

    def _leave_run(self, address: int) -> None:
        """As the extension's leave_run: out of use, keeping its bytes while
        another member is in use; the last one out gives the run back."""
        run = self.run_of[address]
        run["in_use"].discard(address)
        tensor = self.memory.pop(address, None)
        if run["in_use"]:
            if tensor is not None:
                run["held"][address] = tensor
            return
        for member in run["sizes"]:
            self.run_of.pop(member, None)

    def unmap_and_release(self, device: int, size: int, address: int, handle: int) -> None:
        self._maybe_fail(
            "unmap_and_release", "cuMemUnmap failed: unspecified launch failure", address
        )
        if address not in self.memory:
            raise RuntimeError("cuMemUnmap failed: invalid argument (range not mapped)")
        if address in self.run_of:
            self._leave_run(address)
        else:
            del self.memory[address]
        self.unmap_threads[address] = threading.current_thread().name
        self.unmap_calls.append(address)
        self.timeline.append(("unmapped", address))

    def device_bytes(self, device: int, address: int, size: int) -> torch.Tensor:
        if address not in self.memory:
            raise RuntimeError(f"illegal memory access at {address:#x}")
        return self.memory[address]

    def fingerprint(self, ranges: list[torch.Tensor], out: torch.Tensor) -> None:
        self._maybe_fail("fingerprint", "CUDA error: an illegal memory access was encountered")
        out.copy_(torch.cat([fingerprint_reference.fingerprints(data) for data in ranges]))
        self.fingerprinted_bytes += sum(data.numel() for data in ranges)
        self.timeline.append(("fingerprinted", sum(data.numel() for data in ranges)))

    def stack_limit(self, device: int) -> int:
        self._maybe_fail("stack_limit", "cuCtxGetLimit failed: invalid context")
        return self.stack_limits.get(device, DEFAULT_STACK)

    def set_stack_limit(self, device: int, size: int) -> None:
        self._maybe_fail("set_stack_limit", "cuCtxSetLimit failed: out of memory")
        self.stack_limits[device] = size

    def probe_mapping(self, device: int) -> None:
        self._maybe_fail("probe_mapping", "cuMemCreate failed: out of memory")
        self.probes.append(device)

    def host_buffer(self, size: int) -> torch.Tensor:
        self._maybe_fail("host_buffer", "CUDA error: out of memory (pinned host allocation)")
        return torch.empty(size, dtype=torch.uint8)

    def release_dropped_host_buffers(self) -> None:
        # Plain tensors here; tests of registered buffers put the real one in.
        pass

    # -- torch's cuBLAS workspaces, one per stream ---------------------------

    def current_stream_handle(self) -> int:
        return self.current_stream

    @contextmanager
    def on_stream(self, stream: int):
        previous, self.current_stream = self.current_stream, stream
        try:
            yield
        finally:
            self.current_stream = previous

    def pool_active_blocks(self, pool: FakePool) -> set[tuple[int, int]]:
        return {
            (block["address"], block["size"])
            for segment in pool.snapshot()
            for block in segment["blocks"]
            if block["state"] != "inactive"
        }

    def block_offsets(self, addresses: set[int]) -> dict[int, list[int]]:
        """Offsets of the allocated blocks of our segments at `addresses`: one
        block per segment unless a test placed more (`blocks`)."""
        return {
            address: [
                offset
                for offset, _, state in self.blocks.get(address, [(0, 0, "active_allocated")])
                if state != "inactive"
            ]
            for address in addresses
            if address in self.memory
        }

    def torch_segments(self) -> list[tuple[int, int, int]]:
        """(address, stream, bytes in use) of torch's segments: ours, then torch's own."""
        # From a copy, as torch's snapshot is one: the KV cache's thread may
        # release segments meanwhile.
        ours = [
            (address, self.segment_streams.get(address, 0), self._in_use(address, tensor))
            for address, tensor in list(self.memory.items())
        ]
        return ours + list(self.outside_segments)

    def _in_use(self, address: int, tensor: torch.Tensor) -> int:
        return 0 if address in self.cached else tensor.numel()

    def _workspace(self, kind: str, size: int) -> None:
        """What torch does the first time a stream needs this workspace: take it
        from the pool routed, or from torch's own memory."""
        made = self.workspaces.setdefault(self.current_stream, {})
        if kind in made:
            return
        if self.routing:
            address = self.malloc(size)
            self.segment_streams[address] = self.current_stream
        else:
            address = self._next_address
            self._next_address += size + PAGE
            self.outside_segments.append((address, self.current_stream, size))
        made[kind] = address

    def create_blas_workspace(self) -> None:
        self._workspace("blas", BLAS_WORKSPACE)

    def create_blas_lt_workspace(self) -> None:
        if self.lt_path:
            self._workspace("lt", LT_WORKSPACE)

    def create_blas_workspaces(self) -> None:
        """A warm-up's matmuls on the current stream: both workspaces."""
        self._workspace("blas", BLAS_WORKSPACE)
        self._workspace("lt", LT_WORKSPACE)

    def release_blas_workspaces(self) -> None:
        """torch._C._cuda_clearCublasWorkspaces: every workspace is freed; one
        in a pool stays cached there, torch's own stays cached with nothing in
        use on its stream until empty_cache."""
        for made in self.workspaces.values():
            for address in made.values():
                if address in self.memory:
                    self.tensor_dies(address)
                else:
                    self.outside_segments = [
                        (a, stream, 0 if a == address else in_use)
                        for a, stream, in_use in self.outside_segments
                    ]
        self.workspaces.clear()
        self.blas_releases += 1

    # -- torch's graph-safe RNG state ----------------------------------------

    def begin_capture(self) -> None:
        """What capture_begin does for the default generator: with no live
        graph holding its graph-safe state, torch makes it (two 8-byte tensors)
        on the current stream before routing to the capture's pool: outside
        it, in the pool this thread routes to if any."""
        if self.generator_state is not None:
            return
        if self.routing:
            address = self.malloc(1024)
            self.segment_streams[address] = self.current_stream
        else:
            address = self._next_address
            self._next_address += 2 * PAGE
            self.outside_segments.append((address, self.current_stream, 1024))
        self.generator_state = (address, self.current_stream)

    def hold_generator_graph_state(self) -> object:
        """A one-node graph, never instantiated; when it goes and no other
        graph is alive (none is, in these tests), torch frees the state."""
        self._maybe_fail("hold_generator_graph_state", "CUDA error: operation not permitted")
        self.generator_holds.append(bool(self.routing))
        self.begin_capture()
        holder = _Graph()
        weakref.finalize(holder, self._last_graph_gone)
        return holder

    def _last_graph_gone(self) -> None:
        address, _ = self.generator_state
        self.outside_segments = [
            (a, stream, 0 if a == address else in_use)
            for a, stream, in_use in self.outside_segments
        ]
        self.generator_state = None

    def synchronize(self, device: int) -> None:
        self._maybe_fail("synchronize", "CUDA error: an illegal memory access was encountered")
        self.sync_calls += 1
        self.timeline.append(("synchronized", device))

    def is_rocm(self) -> bool:
        return self.rocm

    def codes_backups_by_default(self) -> bool:
        # Its memory is host tensors, which the compiled coder cannot run on:
        # the coder's tests switch it on and run Triton's interpreter.
        return self.codes_by_default

    def memory_pool(self) -> FakePool:
        return FakePool(self)

    def _no_routing(self, what: str) -> None:
        # torch 2.11: "captures_underway.empty() INTERNAL ASSERT FAILED", an abort.
        if self.routing:
            raise AssertionError(f"{what} while pool {self.routing[0].id} is routed")

    def torch_allocates(self, holder: object, size: int) -> None:
        """What tensors of `size` bytes in all that `holder` keeps take in
        torch's own pool (outside ours): device memory while `holder` lives,
        cached by torch after it dies until empty_cache."""
        if self.used_bytes() + size > self.capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} bytes")
        self.torch_held.append((weakref.ref(holder), size))

    def collect_garbage(self) -> None:
        self.cache_calls.append("collect")

    def release_cached_memory(self) -> None:
        self.cache_calls.append("empty")
        self._no_routing("empty_cache")
        self.torch_held = [(holder, size) for holder, size in self.torch_held if holder()]
        self.outside_segments = [s for s in self.outside_segments if s[2] > 0]
        for segments in self._freeable:
            self._release_free(segments)
        self._freeable = [segments for segments in self._freeable if segments]

    def _pool_dropped(self, segments: list[int]) -> None:
        self._no_routing("a MemPool dropped")
        self._freeable.append(segments)
        self._release_free(segments)

    def _release_free(self, segments: list[int]) -> None:
        for address in [a for a in segments if a in self.cached]:
            segments.remove(address)
            self.cached.discard(address)
            self.free(address)

    def route(self, pool: FakePool) -> None:
        # With two pools routed torch may serve either; the manager must never ask.
        if self.routing:
            raise AssertionError(f"{pool.id} routed while {self.routing[0].id} still is")
        self.routing.append(pool)
        self.routing_log.append(("route", weakref.ref(pool)))

    def unroute(self, pool: FakePool) -> None:
        self.routing.remove(pool)
        self.routing_log.append(("unroute", weakref.ref(pool)))

    # -- what torch would do through my_malloc / my_free --------------------

    def malloc(self, size: int, device: int = 0) -> int:
        size = (size + PAGE - 1) // PAGE * PAGE
        address = self._next_address
        # Right after the last one, as the extension asks the driver for.
        self._next_address += size
        handle = address + 1
        self.create_and_map(device, size, address, handle)
        if self.routing:
            self.routing[0].segments.append(address)
        self._on_malloc(device, size, address, handle)
        return address

    def free(self, address: int) -> None:
        """my_free: what the driver refuses to give back (fail("unmap_and_release"))
        the extension holds for `retry_refused_frees`, the record gone."""
        size, handle, mapped = self._on_free(address)
        self.freed_handles.add(handle)
        run = self.run_of.get(address)
        if run is not None:  # its bytes go with the run
            if run["in_use"] == {address} and self._refuses("unmap_and_release", address):
                # The run stays mapped with no range in use, held until a
                # retry, or a member that rejoins it, ends it.
                run["in_use"].discard(address)
                run["held"][address] = self.memory.pop(address)
                run["refused"] = True
                return
            if address in run["in_use"]:
                self._leave_run(address)
            run["held"].pop(address, None)
        elif mapped:
            try:
                self.unmap_and_release(0, size, address, handle)
            except RuntimeError:
                self.refused_frees[address] = self.memory.pop(address)

    def _refuses(self, call: str, address: int) -> bool:
        try:
            self._maybe_fail(call, "refused", address)
        except RuntimeError:
            return True
        return False

    def _held_runs(self) -> list[dict]:
        runs = {id(run): run for run in self.run_of.values() if run["refused"]}
        return list(runs.values())

    def _refused_range_bytes(self) -> int:
        return sum(t.numel() for t in self.refused_frees.values())

    def held_after_refused_frees(self) -> int:
        """As the extension's held_bytes: of a held run, what no member in use
        accounts for (the table counts one that rejoined it)."""
        held = self._refused_range_bytes()
        for run in self._held_runs():
            held += sum(s for a, s in run["sizes"].items() if a not in run["in_use"])
        return held

    def retry_refused_frees(self) -> tuple[int, str]:
        if self.held_after_refused_frees() and self._refuses("retry_refused_frees", None):
            return 0, "cuMemUnmap failed: out of memory"
        freed = self._refused_range_bytes()
        self.refused_frees.clear()
        for run in self._held_runs():
            if not run["in_use"]:  # one in use ends with its last member out
                freed += sum(run["sizes"].values())
                for member in run["sizes"]:
                    self.run_of.pop(member, None)
        return freed, ""

    def tensor_dies(self, address: int) -> None:
        """The only tensor in the segment at `address` was freed: torch keeps
        the segment cached in its pool (released if the pool is freeable)."""
        self.cached.add(address)

    # -- helpers for tests ---------------------------------------------------

    def mapped_bytes(self) -> int:
        return sum(t.numel() for t in list(self.memory.values()))

    def stranded_bytes(self) -> int:
        """What live runs hold for members not in use (unmapped or freed)."""
        runs = {id(run): run for run in self.run_of.values()}
        return sum(
            size
            for run in runs.values()
            for address, size in run["sizes"].items()
            if address not in run["in_use"]
        )

    def used_bytes(self) -> int:
        """Device memory in use: ours (runs' whole), torch's own, other processes'."""
        torch_own = sum(size for _, size in self.torch_held)
        ours = self.mapped_bytes() + self.stranded_bytes() + self._refused_range_bytes()
        return ours + torch_own + self.occupied_elsewhere

    def write(self, address: int, value: int) -> None:
        self.device_bytes(0, address, 0).fill_(value)

    def read(self, address: int) -> torch.Tensor:
        return self.device_bytes(0, address, 0)
