"""Host backups: what a sleep copies (graph-pool live ranges, host-buffer
reuse, raw or coded) and how a wake puts it back, filling what came back
without a backup by a `FillPolicy`. Holds no state between calls: the backup
of an allocation lives on its record."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from vllm_graph_sleep.memory import fingerprints as blocks_of
from vllm_graph_sleep.memory.mapping import WakeMapper
from vllm_graph_sleep.memory.records import (
    KV_CACHE_TAG,
    WEIGHTS_TAG,
    Allocation,
    add,
    bytes_by_tag,
)
from vllm_graph_sleep.memory.report import PhaseClock, coded_note, describe
from vllm_graph_sleep.settings import COMPRESS_BACKUPS, KEEP_UNCHANGED_BACKUPS
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


def _triton_feature(switch: bool | None, default: bool, name: str, without: str, uses: str) -> bool:
    """Whether a feature built on Triton kernels is on: as switched (`name`),
    else `default` where Triton imports. Checked at start rather than at the
    first sleep. `without`: what a sleep does instead, `uses`: what the
    kernels do (for the log line and the error)."""
    if switch is False or (switch is None and not default):
        return False
    try:
        import triton  # noqa: F401
    except ImportError as error:
        if switch is None:
            logger.info(
                "graph-sleep: %s: Triton, which %s, cannot be imported (%s)", without, uses, error
            )
            return False
        raise RuntimeError(
            f"{name}=1 {uses} with Triton kernels, and Triton cannot be imported: {error}. "
            f"Install Triton or unset {name}."
        ) from error
    return True


def resolve_coding(switch: bool | None, driver: DeviceDriver) -> bool:
    """Whether weight backups are coded: as switched, else the driver's default."""
    return _triton_feature(
        switch,
        driver.codes_backups_by_default(),
        COMPRESS_BACKUPS.name,
        "weight backups are copied as they are",
        "codes backups",
    )


def resolve_keeping(switch: bool | None) -> bool:
    """Whether a sleep keeps the backup blocks that did not change: as
    switched, else wherever Triton imports."""
    return _triton_feature(
        switch,
        True,
        KEEP_UNCHANGED_BACKUPS.name,
        "every sleep copies its backups again",
        "fingerprints backups",
    )


@dataclasses.dataclass
class BackupCount:
    """Bytes per tag a sleep's backup copied to host memory and bytes it kept
    from the backup before, unchanged since (their fingerprints say so)."""

    copied: dict[str, int] = dataclasses.field(default_factory=dict)
    kept: dict[str, int] = dataclasses.field(default_factory=dict)


def _changed_spans(
    then: torch.Tensor | None,
    now: torch.Tensor | None,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[int, int, int]] | None:
    """(pair index, start, end) of the blocks whose fingerprint `now` (the
    device's) differs from `then` (the host backup's), neighbours joined into
    one span; None: all of them, nothing being known of what the host holds."""
    if then is None or now is None or then.shape != now.shape:
        return None
    if torch.equal(then, now):
        # What most allocations find at a sleep after a wake: one comparison
        # instead of a walk in Python over every block.
        return []
    differs = (then != now).any(dim=1).tolist()
    spans = []
    first = 0
    for index, (device_range, _) in enumerate(pairs):
        count = blocks_of.blocks(device_range.numel())
        for changed, run in itertools.groupby(
            range(count), key=differs[first : first + count].__getitem__
        ):
            if changed:
                run = list(run)
                lo = run[0] * blocks_of.BLOCK_BYTES
                hi = min((run[-1] + 1) * blocks_of.BLOCK_BYTES, device_range.numel())
                spans.append((index, lo, hi))
        first += count
    return spans


# Per device: the allocations, their fingerprints' rows on the device, and
# how many of those rows each allocation has.
_Queued = list[tuple[list[Allocation], torch.Tensor, list[int]]]


