"""The allocation table: one record per allocation of ours, filled by the
extension's callbacks, and the queries over it. The tags live here too."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm_graph_sleep.coded_backup import CodedBackup
    from vllm_graph_sleep.memory.driver import DeviceDriver

DEFAULT_TAG = "default"
WEIGHTS_TAG = "weights"
KV_CACHE_TAG = "kv_cache"
GRAPH_TAG = "cudagraph"
# State built while the KV cache is initialised (attention metadata, block
# tables, graph input buffers): small, backed up at every level.
RUNTIME_TAG = "runtime"
# Tags a wake may leave asleep; every other tag returns on any wake.
DEFERRABLE_TAGS = (WEIGHTS_TAG, KV_CACHE_TAG)
BUILTIN_TAGS = (DEFAULT_TAG, WEIGHTS_TAG, KV_CACHE_TAG, GRAPH_TAG, RUNTIME_TAG)


@dataclasses.dataclass(eq=False)
class SharedRun:
    """Neighbouring allocations a wake mapped with one physical allocation and
    one mapping (`DeviceDriver.create_and_map_run`). The driver gives the run
    back when the last of them is unmapped or freed; until then the others
    keep their memory and contents, and one mapped again rejoins it."""

    sizes: dict[int, int]  # member address -> bytes
    mapped: set[int]  # addresses of the members in use

    def alive(self) -> bool:
        return bool(self.mapped)

    def stranded(self) -> int:
        """Bytes the run holds for members not in use (unmapped, or freed by
        torch): they go with its last member in use."""
        if not self.mapped:
            return 0
        return sum(size for address, size in self.sizes.items() if address not in self.mapped)


@dataclasses.dataclass
class Allocation:
    device: int
    size: int
    address: int
    handle: int
    tag: str
    mapped: bool = True
    # Pinned host buffer. Kept across cycles unless host memory is released.
    host: torch.Tensor | None = None
    has_backup: bool = False
    # (offset, bytes) of what the backup holds; None: the whole allocation.
    backup_ranges: list[tuple[int, int]] | None = None
    # Left by an earlier engine of this process and still referenced (vLLM keeps
    # some module-level caches): never slept, not counted, freed when it dies.
    orphaned: bool = False
    # The backup's coded pieces (views of `host`), when weight backups are coded.
    coded: CodedBackup | None = None
    # What `host` holds, as int64 [blocks, lanes] fingerprints (memory.fingerprints)
    # of the backed-up bytes, block by block over the backup's pairs; None: unknown.
    fingerprints: torch.Tensor | None = None
    # The host buffer was filled ahead (backups.back_up_ahead) and no sleep has
    # filled it, before or since: a drop gives it back.
    backed_up_ahead: bool = False
    # The run whose mapping backs this one, while the run is alive.
    run: SharedRun | None = None
    # torch freed it (AllocationTable.on_free): the extension released it, and
    # a wake or a release that still holds the record must leave it alone.
    freed: bool = False

    def unmapped(self) -> None:
        """Records that the driver unmapped this allocation (or, for a member
        of a run still in use, took it out of use)."""
        self.mapped = False
        if self.run is not None:
            self.run.mapped.discard(self.address)

    def mapped_in(self, run: SharedRun) -> None:
        """Records that the driver mapped this allocation as a member of `run`."""
        self.mapped = True
        self.run = run

    def mapped_again(self) -> None:
        """Records that the driver mapped this allocation on its own: back in
        its run if the run is still mapped (the driver reuses that memory).
        Recorded at once, not at the end of a wake: torch may free it before
        (a cache release between a coded wake's phases), and the extension
        must then unmap it."""
        self.mapped = True
        if self.run is not None and self.run.alive():
            self.run.mapped.add(self.address)
        else:
            self.run = None

    def drop_host(self) -> None:
        """Lets the host buffer go, with the coded pieces that view it."""
        self.host = None
        self.coded = None
        self.fingerprints = None
        self.backed_up_ahead = False

    def backup_bytes(self) -> int:
        if self.backup_ranges is None:
            return self.size
        return sum(size for _, size in self.backup_ranges)

    def vmm_args(self) -> tuple[int, int, int, int]:
        """(device, size, address, handle): what the driver's map calls take."""
        return self.device, self.size, self.address, self.handle


def add(per_tag: dict[str, int], tag: str, size: int) -> None:
    per_tag[tag] = per_tag.get(tag, 0) + size


def bytes_by_tag(allocations: Iterable[Allocation]) -> dict[str, int]:
    """Bytes per tag of `allocations`, whole sizes."""
    per_tag: dict[str, int] = {}
    for allocation in allocations:
        add(per_tag, allocation.tag, allocation.size)
    return per_tag


class AllocationTable:
    """Address -> record of every allocation of ours still alive. The
    extension reports each allocation and free (`on_malloc`, `on_free`); the
    tag recorded is the one `tag_now()` answers at that moment."""

    def __init__(self, driver: DeviceDriver, tag_now) -> None:
        self._driver = driver
        self._tag_now = tag_now
        self._by_address: dict[int, Allocation] = {}
        # Held by on_free, and by a thread of ours that releases records while
        # torch may free them on another (`frees_held`). Reentrant: a garbage
        # collection inside either may drop a pool of ours that only a cycle
        # kept, and torch then frees its cached segments on the same thread.
        self._freeing = threading.RLock()

    # -- callbacks from the extension ------------------------------------

    def on_malloc(self, device: int, size: int, address: int, handle: int) -> None:
        self._by_address[address] = Allocation(device, size, address, handle, self._tag_now())

    def on_free(self, address: int) -> tuple[int, int, bool]:
        with self._freeing:
            allocation = self._by_address.pop(address)
            allocation.freed = True
            allocation.has_backup = False
            mapped = allocation.mapped
            if mapped:
                # The caching allocator may hand a block back while kernels queued
                # on other streams still use it; unmapping then would fault them.
                self._driver.synchronize(allocation.device)
                allocation.unmapped()  # the extension unmaps it once this returns
            allocation.drop_host()
        return allocation.size, allocation.handle, mapped

    @contextlib.contextmanager
    def frees_held(self) -> Iterator[None]:
        """Inside, torch's frees of our allocations wait (on_free): for a thread
        of ours that checks a record (`freed`) and releases it as one step,
        while the sleep's own thread may make torch free it."""
        with self._freeing:
            yield

    # -- queries -----------------------------------------------------------

    @property
    def by_address(self) -> dict[int, Allocation]:
        """The table itself (address -> record), for the allocator's own collaborators."""
        return self._by_address

    def get(self, address: int) -> Allocation | None:
        return self._by_address.get(address)

    def all(self) -> list[Allocation]:
        """Every record, those of earlier engines included."""
        return list(self._by_address.values())

    def live(self) -> list[Allocation]:
        """Allocations of the current engine (not orphaned)."""
        return [a for a in self._by_address.values() if not a.orphaned]

    def addresses(self) -> frozenset[int]:
        return frozenset(self._by_address)

    def orphan_all(self) -> int:
        """Marks every allocation as left by an earlier engine; returns their
        bytes. A mapped one never sleeps again, so its host buffer goes now."""
        for allocation in self._by_address.values():
            allocation.orphaned = True
            if allocation.mapped:
                allocation.drop_host()
        self._driver.release_dropped_host_buffers()
        return sum(allocation.size for allocation in self._by_address.values())

    def mapped_bytes(self, tag: str | None = None) -> int:
        return sum(
            allocation.size
            for allocation in self.live()
            if allocation.mapped and (tag is None or allocation.tag == tag)
        )

    def all_mapped_bytes(self) -> int:
        """Bytes mapped, allocations of earlier engines included, and the
        bytes runs hold for members no longer mapped there (`stranded_bytes`)."""
        return sum(a.size for a in self._by_address.values() if a.mapped) + self.stranded_bytes()

    def stranded_bytes(self) -> int:
        """Device bytes that runs hold for members not in use (`SharedRun.stranded`)."""
        runs = {id(a.run): a.run for a in self._by_address.values() if a.run is not None}
        return sum(run.stranded() for run in runs.values())

    def bytes_by_tag(self) -> dict[str, int]:
        return bytes_by_tag(self._by_address.values())

    def retag(self, addresses: set[int], tag: str) -> None:
        """Gives the allocations at `addresses` (those of ours) `tag`."""
        for address in addresses & self._by_address.keys():
            self._by_address[address].tag = tag

    def to_wake(self, tags: tuple[str, ...] | None) -> list[Allocation]:
        """The sleeping allocations a wake of `tags` (None: all) maps back,
        every non-deferrable tag's included, in the order it maps them: those
        with a backup first, so that their copies start while the rest map;
        then graph pool and other internal tags, what replays need."""
        targets = [
            a
            for a in self._by_address.values()
            if not a.mapped and (tags is None or a.tag in tags or a.tag not in DEFERRABLE_TAGS)
        ]
        targets.sort(key=lambda a: (not a.has_backup, a.tag in DEFERRABLE_TAGS, a.tag != GRAPH_TAG))
        return targets

    def asleep_by_tag(self) -> dict[str, int]:
        per_tag: dict[str, int] = {}
        for allocation in self._by_address.values():
            if not allocation.mapped:
                add(per_tag, allocation.tag, allocation.size)
        return per_tag

    def usage_by_tag(self) -> dict[str, dict[str, int]]:
        """Per tag: bytes mapped, asleep with a host backup, asleep without."""
        usage: dict[str, dict[str, int]] = {}
        for allocation in self.live():
            entry = usage.setdefault(allocation.tag, {"mapped": 0, "backed_up": 0, "dropped": 0})
            if allocation.mapped:
                entry["mapped"] += allocation.size
            elif allocation.has_backup:
                entry["backed_up"] += allocation.backup_bytes()
                entry["dropped"] += allocation.size - allocation.backup_bytes()
            else:
                entry["dropped"] += allocation.size
        return usage

    def host_bytes(self) -> int:
        return sum(a.host.numel() for a in self._by_address.values() if a.host is not None)

    def tags_in_use(self) -> set[str]:
        return {allocation.tag for allocation in self._by_address.values()}

    def __len__(self) -> int:
        return len(self._by_address)
