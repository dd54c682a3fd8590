"""Awake memory and level-1 host backup, ours vs stock, one engine per run (one GPU).

Starts one engine (`--config ours` with graph offload, or `stock` sleep mode)
on a locally made model with the engine tests' settings, optionally with online
quantization (`--quantization fp8` on the bf16 checkpoint), and reports:

- `nvml_used_mib`: device memory in use once the engine is up (NVML, whole
  GPU: run nothing else on it). A pool that keeps memory vLLM's profiling
  thought it freed (V1's profiling KV cache, dead weights after online
  quantization) shows up here, above stock;
- `num_gpu_blocks`: the KV cache vLLM sized from its profile;
- `weights_mib` and `backup_mib`: bytes tagged "weights", and bytes copied to
  host by a level-1 sleep (stock: its "weights"; ours: weights + graphs + runtime,
  with weights on their own in `backup_weights_mib`);
- `exact`: greedy tokens after the sleep and wake equal those before.

    python benchmarks/awake_memory.py --kind qwen3_moe --config ours
    python benchmarks/awake_memory.py --kind llama --config stock --quantization fp8

Prints one line `RESULT {json}`. Exit status: 0 when it ran, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_graph_sleep.units import MiB


def mib(value: int) -> float:
    return round(value / MiB, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="qwen3_moe")
    parser.add_argument("--config", choices=("ours", "stock"), default="ours")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--mode", default="full_and_piecewise")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("awake_memory: no CUDA or ROCm GPU visible; nothing to run", file=sys.stderr)
        return 2
    from vllm_graph_sleep.bench.gpu import NvmlMemory
    from vllm_graph_sleep.testing import greedy_tokens, report, start_engine

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # NVML sees one process
    overrides = {"quantization": args.quantization} if args.quantization else {}
    llm = start_engine(args.kind, args.mode, offload=args.config == "ours", **overrides)
    torch.cuda.synchronize()
    (used,) = NvmlMemory(1).used()  # the engine's GPU (CUDA_VISIBLE_DEVICES honoured)
    awake = report(llm)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    reference = greedy_tokens(llm)
    llm.sleep(level=1)
    asleep = report(llm)
    if awake["allocator"] == "vllm_graph_sleep":
        backup = asleep["host_bytes"]
        backup_weights = asleep["tags"]["weights"]["backed_up"]
    else:
        backup = backup_weights = asleep["tags"]["weights"]["asleep"]
    llm.wake_up()
    result = {
        **vars(args),
        "allocator": awake["allocator"],
        "nvml_used_mib": mib(used),
        "num_gpu_blocks": blocks,
        "weights_mib": mib(awake["tags"]["weights"]["mapped"]),
        "backup_mib": mib(backup),
        "backup_weights_mib": mib(backup_weights),
        "tags_mib": {tag: mib(usage["mapped"]) for tag, usage in awake["tags"].items()},
        "exact": greedy_tokens(llm) == reference,
    }
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