def _queue_fingerprints(
    driver: DeviceDriver,
    allocations: list[Allocation],
    pairs_of: dict[int, list[tuple[torch.Tensor, torch.Tensor]]],
) -> _Queued:
    """Queues on the devices the fingerprints of each allocation's
    backed-up bytes as the device holds them, block by block over its pairs;
    `_read_fingerprints` waits for them."""
    by_device: dict[torch.device, list[Allocation]] = {}
    for allocation in allocations:
        pairs = pairs_of[allocation.address]
        if pairs:
            by_device.setdefault(pairs[0][0].device, []).append(allocation)
    queued: _Queued = []
    for device, on_device in by_device.items():
        ranges = [device_range for a in on_device for device_range, _ in pairs_of[a.address]]
        per_allocation = [
            sum(blocks_of.blocks(d.numel()) for d, _ in pairs_of[a.address]) for a in on_device
        ]
        out = torch.empty((sum(per_allocation), blocks_of.LANES), dtype=torch.int64, device=device)
        driver.fingerprint(ranges, out)
        queued.append((on_device, out, per_allocation))
    return queued


def _read_fingerprints(queued: _Queued) -> dict[int, torch.Tensor]:
    """Address -> host int64 [blocks, lanes] fingerprints, read in one copy per device."""
    result: dict[int, torch.Tensor] = {}
    for on_device, out, per_allocation in queued:
        host = out.cpu()
        result.update(zip((a.address for a in on_device), host.split(per_allocation), strict=True))
    queued.clear()  # the device copies, before the caller frees torch's cache
    return result


def _copy_back(backups: Backups, mapped: list[Allocation], when: str) -> Exception | None:
    """Copies their backups into `mapped` (mapped allocations, awake from then
    on: `has_backup` False); the error, logged, where the copies failed (what
    the device holds there is then not certain)."""
    try:
        backups.restore(mapped, mapped)
    except Exception as error:
        logger.exception(
            "graph-sleep: copying %d allocations back from their host copies %s failed: what "
            "they hold is not certain",
            len(mapped),
            when,
        )
        return error
    finally:
        for allocation in mapped:
            allocation.has_backup = False
    return None


