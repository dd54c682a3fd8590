"""What loading the plugin costs each process vLLM starts (CPU, no GPU needed).

vLLM calls its general plugins (ours: vllm_graph_sleep.register) from the API
server (EngineArgs.add_cli_args), the engine core (EngineCore.__init__) and every
worker (WorkerWrapperBase.init_worker). For each of those, a fresh Python first
imports the module that makes the call, as that process has by then, and then
times vllm.plugins.load_general_plugins() and counts the modules it adds: with
the plugin (VLLM_PLUGINS=graph_sleep) and without it (VLLM_PLUGINS="", stock).
In a worker the import of the worker class that follows is timed too.
Each figure is the median over --repeats fresh processes.

    python benchmarks/plugin_start_cost.py --repeats 5 --out docs/results/plugin-start-cost-cpu.json

Prints one line per process and, with --out, writes the JSON that
tools/render_results.py renders.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

#: Process -> (the vLLM module that calls load_general_plugins() there, what the
#: process imports next and is timed with it). A worker imports its worker class
#: right after the plugins load (WorkerWrapperBase.init_worker), so the patches
#: that belong there are paid for in that import.
PROCESSES = {
    "api_server": ("vllm.engine.arg_utils", None),
    "engine_core": ("vllm.v1.engine.core", None),
    "worker": ("vllm.v1.worker.worker_base", "vllm.v1.worker.gpu_worker"),
}

_PROBE = """
import json, sys, time
import {module}
from vllm.plugins import load_general_plugins
before = set(sys.modules)
start = time.perf_counter()
load_general_plugins()
{then}
seconds = time.perf_counter() - start
print("RESULT " + json.dumps({{"seconds": seconds, "modules": len(set(sys.modules) - before)}}))
"""


def measure(module: str, then: str | None, plugins: str) -> dict[str, float]:
    env = {**os.environ, "VLLM_PLUGINS": plugins, "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE.format(module=module, then=f"import {then}" if then else "")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    for process, (module, then) in PROCESSES.items():
        row: dict[str, object] = {"process": process, "after": module, "then": then or "-"}
        for label, plugins in (("stock", ""), ("ours", "graph_sleep")):
            runs = [measure(module, then, plugins) for _ in range(args.repeats)]
            row[f"{label}_modules"] = statistics.median(r["modules"] for r in runs)
            row[f"{label}_ms"] = round(1000 * statistics.median(r["seconds"] for r in runs), 1)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        import torch
        import vllm

        record = {
            "command": " ".join(["python", "benchmarks/plugin_start_cost.py", *sys.argv[1:]]),
            "environment": {
                "cpu": platform.processor() or platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "vllm": vllm.__version__,
                "torch": torch.__version__,
                "gpu": "none",
            },
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
