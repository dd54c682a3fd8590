"""Diag (not shipped; run 10): what does raising the stack limit back cost, what does it depend
on (graph executables kept, value lowered to), and does it overlap with a copy from another
thread? The statements that ran, split one per line for the linter."""

import ctypes
import json
import os
import threading
import time

import pynvml
import torch

MIB = 1 << 20
cuda = ctypes.CDLL("libcuda.so.1")
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)


def used():
    torch.cuda.synchronize()
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        if p.pid == os.getpid():
            return p.usedGpuMemory // MIB


def set_stack(v):
    t = time.perf_counter()
    rc = cuda.cuCtxSetLimit(0, ctypes.c_size_t(v))
    return rc, (time.perf_counter() - t) * 1e3


out = {}
x = torch.randn(1024, 1024, device="cuda")
y = x @ x
torch.cuda.synchronize()


def cycle(label, low=0, n=3):
    res = []
    for _ in range(n):
        before = used()
        rc1, t_lo = set_stack(low)
        lo = used()
        rc2, t_hi = set_stack(1024)
        hi = used()
        res.append(
            dict(
                rc=(rc1, rc2),
                lower_ms=round(t_lo, 2),
                raise_ms=round(t_hi, 2),
                used=(before, lo, hi),
            )
        )
    out[label] = res


cycle("bare")
graphs, bufs = [], []


def capture(n):
    for _ in range(n):
        b = torch.zeros(256, 256, device="cuda")
        bufs.append(b)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(4):
                b.add_(1)
                torch.softmax(b, -1)
                b.mul_(1.0)
        graphs.append(g)
    torch.cuda.synchronize()


capture(500)
cycle("graphs_500")
capture(1000)
cycle("graphs_1500")
cycle("graphs_1500_low256", low=256)
cycle("graphs_1500_low512", low=512)
print(json.dumps(out), flush=True)
# The raise with a 240 MiB H2D copy in flight on the main thread: does it wait for the copy?
hostq = torch.empty(240 * MIB, dtype=torch.uint8).pin_memory()
devq = torch.empty(240 * MIB, dtype=torch.uint8, device="cuda")
inflight = []
for _ in range(3):
    set_stack(0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    devq.copy_(hostq, non_blocking=True)
    t_q = time.perf_counter()
    _, r = set_stack(1024)
    t_r = time.perf_counter()
    torch.cuda.synchronize()
    inflight.append(
        dict(
            queue_ms=round((t_q - t) * 1e3, 2),
            raise_ms=round(r, 2),
            total_ms=round((time.perf_counter() - t) * 1e3, 2),
        )
    )
for _ in range(2):
    t = time.perf_counter()
    devq.copy_(hostq, non_blocking=True)
    torch.cuda.synchronize()
    inflight.append(dict(copy_alone_ms=round((time.perf_counter() - t) * 1e3, 2)))
out["raise_with_copy_in_flight"] = inflight
print(json.dumps(out), flush=True)
for g in graphs[:50]:
    g.replay()
torch.cuda.synchronize()
out["replay_ok"] = True
# Overlap: a 240 MiB pinned H2D copy and 37 cudaMalloc'd 8 MiB buffers on the main thread,
# the raise on another thread.
host = torch.empty(240 * MIB, dtype=torch.uint8).pin_memory()
dev = torch.empty(240 * MIB, dtype=torch.uint8, device="cuda")


def work():
    t = time.perf_counter()
    keep = [torch.empty(8 * MIB, dtype=torch.uint8, device="cuda") for _ in range(37)]
    t_alloc = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t_end = time.perf_counter()
    del keep
    torch.cuda.empty_cache()
    return (t_alloc - t) * 1e3, (t_end - t_alloc) * 1e3


seq = []
for _ in range(3):
    set_stack(0)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    _, r = set_stack(1024)
    a, c = work()
    seq.append(
        dict(
            raise_ms=round(r, 2),
            alloc_ms=round(a, 2),
            copy_ms=round(c, 2),
            total_ms=round((time.perf_counter() - t) * 1e3, 2),
        )
    )
out["sequential"] = seq
par = []
for _ in range(3):
    set_stack(0)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    box = {}

    def raise_it(box=box):
        torch.cuda.set_device(0)
        box["r"] = set_stack(1024)

    t = time.perf_counter()
    th = threading.Thread(target=raise_it)
    th.start()
    a, c = work()
    t_work = time.perf_counter()
    th.join()
    par.append(
        dict(
            raise_ms=round(box["r"][1], 2),
            alloc_ms=round(a, 2),
            copy_ms=round(c, 2),
            work_done_ms=round((t_work - t) * 1e3, 2),
            total_ms=round((time.perf_counter() - t) * 1e3, 2),
        )
    )
out["threaded"] = par
for g in graphs[:50]:
    g.replay()
torch.cuda.synchronize()
out["replay_ok_after_threaded"] = True
print(json.dumps(out, indent=1), flush=True)
