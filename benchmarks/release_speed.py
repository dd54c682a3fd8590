"""How long the CUDA driver takes to give back mapped memory, and what the
order of the calls and the time since mapping change (issue 38, one GPU).

Releasing memory is most of a level-1 sleep that copies little: 21-39 ms of
the 8B's 42-72 ms sleeps with nothing changed (13 GiB of weights, 28 GiB of KV
cache, 184 allocations), 21-30 ms of the default model's 32-42 ms (run 19's
server logs, docs/results/h200-2026-12-04b.tar.gz). Stock vLLM pays it too; a
cheaper release makes every sleep cheaper. The sleep right after a wake
released more slowly (39 ms) than the first sleep (21 ms), which came after a
long idle time: whether memory mapped recently costs more to give back is one
question this answers.

Directly through libcuda (ctypes, no vLLM, nothing of the plugin): --chunks
allocations of --gib in all, each cuMemCreate'd, mapped into one reserved
range, made read-write and written, then, after waiting --waits seconds,
released one of these ways, each timed (median of --repeats, a fresh mapping
each time):
- `each`: per allocation, cuMemUnmap then cuMemRelease (what the allocator does);
- `unmap_all_first`: every cuMemUnmap, then every cuMemRelease;
- `one_unmap`: one cuMemUnmap over the whole range, then every cuMemRelease;
- `threads4`: `each`, split over 4 threads;
- `each_beside_kernel`, `each_beside_copy`: `each`, with a busy kernel (about
  0.1 s) or a 4 GiB device-to-host copy queued on the GPU just before, on other
  memory. Whether the driver waits for that work before it unmaps decides
  whether a sleep can release the KV cache while its backup's fingerprints and
  copies run; the row says whether the work was still running when the release
  returned.
- `thread_beside_launches`: `each` on a thread of its own, while this thread
  launches a tiny kernel again and again until the release ends: whether a
  sleep's host work (its launches, copies and other driver calls) can go on
  while another thread gives back the KV cache, or waits for the driver; the
  row has the launches' latencies.

    python benchmarks/release_speed.py --out release-speed.json

Exit status: 0 when every way ran, 1 when one failed (its error recorded), 2
without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vllm_graph_sleep.units import GiB, MiB

BUSY_WAYS = {"each_beside_kernel": "kernel", "each_beside_copy": "copy"}
THREADED_WAY = "thread_beside_launches"
WAYS = ("each", "unmap_all_first", "one_unmap", "threads4", *BUSY_WAYS, THREADED_WAY)
BUSY_KERNEL_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s at 2 GHz
BUSY_COPY_BYTES = 4 * GiB
THREADS = 4
# CUDA driver API values (cuda.h).
_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_GRANULARITY_MINIMUM = 0
_ACCESS_READ_WRITE = 3


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class Driver:
    """The few VMM calls this needs; a failing one raises RuntimeError("<call> failed: <name>")."""

    def __init__(self, device: int) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._prop = _AllocationProp(
            type=_ALLOCATION_TYPE_PINNED, location=_Location(_LOCATION_TYPE_DEVICE, device)
        )
        self._access = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, device), _ACCESS_READ_WRITE)
        context = ctypes.c_void_p()
        self._call("cuCtxGetCurrent", ctypes.byref(context))
        self.context = context

    def _call(self, name: str, *args: Any) -> None:
        result = getattr(self._lib, name)(*args)
        if result != 0:
            text = ctypes.c_char_p()
            self._lib.cuGetErrorName(result, ctypes.byref(text))
            raise RuntimeError(f"{name} failed: {(text.value or b'?').decode()} ({result})")

    def make_current(self) -> None:
        self._call("cuCtxSetCurrent", self.context)

    def granularity(self) -> int:
        size = ctypes.c_size_t()
        self._call(
            "cuMemGetAllocationGranularity",
            ctypes.byref(size),
            ctypes.byref(self._prop),
            _GRANULARITY_MINIMUM,
        )
        return size.value

    def reserve(self, size: int, alignment: int = 0) -> int:
        address = ctypes.c_uint64()
        self._call(
            "cuMemAddressReserve",
            ctypes.byref(address),
            ctypes.c_size_t(size),
            ctypes.c_size_t(alignment),
            ctypes.c_uint64(0),
            ctypes.c_ulonglong(0),
        )
        return address.value

    def free_range(self, address: int, size: int) -> None:
        self._call("cuMemAddressFree", ctypes.c_uint64(address), ctypes.c_size_t(size))

    def map_written(self, address: int, size: int) -> int:
        """A new allocation of `size` mapped read-write at `address` and
        written (its pages touched); returns its handle."""
        handle = ctypes.c_uint64()
        self._call(
            "cuMemCreate",
            ctypes.byref(handle),
            ctypes.c_size_t(size),
            ctypes.byref(self._prop),
            ctypes.c_ulonglong(0),
        )
        at, length = ctypes.c_uint64(address), ctypes.c_size_t(size)
        self._call("cuMemMap", at, length, ctypes.c_size_t(0), handle, ctypes.c_ulonglong(0))
        self._call("cuMemSetAccess", at, length, ctypes.byref(self._access), ctypes.c_size_t(1))
        self._call("cuMemsetD8_v2", at, ctypes.c_ubyte(1), length)
        return handle.value

    def unmap(self, address: int, size: int) -> None:
        self._call("cuMemUnmap", ctypes.c_uint64(address), ctypes.c_size_t(size))

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", ctypes.c_uint64(handle))

    def synchronize(self) -> None:
        self._call("cuCtxSynchronize")


def release(driver: Driver, way: str, base: int, chunk: int, handles: list[int]) -> None:
    """Gives back the chunks mapped at `base` one after another, `way`."""
    addresses = [base + index * chunk for index in range(len(handles))]
    if way in ("each", *BUSY_WAYS):
        for address, handle in zip(addresses, handles, strict=True):
            driver.unmap(address, chunk)
            driver.release(handle)
    elif way == "unmap_all_first":
        for address in addresses:
            driver.unmap(address, chunk)
        for handle in handles:
            driver.release(handle)
    elif way == "one_unmap":
        driver.unmap(base, chunk * len(handles))
        for handle in handles:
            driver.release(handle)
    elif way == "threads4":
        errors: list[BaseException] = []

        def share(first: int) -> None:
            try:
                driver.make_current()
                for index in range(first, len(handles), THREADS):
                    driver.unmap(addresses[index], chunk)
                    driver.release(handles[index])
            except BaseException as error:  # reported by the caller's thread
                errors.append(error)

        threads = [threading.Thread(target=share, args=(first,)) for first in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
    else:
        raise ValueError(f"unknown way {way!r}")


class BusyWork:
    """GPU work queued on the current stream just before a timed release,
    on memory of its own: a busy kernel or a device-to-host copy."""

    def __init__(self, kind: str | None) -> None:
        import torch

        self._torch = torch
        self.kind = kind
        self._source = self._target = None
        if kind == "copy":
            self._source = torch.empty(BUSY_COPY_BYTES, dtype=torch.uint8, device="cuda")
            self._target = torch.empty(BUSY_COPY_BYTES, dtype=torch.uint8, pin_memory=True)

    def queue(self) -> None:
        if self.kind == "kernel":
            self._torch.cuda._sleep(BUSY_KERNEL_CYCLES)
        elif self.kind == "copy":
            self._target.copy_(self._source, non_blocking=True)

    def still_running(self) -> bool | None:
        if self.kind is None:
            return None
        running = not self._torch.cuda.current_stream().query()
        self._torch.cuda.synchronize()
        return running


def release_beside_launches(
    driver: Driver, base: int, chunk: int, handles: list[int]
) -> dict[str, float]:
    """`each` on another thread while this one launches a one-element add until
    it ends; the launches' count and latencies (ms)."""
    import torch

    counter = torch.zeros(1, device="cuda")
    errors: list[BaseException] = []
    started = threading.Event()

    def work() -> None:
        try:
            driver.make_current()
            started.set()
            release(driver, "each", base, chunk, handles)
        except BaseException as error:  # reported by the caller's thread
            errors.append(error)
            started.set()

    thread = threading.Thread(target=work)
    thread.start()
    started.wait()
    latencies: list[float] = []
    while thread.is_alive():
        start = time.perf_counter()
        counter.add_(1)
        latencies.append(1000 * (time.perf_counter() - start))
    thread.join()
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    return {
        "launches": len(latencies),
        "launch_ms_median": round(statistics.median(latencies), 4) if latencies else None,
        "launch_ms_max": round(max(latencies), 3) if latencies else None,
    }


