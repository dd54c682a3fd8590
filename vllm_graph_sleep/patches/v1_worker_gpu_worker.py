"""Patch: vllm.v1.worker.gpu_worker (Worker, get_mem_allocator_instance).

vLLM symbols: Worker.init_device, Worker.compile_or_warm_up_model,
Worker._maybe_get_memory_pool_context, Worker.sleep,
Worker._get_sleep_mode_backend, Worker.wake_up (and the model runner's
post_kv_cache_wake_up it calls),
Worker.reload_weights, Worker.finish_weight_update, Worker.shutdown, and the
module global get_mem_allocator_instance that it calls; it calls
vllm.utils.gc_utils.freeze_gc_heap. Verified against vLLM 0.26.0.

Why: vLLM 0.26 has no seam that puts graph memory under sleep mode. When the
gate is on in this worker, this patch
- sets NCCL_GRAPH_REGISTER before init_device starts NCCL, and marks the
  process active before the all-reduce communicators are built;
- after init_device: serves all sleep-mode memory from our allocator, selects
  our sleep-mode backend, and points the platform's global graph pool (read by
  every capture wrapper of both model runners, and passed to NCCL's
  set_graph_pool_id while capturing) at our "cudagraph" pool;
- tags what compile_or_warm_up_model captures as "cudagraph", with torch's
  expandable segments off (they and a pluggable-allocator pool do not mix),
  and compiles the backup kernels before it (the fingerprints and the coder:
  GraphSleepAllocator.prepare_backup_kernels), so that neither the first
  sleep nor vLLM's JIT monitor sees Triton compile;
- once warm-up is done, backs the weights up ahead
  (GraphSleepAllocator.back_up_ahead), so that the first sleep copies only
  what changed since instead of pinning its buffers and coding every weight
  (VLLM_GRAPH_SLEEP_BACK_UP_AT_START=0 leaves that to the first sleep), and
  then freezes the garbage collector's heap again, the backup's records
  with it: vLLM's freeze at the end of warm-up came before them, and only
  the EngineCore process freezes again (not a worker process of its own,
  TP or PP > 1);
- turns the "kv_cache" pool that initialize_from_config opens around
  initialize_kv_cache into a "runtime" pool, backed up at every level: the
  attention metadata, block tables and graph input buffers built there must
  survive sleep (FULL graphs read them). The KV tensors get their own
  "kv_cache" pool (v1_worker_gpu_attn_utils, v1_worker_gpu_model_runner).
  Upstream did the same in PR #59158.
- saves the model's buffers before a level-2 sleep in one pinned staging
  buffer, gathered on their device and copied in a few chunks with one wait
  (vllm_graph_sleep.model_buffers), where vLLM's own save makes a
  synchronous copy and a clone per buffer (129 on a Llama 8B); vLLM's sleep
  then finds no buffer to save and the wake restores these. The save runs
  first in our backend's suspend (GraphSleepBackend.first_in_suspend), while
  the KV cache's release runs on a thread, and after vLLM has measured the
  free memory that its log line's "freed" figure starts from;
- runs what vLLM's wake_up does to memory in the weights pool only at the
  wake that brings the weights back, when "kv_cache" is woken first: the
  restore of the buffers a level-2 sleep saved, the draft model's fused
  buffers rebuilt from its weights, and the model runner's
  post_kv_cache_wake_up (with a quantized KV cache, model runner V1 sets the
  attention layers' scale buffers there). vLLM 0.26 runs them at that first
  wake, on the still-unmapped weights;
- freezes the garbage collector's heap again once a weight reload
  (reload_weights) or a weight transfer (finish_weight_update) is done, as
  it is frozen once warm-up is done: otherwise every later sleep's
  gc.collect() scans what the reload made (15,000 objects on the 8B, 4.4-6.4
  ms a sleep against 0.1-0.2 ms refrozen; leases 13 and 14 in
  docs/results/archive/sleep-speed-h100-2026-12-07.md);
- at shutdown, drops the graph pool, points the platform's global graph pool
  back at nothing and marks the process inactive, so that a next engine in the
  same process (vLLM's test suites make several) starts as if it were the
  first, with graph offload on or off.
With the gate off every wrapper calls straight through (stock behaviour),
except that init_device, on or off, first
- makes the ops vLLM marks with eager_break_during_capture break points of
  breakable graphs if VLLM_USE_BREAKABLE_CUDAGRAPH is in effect in this worker
  but their modules were imported before it was set (a process that set it
  later, or a model VllmConfig.__post_init__ turns it on for, and a forked
  engine: stock vLLM 0.26 then captures attention inside its breakable graphs
  and fails at the first request with an illegal memory access). It applies
  vLLM's own decorator again and rebinds the module or class attribute, the
  copies other vLLM modules imported by value and the torch op's kernel
  (vllm_graph_sleep.breakable_order). Safe: the worker then runs exactly what
  it runs when the variable is set before the import; vLLM's wrapper acts only
  inside a BreakableCUDAGraphCapture, which only breakable graphs open, and
  calls straight through everywhere else. Cost: with the variable off, none
  (nothing is touched); with it on, each call of a marked op outside a capture
  pays vLLM's wrapper (one thread-local lookup and one Python call), as it does
  with the variable set in time. What cannot be marked (a vLLM whose break
  points differ from 0.26.0's) stops the worker, naming the op and the fix;
- notes the private pools an earlier engine of this process left
  (earlier_pools.remember_pools_of_earlier_engines), so the probe does not count them
  as graphs of this engine that escaped our pool.

Remove when: the plugin moves to a vLLM with the feature (upstream PRs #59160
and #59523, released in 0.33).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from vllm_graph_sleep import config, model_buffers
from vllm_graph_sleep.alloc_conf import expandable_segments_off
from vllm_graph_sleep.allocator import (
    GRAPH_TAG,
    KV_CACHE_TAG,
    RUNTIME_TAG,
    WEIGHTS_TAG,
    GraphSleepAllocator,
    WakeUpError,
)
from vllm_graph_sleep.breakable_order import mark_break_points
from vllm_graph_sleep.earlier_pools import remember_pools_of_earlier_engines
from vllm_graph_sleep.patches._wrap import require, wrap_function
from vllm_graph_sleep.settings import AllocatorSettings
from vllm_graph_sleep.units import format_bytes

logger = logging.getLogger("vllm.graph_sleep")
WHERE = "vllm.v1.worker.gpu_worker"


def _platform_class():
    from vllm.platforms import current_platform

    platform_cls = type(current_platform)
    require(platform_cls, "get_global_graph_pool", where="vllm.platforms.interface.Platform")
    if not hasattr(platform_cls, "_global_graph_pool"):
        raise RuntimeError(
            "vllm-graph-sleep: Platform._global_graph_pool not found; cannot route capture"
        )
    return platform_cls


def route_graph_capture_to_pool() -> None:
    """Makes our graph pool the platform's global graph pool."""
    with GraphSleepAllocator.get_instance().cudagraph_pool() as pool:
        _platform_class()._global_graph_pool = pool.id


