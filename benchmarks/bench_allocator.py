"""Benchmark of the graph-sleep allocator's sleep/wake against plain torch copies.

What it measures, on one GPU (cuda:0 of what CUDA_VISIBLE_DEVICES shows):

1. Bandwidth, for each size in --sizes-gib: one tensor of that many bytes
   allocated under the tag "weights" and filled with random bytes. Each cycle
   is `sleep(offload_tags=("weights",))` (device->host backup + unmap) then
   `wake_up()` (map + host->device restore). The first cycle is cold (its
   sleep allocates the pinned host buffer) and is reported on its own; the
   --repeats cycles after it are steady state (host buffers are reused unless
   VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY is set). Interleaved with those
   cycles, the same number of bytes is copied with plain torch: device tensor
   `.copy_()` into a pinned host tensor allocated beforehand, and back, each
   with non_blocking=True and a synchronize. GB/s is bytes / median seconds
   (1 GB = 1e9 bytes); the ratio ours/plain is checked against the target
   of 0.8 and printed as PASS or MISS (nothing is asserted). After every wake
   the tensor is compared byte for byte with a device copy kept elsewhere.
2. Small allocations: --small-count tensors cycling 64 KiB, 256 KiB, 1 MiB and
   2 MiB under "weights". torch's caching allocator packs them into larger
   segments, so both the tensor count and the allocator-level allocation count
   are reported. Sleep and wake are timed (first cycle, then median of
   --repeats) when offloading and when dropping (`sleep(offload_tags=())`).
3. Memory around each first cycle (bandwidth: the cold one; small: offload and
   drop): driver free memory (torch.cuda.mem_get_info) and NVML used memory
   (nvidia-ml-py, skipped when missing) before sleep, while asleep and after
   wake, plus torch's reserved bytes and the allocator's own counters.

Every size and the small-allocation run go in a fresh subprocess: the
allocator is a per-process singleton whose memory pools live as long as the
process, so blocks freed into them stay mapped (and would be slept) until the
process ends, and torch's pinned-host cache would make later first cycles warm.

Run it on a GPU machine from the repository root:

    python benchmarks/bench_allocator.py --out docs/results/allocator-bench-h200.json

Exit status: 0 when every case ran, 1 when one failed (its error is in the JSON),
2 when there is nothing to measure (no GPU, extension not built).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vllm_graph_sleep.units import GiB, KiB, MiB

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = "docs/results/allocator-bench-h200.json"
TAG = "weights"
GB = 1e9
TARGET_RATIO = 0.8
SMALL_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB)
VERIFY_CHUNK = 256 * MiB

Json = dict[str, Any]


# -- setup -------------------------------------------------------------------


def _from_package(module: str) -> Any:
    """A module of vllm_graph_sleep, from the installed package or this checkout."""
    try:
        return importlib.import_module(module)
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        return importlib.import_module(module)


def _allocator_class() -> type:
    return _from_package("vllm_graph_sleep.allocator").GraphSleepAllocator


def _unusable_reason() -> str | None:
    """Why nothing can be measured here, or None when a GPU and the extension are there."""
    if not torch.cuda.is_available():
        return "no GPU visible to torch (torch.cuda.is_available() is False); run it on a GPU host"
    try:
        _allocator_class()
        from vllm_graph_sleep._native import VmmDriver

        VmmDriver()
    except Exception as error:  # an unbuilt or mismatched extension
        return f"the vllm_graph_sleep extension cannot be loaded: {error}"
    return None


class Nvml:
    """NVML view of the benchmarked device; every query is None without pynvml."""

    def __init__(self, device: int = 0):
        self.error: str | None = None
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = self._find_handle(device)
        except Exception as error:  # ImportError, NVMLError, no such PCI id
            self.error = f"{type(error).__name__}: {error}"

    def _find_handle(self, device: int) -> Any:
        # Match by PCI address: NVML indices ignore CUDA_VISIBLE_DEVICES.
        props = torch.cuda.get_device_properties(device)
        bus_id = f"{props.pci_domain_id:x}:{props.pci_bus_id:x}:{props.pci_device_id:x}.0"
        return self._nvml.nvmlDeviceGetHandleByPciBusId(bus_id)

    def used_bytes(self) -> int | None:
        if self._handle is None:
            return None
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def driver_version(self) -> str | None:
        if self._nvml is None:
            return None
        version = self._nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)


# -- measuring helpers ---------------------------------------------------------


def timed(action: Callable[[], object]) -> float:
    """Seconds `action` takes, with the device idle before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    action()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-for-byte equality, compared in chunks to bound temporary memory."""
    if a.numel() != b.numel():
        return False
    for start in range(0, a.numel(), VERIFY_CHUNK):
        if not torch.equal(a[start : start + VERIFY_CHUNK], b[start : start + VERIFY_CHUNK]):
            return False
    return True


def summary(seconds: list[float], nbytes: int | None = None) -> Json:
    """Median, min and max of `seconds`, and GB/s at the median when `nbytes` is given."""
    median = statistics.median(seconds)
    entry: Json = {"seconds": seconds, "median_s": median, "min_s": min(seconds)}
    entry["max_s"] = max(seconds)
    if nbytes is not None:
        entry["gbps"] = nbytes / median / GB
    return entry


def snapshot(alloc: Any, nvml: Nvml) -> Json:
    """Driver, NVML, torch and allocator view of memory right now."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "driver_free_bytes": free,
        "driver_total_bytes": total,
        "nvml_used_bytes": nvml.used_bytes(),
        "torch_reserved_bytes": torch.cuda.memory_reserved(),
        "allocator_mapped_bytes": alloc.mapped_bytes(),
        "allocator_host_bytes": alloc.host_bytes(),
        "allocator_usage_by_tag": alloc.usage_by_tag(),
    }


