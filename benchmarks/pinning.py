"""How long a first sleep's backups take to pin and copy, by way of making them (one GPU).

Issue 15's first-sleep target is open: on an H200 our first sleep pinned about
as much host memory as stock vLLM's (379 vs 377 MiB, torch rounding each buffer
up to a power of two) but spent 266 ms in cudaHostAlloc against stock's 146
(docs/results/archive/bench-h200-run4.md). This separates the candidate causes, each
mode in a fresh process (torch caches pinned blocks for the life of a process)
and the order of the modes rotated from one repeat to the next (the bench always
started ours first):

- `torch-async`: what the plugin does: per buffer, torch's pinned allocator,
  then an asynchronous copy; one synchronize at the end;
- `torch-sync`: what stock vLLM does: per buffer, torch's pinned allocator,
  then a copy waited for before the next buffer;
- `torch-alloc-first`: every buffer from torch's pinned allocator first, then
  the copies;
- `register`: exact-size pageable memory registered with cudaHostRegister (no
  rounding up);
- `register-hugepages`: the same on memory advised to use transparent huge
  pages (fewer pages to lock);
- `register-prefault`: exact-size pageable memory whose pages torch's CPU
  threads fault in first (a parallel fill), then registered: whether the
  kernel's page faults, made by one thread inside the driver's call, are the
  cost.

    python benchmarks/pinning.py                       # 12 buffers of 20 MiB, 5 repeats
    python benchmarks/pinning.py --sizes-mib 32 2 150 --repeats 5 --out pinning.json

Prints one line `RESULT {json}` per run and the median per mode; `--out` writes
everything. Exit status: 0 when every run completed with the right bytes, 1
when a run failed (a crash, a time-out, a wrong copy), 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import subprocess
import sys
import time

from vllm_graph_sleep.bench.start_rounds import rotated
from vllm_graph_sleep.units import MiB

MODES = (
    "torch-async",
    "torch-sync",
    "torch-alloc-first",
    "register",
    "register-hugepages",
    "register-prefault",
)


def medians(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode, the median of each timing over the runs that completed."""
    summary: dict[str, dict[str, float]] = {}
    for mode in dict.fromkeys(run["mode"] for run in runs):
        done = [run for run in runs if run["mode"] == mode and run.get("ok")]
        if done:
            summary[mode] = {
                key: round(statistics.median(run[key] for run in done), 4)
                for key in ("alloc_s", "total_s", "pinned_mib")
            }
    return summary


def _registered(size: int, mode: str, keep: list):
    import torch

    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if mode == "register-hugepages":
        buffer.madvise(mmap.MADV_HUGEPAGE)
    host = torch.frombuffer(buffer, dtype=torch.uint8)
    if mode == "register-prefault":
        host.fill_(0)
    error = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister failed: error {int(error)}")
    keep.append(buffer)
    return host


def child(mode: str, sizes: list[int]) -> dict:
    """One mode in this process: device buffers, then their host backups."""
    import torch

    device = [
        torch.full((size,), index % 251, dtype=torch.uint8, device="cuda")
        for index, size in enumerate(sizes)
    ]
    torch.cuda.synchronize()
    keep: list = []
    start = time.perf_counter()
    hosts = []
    if mode == "torch-alloc-first":
        hosts = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for size in sizes]
        alloc_s = time.perf_counter() - start
        for host, data in zip(hosts, device, strict=True):
            host.copy_(data, non_blocking=True)
    else:
        alloc_s = 0.0
        for data in device:
            begin = time.perf_counter()
            if mode.startswith("register"):
                host = _registered(data.numel(), mode, keep)
            else:
                host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=True)
            alloc_s += time.perf_counter() - begin
            host.copy_(data, non_blocking=True)
            if mode == "torch-sync":
                torch.cuda.synchronize()
            hosts.append(host)
    torch.cuda.synchronize()
    total_s = time.perf_counter() - start
    ok = all(
        int(host[0]) == index % 251 and int(host[-1]) == index % 251
        for index, host in enumerate(hosts)
    )
    if mode.startswith("register"):
        pinned = sum(sizes)
    else:
        pinned = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    return {
        "mode": mode,
        "ok": ok,
        "transparent_hugepages": _transparent_hugepages(),
        "alloc_s": round(alloc_s, 4),
        "total_s": round(total_s, 4),
        "pinned_mib": round(pinned / MiB, 1),
        "backup_mib": round(sum(sizes) / MiB, 1),
    }


def _transparent_hugepages() -> str | None:
    """The kernel's THP setting ("[madvise]" is what register-hugepages needs)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            return setting.read().strip()
    except OSError:
        return None


def _run_child(mode: str, sizes_mib: list[float]) -> dict:
    argv = [sys.executable, __file__, "--child", mode, "--sizes-mib", *map(str, sizes_mib)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "ok": False, "error": "ran past 300 s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    return {"mode": mode, "ok": False, "error": done.stderr.strip()[-500:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[20.0] * 12)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=len(MODES))
    parser.add_argument("--out", help="write the runs and medians here (JSON)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("pinning: no CUDA or ROCm GPU visible; nothing to run", file=sys.stderr)
        return 2
    sizes = [int(size * MiB) for size in args.sizes_mib]
    if args.child:
        print("RESULT " + json.dumps(child(args.child, sizes)), flush=True)
        return 0
    runs = []
    for repeat in range(args.repeats):
        for mode in rotated(args.modes, repeat):
            run = {**_run_child(mode, args.sizes_mib), "repeat": repeat}
            print("RESULT " + json.dumps(run), flush=True)
            runs.append(run)
    summary = medians(runs)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"sizes_mib": args.sizes_mib, "runs": runs, "median": summary}, out, indent=1)
    return 0 if all(run.get("ok") for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
