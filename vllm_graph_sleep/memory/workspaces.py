"""torch's cuBLAS/cuBLASLt workspaces and graph-safe RNG state, kept in or
trusted to the graph pool. Owns the trusted capture streams, the blocks the
workspaces took in the graph pool (which a backup leaves out: `blocks()`), and
what keeps the RNG state on a trusted stream. See docs/design.md, "cuBLAS
workspaces and graph scratch"."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm_graph_sleep.settings import RELEASE_BLAS_WORKSPACES

if TYPE_CHECKING:
    from vllm_graph_sleep.memory.driver import DeviceDriver
    from vllm_graph_sleep.memory.routing import PoolRouter

logger = logging.getLogger("vllm.graph_sleep")


class WorkspaceKeeper:
    def __init__(self, driver: DeviceDriver, router: PoolRouter, *, release: bool) -> None:
        self._driver = driver
        self._router = router
        self.release_enabled = release
        # Streams whose cuBLAS and cuBLASLt workspaces this allocator made in
        # the graph pool, each mapped to what torch held outside the graph pool
        # on it (segment -> bytes in use) when a sleep first released the
        # workspaces (None before): growth there later may be a workspace made
        # outside. And the (address, bytes) blocks those workspaces took.
        self._trusted_streams: dict[int, dict[int, int] | None] = {}
        self._blocks: set[tuple[int, int]] = set()
        # Keeps torch's graph-safe RNG state on a trusted capture stream, from
        # the first capture into the graph pool to engine shutdown
        # (_hold_generator_graph_state).
        self._generator_state_holder: Any = None

    def blocks(self) -> frozenset[tuple[int, int]]:
        """(address, bytes) of the graph-pool blocks the workspaces took (scratch: no backup)."""
        return frozenset(self._blocks)

    def trusted_streams(self) -> frozenset[int]:
        """Handles of the capture streams whose workspaces were both made in the graph pool."""
        return frozenset(self._trusted_streams)

    def create_in_graph_pool(self, side_streams: Sequence[Any] = ()) -> None:
        """Creates the cuBLAS and cuBLASLt workspaces of this thread's current
        stream, and of `side_streams` (streams the captured graphs fork onto),
        in the graph pool, before anything on those streams uses cuBLAS.

        torch keeps one workspace per (handle, stream), made at the first matmul
        there. On a graph-capture stream that is the eager warm-up before the
        first capture, outside every pool, and the captured graphs keep its
        address, so it would stay resident while asleep (issue 15). Made in the
        graph pool, it sleeps and wakes with the graphs, and is never backed
        up: a workspace is scratch within each call.

        A stream that already has a workspace keeps it where it is, and each
        step makes at most its own workspace, so what the pool gained in each
        step is that workspace. A stream is trusted (see `release`) only when
        both were made here; a call that makes nothing leaves its trust as it
        is (vLLM enters the context once per parallel group). This is an
        optimisation: if it fails, the capture goes on with the workspaces
        where torch puts them.

        Before the first capture into the graph pool no graph of ours exists
        (and those captured outside our pools, vLLM's throwaway profiling
        graphs, never replay), so torch's workspaces are dropped first (with
        the release switched on): what eager work made before on a side
        stream, or on the side stream of the model runner V1's throwaway
        profiling graphs (which stayed resident with Qwen3-MoE), is made again
        here or, on a stream no graph uses, left out of the graph pool."""
        try:
            if self.release_enabled and not self._router.graph_pool_segments():
                self._driver.release_blas_workspaces()
        except Exception as error:
            logger.warning(
                "graph-sleep: torch's cuBLAS workspaces were not dropped before the first "
                "capture: %s",
                error,
            )
        self._hold_generator_graph_state()
        self._create_on(None)
        for stream in side_streams:
            try:
                with self._driver.on_stream(stream):
                    self._create_on(stream)
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
        if self._generator_state_holder is not None or not self.release_enabled:
            return
        try:
            with self._router.routed_to(None):
                self._generator_state_holder = self._driver.hold_generator_graph_state()
        except Exception as error:
            logger.warning(
                "graph-sleep: torch's graph-safe RNG state was not put on the capture stream: %s",
                error,
            )

    def _create_on(self, stream: Any) -> None:
        """The workspaces of the current stream (`stream`, or this thread's
        own when None) in the graph pool; trusts the stream when both were
        made there."""
        made: list[set[tuple[int, int]]] = []
        try:
            with (
                self._router.graph_pool_without_routing() as pool,
                self._router.routed_to(pool),
            ):
                for create in (
                    self._driver.create_blas_workspace,
                    self._driver.create_blas_lt_workspace,
                ):
                    before = self._driver.pool_active_blocks(pool)
                    create()
                    made.append(self._driver.pool_active_blocks(pool) - before)
                    self._blocks |= made[-1]
        except Exception as error:
            logger.warning(
                "graph-sleep: the cuBLAS workspaces of %s stay outside the graph pool: %s",
                "the capture stream" if stream is None else f"side stream {stream}",
                error,
            )
            return
        if all(made):
            self._trusted_streams[self._driver.current_stream_handle()] = None

    def release(self) -> str:
        """Has torch drop every cuBLAS/cuBLASLt workspace it keeps, when no
        captured graph can be using one outside our pools; returns what it did,
        for the sleep's log line.

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
        if not self.release_enabled:
            return f"cuBLAS workspaces kept (switched off: {RELEASE_BLAS_WORKSPACES.name})"
        graph_segments = {segment["address"] for segment in self._router.graph_pool_segments()}
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
        self._blocks.clear()
        return "cuBLAS workspaces released"

    def shut_down(self) -> None:
        """Engine shutdown: drops workspaces made in the graph pool (one would
        outlive the pool, and a next engine capturing on the same pooled stream
        would use it from a segment nobody sleeps), forgets every stream's
        trust (torch hands the same stream handles out again) and lets the RNG
        state holder go. Whatever a sleep would keep (the switch off, a
        stream it cannot trust): no graph of this engine replays any more."""
        if self._blocks:
            try:
                self._driver.release_blas_workspaces()
            except Exception as error:
                logger.warning(
                    "graph-sleep: at shutdown, torch's cuBLAS workspaces could not be dropped "
                    "(%s); a next engine capturing on the same stream may use one made in this "
                    "engine's graph pool",
                    error,
                )
            self._blocks.clear()
        self._trusted_streams.clear()
        self._generator_state_holder = None
