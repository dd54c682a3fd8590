"""vLLM's own graph-pool sleep test sequence, on one engine, with diagnostics (one GPU).

Replays the sequence of upstream vLLM's `test_sleep_cudagraph_pool`
(tests/basic_correctness/memory/sleep_mode/, vLLM 0.33) with vLLM's defaults
(gpu_memory_utilization 0.92, default capture sizes): greedy, max_tokens 10,
prompt "How are you?"; generate; sleep(level=1); wake_up(["weights"]);
wake_up(["kv_cache"]); generate again. Then it keeps going on the same engine so
that one start tells what differs:

- `repeat`: generate twice more without any sleep (is greedy stable at all?);
- `upstream`: the sequence above;
- `upstream_zeroed` (ours only): the same with dropped memory zeroed on wake;
- `full_wake`: sleep(level=1); wake_up();
- `level2`: sleep(level=2); wake_up(["weights"]); reload_weights; wake_up(["kv_cache"]).

With graph offload it also checksums every allocation that sleep backs up, before
the sleep and after the wake: a backed-up allocation whose bytes changed is a bug
of ours, one that did not change clears the pools.

    python benchmarks/upstream_sequence.py --config ours --mode PIECEWISE --breakable --late-env

`--config stock` runs stock vLLM 0.26 sleep mode (no graph offload) through the
same steps; the plugin is still loaded. `--late-env` is upstream's breakable case
as its test is written: this process imports vLLM's attention layers before
VLLM_USE_BREAKABLE_CUDAGRAPH is set (the test sets it with monkeypatch.setenv
after pytest imported vLLM) and forks the engine, as vLLM does by default.
vLLM 0.26 decides at that import whether its attention ops break the graph; the
plugin marks them as the worker starts (vllm_graph_sleep.breakable_order).

With --breakable, the result also has what the worker's breakable graphs hold
after the first generation (captured batch shapes, graph segments, eager breaks,
and whether each imported break point is vLLM's wrapper): a breakable graph
without eager breaks captured attention inside it.

Prints one line `RESULT {json}` (and writes it to --json): per step the token ids
and whether they equal the first generation's. Exit status: 0 when it ran and
every step gave the first generation's tokens (and, with --breakable, the graphs
broke), 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

PROMPT = "How are you?"
MAX_TOKENS = 10


def import_attention_first() -> None:
    """What a test process has imported before its test sets the variable."""
    import vllm.model_executor.layers.attention.attention  # noqa: F401


def set_env(breakable: bool, in_process: bool) -> None:
    # The upstream test's environment.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ["VLLM_ALLREDUCE_USE_FLASHINFER"] = "0"
    os.environ["VLLM_ALLREDUCE_USE_SYMM_MEM"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # skips a ~96 s JIT build
    if in_process:
        # The worker's allocator is reachable from here for checksums.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if breakable:
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"


def checksums(tags_kept: set[str] | None = None) -> dict[int, tuple[str, int]]:
    """Per mapped allocation of ours (tags other than kv_cache): tag and a checksum."""
    from vllm_graph_sleep.allocator import KV_CACHE_TAG, GraphSleepAllocator

    allocator = GraphSleepAllocator.current()
    if allocator is None:
        return {}
    torch.cuda.synchronize()
    sums = {}
    for address, allocation in allocator.allocations.items():
        if not allocation.mapped or allocation.tag == KV_CACHE_TAG:
            continue
        data = allocator.device_bytes(allocation)
        words = data.view(torch.int32) if allocation.size % 4 == 0 else data.to(torch.int32)
        weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64)
        sums[address] = (allocation.tag, int((words.to(torch.int64) * weights).sum().item()))
    return sums


def changed(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]]) -> dict:
    """Bytes per tag whose checksum differs (allocations present in both)."""
    from vllm_graph_sleep.allocator import GraphSleepAllocator

    allocator = GraphSleepAllocator.current()
    diff: dict[str, dict[str, int]] = {}
    for address, (tag, value) in before.items():
        if address not in after:
            continue
        entry = diff.setdefault(tag, {"allocations": 0, "changed": 0, "changed_bytes": 0})
        entry["allocations"] += 1
        if after[address][1] != value:
            entry["changed"] += 1
            entry["changed_bytes"] += allocator.allocations[address].size
    return diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=("ours", "stock"), default="ours")
    parser.add_argument("--mode", default="PIECEWISE")
    parser.add_argument("--breakable", action="store_true")
    parser.add_argument("--in-process", action="store_true", help="engine in this process")
    parser.add_argument("--late-env", action="store_true")
    parser.add_argument("--json", help="also write the result to this file")
    parser.add_argument("--kind", default="llama")
    parser.add_argument("--model", help="model directory (default: made locally)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    args = parser.parse_args()
    # NVML's answer: the CUDA runtime stays uninitialised, so the engine can fork.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    if not torch.cuda.is_available():
        print("upstream_sequence: no CUDA or ROCm GPU visible; nothing to run", file=sys.stderr)
        return 2
    if args.late_env:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        import_attention_first()
    set_env(args.breakable, args.in_process)

    from vllm import LLM, SamplingParams

    from vllm_graph_sleep.testing import model_dir

    model = args.model or model_dir(args.kind)
    kwargs: dict[str, Any] = dict(
        model=model,
        enable_sleep_mode=True,
        compilation_config={
            "cudagraph_mode": args.mode,
            "pass_config": {"fuse_allreduce_rms": False},
        },
    )
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    ours = args.config == "ours"
    if ours:
        kwargs["additional_config"] = {"sleep_mode_offload_cudagraph": True}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def generate() -> list[int]:
        return list(llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids)

    reference = generate()
    steps: list[dict[str, Any]] = []
    breakable = None
    if args.breakable:
        from vllm_graph_sleep.breakable_order import capture_report

        breakable = llm.collective_rpc(capture_report)[0]
        print(f"BREAKABLE {json.dumps(breakable)}", flush=True)

    def record(name: str, extra: dict | None = None) -> None:
        tokens = generate()
        steps.append({"step": name, "tokens": tokens, "same": tokens == reference, **(extra or {})})
        print(f"STEP {name}: same={tokens == reference} tokens={tokens}", flush=True)

    record("repeat_1")
    record("repeat_2")

    def staged(level: int, zero: bool = False) -> dict:
        from vllm_graph_sleep.allocator import GraphSleepAllocator

        allocator = GraphSleepAllocator.current()
        if allocator is not None:
            allocator.zero_on_wake = zero
        before = checksums()
        llm.sleep(level=level)
        llm.wake_up(tags=["weights"])
        if level == 2:
            llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
        after = checksums()
        return {"checksums_changed": changed(before, after)} if allocator is not None else {}

    record("upstream", staged(1))
    if ours:
        record("upstream_zeroed", staged(1, zero=True))
        record("upstream_again", staged(1))
    llm.sleep(level=1)
    llm.wake_up()
    record("full_wake")
    record("level2", staged(2))
    record("repeat_3")
    result = {"config": vars(args), "reference": reference, "steps": steps, "breakable": breakable}
    print("RESULT " + json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    broke = breakable is None or (
        breakable["eager_breaks"] > 0 and all(breakable["break_points"].values())
    )
    return 0 if broke and all(step["same"] for step in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