class Backups:
    def __init__(
        self,
        driver: DeviceDriver,
        *,
        coded: bool,
        keep_unchanged: bool,
        whole_graph_pool: bool,
        fill: FillPolicy,
    ) -> None:
        self._driver = driver
        self._mapper = WakeMapper(driver)
        self.coded = coded
        self.keep_unchanged = keep_unchanged
        self.whole_graph_pool = whole_graph_pool
        self.fill_policy = fill

    def prepare_kernels(self, device: torch.device) -> None:
        """Compiles on `device` now, while the engine warms up, the kernels a
        sleep launches: the fingerprints' if backups are kept, the coder's (and
        checks it) if they are coded. Triton compiles a kernel at its first
        use, which would otherwise fall on the first sleep (0.6 s on an H200)
        and set off vLLM's JIT monitor."""
        if self.keep_unchanged:
            started = time.perf_counter()
            self._driver.fingerprint(
                [torch.zeros(blocks_of.BLOCK_BYTES, dtype=torch.uint8, device=device)],
                torch.empty((1, blocks_of.LANES), dtype=torch.int64, device=device),
            )
            logger.info(
                "graph-sleep: backups are kept where unchanged; their fingerprints compiled on "
                "%s in %.2f s",
                device,
                time.perf_counter() - started,
            )
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
        self,
        allocations: list[Allocation],
        live: dict[int, list[tuple[int, int]]],
        clock: PhaseClock | None = None,
        beside: Callable[[], None] | None = None,
        free_scratch: bool = True,
    ) -> BackupCount:
        """Copies `allocations` to pinned host buffers and waits for the copies;
        `live`: the ranges to copy of graph-pool segments (live_ranges).
        `beside` is called once the fingerprints are queued (or the host
        buffers are ready, where there are none), to start work of its own
        beside the rest: its driver calls would make those of the queueing
        wait (the KV cache's release, release.EarlyDrop). With
        keep_unchanged, the blocks whose fingerprint equals that of the backup
        an allocation's host buffer still holds are not copied again; of a
        coded backup, the pieces with a changed block are coded again (with a
        table of their own counts). Returns what was copied and what was kept;
        `clock` gets a lap per phase (issue 38: where a sleep's time goes).
        `free_scratch`: empty torch's cache after (the coder's scratch is in it).

        The driver makes each buffer the exact size needed, registered with
        cudaHostRegister, or from torch's pinned allocator (rounded up to a
        power of two) under VLLM_GRAPH_SLEEP_HOST_BUFFERS=torch or once a
        registration failed. A registered buffer is unregistered at the next
        release point after its last view dies (the end of this sleep for a
        replaced one), so dropping `allocation.host` is all a replacement needs.
        On failure no host buffer of `allocations` is trusted any more: a copy
        may have written part of it; the devices are waited for first."""
        try:
            return self._back_up(allocations, live, clock or PhaseClock(), beside, free_scratch)
        except BaseException:
            # Copies already queued must not outlive the call: a later sleep that
            # drops these allocations, or shutdown, lets their buffers go (and a
            # registered one is unregistered) without waiting for the device.
            self.wait_for_devices(allocations, "a failed sleep")
            for allocation in allocations:
                allocation.fingerprints = None
                allocation.has_backup = False
            raise

    def _back_up(
        self,
        allocations: list[Allocation],
        live: dict[int, list[tuple[int, int]]],
        clock: PhaseClock,
        beside: Callable[[], None] | None,
        free_scratch: bool,
    ) -> BackupCount:
        for device in {allocation.device for allocation in allocations}:
            self._driver.synchronize(device)
        clock.lap(f"backup of {len(allocations)} allocations: waiting for the device")
        count = BackupCount()
        pairs_of: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for allocation in allocations:
            ranges = live.get(allocation.address)
            if ranges != allocation.backup_ranges:
                allocation.fingerprints = None  # the host holds other ranges
            allocation.backup_ranges = ranges
            needed = allocation.backup_bytes()
            held = 0 if allocation.host is None else allocation.host.numel()
            # Reused across cycles; replaced when too small or far too large.
            if needed == 0:
                allocation.drop_host()
            elif not needed <= held <= 2 * needed:
                allocation.drop_host()
                allocation.host = self._driver.host_buffer(needed)
            pairs_of[allocation.address] = self.pairs(allocation)
        clock.lap("host buffers")
        queued = (
            _queue_fingerprints(self._driver, allocations, pairs_of) if self.keep_unchanged else []
        )
        clock.lap("fingerprints queued")
        if beside is not None:
            beside()
        now = _read_fingerprints(queued)
        clock.lap("fingerprints")
        copied: dict[int, int] = {}
        # Per device: coded backups to code again whole, and pieces of others.
        to_code: dict[int, list[Allocation]] = {}
        to_recode: dict[int, list[tuple[Allocation, list[int]]]] = {}
        for allocation in allocations:
            pairs = pairs_of[allocation.address]
            coding = self.coded and allocation.tag == WEIGHTS_TAG and bool(pairs)
            if coding != (allocation.coded is not None):
                allocation.fingerprints = None  # the host holds the other format
            changed = _changed_spans(allocation.fingerprints, now.get(allocation.address), pairs)
            allocation.fingerprints = now.get(allocation.address)
            if coding and changed is None:
                allocation.coded = None
                to_code.setdefault(allocation.device, []).append(allocation)
                copied[allocation.address] = allocation.backup_bytes()
            elif coding:
                pieces = allocation.coded.pieces_touching(changed)
                if pieces:
                    to_recode.setdefault(allocation.device, []).append((allocation, pieces))
                copied[allocation.address] = allocation.coded.bytes_of(pieces)
            else:
                allocation.coded = None
                spans = (
                    pairs
                    if changed is None
                    else [(pairs[i][0][lo:hi], pairs[i][1][lo:hi]) for i, lo, hi in changed]
                )
                for device_range, host_range in spans:
                    host_range.copy_(device_range, non_blocking=True)
                copied[allocation.address] = sum(d.numel() for d, _ in spans)
        clock.lap("plan and raw copies queued")
        if to_code or to_recode:
            # Imported here: it brings Triton, which nothing else needs.
            from vllm_graph_sleep import coded_backup

            recoded = copied_raw = 0
            for device, recoding in to_recode.items():
                items = [(a.coded, pairs_of[a.address], pieces) for a, pieces in recoding]
                if coded_backup.too_few_to_code(items):
                    coded_backup.copy_again_raw(items)
                    copied_raw += sum(len(pieces) for _, pieces in recoding)
                    continue
                if coded_backup.recode(items):
                    recoded += sum(len(pieces) for _, pieces in recoding)
                    continue
                for allocation, _ in recoding:
                    allocation.coded = None
                    to_code.setdefault(device, []).append(allocation)
                    copied[allocation.address] = allocation.backup_bytes()
            for coding in to_code.values():
                backups = coded_backup.back_up(
                    [pairs_of[a.address] for a in coding], self._tensor_starts(coding)
                )
                for allocation, backup in zip(coding, backups, strict=True):
                    allocation.coded = backup
            whole = sum(map(len, to_code.values()))
            clock.lap(
                f"coding ({whole} allocations whole, {recoded} pieces again, "
                f"{copied_raw} copied again raw)"
            )
        for allocation in allocations:
            add(count.copied, allocation.tag, copied[allocation.address])
            add(count.kept, allocation.tag, allocation.backup_bytes() - copied[allocation.address])
        for device in {allocation.device for allocation in allocations}:
            self._driver.synchronize(device)
        clock.lap("copies")
        if free_scratch and (to_code or to_recode or now):
            # The coder's scratch and the fingerprints' device copy, cached by
            # torch outside our pools.
            self._driver.release_cached_memory()
            clock.lap("backup's scratch freed")
        for allocation in allocations:
            # One torch freed meanwhile (that release, or one on another
            # thread) is gone: the extension released it.
            allocation.has_backup = not allocation.freed
            allocation.backed_up_ahead = False
        return count

    def _tensor_starts(self, allocations: list[Allocation]) -> list[list[int]]:
        """Per allocation, the offsets where torch placed its tensors: a coded
        backup is cut there, so that a tensor updated alone (a weight update
        of some layers) is coded again alone."""
        starts = self._driver.block_offsets({a.address for a in allocations})
        return [starts.get(a.address, []) for a in allocations]

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
            self._driver.release_cached_memory()
            if clock is not None:
                clock.lap("restore's staging freed")
        return restored, fresh

    def map_and_restore(
        self, targets: list[Allocation], mapped: list[Allocation], clock: PhaseClock
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Maps `targets` in order, appending each to `mapped` once it is, and
        restores their backups (`restore`); returns bytes per tag restored and
        remapped without backup. On failure `mapped` says what to roll back."""
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
            filled = self.restore(self._mapper.mapping(phase, mapped), phase, clock)
            for total, part in zip((restored, fresh), filled, strict=True):
                for tag, size in part.items():
                    add(total, tag, size)
        return restored, fresh

    def restore_after_failed_sleep(
        self, released: list[Allocation], backed_up: list[Allocation]
    ) -> str:
        """Maps `released` back from their host copies; every backup is then
        marked stale (the allocator is awake and writes will follow). Raises
        nothing, so that the sleep's own error is the one its caller reports:
        the error that failed the release often fails the device's wait for
        the copies back too (a sticky one); returns a note saying so then."""
        restored: list[Allocation] = []
        for allocation in released:
            try:
                self._driver.create_and_map(*allocation.vmm_args())
                allocation.mapped_again()
            except Exception:
                logger.exception(
                    "graph-sleep: could not map %#x (%s) back after a failed sleep; it stays "
                    "asleep with its host copy",
                    allocation.address,
                    format_bytes(allocation.size),
                )
                continue
            restored.append(allocation)
        try:
            error = _copy_back(self, restored, "after a failed sleep")
        finally:
            for allocation in backed_up:
                if allocation.mapped:
                    allocation.has_backup = False
        if error is None:
            return ""
        return (
            f"; copying {len(restored)} allocations back from their host copies failed "
            f"({error}), so what the device holds there is not certain"
        )

    def roll_back(self, mapped: list[Allocation]) -> None:
        """Unmaps what a failed wake mapped; their backups stay. One torch
        freed meanwhile is unmapped already (on_free recorded it, and the
        extension unmapped it)."""
        # Copies restore queued may still be running into this memory (and, with
        # registered host buffers, out of host memory that nothing else keeps
        # from being unmapped); a device too broken to wait for is unmapped anyway.
        self.wait_for_devices(mapped, "rollback")
        stuck: list[Allocation] = []
        for allocation in reversed(mapped):
            if not allocation.mapped:
                continue
            try:
                self._driver.unmap_and_release(*allocation.vmm_args())
                allocation.unmapped()
            except Exception:
                logger.exception(
                    "graph-sleep: rollback could not unmap %#x (%s); it stays mapped, awake",
                    allocation.address,
                    format_bytes(allocation.size),
                )
                stuck.append(allocation)
        # Awake from now on (a retried wake passes them over, the next sleep
        # backs them up): they must hold their backups, not what the wake left.
        _copy_back(self, stuck, "into what a failed wake's rollback could not unmap")

    def give_back_host_buffers(self, allocations: Iterable[Allocation]) -> None:
        """Lets go of the host buffers among `allocations` that hold no backup
        a wake needs (mapped, or asleep without a backup), and has the driver
        give them back: at shutdown, and where host memory is released after
        each wake."""
        for allocation in allocations:
            if allocation.mapped or not allocation.has_backup:
                allocation.drop_host()
        self._driver.release_dropped_host_buffers()

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


def back_up_ahead(
    backups: Backups,
    awake: list[Allocation],
    live_ranges: Callable[[], dict],
    release_host_memory: bool,
) -> BackupCount | None:
    """Backs up `awake` (mapped allocations) now, as a sleep would, and leaves
    them mapped with their backups kept as a wake keeps them (host buffers,
    fingerprints, coded pieces): the next sleep copies only what changed
    since. The worker has it done for the weights once the engine has warmed
    up, so that the first sleep neither pins its host buffers nor codes
    weights that did not change (issue 38; of lease 23's first sleep of the
    bench's Llama, 130 ms in the allocator, pinning took 62.8 ms and coding
    55.3: docs/results/sleep-speed-h100.md). `live_ranges` gives the sleep's
    `live` argument. Only where backups are kept (keep_unchanged, and host
    memory not given back at each wake: `release_host_memory` False); else
    None, logged, with nothing done.

    torch's cache is left as it is: vLLM fills it at the end of its warm-up
    (the sampler's buffers of the largest shape) so that they stay there. A
    level-2 sleep gives these buffers back while no sleep has used them: a
    loop of level-2 sleeps never reads them. None where there is nothing to
    back up; None, with nothing kept, where
    the coder found no device memory (the weights would stay raw: the first
    sleep codes them, the KV cache's memory being released meanwhile), and
    where anything fails: an optimization must not stop the engine, so that is
    logged and the first sleep backs everything up as before."""
    if not awake:
        return None
    what = describe(bytes_by_tag(awake))
    if not backups.keep_unchanged or release_host_memory:
        logger.info(
            "graph-sleep: %s not backed up ahead: backups are not kept (%s); the first sleep "
            "backs it up",
            what,
            "VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY is on"
            if release_host_memory
            else "VLLM_GRAPH_SLEEP_KEEP_UNCHANGED_BACKUPS is off or Triton is missing",
        )
        return None
    # Buffers a sleep has filled before are not this backup's own: a second
    # backup ahead (elastic EP warms up again) neither flags them, for a
    # level-2 sleep to give back, nor gives them back when it fails.
    filled_ahead = [a for a in awake if a.host is None or a.backed_up_ahead]
    own = {a.address for a in filled_ahead}
    coded_before = {a.address: a.coded for a in awake}
    clock = PhaseClock()
    failure = None
    try:
        count = backups.back_up(awake, live_ranges(), clock, free_scratch=False)
        # Only a backup coded whole by this call (a new one) can say so: an
        # earlier sleep's that nothing changed since keeps its old flag.
        if any(
            a.coded is not None
            and a.coded is not coded_before[a.address]
            and a.coded.short_of_memory
            for a in awake
        ):
            raise RuntimeError("the coder found no device memory")
    except Exception as error:  # noqa: BLE001 - whatever the backup raised
        # Its message only: the traceback's frames hold views of the new host
        # buffers, which stay pinned until the last view goes.
        failure = str(error)
    if failure is not None:
        for allocation in awake:  # mapped: nothing kept, nothing to restore
            allocation.fingerprints = None
            allocation.has_backup = False
        try:
            backups.give_back_host_buffers(filled_ahead)
        except Exception as also:  # noqa: BLE001 - the engine starts anyway
            failure = f"{failure}; giving its host buffers back failed too: {also}"
        logger.warning(
            "graph-sleep: backing up %s ahead failed (%s); the first sleep backs it up",
            what,
            failure,
        )
        return None
    for allocation in awake:
        allocation.has_backup = False  # awake: a backup kept, as after a wake
        allocation.backed_up_ahead = allocation.address in own
    logger.info(
        "graph-sleep: backed up %s ahead%s; a sleep copies only what changes from now on; %s",
        what,
        coded_note(awake),
        clock.summary(),
    )
    return count