def memory_report(before: Json, asleep: Json, after: Json) -> Json:
    """The three snapshots and what sleep gave back to the driver."""
    freed = asleep["driver_free_bytes"] - before["driver_free_bytes"]
    nvml_freed = None
    if before["nvml_used_bytes"] is not None and asleep["nvml_used_bytes"] is not None:
        nvml_freed = before["nvml_used_bytes"] - asleep["nvml_used_bytes"]
    cycle_change = after["driver_free_bytes"] - before["driver_free_bytes"]
    return {
        "before_sleep": before,
        "asleep": asleep,
        "after_wake": after,
        "driver_freed_by_sleep_bytes": freed,
        "nvml_freed_by_sleep_bytes": nvml_freed,
        "driver_free_change_over_cycle_bytes": cycle_change,
    }


def tagged_tensors(alloc: Any, sizes: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Random-filled uint8 tensors of `sizes` under TAG, and the new allocation sizes."""
    known = set(alloc.allocations)
    with alloc.use_memory_pool(TAG):
        tensors = [torch.empty(size, dtype=torch.uint8, device="cuda") for size in sizes]
    for tensor in tensors:
        tensor.random_(0, 256)
    new = [a.size for address, a in alloc.allocations.items() if address not in known]
    return tensors, new


def first_cycle(alloc: Any, nvml: Nvml, offload: tuple[str, ...]) -> tuple[Json, Json]:
    """Times one sleep/wake cycle and snapshots memory before, asleep and after."""
    torch.cuda.empty_cache()
    before = snapshot(alloc, nvml)
    sleep_s = timed(lambda: alloc.sleep(offload_tags=offload))
    asleep = snapshot(alloc, nvml)
    wake_s = timed(alloc.wake_up)
    after = snapshot(alloc, nvml)
    return {"sleep_s": sleep_s, "wake_s": wake_s}, memory_report(before, asleep, after)


# -- case: bandwidth of one size ---------------------------------------------------


def plain_copies(
    device: torch.Tensor, host: torch.Tensor, back: torch.Tensor
) -> tuple[float, float]:
    """Seconds for device->pinned host and pinned host->device copies."""
    d2h = timed(lambda: host.copy_(device, non_blocking=True))
    h2d = timed(lambda: back.copy_(host, non_blocking=True))
    return d2h, h2d


def bandwidth_case(size_gib: float, repeats: int) -> Json:
    alloc = _allocator_class().get_instance()
    nvml = Nvml()
    nbytes = int(size_gib * GiB)
    (tensor,), allocation_sizes = tagged_tensors(alloc, [nbytes])
    reference = tensor.clone()  # torch's own pool, not ours
    plain_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    plain_back = torch.empty_like(reference)
    plain_copies(reference, plain_host, plain_back)  # warm-up, untimed

    cold, memory = first_cycle(alloc, nvml, (TAG,))
    exact = [equal_bytes(tensor, reference)]

    sleeps, wakes, d2hs, h2ds, plain_exact = [], [], [], [], []
    for _ in range(repeats):
        sleeps.append(timed(lambda: alloc.sleep(offload_tags=(TAG,))))
        wakes.append(timed(alloc.wake_up))
        exact.append(equal_bytes(tensor, reference))
        d2h, h2d = plain_copies(reference, plain_host, plain_back)
        d2hs.append(d2h)
        h2ds.append(h2d)
        plain_exact.append(equal_bytes(plain_back, reference))

    ours_sleep, ours_wake = summary(sleeps, nbytes), summary(wakes, nbytes)
    plain_d2h, plain_h2d = summary(d2hs, nbytes), summary(h2ds, nbytes)
    sleep_ratio = ours_sleep["gbps"] / plain_d2h["gbps"]
    wake_ratio = ours_wake["gbps"] / plain_h2d["gbps"]
    return {
        "size_gib": size_gib,
        "bytes": nbytes,
        "allocator_allocations": len(allocation_sizes),
        "allocator_allocation_bytes": sum(allocation_sizes),
        "ours": {
            "cold": {
                **cold,
                "sleep_gbps": nbytes / cold["sleep_s"] / GB,
                "wake_gbps": nbytes / cold["wake_s"] / GB,
            },
            "sleep": ours_sleep,
            "wake": ours_wake,
        },
        "plain": {"d2h": plain_d2h, "h2d": plain_h2d},
        "ratio_sleep_vs_d2h": sleep_ratio,
        "ratio_wake_vs_h2d": wake_ratio,
        "sleep_pass": sleep_ratio >= TARGET_RATIO,
        "wake_pass": wake_ratio >= TARGET_RATIO,
        "bit_exact": all(exact),
        "bit_exact_per_cycle": exact,
        "plain_bit_exact": all(plain_exact),
        "host_bytes_kept_after_wake": alloc.host_bytes(),
        "memory": memory,
    }


# -- case: many small allocations ----------------------------------------------------


def sleep_wake_cycles(alloc: Any, nvml: Nvml, offload: tuple[str, ...], repeats: int) -> Json:
    """First cycle (with memory snapshots) and `repeats` more, sleeping with `offload`."""
    first, memory = first_cycle(alloc, nvml, offload)
    sleeps, wakes = [], []
    for _ in range(repeats):
        sleeps.append(timed(lambda: alloc.sleep(offload_tags=offload)))
        wakes.append(timed(alloc.wake_up))
    return {"first": first, "sleep": summary(sleeps), "wake": summary(wakes), "memory": memory}


def small_case(count: int, repeats: int) -> Json:
    alloc = _allocator_class().get_instance()
    nvml = Nvml()
    sizes = [SMALL_SIZES[index % len(SMALL_SIZES)] for index in range(count)]
    tensors, allocation_sizes = tagged_tensors(alloc, sizes)
    reference = torch.cat(tensors)

    # Offload first: its first cycle allocates the host buffers; a drop sleep
    # frees them again.
    offload = sleep_wake_cycles(alloc, nvml, (TAG,), repeats)
    offload["bit_exact"] = equal_bytes(torch.cat(tensors), reference)
    drop = sleep_wake_cycles(alloc, nvml, (), repeats)
    drop["bit_exact"] = None  # contents after a drop are undefined
    return {
        "tensors": count,
        "tensor_sizes": list(SMALL_SIZES),
        "tensor_bytes": sum(sizes),
        "allocator_allocations": len(allocation_sizes),
        "allocator_allocation_bytes": sum(allocation_sizes),
        "offload": offload,
        "drop": drop,
    }


# -- parent: run cases in subprocesses ---------------------------------------------


def run_case(case_args: list[str]) -> Json:
    """Runs this script on one case in a fresh process; its JSON or an error."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        command = [sys.executable, str(Path(__file__).resolve()), *case_args]
        command += ["--case-result", str(result_path)]
        completed = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False)
        if completed.stderr:
            sys.stderr.write(completed.stderr)
        if completed.returncode == 0 and result_path.exists():
            return json.loads(result_path.read_text())
    lines = [line for line in completed.stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "no output"
    return {"error": f"case {case_args} exited with {completed.returncode}: {last}"}


def environment() -> Json:
    props = torch.cuda.get_device_properties(0)
    nvml = Nvml()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "gpu_name": props.name,
        "gpu_total_memory_bytes": props.total_memory,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "driver_version": nvml.driver_version(),
        "nvml_error": nvml.error,
        "hostname": platform.node(),
        "git_revision": _from_package("vllm_graph_sleep.bench.live").git_revision(),
        "release_host_memory_env": os.environ.get("VLLM_GRAPH_SLEEP_RELEASE_HOST_MEMORY"),
        "zero_on_wake_env": os.environ.get("VLLM_GRAPH_SLEEP_ZERO_ON_WAKE"),
    }


