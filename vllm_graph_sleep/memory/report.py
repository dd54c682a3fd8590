"""The wording of the allocator's log lines: byte counts, per-tag summaries,
where a sleep or wake spent its time."""

from __future__ import annotations

import time

from vllm_graph_sleep.units import format_bytes


def describe(per_tag: dict[str, int]) -> str:
    if not per_tag:
        return "nothing"
    return ", ".join(f"{tag} {format_bytes(size)}" for tag, size in sorted(per_tag.items()))


def copy_note(count) -> str:
    """' (copied <bytes>, kept <bytes> unchanged)' for a sleep's BackupCount."""
    copied, kept = (sum(per_tag.values()) for per_tag in (count.copied, count.kept))
    return f" (copied {format_bytes(copied)}, kept {format_bytes(kept)} unchanged)"


def coded_note(allocations: list) -> str:
    coded = [allocation for allocation in allocations if allocation.coded is not None]
    if not coded:
        return ""
    into = sum(allocation.coded.coded_bytes for allocation in coded)
    raw = sum(allocation.backup_bytes() for allocation in coded)
    return f" (weights coded: {format_bytes(raw)} in {format_bytes(into)})"


class PhaseClock:
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
