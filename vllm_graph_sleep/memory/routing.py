"""Pool routing: which of our pools this thread's allocations go to and under
which tag. Owns the current tag and the known tags, the pools of open
`use_memory_pool` contexts and those retired meanwhile, the process's one graph
pool, and each thread's stack of pools routed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from vllm_graph_sleep.alloc_conf import expandable_segments_off
from vllm_graph_sleep.memory.records import BUILTIN_TAGS, DEFAULT_TAG, GRAPH_TAG

if TYPE_CHECKING:
    from vllm_graph_sleep.memory.driver import DeviceDriver, MemoryPool


class PoolRouter:
    def __init__(self, driver: DeviceDriver) -> None:
        self._driver = driver
        self.current_tag = DEFAULT_TAG
        self._known_tags: set[str] = set(BUILTIN_TAGS)
        # Pools of open use_memory_pool contexts. A pool is dropped when its
        # context exits; torch then releases its free segments through my_free
        # (the pluggable allocator the pools were built on stays alive).
        self._pools: list[MemoryPool] = []
        # Pools whose context exited while an outer one was still routed: they
        # are dropped when the outermost exits.
        self._retired: list[MemoryPool] = []
        self._graph_pool: MemoryPool | None = None
        self._routing = threading.local()  # per thread: stack of pools routed to

    def known_tags(self) -> set[str]:
        return set(self._known_tags)

    def normalize(self, tags: tuple[str, ...] | list[str] | str | None, what: str) -> tuple:
        """The tags as a tuple; ValueError, before anything changes, for unknown ones."""
        checked = (tags,) if isinstance(tags, str) else tuple(tags or ())
        unknown = [t for t in checked if not isinstance(t, str) or t not in self._known_tags]
        if unknown:
            raise ValueError(
                f"{what}: unknown memory tag(s) {unknown}; known tags: {sorted(self._known_tags)}"
            )
        return checked

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
    def use_memory_pool(self, tag: str | None = None) -> Iterator[MemoryPool]:
        """Allocations made inside come from a new pool of ours, tagged `tag`.

        On exit the pool is dropped: its fully free segments go back to the
        driver now, the rest when their tensors die (vLLM 0.26's own
        use_memory_pool trims the same way, by hand)."""
        with self.allocation_tag(tag or DEFAULT_TAG), expandable_segments_off():
            pool = self._driver.memory_pool()
            self._pools.append(pool)
            try:
                with self.routed_to(pool):
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
                    # before vLLM freezes its heap, a collection takes long
                    # enough to show in the start time, and this runs twice per
                    # start (weights, KV cache). What only garbage cycles still
                    # hold here goes at vLLM's own collection before it
                    # profiles memory, or at the next sleep, which collects first.
                    self._driver.release_cached_memory()

    def _routing_stack(self) -> list:
        """This thread's pools of ours routed, innermost last (None: unrouted)."""
        return self._routing.__dict__.setdefault("pools", [])

    @contextmanager
    def routed_to(self, pool: MemoryPool | None) -> Iterator[None]:
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
    def cudagraph_pool(self) -> Iterator[MemoryPool]:
        """The process's graph pool: capture with `pool=<yielded>.id` inside.

        Graph-private allocations made while the context is open are tagged
        "cudagraph"; the same pool is yielded every time so all graphs share it.
        """
        with self.allocation_tag(GRAPH_TAG), expandable_segments_off():
            if self._graph_pool is None:
                self._graph_pool = self._driver.memory_pool()
            yield self._graph_pool

    @contextmanager
    def graph_pool_without_routing(self) -> Iterator[MemoryPool]:
        """The graph pool, with this thread's pool of ours unrouted meanwhile.

        For captures made inside another pool's context (the Gemma4 drafter
        captures during load_model): torch serves a capture from the pool
        routed first, so the graph's memory would land in that pool, which is
        dropped and trimmed when its context exits, under a live graph. Other
        allocations meanwhile come from torch's own allocator."""
        with self.routed_to(None), self.cudagraph_pool() as pool:
            yield pool

    def drop_graph_pool(self) -> None:
        """Engine shutdown: a next engine in this process gets a new graph pool."""
        self._graph_pool = None

    def graph_pool_segments(self) -> list[dict]:
        """torch's segments of the graph pool (none before it exists)."""
        if self._graph_pool is None:
            return []
        return self._graph_pool.snapshot(include_traces=False)

    def pool_ids(self) -> set[tuple[int, int]]:
        """Ids of our open torch memory pools (graph pool included)."""
        pools = [*self._pools, *([self._graph_pool] if self._graph_pool is not None else [])]
        return {tuple(pool.id) for pool in pools}
