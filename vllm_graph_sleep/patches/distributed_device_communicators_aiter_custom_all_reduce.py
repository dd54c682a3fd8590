"""Patch: vllm.distributed.device_communicators.aiter_custom_all_reduce
(AiterCustomAllreduce.__init__, AiterCustomAllreduce.capture).

vLLM symbols: AiterCustomAllreduce.__init__(group, device, max_size=None), which
imports aiter.dist.device_communicators.custom_all_reduce.CustomAllreduce and
builds it with AITER's defaults (lines 30-43), and AiterCustomAllreduce.capture()
(59-60). Verified against vLLM 0.26.0. ROCm only: CudaCommunicator builds this
wrapper for the TP group when VLLM_ROCM_USE_AITER and VLLM_ROCM_USE_AITER_CUSTOM_AR are on
(cuda_communicator.py:109-113), inside Worker.init_device.

Why: with graph offload on, the graph pool is HIP VMM memory. Legacy IPC cannot
export it: hipIpcGetMemHandle returns an unusable handle without an error and
the peers hang at replay (ROCm/aiter#2075); sleep could not release pool memory
that peers hold open either. AITER registers graph inputs in two ways:
- AITER's CustomAllreduce.custom_all_reduce passes the graph input's own address
  while capturing unless the object was built with
  enable_register_for_capturing=False (the copy-in path of ROCm/aiter#2075);
  capture() then exports every recorded address. vLLM 0.26.0 never passes the
  keyword.
- The fused launchers take a `registered` argument, and nothing in 0.26.0 turns
  it off: vLLM's per-group FP8 ops (_aiter_ops.py:879-887 and 952-961, plain and
  bf16-norm) pass registered=torch.cuda.is_current_stream_capturing(), and
  AITER's own capture branches of custom_fused_ar_rms (reached from
  _aiter_ops.py:819, the AR+RMSNorm fusion that is on by default on ROCm at -O2
  and above with AITER and TP > 1, config/vllm.py:131-141) and
  custom_fused_qknorm_ar (MiniMax, rms_norm_tp.py:246) pass
  registered=True whatever enable_register_for_capturing says. Those ops are
  registered with torch at import (register_ops_once, _aiter_ops.py:3154), so
  replacing vLLM's module functions would change nothing.
With graph offload active in this worker, the wrapper therefore
- builds AITER's CustomAllreduce with enable_register_for_capturing=False, and
- on that instance, wraps the launchers fused_ar_rms,
  fused_ar_rms_per_group_quant and fused_qknorm_ar (those an AITER build has)
  so they always run with registered=False: the input is copied into AITER's
  pre-registered IPC buffer and the copy is captured with the graph.
No pool address is then IPC-registered; capture() is left to AITER. Upstream
0.33 does the first half and gates the per-group ops' flag on the AITER
attribute (vllm-project/vllm#59523). Cost: one device-to-device copy per
captured collective (vllm-project/vllm#57481 measured ~1.2 ms per forward on
Kimi-K3, 8x MI355X).

An AITER whose CustomAllreduce lacks enable_register_for_capturing is refused
with an error, not a warning. With such a build the registration cannot be
turned off, and its failure is a silent hang of every rank at the first replay
(or a stale registration after wake), which is far harder to diagnose than a
start-up error naming the fix: upgrade AITER, pass --disable-custom-all-reduce,
or set VLLM_ROCM_USE_AITER_CUSTOM_AR=0 (vLLM's own custom all-reduce, which the
sibling patch runs unregistered). We do not force the copy-in path on such a
build ourselves: it predates #2075's capture path, and we cannot test it.

AITER is configured when the wrapper is constructed, inside Worker.init_device.
capture() fails loudly if graph offload is active but the instance was built
without that configuration: registration would otherwise go ahead silently.
With graph offload off, both wrappers call straight through (stock behaviour).

Remove when: the plugin moves to a vLLM with the feature (upstream 0.33,
vllm-project/vllm#59523) and an AITER whose fused capture paths honour
enable_register_for_capturing.
"""

from __future__ import annotations

import inspect
import logging

from vllm_graph_sleep import config
from vllm_graph_sleep.aiter_all_reduce import (
    KEYWORD,
    LAUNCHERS,
    aiter_class,
    force_unregistered,
    require_keyword,
)
from vllm_graph_sleep.patches._wrap import require, wrap_function

logger = logging.getLogger("vllm.graph_sleep")

WHERE = "vllm.distributed.device_communicators.aiter_custom_all_reduce.AiterCustomAllreduce"
_CONFIGURED = "_graph_sleep_unregistered_capture"


def _wrap_init(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        if not config.is_active():
            return original(self, *args, **kwargs)
        aiter_cls = aiter_class()
        require_keyword(aiter_cls)
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        max_size = bound.arguments["max_size"]
        if max_size is None:
            max_size = self.MAX_SIZE
        # vLLM 0.26.0's __init__ is exactly this construction without the keyword.
        self._impl = aiter_cls(
            bound.arguments["group"],
            bound.arguments["device"],
            max_size=max_size,
            enable_register_for_capturing=False,
        )
        for name in LAUNCHERS:
            force_unregistered(self._impl, name)
        setattr(self, _CONFIGURED, True)
        logger.info(
            "graph-sleep: AITER custom all-reduce copies graph inputs into its IPC buffer "
            "(%s=False, fused launchers unregistered)",
            KEYWORD,
        )

    return __init__


def _wrap_capture(original):
    def capture(self):
        if config.is_active() and not self.disabled and not getattr(self, _CONFIGURED, False):
            raise RuntimeError(
                "vllm-graph-sleep: graph offload is active but this AITER custom all-reduce was "
                "built before it was switched on, so AITER would IPC-register graph-pool memory "
                "during capture. Graph offload must be marked active before "
                "init_worker_distributed_environment creates the communicators."
            )
        return original(self)

    return capture


def apply() -> None:
    from vllm.distributed.device_communicators import aiter_custom_all_reduce

    owner = require(aiter_custom_all_reduce, "AiterCustomAllreduce", where=WHERE.rsplit(".", 1)[0])
    require(owner, "__init__", where=WHERE, parameters=("group", "device", "max_size"))
    require(owner, "MAX_SIZE", where=WHERE)
    require(owner, "capture", where=WHERE)
    require(owner, "disabled", where=WHERE)
    wrap_function(owner, "__init__", _wrap_init, where=WHERE)
    wrap_function(owner, "capture", _wrap_capture, where=WHERE)
