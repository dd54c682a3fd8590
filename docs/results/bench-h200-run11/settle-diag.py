"""Diag (not shipped), run 11 call B: after a large release, how the first mapping call's wait
grows with the time since the release and with the bytes released, whether an immediate call
avoids it, and whether a call from another thread pays it for the main thread. Kept as it ran,
except that ruff's rules were applied (imports moved up, zip's strict=False, loop variables bound
as defaults): the same statements in the same order."""

import ctypes
import json
import threading
import time

import pynvml
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


pynvml.nvmlInit()
nv = pynvml.nvmlDeviceGetHandleByIndex(0)


def used_mib():
    return pynvml.nvmlDeviceGetMemoryInfo(nv).used >> 20


big = [(reserve(5 * GIB), 5 * GIB) for _ in range(16)]
small = reserve(2 * MIB)
out = {}


def fill(n):
    hs = [create_map(p, s) for p, s in big[:n]]
    for p, s in big[:n]:
        check(cuda.cuMemsetD8_v2(c_u64(p), ctypes.c_ubyte(1), c_size(s)), "memset")
    torch.cuda.synchronize()
    return hs


def release(n, hs):
    t = time.perf_counter()
    for (p, s), h in zip(big[:n], hs, strict=False):
        unmap_release(p, s, h)
    return ms(t)


def timed_map():
    t = time.perf_counter()
    h = create_map(small, 2 * MIB)
    took = ms(t)
    unmap_release(small, 2 * MIB, h)
    return took


def mem_info():
    f, tot = c_size(), c_size()
    check(cuda.cuMemGetInfo_v2(ctypes.byref(f), ctypes.byref(tot)), "meminfo")


def sync():
    check(cuda.cuCtxSynchronize(), "sync")


# 1) delay curve and NVML used memory after the release, no driver call meanwhile
rows = []
for d in (0.005, 0.02, 0.05, 0.1, 0.2, 0.5):
    for _ in range(2):
        hs = fill(8)
        before = used_mib()
        rel = release(8, hs)
        t0 = time.perf_counter()
        trace = []
        while time.perf_counter() - t0 < d:
            trace.append((round((time.perf_counter() - t0) * 1e3), used_mib()))
            time.sleep(0.005)
        rows.append(
            dict(
                delay_s=d,
                release_ms=rel,
                used_before=before,
                nvml_trace=trace[::4] + trace[-1:],
                first_map_ms=timed_map(),
                second_map_ms=timed_map(),
                used_after=used_mib(),
            )
        )
out["delay_curve_40g"] = rows
print("delay", rows, flush=True)

# 2) an immediate call, then idle: does the cost come later anyway?
rows = []
for _ in range(3):
    hs = fill(8)
    release(8, hs)
    now = timed_map()
    time.sleep(0.5)
    later = timed_map()
    rows.append(dict(immediate_map_ms=now, after_0_5s_map_ms=later))
out["immediate_then_idle"] = rows
print("immediate", rows, flush=True)

# 3) a thread that makes one cheap driver call some time after the release: does it absorb it?
for name, fn in (("meminfo", mem_info), ("sync", sync), ("map", timed_map)):
    for at in (0.05, 0.15):
        rows = []
        for _ in range(2):
            hs = fill(8)
            release(8, hs)
            got = {}

            def settle(at=at, fn=fn, got=got):
                time.sleep(at)
                t = time.perf_counter()
                fn()
                got["thread_ms"] = ms(t)

            th = threading.Thread(target=settle)
            th.start()
            time.sleep(0.4)
            th.join()
            rows.append(dict(thread_ms=got.get("thread_ms"), main_first_map_ms=timed_map()))
        out[f"thread_{name}_at_{at}"] = rows
        print(name, at, rows, flush=True)

# 4) scale: how does the first call's wait grow with the bytes released?
rows = []
for n in (2, 8, 16):
    for _ in range(2):
        hs = fill(n)
        rel = release(n, hs)
        time.sleep(0.2)
        rows.append(dict(gib=5 * n, release_ms=rel, first_map_ms=timed_map()))
out["scale"] = rows
print("scale", rows, flush=True)
print(json.dumps(out), flush=True)
