"""Patch: vllm.distributed.device_communicators.custom_all_reduce
(CustomAllreduce.custom_all_reduce, CustomAllreduce.capture).

vLLM symbols: CustomAllreduce.custom_all_reduce(input), which calls
CustomAllreduce.all_reduce(inp, *, out=None, registered=False), and the
CustomAllreduce.capture() context manager. Verified against
vLLM 0.26.0 (custom_all_reduce.py: capture() 196-209, register_graph_buffers()
211-228, all_reduce() 245-262, custom_all_reduce() 264-280).

Why: while a graph is being captured, stock custom_all_reduce calls
all_reduce(input, registered=True) (line 271). The graph kernel then reads the
input tensor at its own address, which lives in the graph pool, and when
capture() exits, register_graph_buffers() exports every address recorded during
capture with legacy CUDA IPC (cudaIpcGetMemHandle / hipIpcGetMemHandle). With
graph offload on, the graph pool is cuMem/VMM memory, which legacy IPC cannot
export: cudaIpcGetMemHandle fails on it (we checked), and on ROCm
hipIpcGetMemHandle returns an unusable handle without an error, so peers hang
(ROCm/aiter#2075). Sleep would also have to release memory that peers hold open.
With graph offload active in this worker, capture takes the unregistered path
instead: all_reduce(input, registered=False) copies the input into the
communicator's pre-registered IPC staging buffer, and that copy is captured into
the graph, so no pool address is ever IPC-registered. Eager calls, warm-up
calls (capturing flag set but the stream not capturing) and everything with the
gate off keep stock behaviour. Upstream did the same in 0.33 (a
register_graph_buffers=False keyword that capture honours; vllm-project/vllm
#59160 for CUDA, #59523 for ROCm). Cost: one device-to-device copy per captured
all-reduce.

capture() keeps its behaviour. It still calls register_graph_buffers() on exit, which
is safe: the C++ side (csrc/custom_all_reduce.cuh, allreduce()) records the
pointer each captured all-reduce kernel reads, and with registered=False that
pointer is the staging buffer buffer_ptrs[rank], never pool memory. That buffer
comes straight from ops.allocate_shared_buffer_and_handle (cudaMalloc, or
hipExtMallocWithFlags on ROCm), outside every torch pool, and was IPC-exported
at construction already, so exporting it again works and pins nothing that
sleep releases.

With graph offload active, and only inside capture(), the communicator's
all_reduce is shadowed by one that counts the calls it sees while the stream is
really capturing, by `registered` (vllm_graph_sleep.all_reduce_counts keeps them;
the worker probe reports them): evidence on a GPU that every captured all-reduce took the
copy-in path, and that there were some. Outside capture() all_reduce is vLLM's
own, so eager all-reduces (every decode step without graphs) pay nothing for it.

QuickReduce (quick_all_reduce.py) is not touched: it copies into its own
workspace and never registers graph inputs.

Remove when: the plugin moves to a vLLM with the feature (upstream 0.33,
vllm-project/vllm#59160 and #59523).
"""

from __future__ import annotations

import contextlib

import torch

from vllm_graph_sleep import config
from vllm_graph_sleep.all_reduce_counts import counting
from vllm_graph_sleep.patches._wrap import require, wrap_function

WHERE = "vllm.distributed.device_communicators.custom_all_reduce.CustomAllreduce"


def _wrap_custom_all_reduce(original):
    def custom_all_reduce(self, input: torch.Tensor) -> torch.Tensor | None:
        # Only a real capture differs from stock; the warm-up pass (capturing
        # flag set, stream not capturing) and eager calls go to the original.
        capturing = self._IS_CAPTURING and torch.cuda.is_current_stream_capturing()
        if not (config.is_active() and capturing):
            return original(self, input)
        if self.disabled or not self.should_custom_ar(input):
            return None
        # Stage through the pre-registered IPC buffer; the copy is captured.
        return self.all_reduce(input, registered=False)

    return custom_all_reduce


def _wrap_capture(original):
    @contextlib.contextmanager
    def capture(self):
        if not config.is_active():
            with original(self):
                yield
            return
        # An instance attribute shadows the class's all_reduce for this capture only.
        self.all_reduce = counting(self.all_reduce)
        try:
            with original(self):
                yield
        finally:
            del self.all_reduce

    return capture


def apply() -> None:
    from vllm.distributed.device_communicators import custom_all_reduce

    owner = require(custom_all_reduce, "CustomAllreduce", where=WHERE.rsplit(".", 1)[0])
    require(owner, "custom_all_reduce", where=WHERE, parameters=("input",))
    require(owner, "all_reduce", where=WHERE, parameters=("inp", "registered"))
    require(owner, "should_custom_ar", where=WHERE)
    require(owner, "capture", where=WHERE)
    wrap_function(owner, "custom_all_reduce", _wrap_custom_all_reduce, where=WHERE)
    wrap_function(owner, "capture", _wrap_capture, where=WHERE)