def _gbps(entry: Json) -> str:
    return f"{entry['gbps']:7.2f}" if entry.get("gbps") is not None else "    n/a"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.2f}"


def print_tables(report: Json) -> None:
    print(f"\n{report['environment']['gpu_name']}, torch {report['environment']['torch']}")
    print("GB/s (1e9 B/s, median); ratio = ours / plain; target >= 0.80")
    print(
        f"{'size':>7} | {'sleep':>7} {'D2H':>7} {'ratio':>6} {'':4} | "
        f"{'wake':>7} {'H2D':>7} {'ratio':>6} {'':4} | {'cold sleep/wake':>15} | exact"
    )
    for entry in report["bandwidth"]:
        size = f"{entry['size_gib']:g} GiB"
        if "error" in entry:
            print(f"{size:>7} | ERROR {entry['error']}")
            continue
        ours, plain, cold = entry["ours"], entry["plain"], entry["ours"]["cold"]
        print(
            f"{size:>7} | {_gbps(ours['sleep'])} {_gbps(plain['d2h'])} "
            f"{entry['ratio_sleep_vs_d2h']:6.2f} {'PASS' if entry['sleep_pass'] else 'MISS'} | "
            f"{_gbps(ours['wake'])} {_gbps(plain['h2d'])} "
            f"{entry['ratio_wake_vs_h2d']:6.2f} {'PASS' if entry['wake_pass'] else 'MISS'} | "
            f"{cold['sleep_gbps']:7.2f}/{cold['wake_gbps']:<7.2f} | {entry['bit_exact']}"
        )
    small = report["small_allocations"]
    if small is None:
        return
    if "error" in small:
        print(f"\nsmall allocations: ERROR {small['error']}")
        return
    print(
        f"\nsmall allocations: {small['tensors']} tensors in "
        f"{small['allocator_allocations']} allocator allocations "
        f"({small['allocator_allocation_bytes'] / MiB:.0f} MiB); ms, median (first)"
    )
    for mode in ("offload", "drop"):
        timing = small[mode]
        print(
            f"  {mode:>7}: sleep {_ms(timing['sleep']['median_s'])} "
            f"({_ms(timing['first']['sleep_s']).strip()})  "
            f"wake {_ms(timing['wake']['median_s'])} ({_ms(timing['first']['wake_s']).strip()})"
            f"  exact {timing['bit_exact']}"
        )


