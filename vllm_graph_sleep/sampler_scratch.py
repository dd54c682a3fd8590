"""vLLM's Triton top-k/top-p sampler scratch, dropped while asleep.

vllm.v1.sample.ops.topk_topp_triton keeps, for the life of the process, one
per-program scratch buffer per (device, dtype, vocabulary): up to one row per
SM of float32 logits, 132 x 128256 x 4 bytes = 65 MiB for a Llama-3 vocabulary
on an H200, made eagerly at the first sampling (vLLM's kernel warm-up). It is
made with torch.empty whenever it grows, so no call depends on what an earlier
one left there; no graph uses it (vLLM 0.26 samples outside its graphs). Left
alone it stays resident through every sleep, in stock vLLM too, and can keep a
whole segment of the default stream from going back (the ledger's row for it:
docs/results/bench-default.md). vLLM's own reset_buffer_cache() drops it with
the lookup tables; the first sampling after the wake makes both again, outside
our pools: that memory must still be free then, as for torch's other cached
blocks.

Verified against vLLM 0.26.0. Later vLLMs capture sampling into CUDA graphs of
model runner V2 (vllm.v1.worker.gpu.sample.cudagraph), which would use the
scratch by address: where that module exists, it stays. Remove when vLLM's
sleep drops this cache itself.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

from vllm_graph_sleep.vllm_version import vllm_version

logger = logging.getLogger("vllm.graph_sleep")

SAMPLER_MODULE = "vllm.v1.sample.ops.topk_topp_triton"
SAMPLING_GRAPHS_MODULE = "vllm.v1.worker.gpu.sample.cudagraph"


def drop_sampler_scratch() -> None:
    """Drops the cache if vLLM made it (only if its module is imported: an
    import here would pull in Triton for nothing). An optimisation: if it
    fails, the sleep goes on with the scratch resident."""
    module = sys.modules.get(SAMPLER_MODULE)
    if module is None or vllm_has_module(SAMPLING_GRAPHS_MODULE):
        return
    reset = getattr(module, "reset_buffer_cache", None)
    if reset is None:
        logger.warning(
            "graph-sleep: %s.reset_buffer_cache is missing in vLLM %s; the sampler's "
            "scratch stays resident while asleep",
            SAMPLER_MODULE,
            vllm_version(),
        )
        return
    try:
        reset()
    except Exception as error:
        logger.warning("graph-sleep: the sampler's scratch stays resident while asleep: %s", error)


def vllm_has_module(module: str) -> bool:
    """Whether vLLM has `module`, without importing it (only the packages above it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a package above it is gone
        return False
