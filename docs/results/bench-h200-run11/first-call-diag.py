"""Diag (not shipped): what does the first driver call after a sleep wait for? Run 10 saw the
wake's first call take 10-17 ms whichever it was (stack limit or mapping). Candidates: the driver
finishing the release of the sleep's memory (42 GiB in the bench), or the GPU's idle state.
Run 11 call A; kept as it ran, formatted by ruff (one statement per line, zip's strict=False)."""

import ctypes
import json
import time

import torch

GIB, MIB = 1 << 30, 1 << 20
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


torch.zeros(1, device="cuda")
torch.cuda.synchronize()
prop = Prop()
prop.type = 1
prop.location = Location(1, 0)
access = Access(Location(1, 0), 3)


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
    h = c_u64()
    check(cuda.cuMemCreate(ctypes.byref(h), c_size(size), ctypes.byref(prop), c_u64(0)), "create")
    check(cuda.cuMemMap(c_u64(ptr), c_size(size), c_size(0), h, c_u64(0)), "map")
    check(cuda.cuMemSetAccess(c_u64(ptr), c_size(size), ctypes.byref(access), c_size(1)), "access")
    return h


def unmap_release(ptr, size, h):
    check(cuda.cuMemUnmap(c_u64(ptr), c_size(size)), "unmap")
    check(cuda.cuMemRelease(h), "release")


def ms(t):
    return round((time.perf_counter() - t) * 1e3, 2)


big = [(reserve(5 * GIB), 5 * GIB) for _ in range(8)]
small = reserve(2 * MIB)
out = {}


def first_calls(label, release_big, idle_s, touch=True):
    rows = []
    for _ in range(3):
        handles = [create_map(p, s) for p, s in big] if release_big else []
        if touch and handles:
            for p, s in big:
                check(cuda.cuMemsetD8_v2(c_u64(p), ctypes.c_ubyte(1), c_size(s)), "memset")
            torch.cuda.synchronize()
        t = time.perf_counter()
        for (p, s), h in zip(big, handles, strict=False):
            unmap_release(p, s, h)
        release = ms(t)
        time.sleep(idle_s)
        t = time.perf_counter()
        h = create_map(small, 2 * MIB)
        first = ms(t)
        unmap_release(small, 2 * MIB, h)
        t = time.perf_counter()
        h = create_map(small, 2 * MIB)
        second = ms(t)
        unmap_release(small, 2 * MIB, h)
        t = time.perf_counter()
        check(cuda.cuCtxSetLimit(0, c_size(0)), "lower")
        check(cuda.cuCtxSetLimit(0, c_size(1024)), "raise")
        stack = ms(t)
        rows.append(
            dict(
                release_ms=release,
                first_map_ms=first,
                second_map_ms=second,
                stack_lower_raise_ms=stack,
            )
        )
    out[label] = rows
    print(label, rows, flush=True)


first_calls("no_release_idle_0", False, 0.0)
first_calls("no_release_idle_1s", False, 1.0)
first_calls("release_40g_idle_0", True, 0.0)
first_calls("release_40g_idle_0.1s", True, 0.1)
first_calls("release_40g_idle_1s", True, 1.0)
first_calls("release_40g_untouched_idle_0.5s", True, 0.5, touch=False)
# The stack limit as the first call after a release (the landed wake's order).
rows = []
for _ in range(3):
    handles = [create_map(p, s) for p, s in big]
    check(cuda.cuCtxSetLimit(0, c_size(0)), "lower")
    for (p, s), h in zip(big, handles, strict=False):
        unmap_release(p, s, h)
    time.sleep(0.5)
    t = time.perf_counter()
    check(cuda.cuCtxSetLimit(0, c_size(1024)), "raise")
    raise_first = ms(t)
    t = time.perf_counter()
    h = create_map(small, 2 * MIB)
    then_map = ms(t)
    unmap_release(small, 2 * MIB, h)
    rows.append(dict(raise_first_ms=raise_first, map_after_ms=then_map))
out["stack_first_after_release_0.5s"] = rows
print(json.dumps(out), flush=True)
