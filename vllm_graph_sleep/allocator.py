"""Tagged sleep-mode memory: one manager per process.

`GraphSleepAllocator` implements vLLM 0.26's `MemAllocator` protocol
(`use_memory_pool`, `sleep`, `wake_up`, `get_current_usage`) on our own VMM
allocator, plus `discard` and `cudagraph_pool`, a MemPool whose allocations carry
the tag "cudagraph" so that captured CUDA/HIP graphs can sleep with everything
else and replay after wake at the same addresses.

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
  awake, nothing lost. Once it releases memory without a backup it cannot go
  back, so it finishes: what it could not release stays mapped (wake skips it),
  and it logs the failure;
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
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from vllm_graph_sleep.alloc_conf import expandable_segments_off
from vllm_graph_sleep.config import NO_VALUES, YES_VALUES, parse_yes_no
from vllm_graph_sleep.settle import Settler

if TYPE_CHECKING:
    from vllm_graph_sleep.coded_backup import CodedBackup

logger = logging.getLogger("vllm.graph_sleep")

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

ZERO_ON_WAKE_ENV = "VLLM_GRAPH_SLEEP_ZERO_ON_WAKE"
RELEASE_HOST_MEMORY_ENV = "VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY"
RELEASE_STACK_ENV = "VLLM_GRAPH_SLEEP_RELEASE_STACK"
RELEASE_BLAS_WORKSPACES_ENV = "VLLM_GRAPH_SLEEP_RELEASE_BLAS_WORKSPACES"
SETTLE_AFTER_SLEEP_ENV = "VLLM_GRAPH_SLEEP_SETTLE_AFTER_SLEEP"
# Weight backups coded on the device (coded_backup): about two thirds of the
# bytes over the host link for bf16 weights. On by default on CUDA, where Triton
# imports, for the wake a request waits on (runs 14-15: an 8B's 0.53-0.55x
# stock's, raw 0.71-0.74x); the sleeps after the first cost 0.05-0.16 s more.
COMPRESS_BACKUPS_ENV = "VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS"
WHOLE_GRAPH_POOL_BACKUP_ENV = "VLLM_GRAPH_SLEEP_BACK_UP_WHOLE_GRAPH_POOL"
# How the driver pins host buffers: "registered" (default) or "torch".
HOST_BUFFERS_ENV = "VLLM_GRAPH_SLEEP_HOST_BUFFERS"
# Test switch: a wake fills what a graph-pool backup left out with this byte,
# so that a replay reading memory it did not write gives wrong tokens.
POISON_GRAPH_SCRATCH_ENV = "VLLM_GRAPH_SLEEP_POISON_GRAPH_SCRATCH"
# Test switch: a wake fills what it maps back without any backup (weights that
# sleep level 2 dropped) with the same byte, so that a weight reload that misses
# a tensor gives wrong tokens instead of whatever the driver's fresh pages held
# (often the old bytes). Not the KV cache: vLLM never reads its stale blocks,
# but attention kernels may load masked slots, where 0xFF would be NaN.
POISON_REMAPPED_ENV = "VLLM_GRAPH_SLEEP_POISON_REMAPPED"
#: The yes/no switches the allocator reads (env_switch); check_switches and doctor read them all.
SWITCH_ENVS = (
    ZERO_ON_WAKE_ENV,
    RELEASE_HOST_MEMORY_ENV,
    RELEASE_STACK_ENV,
    RELEASE_BLAS_WORKSPACES_ENV,
    SETTLE_AFTER_SLEEP_ENV,
    COMPRESS_BACKUPS_ENV,
    WHOLE_GRAPH_POOL_BACKUP_ENV,
    POISON_GRAPH_SCRATCH_ENV,
    POISON_REMAPPED_ENV,
)
POISON_BYTE = 0xFF
# Per-thread stack limit while asleep. The context reserves limit x every thread
# the GPU can hold resident (264 MiB at 1 KiB on an H200) and keeps it until the
# limit changes; nothing runs a graph while asleep, and wake restores the limit
# before anything can replay one (a replay with too little stack fails).
STACK_WHILE_ASLEEP = 0


class WakeUpError(RuntimeError):
    """A wake that could not get its memory back; nothing was woken."""


class SleepError(RuntimeError):
    """A sleep that could not back up or release its memory; nothing was released."""


# vLLM pauses the scheduler before it sleeps the workers and resumes it only on a
# wake (EngineCore.sleep / wake_up), also after a sleep that failed.
RESUME_HINT = "vLLM keeps scheduling paused until POST /wake_up (LLM.wake_up() offline)"


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

    def drop_host(self) -> None:
        """Lets the host buffer go, with the coded pieces that view it."""
        self.host = None
        self.coded = None

    def backup_bytes(self) -> int:
        if self.backup_ranges is None:
            return self.size
        return sum(size for _, size in self.backup_ranges)


def env_switch(name: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """A yes/no switch from the environment; None when unset or empty. Any
    other value is refused, so a typo cannot silently pick the other side."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return None
    value = parse_yes_no(raw)
    if value is not None:
        return value
    raise ValueError(
        f"{name}={raw!r} is not a yes/no value: yes is {'/'.join(YES_VALUES)}, "
        f"no is {'/'.join(NO_VALUES)}"
    )


