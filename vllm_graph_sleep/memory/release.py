"""Unmapping: the half of a sleep that releases, first the allocations that
have a host backup, all or none (a failure maps back what went), then the
ones dropped without a backup, as many as the driver lets go; and a discard.
Holds no state: what is mapped lives on each allocation's record."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from vllm_graph_sleep.memory.records import Allocation, add

if TYPE_CHECKING:
    from vllm_graph_sleep.memory.backups import Backups
    from vllm_graph_sleep.memory.driver import DeviceDriver


class PartialRelease(Exception):
    """Releasing backed-up memory failed after `released` allocations; they
    were mapped back from their host copies."""

    def __init__(self, released: int, error: Exception) -> None:
        super().__init__(str(error))
        self.released = released


def release_backed_up(
    driver: DeviceDriver, backups: Backups, backed_up: list[Allocation]
) -> list[Allocation]:
    """Unmaps `backed_up` (their backups are complete); on a failure maps back
    those already released and raises `PartialRelease`."""
    released: list[Allocation] = []
    try:
        for allocation in backed_up:
            driver.unmap_and_release(*allocation.vmm_args())
            allocation.mapped = False
            released.append(allocation)
    except Exception as error:
        backups.restore_after_failed_sleep(released, backed_up)
        raise PartialRelease(len(released), error) from error
    return released


@dataclasses.dataclass
class Dropped:
    """Bytes per tag a sleep released without a backup (or the part of a
    backed-up allocation its backup left out), bytes per tag the driver kept
    mapped, and why, per allocation."""

    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    still_mapped: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)


def drop(driver: DeviceDriver, released: list[Allocation], to_drop: list[Allocation]) -> Dropped:
    """Unmaps `to_drop`, losing their contents; one the driver will not
    release stays mapped with its contents (and is logged by the caller).

    A dropped allocation keeps its host buffer, and with it the backup an
    earlier sleep left there and that backup's fingerprints (issue 38): a
    wake maps it back without that backup (`has_backup` is False), and the
    next sleep that backs it up compares what the device then holds with it,
    so that after a level-2 sleep and a reload only what the reload changed is
    copied (and coded) again, into buffers already pinned. Stock vLLM holds as
    much pinned memory there: torch's pinned-memory cache keeps the blocks of
    its last level-1 sleep. VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY=1 gives the
    buffers back at each wake, so that none is left to keep."""
    result = Dropped()
    for allocation in released:
        if allocation.backup_bytes() < allocation.size:
            add(result.dropped, allocation.tag, allocation.size - allocation.backup_bytes())
    for allocation in to_drop:
        try:
            driver.unmap_and_release(*allocation.vmm_args())
        except Exception as error:
            add(result.still_mapped, allocation.tag, allocation.size)
            result.failures.append(f"{allocation.address:#x}: {error}")
            continue
        allocation.mapped = False
        allocation.has_backup = False
        add(result.dropped, allocation.tag, allocation.size)
    return result


def discard(driver: DeviceDriver, allocations: list[Allocation]) -> int:
    """Releases `allocations` and their host backups, mapped or asleep;
    returns the bytes unmapped."""
    freed = 0
    for allocation in allocations:
        if allocation.mapped:
            driver.synchronize(allocation.device)
            driver.unmap_and_release(*allocation.vmm_args())
            allocation.mapped = False
            freed += allocation.size
        allocation.drop_host()
        allocation.has_backup = False
    driver.release_dropped_host_buffers()
    return freed
