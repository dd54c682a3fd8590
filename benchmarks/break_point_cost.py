"""What a break point of vLLM's breakable CUDA graphs costs per call outside a capture (CPU).

vllm_graph_sleep.breakable_order makes the ops vLLM 0.26 marks with
eager_break_during_capture vLLM's wrapper whenever VLLM_USE_BREAKABLE_CUDAGRAPH is
in effect at worker start. Outside a capture that wrapper looks up the current
capture (a thread-local) and calls the op. This times, per call, an op that writes
into its output tensor called directly and through the wrapper, both as a Python
function (the direct-call path of vLLM's Attention layer) and as a torch custom op
registered the way vLLM registers its attention ops (torch.ops.vllm.*).

    python benchmarks/break_point_cost.py [--calls N] [--repeats R]

Prints one line `RESULT {json}`: best-of-R nanoseconds per call for each, and the
difference the wrapper adds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import timeit

import torch


def op(x: torch.Tensor, output: torch.Tensor) -> None:
    output.copy_(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.utils.torch_utils import direct_register_custom_op

    wrapped = eager_break_during_capture(op)
    library = torch.library.Library("graph_sleep_bench", "FRAGMENT")
    for name, kernel in (("plain", op), ("marked", wrapped)):
        direct_register_custom_op(
            name, kernel, mutates_args=["output"], target_lib=library, dispatch_key="CPU"
        )
    x, output = torch.ones(8), torch.empty(8)
    calls = {
        "python_plain": lambda: op(x, output),
        "python_marked": lambda: wrapped(x, output),
        "torch_op_plain": lambda: torch.ops.graph_sleep_bench.plain(x, output),
        "torch_op_marked": lambda: torch.ops.graph_sleep_bench.marked(x, output),
    }
    # Interleaved, best of the repeats: a busy machine slows all four alike.
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(args.repeats):
        for name, call in calls.items():
            best[name] = min(best[name], timeit.timeit(call, number=args.calls))
    ns = {name: seconds / args.calls * 1e9 for name, seconds in best.items()}
    result = {
        "ns_per_call": {name: round(value, 1) for name, value in ns.items()},
        "wrapper_adds_ns": {
            "python": round(ns["python_marked"] - ns["python_plain"], 1),
            "torch_op": round(ns["torch_op_marked"] - ns["torch_op_plain"], 1),
        },
        "calls": args.calls,
        "repeats": args.repeats,
        "torch": torch.__version__,
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
