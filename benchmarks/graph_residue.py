"""What a sleeping engine's graphs keep on the GPU outside our pool.

Graph offload moves graph-private memory (the cudagraph pool) off the GPU, yet a
sleeping vLLM with graphs still holds more than one run with --enforce-eager
(docs/results/engine-h200.md). The suspect is the instantiated graph executables,
which the driver keeps in device memory of its own. This measures that directly,
on one GPU, with no vLLM: for each (graphs, kernels per graph) case it captures
that many graphs into the allocator's cudagraph pool, each a chain of in-place
kernels on a small static buffer, and reads the driver's used memory
(total - free) at four points:

- before capture;
- after capture (the graph pool's mapped bytes are reported beside it);
- asleep: after `sleep(offload_tags=("cudagraph",))`, i.e. pool backed up to host;
- after wake, a replay checked against the expected values, and destroying the graphs.

"asleep - before" is what the graphs keep outside the pool; "asleep - destroyed"
is the part that destroying the graphs gives back. Dividing by graphs and by
kernel nodes separates a per-graph from a per-node cost, which, with the number
of graphs vLLM captures (its log says how many sizes, and each piecewise size is
one graph per piece), accounts for the residue or does not.

    python benchmarks/graph_residue.py --out docs/results/graph-residue-h200.json

Exit status: 0 when every case ran, 2 when there is nothing to measure (no GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

from vllm_graph_sleep.units import MiB


def used_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return total - free


def run_case(graphs: int, nodes: int) -> dict:
    from vllm_graph_sleep.allocator import GRAPH_TAG, GraphSleepAllocator

    allocator = GraphSleepAllocator.get_instance()
    buffers = [torch.zeros(1024, device="cuda") for _ in range(graphs)]
    warm = torch.zeros(1024, device="cuda")
    warm.add_(1)  # kernels loaded before the first reading
    before = used_bytes()
    captured = []
    with allocator.cudagraph_pool() as pool:
        for buffer in buffers:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool.id):
                for _ in range(nodes):
                    buffer.add_(1)
            captured.append(graph)
    after_capture = used_bytes()
    pool_bytes = allocator.mapped_bytes(GRAPH_TAG)
    allocator.sleep(offload_tags=(GRAPH_TAG,))
    asleep = used_bytes()
    allocator.wake_up()
    for graph in captured:
        graph.replay()
    torch.cuda.synchronize()
    # Capture does not run the kernels: one replay adds `nodes` to each buffer.
    replay_exact = all(bool((buffer == nodes).all()) for buffer in buffers)
    del captured
    gc.collect()
    destroyed = used_bytes()
    outside = asleep - before
    return {
        "graphs": graphs,
        "nodes_per_graph": nodes,
        "pool_mapped_bytes": pool_bytes,
        "used_before_bytes": before,
        "used_after_capture_bytes": after_capture,
        "used_asleep_bytes": asleep,
        "used_after_destroy_bytes": destroyed,
        "outside_pool_asleep_bytes": outside,
        "released_by_destroy_bytes": asleep - destroyed,
        "outside_per_graph_bytes": outside / graphs if graphs else None,
        "outside_per_node_bytes": outside / (graphs * nodes) if graphs and nodes else None,
        "replay_exact": replay_exact,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", type=int, nargs="+", default=[100, 400, 1000])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--out", type=Path, help="JSON file to write (default: print only)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_residue: no CUDA or ROCm GPU visible; nothing to measure", file=sys.stderr)
        return 2
    results = []
    for nodes in args.nodes:
        for graphs in args.graphs:
            result = run_case(graphs, nodes)
            results.append(result)
            print(
                f"{graphs:5d} graphs x {nodes:3d} kernels: outside the pool while asleep "
                f"{result['outside_pool_asleep_bytes'] / MiB:8.1f} MiB "
                f"({result['outside_per_graph_bytes'] / 1024:6.1f} KiB/graph), "
                f"given back by destroying them {result['released_by_destroy_bytes'] / MiB:8.1f} "
                f"MiB, pool {result['pool_mapped_bytes'] / MiB:.1f} MiB, "
                f"replay {'exact' if result['replay_exact'] else 'WRONG'}"
            )
    from bench_allocator import environment

    report = {
        "benchmark": "graph memory outside the pool (graph executables)",
        "command": " ".join(["python", "benchmarks/graph_residue.py", *(argv or sys.argv[1:])]),
        "environment": environment(),
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