def orphan_leftovers(allocator: GraphSleepAllocator) -> None:
    """A new engine starts on an empty allocator (vLLM asserts it when it loads
    the weights). What an earlier engine of this process still holds (vLLM keeps
    some module-level caches, e.g. rotary tables) is set apart: never slept, not
    counted, freed when its tensors die. If that engine was shut down asleep
    (or an earlier start could not map a leftover again: take_runs_apart),
    it is mapped back first (a reader would fault on it), from its host copy
    where one was kept; the log says what came back without its contents."""
    if not allocator.allocated_addresses():
        return
    allocator.release_pools()
    if not allocator.allocated_addresses():
        return
    usage = allocator.usage_by_tag()
    lost = {tag: entry["dropped"] for tag, entry in usage.items() if entry["dropped"]}
    state = ""
    if allocator.mapped_bytes() < allocator.get_current_usage():
        try:
            allocator.wake_up()
        except WakeUpError as error:
            raise RuntimeError(
                "graph-sleep: what an earlier engine in this process left referenced is "
                "unmapped (it was shut down asleep, or an earlier start could not map it "
                f"again) and could not be mapped back: {error}. Free the device "
                "memory held elsewhere and start the engine again, or start it in a new process."
            ) from error
        state = (
            "; some were unmapped (that engine was shut down asleep, or an earlier start could "
            "not map them again): they were mapped back from their host copies"
        )
        if lost:
            state += (
                f", except {_describe_bytes(lost)} mapped back without their contents (its sleep "
                "dropped them; a reader gets whatever the memory holds): wake the engine before "
                "shutting it down to keep them"
            )
    logger.warning(
        "graph-sleep: %s of an earlier engine in this process are still referenced (%s)%s; "
        "they stay mapped and are left out of this engine's sleep",
        format_bytes(allocator.orphan_leftovers()),
        _describe_bytes({tag: sum(entry.values()) for tag, entry in usage.items()}),
        state,
    )


