"""How a wake maps memory back: each run of neighbouring weight allocations
with one physical allocation and one mapping (`DeviceDriver.create_and_map_run`),
everything else one allocation at a time. A sleep then gives a run back with
one unmap and one release, where the 8B's 134 weight allocations each cost a
release of their own (issue 38, leases 17-19 in
docs/results/archive/sleep-speed-h100-2026-12-07.md). Owns whether runs are
tried."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm_graph_sleep.memory.records import WEIGHTS_TAG, Allocation, SharedRun
from vllm_graph_sleep.units import format_bytes

if TYPE_CHECKING:
    import torch

    from vllm_graph_sleep.memory.driver import DeviceDriver

logger = logging.getLogger("vllm.graph_sleep")

# Only the weights: they live as long as the model, so one freed while the
# rest of its run is mapped (its memory held until the run goes) is rare.
# The KV cache's few, large allocations are released on a thread of their own
# at a level-1 sleep (release.EarlyDrop), and the graph pool's segments come
# and go with torch's cache.
RUN_TAGS = (WEIGHTS_TAG,)


class WakeMapper:
    def __init__(self, driver: DeviceDriver) -> None:
        self._driver = driver
        # ROCm holds each sleeping range with a placeholder of its own. A
        # driver that refuses a run for another reason than memory is not
        # asked again.
        self._runs_enabled = not driver.is_rocm()

    def mapping(
        self, allocations: list[Allocation], mapped: list[Allocation]
    ) -> Iterator[Allocation]:
        """Maps `allocations` in order, yielding each once it is mapped and
        appended to `mapped` (what a failed wake rolls back), so that the
        copies of one run while the next one maps. A run is mapped whole where
        its first member comes; one the driver refuses, one at a time. One
        torch freed since the wake chose it (a cache release between a coded
        wake's phases) is passed over: the extension released it."""
        allocations = [allocation for allocation in allocations if not allocation.freed]
        run_of = {allocation.address: run for run in self._runs(allocations) for allocation in run}
        with_run: set[int] = set()
        for allocation in allocations:
            if allocation.address in with_run:
                continue
            run = run_of.get(allocation.address)
            if run is not None:
                for member in run:
                    del run_of[member.address]
                if self._map_run(run):
                    with_run.update(member.address for member in run)
                    mapped.extend(run)
                    yield from run
                    continue
            self._driver.create_and_map(*allocation.vmm_args())
            allocation.mapped_again()
            mapped.append(allocation)
            yield allocation

    def _runs(self, allocations: list[Allocation]) -> list[list[Allocation]]:
        """Chains of two or more neighbouring allocations of RUN_TAGS on one
        device (each ends where the next starts), none in a run still mapped."""
        if not self._runs_enabled:
            return []
        candidates = sorted(
            (a for a in allocations if a.tag in RUN_TAGS and (a.run is None or not a.run.alive())),
            key=lambda a: (a.device, a.address),
        )
        chains: list[list[Allocation]] = []
        for allocation in candidates:
            last = chains[-1][-1] if chains else None
            if (
                last is not None
                and last.device == allocation.device
                and last.address + last.size == allocation.address
            ):
                chains[-1].append(allocation)
            else:
                chains.append([allocation])
        return [chain for chain in chains if len(chain) > 1]

    def _map_run(self, run: list[Allocation]) -> bool:
        try:
            self._driver.create_and_map_run(
                run[0].device, [(a.size, a.address, a.handle) for a in run]
            )
        except RuntimeError as error:
            # Out of memory: one at a time needs as much, and says so itself.
            # Not neighbours: the chain spans two of the extension's
            # reservations (arena chunks), which one mapping cannot cover.
            if not any(why in str(error) for why in ("out of memory", "not free neighbours")):
                self._runs_enabled = False
                logger.warning(
                    "graph-sleep: the driver would not map %d neighbouring weight allocations "
                    "with one mapping (%s); every wake maps them one at a time from now on",
                    len(run),
                    error,
                )
            return False
        shared = SharedRun(
            sizes={allocation.address: allocation.size for allocation in run},
            mapped={allocation.address for allocation in run},
        )
        for allocation in run:
            allocation.mapped_in(shared)
        return True


def take_runs_apart(driver: DeviceDriver, leftovers: list[Allocation]) -> None:
    """Maps each of `leftovers` (what an earlier engine still references)
    that is in a run holding memory for others (freed since) on its own, with
    its contents, so that the run's memory goes: a leftover never sleeps
    again, and its run would hold the rest (up to every weight of that
    engine) until it dies. A run the driver will not give back stays as it
    was (its members back in use), with a warning. A leftover the driver
    will not map again once its run is gone keeps its contents as its host
    backup, so that a wake brings it back whole, and RuntimeError says so:
    unmapped, it must not be set apart (a reader would fault on it)."""
    runs: dict[int, tuple[SharedRun, list[Allocation]]] = {}
    for allocation in leftovers:
        run = allocation.run
        if allocation.mapped and run is not None and run.stranded():
            runs.setdefault(id(run), (run, []))[1].append(allocation)
    freed = 0
    unmapped: list[Allocation] = []
    failure: RuntimeError | None = None
    for run, members in runs.values():
        stranded = run.stranded()
        contents = [
            driver.device_bytes(a.device, a.address, a.size).to("cpu", copy=True) for a in members
        ]
        left: list[Allocation] = []
        try:
            for allocation in members:
                driver.unmap_and_release(*allocation.vmm_args())
                allocation.unmapped()
                left.append(allocation)
        except RuntimeError as error:
            # Only the last member in use gives the run back, so the run is
            # still mapped with every member's contents: they rejoin it, which
            # the extension records without a driver call.
            for allocation in left:
                driver.create_and_map(*allocation.vmm_args())
                allocation.mapped_again()
            logger.warning(
                "graph-sleep: a run of an earlier engine's weights could not be given back "
                "(%s); it keeps %s of freed weights mapped until its leftovers die",
                error,
                format_bytes(stranded),
            )
            continue
        for allocation, content in zip(members, contents, strict=True):
            try:
                driver.create_and_map(*allocation.vmm_args())
            except RuntimeError as error:
                failure = failure or error
                keep_as_backup(allocation, content)
                unmapped.append(allocation)
                continue
            allocation.mapped_again()
            driver.device_bytes(allocation.device, allocation.address, allocation.size).copy_(
                content
            )
        driver.synchronize(members[0].device)
        freed += stranded
    if freed:
        logger.info(
            "graph-sleep: mapped an earlier engine's leftovers on their own, which gave back "
            "%s of freed weights their runs held",
            format_bytes(freed),
        )
    if failure is not None:
        raise RuntimeError(
            f"graph-sleep: {len(unmapped)} of an earlier engine's leftovers "
            f"({format_bytes(sum(a.size for a in unmapped))}) were taken out of their run but "
            f"could not be mapped again on their own: {failure}. Their contents are kept on "
            "the host; the next engine started in this process maps them back once the "
            "device has the memory"
        ) from failure


def keep_as_backup(allocation: Allocation, content: torch.Tensor) -> None:
    """Makes `content` (the whole allocation's bytes, on the host) the
    backup a wake restores it from."""
    allocation.drop_host()
    allocation.host = content
    allocation.backup_ranges = None
    allocation.has_backup = True
    allocation.run = None  # given back: the next wake maps it on its own