def _backup_coding(switch: bool | None, driver: Any) -> bool:
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
        raise RuntimeError(
            f"{COMPRESS_BACKUPS_ENV}=1 codes backups with Triton kernels, and Triton "
            f"cannot be imported: {error}. Install Triton or unset {COMPRESS_BACKUPS_ENV}."
        ) from error
    return True


def check_switches(environ: Mapping[str, str] | None = None) -> None:
    """Reads every yes/no switch the allocator reads: ValueError for the first
    value it would refuse, before a worker sets anything up."""
    for name in SWITCH_ENVS:
        env_switch(name, environ)


def format_bytes(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size} B"


def _describe(per_tag: dict[str, int]) -> str:
    if not per_tag:
        return "nothing"
    return ", ".join(f"{tag} {format_bytes(size)}" for tag, size in sorted(per_tag.items()))


class _PhaseClock:
    """Where one sleep or wake spent its time, for its log line: a wake that
    misses its target says whether the stack limit, the mappings or the copies
    took the time, in the logs of every server that ran it."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self._laps: list[str] = []

    def lap(self, what: str) -> None:
        now = time.perf_counter()
        self._laps.append(f"{what} {1000 * (now - self._last):.1f} ms")
        self._last = now

    def summary(self) -> str:
        """'<total> s (<phase> <ms> ms, ...)'."""
        return f"{time.perf_counter() - self._start:.3f} s ({', '.join(self._laps)})"


def _coded_note(allocations: list[Allocation]) -> str:
    coded = [allocation for allocation in allocations if allocation.coded is not None]
    if not coded:
        return ""
    into = sum(allocation.coded.coded_bytes for allocation in coded)
    raw = sum(allocation.backup_bytes() for allocation in coded)
    return f" (weights coded: {format_bytes(raw)} in {format_bytes(into)})"


def _add(per_tag: dict[str, int], tag: str, size: int) -> None:
    per_tag[tag] = per_tag.get(tag, 0) + size


class GraphSleepAllocator:
    """Process-wide owner of all sleep-mode memory (see module docstring)."""

    _instance: GraphSleepAllocator | None = None

    @classmethod
    def get_instance(cls) -> GraphSleepAllocator:
        if cls._instance is None:
            from vllm_graph_sleep._native import VmmDriver

            cls._instance = cls(VmmDriver())
        return cls._instance

    def __init__(
        self,
        driver: Any,
        *,
        zero_on_wake: bool | None = None,
        release_host_memory: bool | None = None,
        release_stack: bool | None = None,
        release_blas_workspaces: bool | None = None,
        whole_graph_pool_backup: bool | None = None,
        settle_after_sleep: bool | None = None,
        compress_backups: bool | None = None,
    ):
        self._driver = driver
        self.allocations: dict[int, Allocation] = {}
        self.current_tag = DEFAULT_TAG
        self._known_tags: set[str] = set(BUILTIN_TAGS)
        # Pools of open use_memory_pool contexts. A pool is dropped when its
        # context exits; torch then releases its free segments through my_free
        # (the pluggable allocator the pools were built on stays alive).
        self._pools: list[torch.cuda.MemPool] = []
        # Pools whose context exited while an outer one was still routed: they
        # are dropped when the outermost exits.
        self._retired: list[torch.cuda.MemPool] = []
        self._graph_pool: torch.cuda.MemPool | None = None
        self._routing = threading.local()  # per thread: stack of pools routed to
        if zero_on_wake is None:
            zero_on_wake = env_switch(ZERO_ON_WAKE_ENV)
        self.zero_on_wake = driver.is_rocm() if zero_on_wake is None else zero_on_wake
        if release_host_memory is None:
            release_host_memory = bool(env_switch(RELEASE_HOST_MEMORY_ENV))
        self.release_host_memory = release_host_memory
        if release_stack is None:
            release_stack = env_switch(RELEASE_STACK_ENV) is not False
        self.release_stack = release_stack
        if release_blas_workspaces is None:
            release_blas_workspaces = env_switch(RELEASE_BLAS_WORKSPACES_ENV) is not False
        self.release_blas_workspaces = release_blas_workspaces
        if whole_graph_pool_backup is None:
            whole_graph_pool_backup = bool(env_switch(WHOLE_GRAPH_POOL_BACKUP_ENV))
        self.whole_graph_pool_backup = whole_graph_pool_backup
        if settle_after_sleep is None:
            settle_after_sleep = env_switch(SETTLE_AFTER_SLEEP_ENV) is not False
        self._settler = Settler(driver.probe_mapping) if settle_after_sleep else None
        if compress_backups is None:
            compress_backups = _backup_coding(env_switch(COMPRESS_BACKUPS_ENV), driver)
        self.compress_backups = compress_backups
        self.poison_graph_scratch = bool(env_switch(POISON_GRAPH_SCRATCH_ENV))
        self.poison_remapped = bool(env_switch(POISON_REMAPPED_ENV))
        # device -> the stack limit a wake puts back (only while it is lowered)
        self._saved_stack: dict[int, int] = {}
        # Streams whose cuBLAS and cuBLASLt workspaces this allocator made in
        # the graph pool, each mapped to what torch held outside the graph pool
        # on it (segment -> bytes in use) when a sleep first released the
        # workspaces (None before): growth there later may be a workspace made
        # outside. And the (address, bytes) blocks those workspaces took.
        self._trusted_streams: dict[int, dict[int, int] | None] = {}
        self._workspace_blocks: set[tuple[int, int]] = set()
        # Keeps torch's graph-safe RNG state on a trusted capture stream, from
        # the first capture into the graph pool to engine shutdown
        # (_hold_generator_graph_state).
        self._generator_state_holder: Any = None
        # The extension keeps its own references to these bound methods.
        driver.register_callbacks(self._on_malloc, self._on_free)

    # -- callbacks from the extension ------------------------------------

    def _on_malloc(self, device: int, size: int, address: int, handle: int) -> None:
        self.allocations[address] = Allocation(device, size, address, handle, self.current_tag)

    def _on_free(self, address: int) -> tuple[int, int, bool]:
        allocation = self.allocations.pop(address)
        if allocation.mapped:
            # The caching allocator may hand a block back while kernels queued
            # on other streams still use it; unmapping then would fault them.
            self._driver.synchronize(allocation.device)
        allocation.drop_host()
        return allocation.size, allocation.handle, allocation.mapped

    # -- pools -------------------------------------------------------------

    @contextmanager
    def allocation_tag(self, tag: str) -> Iterator[None]:
        """Allocations our allocator makes inside are tagged `tag` (no new pool)."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"a memory tag must be a non-empty string, not {tag!r}")
        self._known_tags.add(tag)
        previous, self.current_tag = self.current_tag, tag
        try:
            yield
        finally:
            self.current_tag = previous

    @contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[torch.cuda.MemPool]:
        """Allocations made inside come from a new pool of ours, tagged `tag`.

        On exit the pool is dropped: its fully free segments go back to the
        driver now, the rest when their tensors die (vLLM 0.26's own
        use_memory_pool trims the same way, by hand)."""
        with self.allocation_tag(tag or DEFAULT_TAG), expandable_segments_off():
            pool = self._driver.memory_pool()
            self._pools.append(pool)
            try:
                with self._routed_to(pool):
                    yield pool
            finally:
                self._pools.remove(pool)
                self._retired.append(pool)
                del pool
                # torch asserts that no pool is routed while it drops a pool or
                # empties its cache: the outermost of our contexts does both.
                if not any(self._routing_stack()):
                    self._retired.clear()
                    # Without a garbage collection: in an engine starting up,
                    # before vLLM freezes its heap, one takes about 0.2 s (run
                    # 4's profile), and this runs twice per start (weights, KV
                    # cache). What only garbage cycles still hold here goes at
                    # vLLM's own collection before it profiles memory, or at
                    # the next sleep, which collects first.
                    self._driver.release_cached_memory(collect_garbage=False)

    def _routing_stack(self) -> list:
        """This thread's pools of ours routed, innermost last (None: unrouted)."""
        return self._routing.__dict__.setdefault("pools", [])

    @contextmanager
    def _routed_to(self, pool: torch.cuda.MemPool | None) -> Iterator[None]:
        """Routes this thread's allocations to `pool` (None: to none of ours).
        A pool of ours already routed (an enclosing use_memory_pool) is
        unrouted meanwhile: torch keeps one routing list and may serve from the
        outer entry, which would put inner allocations in segments of the outer
        pool and tag."""
        stack = self._routing_stack()
        outer = stack[-1] if stack else None
        if outer is not None:
            self._driver.unroute(outer)
        if pool is not None:
            self._driver.route(pool)
        stack.append(pool)
        try:
            yield
        finally:
            stack.pop()
            if pool is not None:
                self._driver.unroute(pool)
            if outer is not None:
                self._driver.route(outer)

    @contextmanager
    def cudagraph_pool(self) -> Iterator[torch.cuda.MemPool]:
        """The process's graph pool: capture with `pool=<yielded>.id` inside.

        Graph-private allocations made while the context is open are tagged
        "cudagraph"; the same pool is yielded every time so all graphs share it.
        """
        with self.allocation_tag(GRAPH_TAG), expandable_segments_off():
            if self._graph_pool is None:
                self._graph_pool = self._driver.memory_pool()
            yield self._graph_pool

    def release_pools(self) -> None:
        """Engine shutdown: drops the graph pool (a next engine in this process
        gets a new one) and has torch hand back every free segment of ours.
        Allocations still alive afterwards belong to tensors someone holds.

        torch's workspaces go too: one made in this graph pool would otherwise
        outlive it, and a next engine capturing on the same (pooled) stream
        would use it from a segment nobody sleeps, or that is unmapped once
        torch frees it.

        An engine shut down asleep stops its settle thread and gets its stack
        limit back here: a next engine in this process starts with the stack
        the context had, and its first sleep lowers it again."""
        if self._settler is not None:
            self._settler.stop()
        try:
            self._restore_stack()
        except Exception as error:
            logger.warning(
                "graph-sleep: at shutdown, the per-thread stack limit could not be restored (%s); "
                "a next engine in this process starts with it lowered",
                error,
            )
        if self._workspace_blocks:
            outcome = self._release_blas_workspaces()
            logger.debug("graph-sleep: at shutdown, %s", outcome)
            self._workspace_blocks.clear()
        # torch hands the same stream handles out again: a next engine's
        # streams start untrusted, whatever this engine's were.
        self._trusted_streams.clear()
        self._generator_state_holder = None
        self._graph_pool = None
        self._driver.release_cached_memory()
        # This engine sleeps no more: the buffers kept for its next sleep go
        # now, not when their allocations are freed, which can be after the
        # last release point. Backups of what is asleep stay for a wake.
        for allocation in self.allocations.values():
            if allocation.mapped:
                allocation.drop_host()
        self._driver.release_dropped_host_buffers()
        if self.allocations:
            logger.info(
                "graph-sleep: %s still allocated after shutdown (%s)",
                format_bytes(self.get_current_usage()),
                _describe(self._bytes_by_tag()),
            )

    def _bytes_by_tag(self) -> dict[str, int]:
        per_tag: dict[str, int] = {}
        for allocation in self.allocations.values():
            _add(per_tag, allocation.tag, allocation.size)
        return per_tag

    @contextmanager
    def graph_pool_without_routing(self) -> Iterator[torch.cuda.MemPool]:
        """The graph pool, with this thread's pool of ours unrouted meanwhile.

        For captures made inside another pool's context (the Gemma4 drafter
        captures during load_model): torch serves a capture from the pool
        routed first, so the graph's memory would land in that pool, which is
        dropped and trimmed when its context exits, under a live graph. Other
        allocations meanwhile come from torch's own allocator."""
        with self._routed_to(None), self.cudagraph_pool() as pool:
            yield pool

    def create_blas_workspaces_in_graph_pool(self, side_streams: Sequence[Any] = ()) -> None:
        """Creates the cuBLAS and cuBLASLt workspaces of this thread's current
        stream, and of `side_streams` (streams the captured graphs fork onto),
        in the graph pool, before anything on those streams uses cuBLAS.

        torch keeps one workspace per (handle, stream), made at the first matmul
        there. On a graph-capture stream that is the eager warm-up before the
        first capture, outside every pool, and the captured graphs keep its
        address: 33 MiB that stayed resident while asleep (H200 ledger, issue
        15). Made in the graph pool, it sleeps and wakes with the graphs, and
        is never backed up: a workspace is scratch within each call.

        A stream that already has a workspace keeps it where it is, and each
        step makes at most its own workspace, so what the pool gained in each
        step is that workspace. A stream is trusted (see
        _release_blas_workspaces) only when both were made here; a call that
        makes nothing leaves its trust as it is (vLLM enters the context once
        per parallel group). This is an optimisation: if it fails, the capture
        goes on with the workspaces where torch puts them.

        Before the first capture into the graph pool no graph of ours exists
        (and those captured outside our pools, vLLM's throwaway profiling
        graphs, never replay), so torch's workspaces are dropped first (with
        the release switched on): what eager work made before on a side
        stream, or on the side stream of the model runner V1's throwaway
        profiling graphs (32 MiB that stayed resident on the H200 with
        Qwen3-MoE, run 5), is made again here or, on a stream no graph uses,
        left out of the graph pool."""
        try:
            if self.release_blas_workspaces and not self._graph_pool_segments():
                self._driver.release_blas_workspaces()
        except Exception as error:
            logger.warning(
                "graph-sleep: torch's cuBLAS workspaces were not dropped before the first "
                "capture: %s",
                error,
            )
        self._hold_generator_graph_state()
        self._create_blas_workspaces_on(None)
        for stream in side_streams:
            try:
                with self._driver.on_stream(stream):
                    self._create_blas_workspaces_on(stream)
            except Exception as error:
                logger.warning(
                    "graph-sleep: the cuBLAS workspaces of side stream %s stay outside the "
                    "graph pool: %s",
                    stream,
                    error,
                )

    def _hold_generator_graph_state(self) -> None:
        """Puts torch's graph-safe RNG state on this thread's current stream,
        the capture stream whose workspaces are made here, unless a live graph
        already holds it somewhere.

        torch makes that state (two 8-byte tensors, outside every pool) on the
        stream of the first graph to begin capturing while none is alive.
        Model runner V2 captures its FULL graphs, and model runner V1 its
        encoder graphs, on torch's own default capture stream, which has no
        workspace of ours and is not trusted: with FULL graphs alone (no
        piecewise graph captured first on vLLM's stream) the state would land
        there and every sleep would keep torch's workspaces. Made here first,
        it stays on a trusted stream until engine shutdown. If this fails, the
        workspaces are merely kept where the state lands. Nothing to do when
        the workspaces are kept anyway (the release switched off)."""
        if self._generator_state_holder is not None or not self.release_blas_workspaces:
            return
        try:
            with self._routed_to(None):
                self._generator_state_holder = self._driver.hold_generator_graph_state()
        except Exception as error:
            logger.warning(
                "graph-sleep: torch's graph-safe RNG state was not put on the capture stream: %s",
                error,
            )

    def _graph_pool_segments(self) -> list[dict]:
        if self._graph_pool is None:
            return []
        return self._graph_pool.snapshot(include_traces=False)

    def _create_blas_workspaces_on(self, stream: Any) -> None:
        """The workspaces of the current stream (`stream`, or this thread's
        own when None) in the graph pool; trusts the stream when both were
        made there."""
        made: list[set[tuple[int, int]]] = []
        try:
            with self.graph_pool_without_routing() as pool, self._routed_to(pool):
                for create in (
                    self._driver.create_blas_workspace,
                    self._driver.create_blas_lt_workspace,
                ):
                    before = self._driver.pool_active_blocks(pool)
                    create()
                    made.append(self._driver.pool_active_blocks(pool) - before)
                    self._workspace_blocks |= made[-1]
        except Exception as error:
            logger.warning(
                "graph-sleep: the cuBLAS workspaces of %s stay outside the graph pool: %s",
                "the capture stream" if stream is None else f"side stream {stream}",
                error,
            )
            return
        if all(made):
            self._trusted_streams[self._driver.current_stream_handle()] = None

    def _release_blas_workspaces(self) -> str:
        """Has torch drop every cuBLAS/cuBLASLt workspace it keeps, when no
        captured graph can be using one outside our pools.

        A graph replays with the workspace its capture stream had. Those in our
        pools stay mapped in their segments (they sleep and wake with the
        pool); one outside would be freed under a graph. Captures never run on
        the default stream, so the workspaces are dropped only when every torch
        segment outside the graph pool (our other pools included: one closed
        pool frees its segments when they empty) was made for the default
        stream or for a capture stream whose workspaces were both made in the
        graph pool (what else a warm-up left there is not a workspace of the
        capturing thread). torch makes a dropped workspace again at the next
        matmul on its stream.

        After a release the workspaces of a trusted stream are gone; eager
        cuBLAS work on that stream (torch hands stream handles out again) would
        make new ones outside the pool, which a later capture there would use.
        So the first release notes what torch held outside the graph pool on
        each trusted stream, and a later sleep distrusts a stream where that
        grew (a new segment, or more bytes in use in one). Something else that
        clears torch's workspaces (torch's CUDA graph trees do, for
        torch.compile's "reduce-overhead" mode) is not seen here."""
        if not self.release_blas_workspaces:
            return f"cuBLAS workspaces kept (switched off: {RELEASE_BLAS_WORKSPACES_ENV})"
        graph_segments = {segment["address"] for segment in self._graph_pool_segments()}
        outside: dict[int, dict[int, int]] = {}
        for address, stream, in_use in self._driver.torch_segments():
            # A cached segment with nothing in use holds no workspace.
            if address not in graph_segments and stream != 0 and in_use > 0:
                outside.setdefault(stream, {})[address] = in_use
        for stream, seen in list(self._trusted_streams.items()):
            now = outside.get(stream, {})
            if seen is not None and any(seen.get(a, -1) < b for a, b in now.items()):
                del self._trusted_streams[stream]
        unsafe = outside.keys() - self._trusted_streams.keys()
        if unsafe:
            return (
                "cuBLAS workspaces kept (torch memory outside the graph pool on "
                f"{len(unsafe)} non-default stream(s))"
            )
        self._driver.release_blas_workspaces()
        for stream, seen in self._trusted_streams.items():
            if seen is None:
                self._trusted_streams[stream] = outside.get(stream, {})
        # Their blocks are free now; a later capture may put a live tensor there.
        self._workspace_blocks.clear()
        return "cuBLAS workspaces released"

    # -- queries -----------------------------------------------------------

    def get_current_usage(self) -> int:
        """Bytes of every allocation we own, awake or asleep (vLLM's meaning)."""
        return sum(allocation.size for allocation in self._live())

    def _live(self) -> list[Allocation]:
        """Allocations of the current engine (not orphaned)."""
        return [allocation for allocation in self.allocations.values() if not allocation.orphaned]

    def orphan_leftovers(self) -> int:
        """Marks every allocation as left by an earlier engine; returns their bytes."""
        for allocation in self.allocations.values():
            allocation.orphaned = True
        return sum(allocation.size for allocation in self.allocations.values())

    def mapped_bytes(self, tag: str | None = None) -> int:
        return sum(
            allocation.size
            for allocation in self._live()
            if allocation.mapped and (tag is None or allocation.tag == tag)
        )

    def usage_by_tag(self) -> dict[str, dict[str, int]]:
        """Per tag: bytes mapped, asleep with a host backup, asleep without."""
        usage: dict[str, dict[str, int]] = {}
        for allocation in self._live():
            entry = usage.setdefault(allocation.tag, {"mapped": 0, "backed_up": 0, "dropped": 0})
            if allocation.mapped:
                entry["mapped"] += allocation.size
            elif allocation.has_backup:
                entry["backed_up"] += allocation.backup_bytes()
                entry["dropped"] += allocation.size - allocation.backup_bytes()
            else:
                entry["dropped"] += allocation.size
        return usage

    def pool_ids(self) -> set[tuple[int, int]]:
        """Ids of our open torch memory pools (graph pool included)."""
        pools = [*self._pools, *([self._graph_pool] if self._graph_pool is not None else [])]
        return {tuple(pool.id) for pool in pools}

    def host_bytes(self) -> int:
        return sum(a.host.numel() for a in self.allocations.values() if a.host is not None)

    # -- sleep / wake / discard -------------------------------------------

    def _normalize(self, tags: tuple[str, ...] | list[str] | str | None, what: str) -> tuple:
        """The tags as a tuple; ValueError, before anything changes, for unknown ones."""
        checked = (tags,) if isinstance(tags, str) else tuple(tags or ())
        unknown = [t for t in checked if not isinstance(t, str) or t not in self._known_tags]
        if unknown:
            raise ValueError(
                f"{what}: unknown memory tag(s) {unknown}; known tags: {sorted(self._known_tags)}"
            )
        return checked

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Backs up `offload_tags` (default: "default") to host, drops the rest.

        Transactional up to the first drop: a failure while backing up, or while
        releasing memory that has a backup, maps back what was released and
        raises `SleepError` with the allocator awake and nothing lost. Memory
        without a backup is released last; once one such allocation is gone
        the sleep finishes, leaving mapped (and logged) what it cannot release."""
        if offload_tags is None:
            offload_tags = (DEFAULT_TAG,)
        offload = self._normalize(offload_tags, "sleep")
        clock = _PhaseClock()
        # Before new backups: those of allocations freed since the last call.
        self._driver.release_dropped_host_buffers()
        clock.lap("freed allocations' host buffers")
        self.claim_graph_pool()
        clock.lap("graph pool claimed")
        workspaces = self._release_blas_workspaces()
        clock.lap("cuBLAS workspaces")
        # Segments that dropped pools (and the workspaces) freed: nothing to
        # back up there.
        self._driver.release_cached_memory()
        awake = [allocation for allocation in self._live() if allocation.mapped]
        to_back_up = [allocation for allocation in awake if allocation.tag in offload]
        to_drop = [allocation for allocation in awake if allocation.tag not in offload]
        clock.lap("garbage and torch's cache")
        try:
            self._back_up(to_back_up)
        except Exception as error:
            # Copies already queued must not outlive the call: a later sleep that
            # drops these allocations, or shutdown, lets their buffers go (and a
            # registered one is unregistered) without waiting for the device.
            self._wait_for_devices(to_back_up, "a failed sleep")
            for allocation in to_back_up:
                allocation.has_backup = False
            raise SleepError(
                f"sleep failed while backing up {len(to_back_up)} allocations "
                f"({format_bytes(sum(a.size for a in to_back_up))}) to host memory: {error}. "
                f"Nothing was released; the engine is awake, but {RESUME_HINT}."
            ) from error
        clock.lap(f"backup ({len(to_back_up)} allocations)")

        released: list[Allocation] = []
        try:
            for allocation in to_back_up:
                self._driver.unmap_and_release(*self._handle(allocation))
                allocation.mapped = False
                released.append(allocation)
        except Exception as error:
            self._restore_after_failed_sleep(released, to_back_up)
            raise SleepError(
                f"sleep failed after releasing {len(released)} of {len(to_back_up)} backed-up "
                f"allocations: {error}. They were mapped back from their host copies; "
                f"the engine is awake, but {RESUME_HINT}."
            ) from error

        kept: dict[str, int] = {}
        dropped: dict[str, int] = {}
        still_mapped: dict[str, int] = {}
        failures: list[str] = []
        for allocation in released:
            _add(kept, allocation.tag, allocation.backup_bytes())
            if allocation.backup_bytes() < allocation.size:
                _add(dropped, allocation.tag, allocation.size - allocation.backup_bytes())
        for allocation in to_drop:
            try:
                self._driver.unmap_and_release(*self._handle(allocation))
            except Exception as error:
                _add(still_mapped, allocation.tag, allocation.size)
                failures.append(f"{allocation.address:#x}: {error}")
                continue
            allocation.mapped = False
            allocation.drop_host()
            allocation.has_backup = False
            _add(dropped, allocation.tag, allocation.size)
        if failures:
            logger.error(
                "graph-sleep sleep: could not release %s (they stay mapped and keep their "
                "contents; wake skips them): %s",
                _describe(still_mapped),
                "; ".join(failures),
            )
        clock.lap(f"release ({len(released) + len(to_drop) - len(failures)} allocations)")
        stack = self._lower_stack({allocation.device for allocation in self._live()})
        clock.lap("stack limit")
        self._driver.release_dropped_host_buffers()  # the backups replaced or dropped
        clock.lap("host buffers given back")
        logger.info(
            "graph-sleep sleep: backed up %s%s; dropped %s; %s; %s; %s",
            _describe(kept),
            _coded_note(released),
            _describe(dropped),
            stack,
            workspaces,
            clock.summary(),
        )
        if self._settler is not None:
            self._settler.start(
                {allocation.device for allocation in (*released, *to_drop) if not allocation.mapped}
            )

    def _lower_stack(self, devices: set[int]) -> str:
        """Lowers the stack limit of `devices`, remembering what to restore;
        a device that refuses keeps its reservation (less is freed, no harm)."""
        if not self.release_stack:
            return f"stack reservation kept (switched off: {RELEASE_STACK_ENV})"
        lowered = []
        for device in sorted(devices - self._saved_stack.keys()):
            try:
                limit = self._driver.stack_limit(device)
                self._driver.set_stack_limit(device, STACK_WHILE_ASLEEP)
            except Exception as error:
                logger.warning(
                    "graph-sleep sleep: device %d keeps its stack reservation: %s", device, error
                )
                continue
            self._saved_stack[device] = limit
            lowered.append(f"device {device} {limit} -> {STACK_WHILE_ASLEEP}")
        if not lowered:
            return "stack limit unchanged"
        return "stack limit per thread " + ", ".join(lowered) + " B"

    def _restore_stack(self) -> None:
        """Puts back every lowered stack limit; raises on the first refusal
        (the devices not yet restored stay lowered)."""
        for device, limit in sorted(self._saved_stack.items()):
            self._driver.set_stack_limit(device, limit)
            del self._saved_stack[device]

    def prepare_backup_coding(self, device: torch.device) -> None:
        """Compiles and checks the weight-backup coder on `device` now, while
        the engine warms up, if backups are coded: Triton compiles kernels at
        their first use (2.0-2.6 s in a fresh engine process, run 15), which would
        otherwise fall on the first sleep and set off vLLM's JIT monitor."""
        if not self.compress_backups:
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

    def _back_up(self, allocations: list[Allocation]) -> None:
        """Copies `allocations` to pinned host buffers and waits for the copies.

        The driver makes each buffer the exact size needed, registered with
        cudaHostRegister, or from torch's pinned allocator (rounded up to a
        power of two) under VLLM_GRAPH_SLEEP_HOST_BUFFERS=torch or once a
        registration failed. A registered buffer is unregistered at the next
        release point after its last view dies (the end of this sleep for a
        replaced one), so dropping `allocation.host` is all a replacement needs."""
        live = self._graph_pool_live_ranges()
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
            pairs = self._backup_pairs(allocation)
            allocation.coded = None
            if self.compress_backups and allocation.tag == WEIGHTS_TAG and pairs:
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

    def _graph_pool_live_ranges(self) -> dict[int, list[tuple[int, int]]]:
        """Segment address -> (offset, bytes) of the blocks torch still has
        allocated there, for each segment of the graph pool.

        Only those are backed up. The rest of the pool is graph scratch: torch
        freed it during capture, so every replay writes it before reading it
        (activations, kernel workspaces), as upstream's #59909 argues for the
        whole pool. What capture left allocated (an output a runner keeps,
        state a backend built at capture, sglang PR #32718) keeps its backup.
        A wake with VLLM_GRAPH_SLEEP_POISON_GRAPH_SCRATCH=1 fills the rest with
        0xFF, and the engine tests check tokens against that."""
        if self.whole_graph_pool_backup:
            return {}
        live = {}
        for segment in self._graph_pool_segments():
            base = segment["address"]
            live[base] = [
                (block["address"] - base, block["size"])
                for block in segment["blocks"]
                if block["state"] != "inactive"
                and (block["address"], block["size"]) not in self._workspace_blocks
            ]
        return live

    def _backup_pairs(self, allocation: Allocation) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device range, host range) pairs that a backup copies one way and a
        wake the other."""
        device = self._device_bytes(allocation)
        if allocation.backup_ranges is None:
            return [(device, allocation.host[: allocation.size])]
        pairs = []
        at = 0
        for offset, size in allocation.backup_ranges:
            pairs.append((device[offset : offset + size], allocation.host[at : at + size]))
            at += size
        return pairs

    def _restore_after_failed_sleep(
        self, released: list[Allocation], backed_up: list[Allocation]
    ) -> None:
        """Maps `released` back from their host copies; every backup is then
        marked stale (the allocator is awake and writes will follow)."""
        restored: list[Allocation] = []
        for allocation in released:
            try:
                self._driver.create_and_map(*self._handle(allocation))
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
        self._fill(restored, restored)
        for allocation in backed_up:
            if allocation.mapped:
                allocation.has_backup = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Maps back the sleeping allocations of `tags` (None: all) and of every
        non-deferrable tag, restoring host backups. On failure nothing is woken
        and `WakeUpError` is raised; the call can be retried."""
        requested = None if tags is None else self._normalize(tags, "wake_up")
        clock = _PhaseClock()
        # Before any driver call of ours: the thread's probe, if one is under
        # way, would only make this wake's first call wait for it.
        if self._settler is None:
            settled = f"driver not probed while asleep (switched off: {SETTLE_AFTER_SLEEP_ENV})"
        else:
            settled = self._settler.stop()

        def wanted(allocation: Allocation) -> bool:
            return (
                requested is None
                or allocation.tag in requested
                or allocation.tag not in DEFERRABLE_TAGS
            )

        targets = [a for a in self.allocations.values() if not a.mapped and wanted(a)]
        # Those with a backup first, so that their copies start while the rest
        # map; then graph pool and other internal tags: what replays need.
        targets.sort(key=lambda a: (not a.has_backup, a.tag in DEFERRABLE_TAGS, a.tag != GRAPH_TAG))
        lowered = set(self._saved_stack)
        try:
            # Before anything else: no graph may replay with the stack lowered.
            self._restore_stack()
        except Exception as error:
            self._lower_stack(lowered)
            raise WakeUpError(
                f"wake_up(tags={tags}) failed restoring the per-thread stack limit: {error}. "
                "Nothing was mapped; the engine is still asleep and the wake can be retried."
            ) from error
        if not targets:
            logger.info("graph-sleep wake_up(tags=%s): nothing asleep to wake", tags)
            return
        clock.lap("stack limit")

        # Return cached but unused blocks of torch's own pools to the driver
        # first: they may be exactly what we need to map.
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        clock.lap("torch's cache")

        mapped: list[Allocation] = []

        def mapping(allocations: list[Allocation]) -> Iterator[Allocation]:
            # One at a time, each handed to _fill as soon as it is mapped: the
            # copies of one run while the next one maps.
            for allocation in allocations:
                self._driver.create_and_map(*self._handle(allocation))
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
        try:
            for phase in filter(None, phases):
                filled = self._fill(mapping(phase), phase, clock)
                for total, part in zip((restored, fresh), filled, strict=True):
                    for tag, size in part.items():
                        _add(total, tag, size)
        except Exception as error:
            self._roll_back(mapped)
            self._lower_stack(lowered)  # asleep again
            wanted_bytes = sum(a.size for a in targets)
            raise WakeUpError(
                f"wake_up(tags={tags}) failed after mapping {len(mapped)} of {len(targets)} "
                f"allocations ({format_bytes(wanted_bytes)} wanted): {error}. Everything it "
                "mapped was released again and all host backups are intact; free device memory "
                "held elsewhere and retry."
            ) from error

        for allocation in mapped:
            allocation.mapped = True
            allocation.has_backup = False
            if self.release_host_memory:
                allocation.drop_host()
        self._driver.release_dropped_host_buffers()
        clock.lap("host buffers given back")
        still_asleep: dict[str, int] = {}
        for allocation in self.allocations.values():
            if not allocation.mapped:
                _add(still_asleep, allocation.tag, allocation.size)
        logger.info(
            "graph-sleep wake_up(tags=%s): restored from host %s; remapped without backup %s%s; "
            "still asleep %s; %s; %s; %s",
            tags,
            _describe(restored),
            _describe(fresh),
            " (zeroed)" if self.zero_on_wake and fresh else "",
            _describe(still_asleep),
            "stack limit restored" if lowered else "stack limit unchanged",
            settled,
            clock.summary(),
        )

    def _fill(
        self,
        allocations: Iterable[Allocation],
        planned: list[Allocation],
        clock: _PhaseClock | None = None,
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Queues, for each allocation as `allocations` yields it mapped, the
        copies of its backup (zeroing or poisoning the rest when asked), then
        waits for them all; `planned`: every allocation it will yield. Returns
        bytes per tag restored and remapped without backup."""
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
                if partial and self.poison_graph_scratch:
                    self._device_bytes(allocation).fill_(POISON_BYTE)
                elif partial and self.zero_on_wake:
                    self._device_bytes(allocation).zero_()
                if allocation.coded is not None:
                    restore.add(allocation.coded, self._backup_pairs(allocation))
                else:
                    for device_range, host_range in self._backup_pairs(allocation):
                        device_range.copy_(host_range, non_blocking=True)
                _add(restored, allocation.tag, allocation.backup_bytes())
                if partial:
                    _add(fresh, allocation.tag, allocation.size - allocation.backup_bytes())
            else:
                if self.poison_remapped and allocation.tag != KV_CACHE_TAG:
                    self._device_bytes(allocation).fill_(POISON_BYTE)
                elif self.zero_on_wake:
                    self._device_bytes(allocation).zero_()
                _add(fresh, allocation.tag, allocation.size)
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

    def claim_graph_pool(self) -> None:
        """Tags everything in the graph pool "cudagraph", whatever tag was current
        when it was allocated (a capture outside `cudagraph_pool()`, e.g. a lazy
        one, still used this pool through the platform's global graph pool)."""
        for segment in self._graph_pool_segments():
            allocation = self.allocations.get(segment["address"])
            if allocation is not None:
                allocation.tag = GRAPH_TAG

    def _roll_back(self, mapped: list[Allocation]) -> None:
        # Copies _fill queued may still be running into this memory (and, with
        # registered host buffers, out of host memory that nothing else keeps
        # from being unmapped); a device too broken to wait for is unmapped anyway.
        self._wait_for_devices(mapped, "rollback")
        for allocation in reversed(mapped):
            try:
                self._driver.unmap_and_release(*self._handle(allocation))
            except Exception:
                logger.exception(
                    "graph-sleep: rollback could not unmap %#x (%s); it stays mapped",
                    allocation.address,
                    format_bytes(allocation.size),
                )
                allocation.mapped = True
                allocation.has_backup = False

    def _wait_for_devices(self, allocations: list[Allocation], who: str) -> None:
        """Waits for what is queued on the devices of `allocations`; a device
        too broken to wait for is logged and passed over."""
        for device in {allocation.device for allocation in allocations}:
            try:
                self._driver.synchronize(device)
            except Exception as error:
                logger.warning(
                    "graph-sleep: %s could not wait for device %d: %s", who, device, error
                )

    def discard(self, tags: tuple[str, ...] | list[str] | str) -> int:
        """Releases the memory of `tags` without any backup; returns bytes freed.

        Awake allocations are unmapped; sleeping ones lose their host backup, so
        they come back with undefined contents (zeroed on ROCm)."""
        selected = self._normalize(tags, "discard")
        freed = 0
        for allocation in self._live():
            if allocation.tag not in selected:
                continue
            if allocation.mapped:
                self._driver.synchronize(allocation.device)
                self._driver.unmap_and_release(*self._handle(allocation))
                allocation.mapped = False
                freed += allocation.size
            allocation.drop_host()
            allocation.has_backup = False
        self._driver.release_dropped_host_buffers()
        logger.info("graph-sleep discard(%s): released %s", list(selected), format_bytes(freed))
        return freed

    # -- helpers -------------------------------------------------------------

    @staticmethod
    def _handle(allocation: Allocation) -> tuple[int, int, int, int]:
        return allocation.device, allocation.size, allocation.address, allocation.handle

    def _device_bytes(self, allocation: Allocation) -> torch.Tensor:
        return self._driver.device_bytes(allocation.device, allocation.address, allocation.size)
