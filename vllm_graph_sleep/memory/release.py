"""Unmapping: the half of a sleep that releases: first what frees the driver
refused left (retry_refused_frees); a KV cache the caller has cleared, on a
thread of its own while the weights' backup runs, or ahead of a level-2 sleep
(EarlyDrop, KvCacheRelease); then the allocations that have a host backup,
all or none (a failure maps back what went); then the other ones dropped
without a backup, as many as the driver lets go; and a discard. Holds no
state past a sleep (KvCacheRelease holds a release started ahead only until
its sleep takes it over): what is mapped lives on each allocation's record."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vllm_graph_sleep.memory.records import KV_CACHE_TAG, WEIGHTS_TAG, Allocation, add
from vllm_graph_sleep.memory.report import PhaseClock, describe
from vllm_graph_sleep.units import format_bytes

if TYPE_CHECKING:
    from vllm_graph_sleep.memory.backups import Backups
    from vllm_graph_sleep.memory.driver import DeviceDriver

logger = logging.getLogger("vllm.graph_sleep")


class PartialRelease(Exception):
    """Releasing backed-up memory failed after `released` allocations; they
    were mapped back from their host copies (`note`: what went wrong there)."""

    def __init__(self, released: int, error: Exception, note: str = "") -> None:
        super().__init__(str(error))
        self.released = released
        self.note = note


def release_backed_up(
    driver: DeviceDriver, backups: Backups, backed_up: list[Allocation]
) -> list[Allocation]:
    """Unmaps `backed_up` (their backups are complete), but one torch freed
    since its backup (the backup's own cache release, on this thread); on a
    failure maps back those already released and raises `PartialRelease`."""
    released: list[Allocation] = []
    try:
        for allocation in backed_up:
            if allocation.freed:
                continue
            driver.unmap_and_release(*allocation.vmm_args())
            allocation.unmapped()
            released.append(allocation)
    except Exception as error:
        note = backups.restore_after_failed_sleep(released, backed_up)
        raise PartialRelease(len(released), error, note) from error
    return released


@dataclasses.dataclass
class Dropped:
    """Bytes per tag a sleep released without a backup (or the part of a
    backed-up allocation its backup left out), bytes per tag the driver kept
    mapped, and why, per allocation."""

    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    still_mapped: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Dropped) -> None:
        """Counts `other` (another drop of the same sleep) in this one."""
        for tag, size in other.dropped.items():
            add(self.dropped, tag, size)
        for tag, size in other.still_mapped.items():
            add(self.still_mapped, tag, size)
        self.failures.extend(other.failures)

    def log_failures(self) -> None:
        if self.failures:
            logger.error(
                "graph-sleep sleep: could not release %s (they stay mapped and keep their "
                "contents; wake skips them): %s",
                describe(self.still_mapped),
                "; ".join(self.failures),
            )


def backed_up_bytes(released: list[Allocation]) -> dict[str, int]:
    """Bytes per tag of the backups of `released`."""
    kept: dict[str, int] = {}
    for allocation in released:
        add(kept, allocation.tag, allocation.backup_bytes())
    return kept


def drop(
    driver: DeviceDriver,
    released: list[Allocation],
    to_drop: list[Allocation],
    frees_held: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
) -> Dropped:
    """Unmaps `to_drop`, losing their contents; one the driver will not
    release stays mapped with its contents (and is logged by the caller).
    `frees_held`: what keeps torch from freeing an allocation between the
    check that it is still ours and its release (a thread other than the
    sleep's; AllocationTable.frees_held); one torch freed is left alone.

    A dropped allocation keeps its host buffer, and with it the backup an
    earlier sleep left there and that backup's fingerprints (issue 38): a
    wake maps it back without that backup (`has_backup` is False), and the
    next sleep that backs it up compares what the device then holds with it,
    so that after a level-2 sleep and a reload only what the reload changed is
    copied (and coded) again, into buffers already pinned. Stock vLLM holds as
    much pinned memory there: torch's pinned-memory cache keeps the blocks of
    its last level-1 sleep. VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY=1 gives the
    buffers back at each wake, so that none is left to keep. A buffer filled
    ahead at the engine's start that no sleep has used goes (a loop of
    level-2 sleeps would hold it and never read it)."""
    result = Dropped()
    for allocation in released:
        if allocation.backup_bytes() < allocation.size:
            add(result.dropped, allocation.tag, allocation.size - allocation.backup_bytes())
    for allocation in to_drop:
        with frees_held():
            if allocation.freed:  # the extension released it
                continue
            try:
                driver.unmap_and_release(*allocation.vmm_args())
            except Exception as error:
                add(result.still_mapped, allocation.tag, allocation.size)
                result.failures.append(f"{allocation.address:#x}: {error}")
                continue
            allocation.unmapped()
            allocation.has_backup = False
            if allocation.backed_up_ahead:
                allocation.drop_host()
        add(result.dropped, allocation.tag, allocation.size)
    return result


@contextlib.contextmanager
def _no_automatic_collection() -> Iterator[None]:
    """Inside, the interpreter starts no garbage collection of its own (an
    explicit gc.collect() still runs). The KV cache's thread holds torch's
    frees (`frees_held`) around each release; a collection there could free a
    CUDA tensor, which waits for torch's allocator lock, while the sleep's
    thread holds that lock in empty_cache and waits in on_free for the frees:
    neither would go on. The release runs for milliseconds."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class EarlyDrop:
    """The KV cache a sleep releases on a thread of its own, when the caller
    has given up its contents (allocator.sleep's kv_cache_cleared), while the
    sleep's thread backs up and releases the rest: that release is most of a
    level-1 sleep that copies little, and the rest now overlaps it instead of
    following it. It starts once the backup's fingerprints are queued: the
    driver makes another thread's allocations and synchronous copies wait
    for a release, though not its kernel launches
    (docs/results/sleep-speed-h100.md). Only a sleep that backs up weights
    has one of its own (`split`).

    A level-2 sleep's starts ahead of it instead (`start_ahead`, at the start of
    the backend's suspend): it overlaps the host work before the sleep's
    first release (the model's buffers saved, the workspaces, the garbage),
    and the sleep waits for it before releasing anything itself
    (`wait_if_ahead`), as the driver serialises two threads' releases. On
    the 8B the level-2 sleeps went from 0.84x stock's to 0.64x (medians,
    lease 22 in docs/results/sleep-speed-h100.md). The thread owns these
    allocations' records from `start` to `finish`; after a failed sleep
    `undo` maps the cache back, filled like after a wake."""

    def __init__(
        self,
        driver: DeviceDriver,
        allocations: list[Allocation],
        frees_held: Callable[[], AbstractContextManager[Any]],
        *,
        ahead: bool = False,
    ) -> None:
        self._driver = driver
        self._frees_held = frees_held
        self.allocations = allocations
        self.ahead = ahead
        self.dropped = Dropped()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()  # set by the thread as its last step
        self._error: BaseException | None = None
        self._seconds = 0.0

    @classmethod
    def start_ahead(
        cls,
        driver: DeviceDriver,
        live: list[Allocation],
        frees_held: Callable[[], AbstractContextManager[Any]],
    ) -> EarlyDrop:
        """Starts releasing the mapped KV cache among `live` now, for a
        sleep that follows on this thread to take over (KvCacheRelease)."""
        kv_cache = [a for a in live if a.tag == KV_CACHE_TAG and a.mapped]
        early = cls(driver, kv_cache, frees_held, ahead=True)
        early._launch()
        return early

    @classmethod
    def split(
        cls,
        driver: DeviceDriver,
        to_back_up: list[Allocation],
        to_drop: list[Allocation],
        kv_cache_cleared: bool,
        frees_held: Callable[[], AbstractContextManager[Any]],
    ) -> tuple[EarlyDrop, list[Allocation]]:
        """The KV cache's early drop for a sleep that backs up `to_back_up`
        and drops `to_drop`, and what the sleep's thread drops itself. Only a
        sleep that backs up weights has one: without their copies to overlap
        the thread only adds contention, as the driver serialises the two
        threads' releases (the 8B's level-2 sleeps were shorter on one thread,
        each of three against each of three in one run: lease 20 in
        docs/results/archive/sleep-speed-h100-2026-12-07.md)."""
        if not (kv_cache_cleared and any(a.tag == WEIGHTS_TAG for a in to_back_up)):
            return cls(driver, [], frees_held), to_drop
        early = [allocation for allocation in to_drop if allocation.tag == KV_CACHE_TAG]
        return cls(driver, early, frees_held), [a for a in to_drop if a.tag != KV_CACHE_TAG]

    def start(self) -> None:
        """Starts the thread; one started ahead is running already."""
        if not self.ahead:
            self._launch()

    def _launch(self) -> None:
        if self.allocations:
            self._thread = threading.Thread(
                target=self._run, name="graph-sleep-kv-release", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            with _no_automatic_collection():
                self.dropped = drop(self._driver, [], self.allocations, self._frees_held)
        except BaseException as error:  # raised again on the sleep's thread
            self._error = error
        finally:
            self._seconds = time.perf_counter() - start
            self._done.set()

    def finish(self, clock: PhaseClock | None = None) -> Dropped:
        """Waits for the release (a lap on `clock` names it); raises, once,
        what the thread raised other than a driver's refusal, which `drop`
        keeps."""
        self._join(clock)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.dropped

    def wait_if_ahead(self, clock: PhaseClock) -> None:
        """Before the sleep's own first release: waits for one started ahead
        (what it raised is raised by `finish`, once the sleep is done)."""
        if self.ahead:
            self._join(clock)

    def _join(self, clock: PhaseClock | None) -> None:
        thread = self._thread
        if thread is None:
            return
        try:
            self._done.wait()
        except BaseException:
            # Interrupted (Ctrl-C, vLLM's SIGTERM handler): the release goes on
            # all the same, and whoever reads these records next (a wake)
            # must find it done. Not Thread.join, which an interrupt can leave
            # marking a running thread stopped (CPython's fix for bpo-45274).
            self._done.wait()
            raise
        finally:
            self._thread = None
        thread.join()
        if clock is not None:
            count = len(self.allocations) - len(self.dropped.failures)
            since = ", started ahead" if self.ahead else ""
            clock.lap(
                f"waiting for the {KV_CACHE_TAG}'s release on its thread{since} ({count} "
                f"allocations, {1000 * self._seconds:.1f} ms there)"
            )

    def undo(self, backups: Backups) -> str:
        """Maps back what the thread released; says so, for the sleep's error.
        What the thread raised (`finish`) is raised once that is done."""
        self._join(None)
        # Not those torch freed meanwhile: my_free deleted them (drop's frees_held).
        emptied = [a for a in self.allocations if not a.mapped and not a.freed]
        note = backups.restore_after_failed_sleep(emptied, []) if emptied else ""
        self.finish()
        if not emptied:
            return ""
        size = format_bytes(sum(allocation.size for allocation in emptied))
        return (
            f" (but the {KV_CACHE_TAG}, {size} released on its thread, came back "
            f"without its contents: vLLM clears it before every sleep{note})"
        )


class KvCacheRelease:
    """Whose thread releases the KV cache in a sleep: the sleep's own, or an
    EarlyDrop, started by the sleep (`split`) or ahead of it (`ahead`). Owns
    the one started ahead until a sleep takes it over."""

    def __init__(
        self,
        driver: DeviceDriver,
        backups: Backups,
        frees_held: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        self._driver = driver
        self._backups = backups
        self._frees_held = frees_held
        self._ahead: EarlyDrop | None = None

    @contextlib.contextmanager
    def ahead(self, live: list[Allocation]) -> Iterator[None]:
        """Inside, the mapped KV cache among `live` is released on a thread
        of its own (the caller gave its contents up), for the sleep that
        follows inside to take over; mapped back empty on the way out if no
        sleep did."""
        if self._ahead is not None:
            raise RuntimeError("the KV cache's release was already started ahead of a sleep")
        self._ahead = EarlyDrop.start_ahead(self._driver, live, self._frees_held)
        try:
            yield
        finally:
            ahead, self._ahead = self._ahead, None
            if ahead is not None:
                note = ahead.undo(self._backups)
                logger.warning("graph-sleep: no sleep took the KV cache's release over%s", note)

    def check_sleep(self, offload: tuple[str, ...], kv_cache_cleared: bool) -> None:
        """ValueError, before the sleep does anything, where a release started
        ahead is under way and the sleep would back the KV cache up or keep
        its contents (the block then undoes the release)."""
        if self._ahead is not None and (KV_CACHE_TAG in offload or not kv_cache_cleared):
            raise ValueError(
                f"the {KV_CACHE_TAG}'s release was started ahead of this sleep, which would "
                f"{'back it up' if kv_cache_cleared else 'keep its contents'}: a sleep inside "
                f"kv_cache_released_ahead() must drop the {KV_CACHE_TAG}, with "
                "kv_cache_cleared=True"
            )

    def split(
        self, to_back_up: list[Allocation], to_drop: list[Allocation], kv_cache_cleared: bool
    ) -> tuple[EarlyDrop, list[Allocation]]:
        """The sleep's early drop and what its own thread drops: the one
        started ahead, if any, taken over (EarlyDrop.split otherwise)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return EarlyDrop.split(
                self._driver, to_back_up, to_drop, kv_cache_cleared, self._frees_held
            )
        taken = {id(allocation) for allocation in ahead.allocations}
        return ahead, [allocation for allocation in to_drop if id(allocation) not in taken]


def retry_refused_frees(driver: DeviceDriver, clock: PhaseClock) -> None:
    """Gives back what frees the driver refused left on the device (torch
    freed those allocations and the table forgot them; the extension holds
    their memory), so that a passing refusal costs memory until the next
    sleep, not for the life of the process. Logs what came back and what is
    still held; a lap on `clock` when there was any."""
    if not driver.held_after_refused_frees():
        return
    freed, why = driver.retry_refused_frees()
    clock.lap("refused frees tried again")
    if freed:
        logger.info(
            "graph-sleep sleep: gave back %s that frees the driver had refused left on the device",
            format_bytes(freed),
        )
    if why:
        logger.warning(
            "graph-sleep sleep: %s that frees the driver refused left on the device is still "
            "held (tried again at the next sleep): %s",
            format_bytes(driver.held_after_refused_frees()),
            why,
        )


def discard(driver: DeviceDriver, allocations: list[Allocation]) -> int:
    """Releases `allocations` and their host backups, mapped or asleep;
    returns the bytes unmapped."""
    freed = 0
    for allocation in allocations:
        if allocation.mapped:
            driver.synchronize(allocation.device)
            driver.unmap_and_release(*allocation.vmm_args())
            allocation.unmapped()
            freed += allocation.size
        allocation.drop_host()
        allocation.has_backup = False
    driver.release_dropped_host_buffers()
    return freed