def _describe_bytes(per_tag: dict[str, int]) -> str:
    return ", ".join(f"{tag} {format_bytes(size)}" for tag, size in sorted(per_tag.items()))


def _wrap_init_device(original):
    def init_device(self, *args, **kwargs):
        marked = mark_break_points()
        if marked:
            logger.info(
                "graph-sleep: VLLM_USE_BREAKABLE_CUDAGRAPH=1 here, but %s were imported before "
                "it was set; made them vLLM's break points of breakable CUDA graphs",
                ", ".join(marked),
            )
        remember_pools_of_earlier_engines()
        gate = config.evaluate_gate(self.vllm_config)
        config.warn_if_ineffective(gate)
        if gate.active:
            # The worker's edge: its switches are read once, here. One the
            # allocator would refuse stops the worker before it sets anything
            # up or marks the process active.
            settings = AllocatorSettings.from_environ()
            earlier = GraphSleepAllocator.current()
            if earlier is not None:  # a next engine in this process
                earlier.settings.require_same(settings)
            config.apply_nccl_policy()
            # Before the original: it builds the all-reduce communicators, whose
            # patches must already see graph offload on.
            config.mark_active()
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            if gate.active:  # no engine of ours started: a next one decides afresh
                config.mark_inactive()
            raise
        if gate.active:
            orphan_leftovers(GraphSleepAllocator.get_instance(settings))
            # vLLM hashes this field into its compile-cache keys; the hash
            # takes it as stock's (config.hashed_as, patch vllm.config.vllm).
            self.vllm_config.model_config.sleep_mode_backend = config.BACKEND_NAME
            route_graph_capture_to_pool()
            logger.info("graph-sleep: CUDA/HIP graphs are captured into the cudagraph pool")
        return result

    return init_device


def _wrap_compile_or_warm_up_model(original):
    def compile_or_warm_up_model(self, *args, **kwargs):
        if not config.is_active():
            return original(self, *args, **kwargs)
        allocator = GraphSleepAllocator.get_instance()
        # Before the original, which turns vLLM's JIT monitor on when it is done.
        allocator.prepare_backup_kernels(self.device)
        with allocator.allocation_tag(GRAPH_TAG), expandable_segments_off():
            result = original(self, *args, **kwargs)
        if allocator.settings.back_up_at_start:
            allocator.back_up_ahead((WEIGHTS_TAG,))
        # vLLM's warm-up ends by freezing the heap, before the backup ahead
        # made its records; the EngineCore process freezes again later, a
        # worker process of its own (TP or PP > 1) does not, and every sleep's
        # gc.collect() would scan them there.
        _freeze_gc_heap()
        return result

    return compile_or_warm_up_model


def _wrap_sleep(original):
    def sleep_saving_buffers_at_once(worker, args, kwargs):
        level = kwargs.get("level", args[0] if args else 1)
        if level != 2:
            return original(worker, *args, **kwargs)
        model = worker.model_runner.model
        saved: dict[str, object] = {}
        # In our backend's suspend, after vLLM's measure of free memory, beside
        # the KV cache's release (GraphSleepBackend.first_in_suspend).
        first = worker._get_sleep_mode_backend().first_in_suspend(
            lambda: saved.update(model_buffers.save(model))
        )
        try:
            with first, model_buffers.hidden(model):
                return original(worker, *args, **kwargs)
        finally:
            # Where vLLM's own save would have left them, also after a failure.
            worker._sleep_saved_buffers = saved

    def sleep(self, *args, **kwargs):
        if not config.is_active():
            return original(self, *args, **kwargs)
        return sleep_saving_buffers_at_once(self, args, kwargs)

    return sleep


#: Set on a worker whose wake of the KV cache left the model runner's
#: post_kv_cache_wake_up for the wake that brings the weights back.
_KV_WAKE_UP_DEFERRED = "_graph_sleep_kv_wake_up_deferred"


@contextlib.contextmanager
def _weights_left_alone(worker, deferring_kv_wake_up: bool) -> Iterator[None]:
    """Inside, vLLM's Worker.wake_up finds nothing to do in the weights pool:
    no saved buffers to restore, no draft buffers to rebuild and (when
    `deferring_kv_wake_up`) a model runner whose post_kv_cache_wake_up does
    nothing. Everything is as it was after."""
    saved = worker._sleep_saved_buffers
    rebuild = getattr(worker, "_sleep_rebuild_draft_metadata_buffers", False)
    runner = worker.model_runner
    worker._sleep_saved_buffers = {}
    worker._sleep_rebuild_draft_metadata_buffers = False
    if deferring_kv_wake_up:
        runner.post_kv_cache_wake_up = lambda: None  # shadows the method on this runner
    try:
        yield
    finally:
        worker._sleep_saved_buffers = saved
        worker._sleep_rebuild_draft_metadata_buffers = rebuild
        if deferring_kv_wake_up:
            del runner.post_kv_cache_wake_up


