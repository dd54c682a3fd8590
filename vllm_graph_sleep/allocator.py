"""Tagged sleep-mode memory: one manager per process.

`GraphSleepAllocator` implements vLLM 0.26's `MemAllocator` protocol
(`use_memory_pool`, `sleep`, `wake_up`, `get_current_usage`) on our own VMM
allocator, plus `discard` and `cudagraph_pool`, a MemPool whose allocations carry
the tag "cudagraph" so that captured CUDA/HIP graphs can sleep with everything
else and replay after wake at the same addresses. It is a facade: each
mechanism is a collaborator of `vllm_graph_sleep.memory` that owns its state
(the allocation table, pool routing, cuBLAS workspaces, the stack limit,
backups, the settle thread); this class holds the sleep, wake and discard
transactions and hands values from one collaborator to another.

Rules it keeps:
- sleep backs the offloaded tags up to pinned host memory and drops the rest;
  an allocation that is already asleep is left alone (no double unmap);
- wake maps only sleeping allocations (no double map); besides the tags it is
  asked for it always brings back every tag that is not deferrable (only
  "weights" and "kv_cache" may stay asleep), graph pool first;
- a wake that fails part-way unmaps what it mapped, keeps every host backup and
  raises: the allocator stays asleep and the wake can be retried;
- a sleep that fails while backing up, or while releasing memory it backed up,
  puts back what it released and raises `SleepError`: the allocator stays
  awake, nothing lost (but the KV cache's contents, when the caller said it
  cleared them: the backend does, since vLLM resets that cache before every
  sleep; the cache is then released on a thread of its own while the backup
  runs, and mapped back empty). Once it releases memory without a backup it
  cannot go back, so it finishes: what it could not release stays mapped (wake
  skips it), and it logs the failure;
- a pool is dropped when its `use_memory_pool` context exits, so torch hands
  back fully free segments (dead memory after online quantization or weight
  repacking is not kept, nor backed up at sleep); sleep first releases what
  such pools freed since. Only the graph pool lives as long as the engine;
- a sleep lowers each device's per-thread stack limit (the context's stack
  reservation) once its memory is released, and any wake restores it first,
  before it maps anything; a wake whose restore fails changes nothing and
  raises `WakeUpError`, a wake that fails later lowers it again;
- after a sleep, a background thread probes the driver twice (`settle.Settler`)
  so that the work the driver defers after a large release is paid while the
  engine sleeps, not by the wake; a wake first stops the thread;
- on ROCm, memory that comes back without a backup is zeroed and the device
  synchronized before wake returns (amdgpu can hand back stale VRAM,
  vllm-project/vllm#44972); CUDA does not zero unless asked to.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from vllm_graph_sleep import settings as switches
from vllm_graph_sleep.memory.backups import (
    POISON_BYTE,
    BackupCount,
    Backups,
    FillPolicy,
    back_up_ahead,
    resolve_coding,
    resolve_keeping,
)
from vllm_graph_sleep.memory.driver import DeviceDriver, MemoryPool
from vllm_graph_sleep.memory.mapping import take_runs_apart
from vllm_graph_sleep.memory.records import (
    BUILTIN_TAGS,
    DEFAULT_TAG,
    DEFERRABLE_TAGS,
    GRAPH_TAG,
    KV_CACHE_TAG,
    RUNTIME_TAG,
    WEIGHTS_TAG,
    Allocation,
    AllocationTable,
)
from vllm_graph_sleep.memory.release import (
    KvCacheRelease,
    PartialRelease,
    backed_up_bytes,
    discard,
    drop,
    release_backed_up,
    retry_refused_frees,
)
from vllm_graph_sleep.memory.report import PhaseClock, coded_note, copy_note, describe
from vllm_graph_sleep.memory.routing import PoolRouter
from vllm_graph_sleep.memory.stack import STACK_WHILE_ASLEEP, StackLimiter
from vllm_graph_sleep.memory.workspaces import WorkspaceKeeper
from vllm_graph_sleep.settings import AllocatorSettings
from vllm_graph_sleep.settle import Settler
from vllm_graph_sleep.units import format_bytes

__all__ = [
    "BUILTIN_TAGS",
    "DEFAULT_TAG",
    "DEFERRABLE_TAGS",
    "GRAPH_TAG",
    "KV_CACHE_TAG",
    "POISON_BYTE",
    "RESUME_HINT",
    "RUNTIME_TAG",
    "STACK_WHILE_ASLEEP",
    "WEIGHTS_TAG",
    "Allocation",
    "GraphSleepAllocator",
    "SleepError",
    "WakeUpError",
    "format_bytes",
]

logger = logging.getLogger("vllm.graph_sleep")

# The switches' names, for the callers that name them (the declarations are settings.py's).
ZERO_ON_WAKE_ENV = switches.ZERO_ON_WAKE.name
RELEASE_HOST_MEMORY_ENV = switches.RELEASE_HOST_MEMORY.name
RELEASE_STACK_ENV = switches.RELEASE_STACK.name
RELEASE_BLAS_WORKSPACES_ENV = switches.RELEASE_BLAS_WORKSPACES.name
SETTLE_AFTER_SLEEP_ENV = switches.SETTLE_AFTER_SLEEP.name
COMPRESS_BACKUPS_ENV = switches.COMPRESS_BACKUPS.name
WHOLE_GRAPH_POOL_BACKUP_ENV = switches.WHOLE_GRAPH_POOL_BACKUP.name
HOST_BUFFERS_ENV = switches.HOST_BUFFERS.name
POISON_GRAPH_SCRATCH_ENV = switches.POISON_GRAPH_SCRATCH.name
POISON_REMAPPED_ENV = switches.POISON_REMAPPED.name
#: The yes/no switches the allocator reads (AllocatorSettings reads them all).
SWITCH_ENVS = switches.WORKER_YES_NO


class WakeUpError(RuntimeError):
    """A wake that could not get its memory back; nothing was woken."""


class SleepError(RuntimeError):
    """A sleep that could not back up or release its memory; nothing was released."""


# vLLM pauses the scheduler before it sleeps the workers and resumes it only on a
# wake (EngineCore.sleep / wake_up), also after a sleep that failed.
RESUME_HINT = "vLLM keeps scheduling paused until POST /wake_up (LLM.wake_up() offline)"


def _release_cached_memory(driver: DeviceDriver, clock: PhaseClock) -> None:
    """A sleep's first release: what garbage cycles hold, then what torch
    caches (segments of dropped pools and of the workspaces): nothing to back
    up there. A lap each (issue 38: the pair grew over the cycles on the 8B)."""
    driver.collect_garbage()
    clock.lap("garbage")
    driver.release_cached_memory()
    clock.lap("torch's cache")


def _failed_release(error: PartialRelease, count: int, undone: str) -> SleepError:
    """The error of a sleep whose release of its `count` backed-up allocations
    failed (`undone`: what mapping the KV cache back says)."""
    return SleepError(
        f"sleep failed after releasing {error.released} of {count} backed-up allocations: "
        f"{error}. They were mapped back from their host copies{error.note}{undone}; the "
        f"engine is awake, but {RESUME_HINT}."
    )


class GraphSleepAllocator:
    """Process-wide owner of all sleep-mode memory (see module docstring)."""

    _instance: GraphSleepAllocator | None = None

    @classmethod
    def get_instance(cls, settings: AllocatorSettings | None = None) -> GraphSleepAllocator:
        """The process's allocator, made at the first call on the GPU driver
        with `settings` (default: read from the environment now)."""
        if cls._instance is None:
            from vllm_graph_sleep._native import VmmDriver

            settings = AllocatorSettings.from_environ() if settings is None else settings
            cls._instance = cls(VmmDriver(settings.host_buffers), settings=settings)
        return cls._instance

    @classmethod
    def current(cls) -> GraphSleepAllocator | None:
        """The process's allocator if one was made, without making one."""
        return cls._instance

    @classmethod
    @contextmanager
    def installed(cls, allocator: GraphSleepAllocator | None) -> Iterator[None]:
        """`allocator` is the process's (None: none is) inside; the previous one after."""
        previous, cls._instance = cls._instance, allocator
        try:
            yield
        finally:
            cls._instance = previous

    def __init__(
        self,
        driver: DeviceDriver,
        *,
        settings: AllocatorSettings | None = None,
        settler: Settler | None = None,
        compress_backups: bool | None = None,
        **overrides: bool | None,
    ):
        """`settings`: the switches as the worker read them (default: read from
        the environment now); a field of them given as a keyword (not None)
        overrides its switch, and `compress_backups` given is taken as it is,
        unchecked (`self.settings`: what it was made with). `settler`: the probe thread."""
        given = AllocatorSettings.from_environ() if settings is None else settings
        given = dataclasses.replace(given, **{k: v for k, v in overrides.items() if v is not None})
        self.settings, self._driver = given, driver
        self.release_host_memory = given.release_host_memory
        self._settler = None
        if given.settle_after_sleep:
            self._settler = settler or Settler(driver.probe_mapping)
        self._router = PoolRouter(driver)
        self.table = AllocationTable(driver, lambda: self._router.current_tag)
        self._workspaces = WorkspaceKeeper(
            driver, self._router, release=given.release_blas_workspaces
        )
        self._stack = StackLimiter(driver, enabled=given.release_stack)
        if compress_backups is None:
            compress_backups = resolve_coding(given.compress_backups, driver)
        fill = FillPolicy(
            zero=driver.is_rocm() if given.zero_on_wake is None else given.zero_on_wake,
            poison_graph_scratch=given.poison_graph_scratch,
            poison_remapped=given.poison_remapped,
        )
        self._backups = Backups(
            driver,
            coded=compress_backups,
            keep_unchanged=resolve_keeping(given.keep_unchanged_backups),
            whole_graph_pool=given.whole_graph_pool_backup,
            fill=fill,
        )
        self._last_backup = BackupCount()
        self._kv_cache_release = KvCacheRelease(driver, self._backups, self.table.frees_held)
        # The extension keeps its own references to these bound methods.
        driver.register_callbacks(self.table.on_malloc, self.table.on_free)

    # -- what the collaborators know, asked through the facade ---------------

    @property
    def driver(self) -> DeviceDriver:
        return self._driver

    @property
    def allocations(self) -> Mapping[int, Allocation]:
        """Address -> record of every allocation of ours (read it, do not change it)."""
        return self.table.by_address

    @property
    def current_tag(self) -> str:
        return self._router.current_tag

    @property
    def release_stack(self) -> bool:
        return self._stack.enabled

    @property
    def compress_backups(self) -> bool:
        return self._backups.coded

    @compress_backups.setter
    def compress_backups(self, coded: bool) -> None:
        self._backups.coded = coded

    @property
    def keeps_unchanged_backups(self) -> bool:
        return self._backups.keep_unchanged

    def last_backup(self) -> BackupCount:
        """What the last sleep's backup copied and kept, bytes per tag (nothing
        when its backup failed)."""
        return self._last_backup

    @property
    def zero_on_wake(self) -> bool:
        return self._backups.fill_policy.zero

    @zero_on_wake.setter
    def zero_on_wake(self, zero: bool) -> None:
        self._backups.fill_policy = dataclasses.replace(self._backups.fill_policy, zero=zero)

    def get_current_usage(self) -> int:
        """Bytes of every allocation we own, awake or asleep (vLLM's meaning)."""
        return sum(allocation.size for allocation in self.table.live())

    def allocated_addresses(self) -> frozenset[int]:
        """Addresses of every allocation of ours, earlier engines' included."""
        return self.table.addresses()

    def tags_in_use(self) -> set[str]:
        return self.table.tags_in_use()

    def all_mapped_bytes(self) -> int:
        """Bytes mapped, allocations of earlier engines and what refused frees left included."""
        return self.table.all_mapped_bytes() + self._driver.held_after_refused_frees()

    def orphan_leftovers(self) -> int:
        """Marks every allocation as left by an earlier engine, each in a run
        mapped on its own first (`take_runs_apart`); returns their bytes."""
        take_runs_apart(self._driver, self.table.all())
        return self.table.orphan_all()

    def mapped_bytes(self, tag: str | None = None) -> int:
        return self.table.mapped_bytes(tag)

    def usage_by_tag(self) -> dict[str, dict[str, int]]:
        """Per tag: bytes mapped, asleep with a host backup, asleep without."""
        return self.table.usage_by_tag()

    def pool_ids(self) -> set[tuple[int, int]]:
        """Ids of our open torch memory pools (graph pool included)."""
        return self._router.pool_ids()

    def host_bytes(self) -> int:
        return self.table.host_bytes()

    def graph_pool_segments(self) -> list[dict]:
        """torch's segments of the graph pool (none before it exists)."""
        return self._router.graph_pool_segments()

    def trusted_streams(self) -> frozenset[int]:
        """Capture streams whose cuBLAS workspaces were both made in the graph pool."""
        return self._workspaces.trusted_streams()

    def device_bytes(self, allocation: Allocation) -> torch.Tensor:
        """A byte view of a mapped allocation."""
        return self._backups.device_bytes(allocation)

    # -- pools -------------------------------------------------------------

    def allocation_tag(self, tag: str):
        """Allocations our allocator makes inside are tagged `tag` (no new pool)."""
        return self._router.allocation_tag(tag)

    def use_memory_pool(self, tag: str | None = None):
        """Allocations made inside come from a new pool of ours, tagged `tag`,
        dropped on exit (see PoolRouter.use_memory_pool)."""
        return self._router.use_memory_pool(tag)

    def routed_to(self, pool: MemoryPool | None):
        """Routes this thread's allocations to `pool` (None: to none of ours) inside."""
        return self._router.routed_to(pool)

    def cudagraph_pool(self):
        """The process's graph pool: capture with `pool=<yielded>.id` inside."""
        return self._router.cudagraph_pool()

    def graph_pool_without_routing(self):
        """The graph pool, with this thread's pool of ours unrouted meanwhile."""
        return self._router.graph_pool_without_routing()

    def create_blas_workspaces_in_graph_pool(self, side_streams: Sequence[Any] = ()) -> None:
        """The cuBLAS workspaces of the capture stream and `side_streams`, made
        in the graph pool (see WorkspaceKeeper.create_in_graph_pool)."""
        self._workspaces.create_in_graph_pool(side_streams)

    def prepare_backup_kernels(self, device: torch.device) -> None:
        """Compiles on `device` now the kernels a sleep launches (the backup
        fingerprints', the coder's), those the switches turn on."""
        self._backups.prepare_kernels(device)

    def back_up_ahead(self, tags: Sequence[str]) -> BackupCount | None:
        """`memory.backups.back_up_ahead` of the mapped allocations of `tags`."""
        selected = self._router.normalize(tags, "back_up_ahead")
        awake = [a for a in self.table.live() if a.mapped and a.tag in selected]
        return back_up_ahead(self._backups, awake, self._live_ranges, self.release_host_memory)

    def claim_graph_pool(self) -> None:
        """Tags everything in the graph pool "cudagraph", whatever tag was current
        when it was allocated (a capture outside `cudagraph_pool()`, e.g. a lazy
        one, still used this pool through the platform's global graph pool)."""
        self.table.retag({s["address"] for s in self._router.graph_pool_segments()}, GRAPH_TAG)

    def release_pools(self) -> None:
        """Engine shutdown: drops the graph pool (a next engine gets a new one),
        torch's workspaces (one made in the pool would outlive it, and a next
        engine capturing on the same pooled stream would use it from a segment
        nobody sleeps) and every free segment of ours; stops the settle thread
        and gives the stack limit back (a next engine starts with the
        context's). Allocations still alive then belong to tensors someone holds."""
        if self._settler is not None:
            self._settler.stop()
        self._stack.shut_down()
        self._workspaces.shut_down()
        self._router.drop_graph_pool()
        self._driver.collect_garbage()
        self._driver.release_cached_memory()
        # This engine sleeps no more: the buffers kept for its next sleep go
        # now, not when their allocations are freed, which can be after the
        # last release point. Backups of what is asleep stay for a wake.
        self._backups.give_back_host_buffers(self.table.all())
        if len(self.table):
            logger.info(
                "graph-sleep: %s still allocated after shutdown (%s)",
                format_bytes(self.get_current_usage()),
                describe(self.table.bytes_by_tag()),
            )

    # -- sleep / wake / discard -------------------------------------------

    def kv_cache_released_ahead(self):
        """Inside, the KV cache (its contents given up) is released on a thread
        of its own for the sleep that follows inside (KvCacheRelease.ahead)."""
        return self._kv_cache_release.ahead(self.table.live())

    def sleep(
        self, offload_tags: tuple[str, ...] | str | None = None, *, kv_cache_cleared: bool = False
    ) -> None:
        """Backs up `offload_tags` (default: "default") to host, drops the rest;
        with `kv_cache_cleared`, a dropped KV cache is released on a thread of
        its own, from the moment the backup's fingerprints are queued, while
        this one backs up the weights and releases the rest; at level 2 (no
        weights backed up) with the rest, unless started ahead (KvCacheRelease).

        Transactional up to the first drop: a failure while backing up, or
        while releasing memory that has a backup, maps back what was released
        and raises `SleepError` with the allocator awake and nothing lost (but,
        with `kv_cache_cleared`, the KV cache's contents). Memory without a
        backup is released last; once one such allocation is gone the sleep
        finishes, leaving mapped (and logged) what it cannot release."""
        if offload_tags is None:
            offload_tags = (DEFAULT_TAG,)
        offload = self._router.normalize(offload_tags, "sleep")
        self._kv_cache_release.check_sleep(offload, kv_cache_cleared)
        # Once the call is valid: a sleep that fails from here copies and keeps nothing.
        self._last_backup = BackupCount()
        clock = PhaseClock()
        # Before new backups: those of allocations freed since the last call.
        self._driver.release_dropped_host_buffers()
        clock.lap("freed allocations' host buffers")
        retry_refused_frees(self._driver, clock)
        self.claim_graph_pool()
        clock.lap("graph pool claimed")
        workspaces = self._workspaces.release()
        clock.lap("cuBLAS workspaces")
        _release_cached_memory(self._driver, clock)
        awake = [allocation for allocation in self.table.live() if allocation.mapped]
        to_back_up = [allocation for allocation in awake if allocation.tag in offload]
        to_drop = [allocation for allocation in awake if allocation.tag not in offload]
        early, to_drop = self._kv_cache_release.split(to_back_up, to_drop, kv_cache_cleared)
        try:
            live = self._live_ranges()
            self._last_backup = self._backups.back_up(to_back_up, live, clock, early.start)
        except BaseException as error:  # a KeyboardInterrupt too: the KV cache comes back
            undone = early.undo(self._backups)
            if not isinstance(error, Exception):
                raise
            raise SleepError(
                f"sleep failed while backing up {len(to_back_up)} allocations "
                f"({format_bytes(sum(a.size for a in to_back_up))}) to host memory: {error}. "
                f"Nothing was released{undone}; the engine is awake, but {RESUME_HINT}."
            ) from error

        try:
            early.wait_if_ahead(clock)
            try:
                released = release_backed_up(self._driver, self._backups, to_back_up)
            except PartialRelease as error:
                raise _failed_release(error, len(to_back_up), early.undo(self._backups)) from error
            late = drop(self._driver, released, to_drop)
            clock.lap(f"release ({len(released) + len(to_drop) - len(late.failures)} allocations)")
            stack = self._stack.lower({allocation.device for allocation in self.table.live()})
            clock.lap("stack limit")
            self._driver.release_dropped_host_buffers()  # the backups replaced or dropped
            clock.lap("host buffers given back")
        finally:
            # Whatever this thread raised, an interrupt too: the KV cache's thread is done.
            dropped = early.finish(clock)
        dropped.add(late)
        dropped.log_failures()
        logger.info(
            "graph-sleep sleep: backed up %s%s%s; dropped %s; %s; %s; %s",
            describe(backed_up_bytes(released)),
            copy_note(self._last_backup) if self._backups.keep_unchanged else "",
            coded_note(released),
            describe(dropped.dropped),
            stack,
            workspaces,
            clock.summary(),
        )
        if self._settler is not None:
            self._settler.start(
                {a.device for a in (*released, *early.allocations, *to_drop) if not a.mapped}
            )

    def _live_ranges(self) -> dict[int, list[tuple[int, int]]]:
        segments, blocks = self._router.graph_pool_segments(), self._workspaces.blocks()
        return self._backups.live_ranges(segments, blocks)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Maps back the sleeping allocations of `tags` (None: all) and of every
        non-deferrable tag, restoring host backups. On failure nothing is woken
        and `WakeUpError` is raised; the call can be retried."""
        requested = None if tags is None else self._router.normalize(tags, "wake_up")
        clock = PhaseClock()
        # Before any driver call of ours: the thread's probe, if one is under
        # way, would only make this wake's first call wait for it.
        if self._settler is None:
            settled = f"driver not probed while asleep (switched off: {SETTLE_AFTER_SLEEP_ENV})"
        else:
            settled = self._settler.stop()
        clock.lap("settle thread stopped")  # it finishes a probe under way first
        # torch's cached but unused blocks go to the driver first: they may be
        # what we need to map, and one of ours that torch frees here (a tensor
        # that died asleep) must not be among the targets.
        self._driver.release_cached_memory()
        clock.lap("torch's cache")
        targets = self.table.to_wake(requested)
        lowered = self._stack.lowered_devices()
        try:
            # Before anything else: no graph may replay with the stack lowered.
            self._stack.restore()
        except Exception as error:
            self._stack.lower(lowered)
            raise WakeUpError(
                f"wake_up(tags={tags}) failed restoring the per-thread stack limit: {error}. "
                "Nothing was mapped; the engine is still asleep and the wake can be retried."
            ) from error
        if not targets:
            if self.release_host_memory:  # those of a sleep that failed, as a wake's go
                self._backups.give_back_host_buffers(self.table.live())
            logger.info("graph-sleep wake_up(tags=%s): nothing asleep to wake", tags)
            return
        clock.lap("stack limit")
        mapped: list[Allocation] = []
        try:
            restored, fresh = self._backups.map_and_restore(targets, mapped, clock)
        except BaseException as error:  # an interrupt too: a retry must find the records true
            self._backups.roll_back(mapped)
            self._stack.lower(lowered)  # asleep again
            if not isinstance(error, Exception):
                raise
            wanted_bytes = sum(a.size for a in targets)
            raise WakeUpError(
                f"wake_up(tags={tags}) failed after mapping {len(mapped)} of {len(targets)} "
                f"allocations ({format_bytes(wanted_bytes)} wanted): {error}. Everything it "
                "mapped was released again and all host backups are intact; free device memory "
                "held elsewhere and retry."
            ) from error

        for allocation in mapped:  # each recorded as mapped as the mapping went
            allocation.has_backup = False
            if self.release_host_memory:
                allocation.drop_host()
        self._driver.release_dropped_host_buffers()
        clock.lap("host buffers given back")
        logger.info(
            "graph-sleep wake_up(tags=%s): restored from host %s; remapped without backup %s%s; "
            "still asleep %s; %s; %s; %s",
            tags,
            describe(restored),
            describe(fresh),
            " (zeroed)" if self.zero_on_wake and fresh else "",
            describe(self.table.asleep_by_tag()),
            "stack limit restored" if lowered else "stack limit unchanged",
            settled,
            clock.summary(),
        )

    def discard(self, tags: tuple[str, ...] | list[str] | str) -> int:
        """Releases the memory of `tags` without any backup; returns bytes freed.

        Awake allocations are unmapped; sleeping ones lose their host backup, so
        they come back with undefined contents (zeroed on ROCm)."""
        selected = self._router.normalize(tags, "discard")
        freed = discard(self._driver, [a for a in self.table.live() if a.tag in selected])
        logger.info("graph-sleep discard(%s): released %s", list(selected), format_bytes(freed))
        return freed