# -- command line --------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time graph-sleep sleep/wake against plain pinned copies (needs a GPU).",
    )
    parser.add_argument(
        "--sizes-gib", type=float, nargs="+", default=[1, 2, 4, 8], help="tensor sizes, GiB"
    )
    parser.add_argument("--repeats", type=int, default=5, help="steady-state cycles per case")
    parser.add_argument("--small-count", type=int, default=1000, help="0 skips the small case")
    parser.add_argument("--out", default=DEFAULT_OUT, help="JSON report path")
    # Internal: one case in this process, result written to --case-result.
    parser.add_argument("--case", choices=("bandwidth", "small"), help=argparse.SUPPRESS)
    parser.add_argument("--case-size-gib", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--case-result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def run_single_case(args: argparse.Namespace) -> int:
    if args.case == "bandwidth":
        result = bandwidth_case(args.case_size_gib, args.repeats)
    else:
        result = small_case(args.small_count, args.repeats)
    Path(args.case_result).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.case is not None:
        return run_single_case(args)
    reason = _unusable_reason()
    if reason is not None:
        print(f"bench_allocator: {reason}", file=sys.stderr)
        return 2

    common = ["--repeats", str(args.repeats), "--small-count", str(args.small_count)]
    bandwidth = []
    for size in args.sizes_gib:
        print(f"bandwidth {size:g} GiB ...", file=sys.stderr, flush=True)
        entry = run_case(["--case", "bandwidth", "--case-size-gib", str(size), *common])
        bandwidth.append(entry if "error" not in entry else {"size_gib": size, **entry})
    small = None
    if args.small_count > 0:
        print(f"small allocations x{args.small_count} ...", file=sys.stderr, flush=True)
        small = run_case(["--case", "small", *common])

    report = {
        "benchmark": "vllm-graph-sleep allocator sleep/wake vs plain pinned copies",
        "command": shlex.join([sys.executable, *sys.argv]),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(),
        "settings": {
            "sizes_gib": args.sizes_gib,
            "repeats": args.repeats,
            "small_count": args.small_count,
            "target_ratio": TARGET_RATIO,
            "gb": "1e9 bytes",
            "tag": TAG,
        },
        "bandwidth": bandwidth,
        "small_allocations": small,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_tables(report)
    print(f"\nwrote {out}")
    failed = any("error" in entry for entry in bandwidth) or (
        small is not None and "error" in small
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