def measure(
    driver: Driver,
    total: int,
    chunks: int,
    way: str,
    wait_s: float,
    repeats: int,
    alignment: int = 0,
):
    """Median seconds of releasing `chunks` freshly mapped allocations `way`,
    `wait_s` after they were written, with the error where one failed."""
    chunk = total // chunks
    base = driver.reserve(chunk * chunks, alignment)
    seconds: list[float] = []
    busy = BusyWork(BUSY_WAYS.get(way))
    still_running: list[bool | None] = []
    launches: list[dict[str, float]] = []
    try:
        for _ in range(repeats):
            handles = [driver.map_written(base + i * chunk, chunk) for i in range(chunks)]
            driver.synchronize()
            time.sleep(wait_s)
            busy.queue()
            start = time.perf_counter()
            try:
                if way == THREADED_WAY:
                    launches.append(release_beside_launches(driver, base, chunk, handles))
                else:
                    release(driver, way, base, chunk, handles)
            except RuntimeError as error:
                # Give back what the failed way left, the slow and sure way.
                for index, handle in enumerate(handles):
                    try:
                        driver.unmap(base + index * chunk, chunk)
                    except RuntimeError:
                        pass
                    try:
                        driver.release(handle)
                    except RuntimeError:
                        pass
                return {"error": str(error)}
            seconds.append(time.perf_counter() - start)
            still_running.append(busy.still_running())
    finally:
        driver.free_range(base, chunk * chunks)
    return {
        "seconds": statistics.median(seconds),
        "all_s": seconds,
        "busy": still_running,
        "launches": launches,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=28.0, help="in all (the 8B's KV cache: 28)")
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument(
        "--alignment-mib",
        type=int,
        default=0,
        help="of the reserved range (0: the driver's choice); whether a range aligned to "
        "more than the 2 MiB granule releases faster",
    )
    parser.add_argument("--waits", type=float, nargs="+", default=[0.0, 2.0])
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("release_speed: no GPU visible, nothing to run", file=sys.stderr)
        return 2
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    driver = Driver(torch.cuda.current_device())
    granularity = driver.granularity()
    chunk = int(args.gib * GiB) // args.chunks // granularity * granularity
    results = []
    for wait_s in args.waits:
        for way in args.ways:
            measured = measure(
                driver,
                chunk * args.chunks,
                args.chunks,
                way,
                wait_s,
                args.repeats,
                args.alignment_mib * MiB,
            )
            row = {"way": way, "wait_s": wait_s, "ms": None, "error": measured.get("error")}
            if way in BUSY_WAYS:
                row["gpu_work_still_running_after"] = measured.get("busy")
            if way == THREADED_WAY:
                row["main_thread_launches"] = measured.get("launches")
            if "seconds" in measured:
                row["ms"] = round(1000 * measured["seconds"], 2)
            results.append(row)
            print(
                f"wait {wait_s:4.1f} s  {way:16s} "
                + (f"{row['ms']:8.2f} ms" if row["ms"] is not None else f"failed: {row['error']}")
                + (f"  GPU work running after: {measured['busy']}" if way in BUSY_WAYS else "")
                + (f"  launches meanwhile: {measured['launches']}" if way == THREADED_WAY else "")
            )
    report = {
        "benchmark": "releasing mapped device memory (issue 38)",
        "command": shlex.join(["python", "benchmarks/release_speed.py", *(argv or sys.argv[1:])]),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "bytes": chunk * args.chunks,
        "chunks": args.chunks,
        "alignment_mib": args.alignment_mib,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(row["error"] is None for row in results) else 1


if __name__ == "__main__":
    sys.exit(main())