def _wrap_wake_up(original):
    def wake(self, tags, *args, **kwargs):
        # A wake that leaves the weights asleep (tags=["kv_cache"] first): what
        # vLLM's wake_up writes into the weights pool would go to unmapped
        # memory ("CUDA error: invalid argument" for the buffers' restore, found
        # by benchmarks/http_fuzz.py on an H200; an illegal address, which ends
        # the CUDA context, for a kernel). It runs at the wake of the weights.
        if (
            tags is not None
            and WEIGHTS_TAG not in tags
            and self._get_sleep_mode_backend().is_asleep(WEIGHTS_TAG)
        ):
            deferring = KV_CACHE_TAG in tags
            with _weights_left_alone(self, deferring):
                result = original(self, tags, *args, **kwargs)
            if deferring:
                setattr(self, _KV_WAKE_UP_DEFERRED, True)
            return result
        result = original(self, tags, *args, **kwargs)
        if getattr(self, _KV_WAKE_UP_DEFERRED, False):
            setattr(self, _KV_WAKE_UP_DEFERRED, False)
            if tags is not None and KV_CACHE_TAG not in tags:  # vLLM's did not run it
                self.model_runner.post_kv_cache_wake_up()
        return result

    def wake_up(self, tags=None, *args, **kwargs):
        if not config.is_active():
            return original(self, tags, *args, **kwargs)
        return wake(self, tags, *args, **kwargs)

    return wake_up


def _freeze_gc_heap() -> None:
    from vllm.utils import gc_utils

    gc_utils.freeze_gc_heap()


def _wrap_refreeze_gc_heap(original):
    def refreezing(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if config.is_active():
            _freeze_gc_heap()
        return result

    return refreezing


def _wrap_shutdown(original):
    def shutdown(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            if config.is_active():
                GraphSleepAllocator.get_instance().release_pools()
                _platform_class()._global_graph_pool = None
                config.mark_inactive()

    return shutdown


def _wrap_maybe_get_memory_pool_context(original):
    def _maybe_get_memory_pool_context(self, tag, *args, **kwargs):
        # In 0.26 only initialize_from_config asks for "kv_cache", around all of
        # initialize_kv_cache.
        if config.is_active() and tag == KV_CACHE_TAG:
            tag = RUNTIME_TAG
        return original(self, tag, *args, **kwargs)

    return _maybe_get_memory_pool_context


def _wrap_get_mem_allocator_instance(original):
    def get_mem_allocator_instance():
        if config.is_active():
            return GraphSleepAllocator.get_instance()
        return original()

    return get_mem_allocator_instance


def apply() -> None:
    from vllm.v1.worker import gpu_worker

    wrap_function(gpu_worker.Worker, "init_device", _wrap_init_device, where=WHERE)
    wrap_function(
        gpu_worker.Worker,
        "compile_or_warm_up_model",
        _wrap_compile_or_warm_up_model,
        where=WHERE,
    )
    wrap_function(gpu_worker.Worker, "shutdown", _wrap_shutdown, where=WHERE)
    from vllm.utils import gc_utils

    require(gc_utils, "freeze_gc_heap", where="vllm.utils.gc_utils")
    for name in ("reload_weights", "finish_weight_update"):
        wrap_function(gpu_worker.Worker, name, _wrap_refreeze_gc_heap, where=WHERE)
    require(gpu_worker.Worker, "sleep", where=WHERE, parameters=("level",))
    require(gpu_worker.Worker, "_get_sleep_mode_backend", where=WHERE)
    wrap_function(gpu_worker.Worker, "sleep", _wrap_sleep, where=WHERE)
    require(gpu_worker.Worker, "wake_up", where=WHERE, parameters=("tags",))
    wrap_function(gpu_worker.Worker, "wake_up", _wrap_wake_up, where=WHERE)
    require(gpu_worker.Worker, "_maybe_get_memory_pool_context", where=WHERE, parameters=("tag",))
    wrap_function(
        gpu_worker.Worker,
        "_maybe_get_memory_pool_context",
        _wrap_maybe_get_memory_pool_context,
        where=WHERE,
    )
    wrap_function(
        gpu_worker, "get_mem_allocator_instance", _wrap_get_mem_allocator_instance, where=WHERE
    )
