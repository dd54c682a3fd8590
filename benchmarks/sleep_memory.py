"""GPU memory while asleep: ours (graphs in the pool) vs stock vLLM with graphs
vs stock vLLM with --enforce-eager, same model and settings. A fourth
configuration, stock compiled without graphs (cudagraph_mode NONE), splits
what ours keeps over eager into torch.compile's share (its kernels' code) and
the graphs' share.

Each configuration runs in its own process (one engine per process). Memory is
NVML's used memory for the GPU (what another process can no longer use) plus
the worker's own report (allocator tags, torch's reserved memory).

    python benchmarks/sleep_memory.py --model-kind llama --out docs/results/sleep-memory-h200.json

`--capture-sizes 1 2 4 8` gives every configuration the same, shorter list of graph
batch sizes (vLLM's default captures ~51 sizes): the residue that graphs keep outside
any pool grows with the number of graphs captured (benchmarks/graph_residue.py), and
this measures how much of it a user can trade away.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "ours": {"offload": True, "enforce_eager": False},
    "stock_graphs": {"offload": False, "enforce_eager": False},
    "stock_compiled": {"offload": False, "enforce_eager": False, "graphs": False},
    "stock_eager": {"offload": False, "enforce_eager": True},
}


def settle_used(memory) -> int:
    """NVML used memory of the engine's GPU once it stops moving (frees can land
    a moment later)."""
    from vllm_graph_sleep.bench.gpu import settle

    return settle(memory, attempts=20)[0]


def run_one(name: str, model: str, utilization: float, capture_sizes: list[int] | None) -> dict:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    from vllm import LLM, SamplingParams

    from vllm_graph_sleep.bench.gpu import NvmlMemory
    from vllm_graph_sleep.probe import memory_report

    settings = CONFIGS[name]
    kwargs = dict(
        model=model,
        enable_sleep_mode=True,
        gpu_memory_utilization=utilization,
        max_model_len=1024,
        seed=0,
        enforce_eager=settings["enforce_eager"],
    )
    compilation: dict = {}
    if not settings.get("graphs", True):
        compilation["cudagraph_mode"] = "NONE"
    if capture_sizes:
        compilation["cudagraph_capture_sizes"] = capture_sizes
    if compilation:
        kwargs["compilation_config"] = compilation
    if settings["offload"]:
        kwargs["additional_config"] = {"sleep_mode_offload_cudagraph": True}
    memory = NvmlMemory(1)  # the GPU the engine runs on (CUDA_VISIBLE_DEVICES honoured)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict = {"config": name, "start_s": time.perf_counter() - started}
    params = SamplingParams(temperature=0.0, max_tokens=32)
    reference = [o.outputs[0].token_ids for o in llm.generate(["Hello, my name is"], params)]
    result["awake_used_bytes"] = settle_used(memory)
    result["awake_report"] = llm.collective_rpc(memory_report)[0]
    for level in (1, 2):
        begin = time.perf_counter()
        llm.sleep(level=level)
        result[f"level{level}_sleep_s"] = time.perf_counter() - begin
        result[f"level{level}_asleep_used_bytes"] = settle_used(memory)
        result[f"level{level}_asleep_report"] = llm.collective_rpc(memory_report)[0]
        begin = time.perf_counter()
        if level == 2:
            llm.wake_up(tags=["weights"])
            llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
        else:
            llm.wake_up()
        result[f"level{level}_wake_s"] = time.perf_counter() - begin
        tokens = [o.outputs[0].token_ids for o in llm.generate(["Hello, my name is"], params)]
        result[f"level{level}_bit_exact"] = tokens == reference
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-kind", default="llama")
    parser.add_argument("--model", help="a local model directory (default: make --model-kind)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--capture-sizes", type=int, nargs="+", help="cudagraph_capture_sizes for every config"
    )
    parser.add_argument("--out", default="docs/results/sleep-memory.json")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--one-out", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        result = run_one(args.one, args.model, args.gpu_memory_utilization, args.capture_sizes)
        Path(args.one_out).write_text(json.dumps(result))
        return 0

    model = args.model
    if model is None:
        from vllm_graph_sleep.testing import model_dir

        model = model_dir(args.model_kind)
    results = []
    for name in args.configs:
        one_out = Path(args.out).with_suffix(f".{name}.part.json")
        command = [sys.executable, __file__, "--one", name, "--model", model]
        command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
        command += ["--one-out", str(one_out)]
        if args.capture_sizes:
            command += ["--capture-sizes", *map(str, args.capture_sizes)]
        print(f"running {name} ...", flush=True)
        subprocess.run(command, check=True)
        results.append(json.loads(one_out.read_text()))
        one_out.unlink()
    by_name = {r["config"]: r for r in results}
    summary = {}
    for baseline in ("stock_eager", "stock_compiled"):
        if baseline not in by_name:
            continue
        base = by_name[baseline]
        for r in results:
            summary.setdefault(r["config"], {}).update(
                {
                    f"level{lv}_over_{baseline}_mib": (
                        r[f"level{lv}_asleep_used_bytes"] - base[f"level{lv}_asleep_used_bytes"]
                    )
                    / 2**20
                    for lv in (1, 2)
                }
            )
    # Read only now: touching CUDA here earlier would hold a context on the GPU
    # while the configurations are measured.
    import vllm
    from bench_allocator import environment

    env = {**environment(), "vllm": vllm.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "command": sys.argv,
                "environment": env,
                "model": model,
                "results": results,
                "summary": summary,
            },
            indent=1,
        )
    )
    for r in results:
        print(
            f"{r['config']:>14}: graphs {r['awake_report']['cudagraphs_captured']:4d}  "
            f"awake {r['awake_used_bytes'] / 2**20:8.0f} MiB  "
            f"L1 asleep {r['level1_asleep_used_bytes'] / 2**20:8.0f} MiB  "
            f"L2 asleep {r['level2_asleep_used_bytes'] / 2**20:8.0f} MiB  "
            f"wake L1 {r['level1_wake_s']:.2f}s  "
            f"exact {r['level1_bit_exact']}/{r['level2_bit_exact']}"
        )
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
