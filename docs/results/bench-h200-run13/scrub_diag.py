"""Run 13's diagnostic (not shipped; the run used this logic, reformatted here): why does mapping
128 GiB right after releasing it take ~280 ms (run 12, engine tests at vLLM's defaults) when
41 GiB mapped 0.1 s after a sleep took 2-13 ms? Reading tested: the driver clears released pages
before handing them out again, and a mapping that needs them waits.

Maps all free memory but 6 GiB in 4 GiB chunks, writes it, releases it, waits `pause_s`, maps
2 MiB elsewhere (the first call after the pause) and then everything again, timing each step.
"""

import ctypes
import json
import time

import torch

GIB, MIB = 1 << 30, 1 << 20
CHUNK = 4 * GIB
cuda = ctypes.CDLL("libcuda.so.1")
c_size, c_u64 = ctypes.c_size_t, ctypes.c_ulonglong


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class Access(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: {rc}")


def reserve(size):
    ptr = c_u64()
    check(
        cuda.cuMemAddressReserve(ctypes.byref(ptr), c_size(size), c_size(0), c_u64(0), c_u64(0)),
        "reserve",
    )
    return ptr.value


def create_map(ptr, size):
    handle = c_u64()
    check(
        cuda.cuMemCreate(ctypes.byref(handle), c_size(size), ctypes.byref(PROP), c_u64(0)), "create"
    )
    check(cuda.cuMemMap(c_u64(ptr), c_size(size), c_size(0), handle, c_u64(0)), "map")
    check(cuda.cuMemSetAccess(c_u64(ptr), c_size(size), ctypes.byref(ACCESS), c_size(1)), "access")
    return handle


def unmap_release(ptr, size, handle):
    check(cuda.cuMemUnmap(c_u64(ptr), c_size(size)), "unmap")
    check(cuda.cuMemRelease(handle), "release")


def ms_since(start):
    return round((time.perf_counter() - start) * 1e3, 2)


def map_all(ranges):
    start = time.perf_counter()
    handles = [create_map(p, CHUNK) for p in ranges]
    return handles, ms_since(start)


def touch_and_release(ranges, handles):
    for p in ranges:
        torch.cuda.synchronize()
        cuda.cuMemsetD8_v2(c_u64(p), ctypes.c_ubyte(1), c_size(CHUNK))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for p, handle in zip(ranges, handles, strict=True):
        unmap_release(p, CHUNK, handle)
    return ms_since(start)


torch.zeros(1, device="cuda")
torch.cuda.synchronize()
PROP = Prop()
PROP.type = 1  # pinned
PROP.location = Location(1, 0)  # device 0
ACCESS = Access(Location(1, 0), 3)  # read and write


def main():
    free, _ = torch.cuda.mem_get_info()
    count = (free - 6 * GIB) // CHUNK
    base = reserve(count * CHUNK)
    ranges = [base + i * CHUNK for i in range(count)]
    small = reserve(2 * MIB)
    out = {"gib": count * 4, "cases": []}
    handles, out["first_map_ms"] = map_all(ranges)
    for pause in (0.0, 0.0, 0.05, 0.15, 0.3, 1.0):
        released = touch_and_release(ranges, handles)
        time.sleep(pause)
        start = time.perf_counter()
        handle = create_map(small, 2 * MIB)
        small_ms = ms_since(start)
        unmap_release(small, 2 * MIB, handle)
        handles, all_ms = map_all(ranges)
        case = {"pause_s": pause, "release_ms": released, "small_map_ms": small_ms}
        out["cases"].append({**case, "map_all_ms": all_ms})
        print(json.dumps(out["cases"][-1]), flush=True)
    for p, handle in zip(ranges, handles, strict=True):
        unmap_release(p, CHUNK, handle)
    print("RESULT " + json.dumps(out))


main()
