"""Host backups: what a sleep copies (graph-pool live ranges, host-buffer
reuse, raw or coded) and how a wake puts it back, filling what came back
without a backup by a `FillPolicy`. Holds no state between calls: the backup
of an allocation lives on its record."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from vllm_graph_sleep.memory.records import KV_CACHE_TAG, WEIGHTS_TAG, Allocation, add
from vllm_graph_sleep.memory.report import PhaseClock
from vllm_graph_sleep.settings import COMPRESS_BACKUPS
from vllm_graph_sleep.units import format_bytes

if TYPE_CHECKING:
    from vllm_graph_sleep.memory.driver import DeviceDriver

logger = logging.getLogger("vllm.graph_sleep")

POISON_BYTE = 0xFF


@dataclasses.dataclass(frozen=True)
class FillPolicy:
    """What a wake writes into memory that comes back without a backup,
    resolved once at start: zeroes (`zero`: zero-on-wake), or, under the test
    switches, 0xFF bytes, so that a replay reading graph scratch it did not
    write (`poison_graph_scratch`), or a weight reload that misses a tensor
    (`poison_remapped`), gives wrong tokens instead of whatever the driver's
    fresh pages held (often the old bytes)."""

    zero: bool = False
    poison_graph_scratch: bool = False
    poison_remapped: bool = False

    def for_scratch(self) -> int | None:
        """The byte for the part of a graph-pool segment its backup left out (None: none)."""
        return POISON_BYTE if self.poison_graph_scratch else self._zero_byte()

    def for_fresh(self, tag: str) -> int | None:
        """The byte for an allocation mapped back with no backup at all. Never
        poison for the KV cache: vLLM never reads its stale blocks, but
        attention kernels may load masked slots, where 0xFF would be NaN."""
        if self.poison_remapped and tag != KV_CACHE_TAG:
            return POISON_BYTE
        return self._zero_byte()

    def _zero_byte(self) -> int | None:
        return 0 if self.zero else None


def _fill_with(data: torch.Tensor, byte: int) -> None:
    if byte == 0:
        data.zero_()
    else:
        data.fill_(byte)


def resolve_coding(switch: bool | None, driver: DeviceDriver) -> bool:
    """Whether weight backups are coded: as switched, else the driver's
    default where Triton imports. Checked here, at start, rather than at the
    first sleep."""
    if switch is False or (switch is None and not driver.codes_backups_by_default()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError as error:
        if switch is None:
            logger.info(
                "graph-sleep: weight backups are copied as they are: Triton, which codes them, "
                "cannot be imported (%s)",
                error,
            )
            return False
        name = COMPRESS_BACKUPS.name
        raise RuntimeError(
            f"{name}=1 codes backups with Triton kernels, and Triton "
            f"cannot be imported: {error}. Install Triton or unset {name}."
        ) from error
    return True


class Backups:
    def __init__(
        self, driver: DeviceDriver, *, coded: bool, whole_graph_pool: bool, fill: FillPolicy
    ) -> None:
        self._driver = driver
        self.coded = coded
        self.whole_graph_pool = whole_graph_pool
        self.fill_policy = fill

    def prepare_coding(self, device: torch.device) -> None:
        """Compiles and checks the weight-backup coder on `device` now, while
        the engine warms up, if backups are coded: Triton compiles kernels at
        their first use, which would otherwise fall on the first sleep and set
        off vLLM's JIT monitor."""
        if not self.coded:
            return
        from vllm_graph_sleep import coded_backup

        started = time.perf_counter()
        if coded_backup.prepare(device):
            logger.info(
                "graph-sleep: weight backups are coded; the coder compiled and checked on %s in "
                "%.2f s",
                device,
                time.perf_counter() - started,
            )

    def live_ranges(
        self, graph_segments: list[dict], workspace_blocks: frozenset[tuple[int, int]]
    ) -> dict[int, list[tuple[int, int]]]:
        """Segment address -> (offset, bytes) of the blocks torch still has
        allocated there, for each segment of the graph pool, less the blocks of
        torch's workspaces (scratch within each call).

        Only those are backed up. The rest of the pool is graph scratch: torch
        freed it during capture, so every replay writes it before reading it
        (activations, kernel workspaces), as upstream's #59909 argues for the
        whole pool. What capture left allocated (an output a runner keeps,
        state a backend built at capture, sglang PR #32718) keeps its backup.
        A wake with VLLM_GRAPH_SLEEP_POISON_GRAPH_SCRATCH=1 fills the rest with
        0xFF, and the engine tests check tokens against that."""
        if self.whole_graph_pool:
            return {}
        live = {}
        for segment in graph_segments:
            base = segment["address"]
            live[base] = [
                (block["address"] - base, block["size"])
                for block in segment["blocks"]
                if block["state"] != "inactive"
                and (block["address"], block["size"]) not in workspace_blocks
            ]
        return live

    def back_up(
        self, allocations: list[Allocation], live: dict[int, list[tuple[int, int]]]
    ) -> None:
        """Copies `allocations` to pinned host buffers and waits for the copies;
        `live`: the ranges to copy of graph-pool segments (live_ranges).

        The driver makes each buffer the exact size needed, registered with
        cudaHostRegister, or from torch's pinned allocator (rounded up to a
        power of two) under VLLM_GRAPH_SLEEP_HOST_BUFFERS=torch or once a
        registration failed. A registered buffer is unregistered at the next
        release point after its last view dies (the end of this sleep for a
        replaced one), so dropping `allocation.host` is all a replacement needs."""
        for device in {allocation.device for allocation in allocations}:
            self._driver.synchronize(device)
        to_code: dict[int, list[tuple[Allocation, list[tuple[torch.Tensor, torch.Tensor]]]]] = {}
        for allocation in allocations:
            allocation.backup_ranges = live.get(allocation.address)
            needed = allocation.backup_bytes()
            held = 0 if allocation.host is None else allocation.host.numel()
            # Reused across cycles; replaced when too small or far too large.
            if needed == 0:
                allocation.drop_host()
            elif not needed <= held <= 2 * needed:
                allocation.drop_host()
                allocation.host = self._driver.host_buffer(needed)
            pairs = self.pairs(allocation)
            allocation.coded = None
            if self.coded and allocation.tag == WEIGHTS_TAG and pairs:
                to_code.setdefault(allocation.device, []).append((allocation, pairs))
                continue
            for device_range, host_range in pairs:
                host_range.copy_(device_range, non_blocking=True)
        if to_code:
            # Imported here: it brings Triton, which nothing else needs.
            from vllm_graph_sleep import coded_backup

            for coding in to_code.values():
                backups = coded_backup.back_up([pairs for _, pairs in coding])
                for (allocation, _), backup in zip(coding, backups, strict=True):
                    allocation.coded = backup
        for device in {allocation.device for allocation in allocations}:
            self._driver.synchronize(device)
        if any(allocation.coded is not None for allocation in allocations):
            # The coder's scratch, cached by torch outside our pools.
            self._driver.release_cached_memory(collect_garbage=False)
        for allocation in allocations:
            allocation.has_backup = True

    def device_bytes(self, allocation: Allocation) -> torch.Tensor:
        return self._driver.device_bytes(allocation.device, allocation.address, allocation.size)

    def pairs(self, allocation: Allocation) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device range, host range) pairs that a backup copies one way and a
        wake the other."""
        device = self.device_bytes(allocation)
        if allocation.backup_ranges is None:
            return [(device, allocation.host[: allocation.size])]
        pairs = []
        at = 0
        for offset, size in allocation.backup_ranges:
            pairs.append((device[offset : offset + size], allocation.host[at : at + size]))
            at += size
        return pairs

    def restore(
        self,
        allocations: Iterable[Allocation],
        planned: list[Allocation],
        clock: PhaseClock | None = None,
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Queues, for each allocation as `allocations` yields it mapped, the
        copies of its backup (filling the rest by the fill policy), then waits
        for them all; `planned`: every allocation it will yield. Returns bytes
        per tag restored and remapped without backup."""
        restored: dict[str, int] = {}
        fresh: dict[str, int] = {}
        coded = [a.coded for a in planned if a.has_backup and a.coded is not None]
        restore = None
        if coded:
            from vllm_graph_sleep import coded_backup

            restore = coded_backup.Restore(coded)
        count = 0
        for allocation in allocations:
            count += 1
            if allocation.has_backup:
                partial = allocation.backup_bytes() < allocation.size
                scratch = self.fill_policy.for_scratch()
                if partial and scratch is not None:
                    _fill_with(self.device_bytes(allocation), scratch)
                if allocation.coded is not None:
                    restore.add(allocation.coded, self.pairs(allocation))
                else:
                    for device_range, host_range in self.pairs(allocation):
                        device_range.copy_(host_range, non_blocking=True)
                add(restored, allocation.tag, allocation.backup_bytes())
                if partial:
                    add(fresh, allocation.tag, allocation.size - allocation.backup_bytes())
            else:
                byte = self.fill_policy.for_fresh(allocation.tag)
                if byte is not None:
                    _fill_with(self.device_bytes(allocation), byte)
                add(fresh, allocation.tag, allocation.size)
        if clock is not None:
            clock.lap(f"mapping ({count} allocations) with copies queued")
        for device in {allocation.device for allocation in planned}:
            self._driver.synchronize(device)
        if clock is not None:
            clock.lap("copies")
        if coded:
            # The decoder's staging slots, cached by torch outside our pools
            # once the restore that holds them is gone.
            del restore
            self._driver.release_cached_memory(collect_garbage=False)
        return restored, fresh

    def map_and_restore(
        self, targets: list[Allocation], mapped: list[Allocation], clock: PhaseClock
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Maps `targets` in order, appending each to `mapped` once it is, and
        restores their backups (`restore`); returns bytes per tag restored and
        remapped without backup. On failure `mapped` says what to roll back."""

        def mapping(allocations: list[Allocation]) -> Iterator[Allocation]:
            # One at a time, each handed to the restore as soon as it is
            # mapped: the copies of one run while the next one maps.
            for allocation in allocations:
                self._driver.create_and_map(*allocation.vmm_args())
                mapped.append(allocation)
                yield allocation

        # A coded restore stages its pieces in device memory of its own: the
        # backed-up allocations are restored and the staging given back before
        # the rest maps, so that the wake needs no more than the sleep freed.
        phases = [targets]
        if any(a.coded is not None for a in targets if a.has_backup):
            backed_up = [a for a in targets if a.has_backup]
            phases = [backed_up, [a for a in targets if not a.has_backup]]
        restored: dict[str, int] = {}
        fresh: dict[str, int] = {}
        for phase in filter(None, phases):
            filled = self.restore(mapping(phase), phase, clock)
            for total, part in zip((restored, fresh), filled, strict=True):
                for tag, size in part.items():
                    add(total, tag, size)
        return restored, fresh

    def restore_after_failed_sleep(
        self, released: list[Allocation], backed_up: list[Allocation]
    ) -> None:
        """Maps `released` back from their host copies; every backup is then
        marked stale (the allocator is awake and writes will follow)."""
        restored: list[Allocation] = []
        for allocation in released:
            try:
                self._driver.create_and_map(*allocation.vmm_args())
            except Exception:
                logger.exception(
                    "graph-sleep: could not map %#x (%s) back after a failed sleep; it stays "
                    "asleep with its host copy",
                    allocation.address,
                    format_bytes(allocation.size),
                )
                continue
            allocation.mapped = True
            restored.append(allocation)
        self.restore(restored, restored)
        for allocation in backed_up:
            if allocation.mapped:
                allocation.has_backup = False

    def roll_back(self, mapped: list[Allocation]) -> None:
        """Unmaps what a failed wake mapped; their backups stay."""
        # Copies restore queued may still be running into this memory (and, with
        # registered host buffers, out of host memory that nothing else keeps
        # from being unmapped); a device too broken to wait for is unmapped anyway.
        self.wait_for_devices(mapped, "rollback")
        for allocation in reversed(mapped):
            try:
                self._driver.unmap_and_release(*allocation.vmm_args())
            except Exception:
                logger.exception(
                    "graph-sleep: rollback could not unmap %#x (%s); it stays mapped",
                    allocation.address,
                    format_bytes(allocation.size),
                )
                allocation.mapped = True
                allocation.has_backup = False

    def wait_for_devices(self, allocations: list[Allocation], who: str) -> None:
        """Waits for what is queued on the devices of `allocations`; a device
        too broken to wait for is logged and passed over."""
        for device in {allocation.device for allocation in allocations}:
            try:
                self._driver.synchronize(device)
            except Exception as error:
                logger.warning(
                    "graph-sleep: %s could not wait for device %d: %s", who, device, error
                )
