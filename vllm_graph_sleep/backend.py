"""Our sleep-mode backend, registered in vLLM's SleepModeBackendFactory.

Level policy (DESIGN.md decision 7):
- level 1: weights and the graph pool (and any other internal tag) are backed
  up to pinned host memory; the KV cache is dropped;
- level 2: weights and the KV cache are dropped; the graph pool is still
  backed up, so graphs replay after `reload_weights` without recapture.
Any wake, even one naming only "kv_cache" or only "weights", restores the graph
pool first (the allocator never leaves a non-deferrable tag asleep).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from vllm_graph_sleep.allocator import KV_CACHE_TAG, WEIGHTS_TAG, GraphSleepAllocator
from vllm_graph_sleep.gil_handoffs import quick_gil_handoffs
from vllm_graph_sleep.sampler_scratch import drop_sampler_scratch

SLEEP_LEVELS = (1, 2)


def offload_tags_for(level: int, tags_in_use: set[str]) -> tuple[str, ...]:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, not {level!r}")
    dropped = {KV_CACHE_TAG} if level == 1 else {KV_CACHE_TAG, WEIGHTS_TAG}
    return tuple(sorted(tags_in_use - dropped))


class GraphSleepBackend(SleepModeBackend):
    def __init__(self) -> None:
        super().__init__()
        self._allocator = GraphSleepAllocator.get_instance()
        self._first_steps: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def first_in_suspend(self, step: Callable[[], None]) -> Iterator[None]:
        """A suspend inside runs `step` before anything of its own (the
        worker's save of the model's buffers before a level-2 sleep), beside
        the KV cache's release where one starts ahead (level 2)."""
        self._first_steps.append(step)
        try:
            yield
        finally:
            self._first_steps.remove(step)

    def suspend(self, level: int = 1) -> None:
        # Claim first: graph memory made under another tag (a lazy capture) must
        # count as "cudagraph" when the tags to back up are chosen.
        self._allocator.claim_graph_pool()
        offload = offload_tags_for(level, self._allocator.tags_in_use())
        # vLLM's EngineCore.sleep has reset the prefix cache and the running
        # requests (pause_scheduler with clear_cache) before any level >= 1. A
        # level-2 sleep releases the KV cache first, on a thread, while this
        # one saves the model's buffers and prepares its own release (a
        # level-1 sleep starts it once its copies are queued).
        with contextlib.ExitStack() as stack:
            stack.enter_context(quick_gil_handoffs())
            if level == 2:
                stack.enter_context(self._allocator.kv_cache_released_ahead())
            for step in self._first_steps:
                step()
            # Before the allocator empties torch's cache: what it freed goes too.
            drop_sampler_scratch()
            self._allocator.sleep(offload_tags=offload, kv_cache_cleared=True)
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        try:
            with quick_gil_handoffs():
                self._allocator.wake_up(tags)
        finally:
            asleep = self._allocator.get_current_usage() - self._allocator.mapped_bytes()
            self._state = "RUNNING" if asleep == 0 else "SUSPENDED"

    def is_asleep(self, tag: str) -> bool:
        """Whether memory of `tag` is asleep (unmapped, backed up or not)."""
        usage = self._allocator.usage_by_tag().get(tag)
        return usage is not None and usage["backed_up"] + usage["dropped"] > 0

    @classmethod
    def preserves_communicators(cls) -> bool:
        # NCCL and custom all-reduce buffers live outside our pools.
        return True
