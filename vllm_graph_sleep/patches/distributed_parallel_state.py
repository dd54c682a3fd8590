"""Patch: vllm.distributed.parallel_state (GroupCoordinator.graph_capture).

vLLM symbol: GroupCoordinator.graph_capture(graph_capture_context), the context
every capture of both model runners enters (through the module's graph_capture,
with a fresh side stream) before its eager warm-up runs. Verified against vLLM
0.26.0.

Why: torch gives each (cuBLAS handle, stream) its own workspace (32 MiB plus
1 MiB for cuBLASLt on an H200), made at the first matmul on the stream. On the
capture stream that is the warm-up, outside every pool, and the graphs keep its
address, so it stayed resident while asleep: the 33 MiB the H200 ledger put on
the capture stream (issue 15). With graph offload active the workspaces of the
capture stream are made in our "cudagraph" pool as the context opens, so they
sleep and wake with the graphs, and a sleep may drop torch's other workspaces
(memory.workspaces.WorkspaceKeeper.release). Not while vLLM profiles graph
memory (config.outside_pools): those graphs are thrown away.

Also read: vllm.utils.torch_utils._aux_stream, the side stream vLLM 0.26's MoE
layers fork onto inside their graphs (shared experts overlapping the routed
ones, e.g. DeepSeek-V2; the NVIDIA-only inkling models use it too), made the
first time a layer asks for it. Its workspaces are made in the graph pool too,
or they stayed outside it and kept every workspace resident while asleep (32
MiB with DeepSeek-V2 on the H200, run 5). Read, not called: aux_stream() would
make a stream nobody uses. Only on CUDA: vLLM makes the stream on ROCm too but
runs shared experts there without it
(SharedExperts._determine_shared_experts_order), and workspaces made for it
would take graph-pool memory vLLM did not plan for. Other side
streams (LoRA's, DeepSeek-V4's list) are not made in the pool: a workspace of
theirs outside it keeps torch's workspaces resident, which is safe.

Remove when: upstream vLLM makes capture-stream workspaces in its graph pool
(not done as of the 0.33 graph-offload PRs #59160 / #59523).
"""

from __future__ import annotations

from contextlib import contextmanager

from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import GraphSleepAllocator
from vllm_graph_sleep.patches._wrap import require, wrap_function

WHERE = "vllm.distributed.parallel_state.GroupCoordinator"


def _side_streams() -> list:
    from vllm.platforms import current_platform
    from vllm.utils import torch_utils

    stream = torch_utils._aux_stream
    return [stream] if stream is not None and current_platform.is_cuda() else []


def _wrap_graph_capture(original):
    @contextmanager
    def graph_capture(self, *args, **kwargs):
        with original(self, *args, **kwargs) as context:
            if config.routes_to_pools():
                GraphSleepAllocator.get_instance().create_blas_workspaces_in_graph_pool(
                    side_streams=_side_streams()
                )
            yield context

    return graph_capture


def apply() -> None:
    from vllm.distributed import parallel_state
    from vllm.utils import torch_utils

    require(torch_utils, "_aux_stream", where="vllm.utils.torch_utils", may_be_none=True)
    coordinator = require(parallel_state, "GroupCoordinator", where=WHERE)
    require(coordinator, "graph_capture", where=WHERE, parameters=("graph_capture_context",))
    wrap_function(coordinator, "graph_capture", _wrap_graph_capture, where=WHERE)
