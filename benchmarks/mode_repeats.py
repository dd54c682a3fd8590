"""Is a cudagraph mode stable on stock vLLM, before any sleep? (one GPU, one engine)

Starts stock vLLM (no graph offload) on a locally made model in one cudagraph mode,
with the engine tests' settings (vllm_graph_sleep.testing.start_engine, capture sizes
1/2/4/8), generates greedy tokens for FULL_MODE_PROMPTS (each longer than the
largest capture size, so no prefill replays a graph in any mode) once as the reference and
then `--repeats` more times. A mode whose repeats differ from its reference, or
whose tokens differ from another mode's, is broken in vLLM itself: a sleep/wake
test in that mode cannot tell anything about sleep. `--variant` turns off prefix
caching or async scheduling, to see whether either causes the difference.

This found that vLLM 0.26's model runner V1 decodes the Qwen3-MoE-shaped model
wrongly in FULL mode (docs/results/engine-h200.md, fourth run).

    python benchmarks/mode_repeats.py --kind qwen3_moe --mode full --variant no_prefix_caching

Prints one line `RESULT {json}`: for each repeat the index of the first prompt whose
tokens differ from the reference (null when all are identical), and the reference.
Exit status: 0 when it ran, 2 when there is nothing to run on (no GPU).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from vllm_graph_sleep.bench.scenario import first_difference
from vllm_graph_sleep.testing import (
    FULL_MODE_PROMPTS,
    MODES,
    cycles,
    greedy_tokens,
    start_engine,
)

VARIANTS = {
    "default": {},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "no_async_scheduling": {"async_scheduling": False},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="qwen3_moe")
    parser.add_argument("--mode", choices=sorted(MODES), default="full")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="default")
    parser.add_argument("--repeats", type=int, help="default: GRAPH_SLEEP_TEST_CYCLES")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("mode_repeats: no CUDA or ROCm GPU visible; nothing to run", file=sys.stderr)
        return 2

    llm = start_engine(args.kind, args.mode, offload=False, **VARIANTS[args.variant])
    prompts = FULL_MODE_PROMPTS
    reference = greedy_tokens(llm, prompts)
    differing = []
    for _ in range(cycles() if args.repeats is None else args.repeats):
        tokens = greedy_tokens(llm, prompts)
        differing.append(None if tokens == reference else first_difference(tokens, reference))
    result = {"kind": args.kind, "mode": args.mode, "variant": args.variant}
    print("RESULT", json.dumps({**result, "first_differing_prompt": differing, "ref": reference}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
