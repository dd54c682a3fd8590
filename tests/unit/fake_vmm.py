"""A CPU stand-in for `vllm_graph_sleep._native.VmmDriver`.

It behaves like the real VMM layer where the manager's correctness depends on
it: a device of fixed capacity (other processes can take part of it), mapping an
already mapped range or unmapping an unmapped one is a driver error, touching
unmapped memory is an illegal address, and freshly mapped memory holds stale
bytes (not zeros) unless something writes it. `malloc`/`free` play the role of
my_malloc/my_free in csrc/cumem_allocator.cpp, calling the same callbacks.
"""

from __future__ import annotations

import torch

STALE_BYTE = 0x5A
PAGE = 2 << 20


class FakePool:
    """Stands in for torch.cuda.MemPool: segments are what tests put there."""

    def __init__(self):
        self.id = (0, id(self))
        self.segments: list[int] = []

    def snapshot(self, include_traces: bool = True) -> list[dict]:
        return [{"address": address, "allocated_size": 0} for address in self.segments]


class FakeVmmDriver:
    def __init__(self, capacity: int = 1 << 30, rocm: bool = False):
        self.capacity = capacity
        self.rocm = rocm
        self.occupied_elsewhere = 0
        self.memory: dict[int, torch.Tensor] = {}  # address -> mapped bytes
        self.map_calls: list[int] = []
        self.unmap_calls: list[int] = []
        self.sync_calls = 0
        self.routing: list[FakePool] = []  # pools allocations go to, as torch sees it
        self.routing_log: list[tuple[str, FakePool]] = []
        self._next_address = 0x7F0000000000
        self._on_malloc = None
        self._on_free = None

    # -- VmmDriver interface ---------------------------------------------

    def register_callbacks(self, on_malloc, on_free) -> None:
        self._on_malloc, self._on_free = on_malloc, on_free

    def create_and_map(self, device: int, size: int, address: int, handle: int) -> None:
        if address in self.memory:
            raise RuntimeError("cuMemMap failed: invalid argument (range already mapped)")
        if self.mapped_bytes() + self.occupied_elsewhere + size > self.capacity:
            raise RuntimeError("cuMemCreate failed: out of memory")
        self.memory[address] = torch.full((size,), STALE_BYTE, dtype=torch.uint8)
        self.map_calls.append(address)

    def unmap_and_release(self, device: int, size: int, address: int, handle: int) -> None:
        if address not in self.memory:
            raise RuntimeError("cuMemUnmap failed: invalid argument (range not mapped)")
        del self.memory[address]
        self.unmap_calls.append(address)

    def device_bytes(self, device: int, address: int, size: int) -> torch.Tensor:
        if address not in self.memory:
            raise RuntimeError(f"illegal memory access at {address:#x}")
        return self.memory[address]

    def host_buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)

    def synchronize(self, device: int) -> None:
        self.sync_calls += 1

    def is_rocm(self) -> bool:
        return self.rocm

    def memory_pool(self) -> FakePool:
        return FakePool()

    def route(self, pool: FakePool) -> None:
        # With two pools routed torch may serve either; the manager must never ask.
        if self.routing:
            raise AssertionError(f"{pool.id} routed while {self.routing[0].id} still is")
        self.routing.append(pool)
        self.routing_log.append(("route", pool))

    def unroute(self, pool: FakePool) -> None:
        self.routing.remove(pool)
        self.routing_log.append(("unroute", pool))

    # -- what torch would do through my_malloc / my_free --------------------

    def malloc(self, size: int, device: int = 0) -> int:
        size = (size + PAGE - 1) // PAGE * PAGE
        address = self._next_address
        self._next_address += size + PAGE
        handle = address + 1
        self.create_and_map(device, size, address, handle)
        if self.routing:
            self.routing[0].segments.append(address)
        self._on_malloc(device, size, address, handle)
        return address

    def free(self, address: int) -> None:
        size, handle, mapped = self._on_free(address)
        if mapped:
            self.unmap_and_release(0, size, address, handle)

    # -- helpers for tests ---------------------------------------------------

    def mapped_bytes(self) -> int:
        return sum(t.numel() for t in self.memory.values())

    def write(self, address: int, value: int) -> None:
        self.device_bytes(0, address, 0).fill_(value)

    def read(self, address: int) -> torch.Tensor:
        return self.device_bytes(0, address, 0)
