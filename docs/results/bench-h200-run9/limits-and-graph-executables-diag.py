"""The diagnostic of run 9, kept beside its log (limits-and-graph-executables-diag.log) as it
ran on the H200 (only reformatted by ruff since): not a maintained benchmark.

Two questions for issue 15, in one process with no vLLM, NVML's used memory of this process
in MiB at each step:
1. Besides the stack size, can the context's other limits (printf FIFO, malloc heap, pending
   device launches, sync depth) be lowered after kernels ran, and does that give memory back?
2. Does the driver memory of graph executables come back when the graphs are destroyed, or after
   cudaDeviceGraphMemTrim; and what does instantiating a kept graph again cost?

    python3 limits-and-graph-executables-diag.py
"""

import ctypes
import gc
import json
import os
import time

import pynvml
import torch

MIB = 1 << 20
out = {}
cuda = ctypes.CDLL("libcuda.so.1")
rt = None
for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
    try:
        rt = ctypes.CDLL(name)
        break
    except OSError:
        pass

pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)


def proc_used():
    torch.cuda.synchronize()
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
        if p.pid == os.getpid():
            return p.usedGpuMemory // MIB
    return None


def get_limit(which):
    v = ctypes.c_size_t()
    rc = cuda.cuCtxGetLimit(ctypes.byref(v), which)
    return rc, v.value


def set_limit(which, value):
    return cuda.cuCtxSetLimit(which, ctypes.c_size_t(value))


x = torch.randn(1024, 1024, device="cuda")
y = x @ x  # cuBLAS handle
z = torch.randint(0, 10, (1000,), device="cuda")
z.sort()
torch.cuda.synchronize()
out["limits"] = {i: get_limit(i) for i in range(7)}
out["used_start"] = proc_used()
set_limit(0, 0)
out["used_stack0"] = proc_used()
for which, name in ((1, "printf"), (2, "malloc_heap"), (4, "pending_launch"), (3, "sync_depth")):
    rc_lo = set_limit(which, 0 if which != 3 else 1)
    lo = proc_used()
    lim_lo = get_limit(which)
    rc_min = set_limit(which, 4096)
    lo2 = proc_used()
    lim_lo2 = get_limit(which)
    rc_back = set_limit(which, out["limits"][which][1])
    back = proc_used()
    out[name] = dict(
        rc_lo=rc_lo,
        used_lo=lo,
        limit_lo=lim_lo,
        rc_4096=rc_min,
        used_4096=lo2,
        limit_4096=lim_lo2,
        rc_back=rc_back,
        used_back=back,
    )
    y = x @ x
    z.sort()
    torch.cuda.synchronize()
print(json.dumps(out), flush=True)

# Graph executables: capture N x K, destroy, trim.
res = {}
buffers = [torch.zeros(1024, device="cuda") for _ in range(1000)]
res["before"] = proc_used()
graphs = []
for b in buffers:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(32):
            b.add_(1)
    graphs.append(g)
torch.cuda.synchronize()
torch.cuda.empty_cache()
res["captured"] = proc_used()
for g in graphs:
    g.replay()
res["replayed"] = proc_used()
del graphs
gc.collect()
torch.cuda.synchronize()
torch.cuda.empty_cache()
res["destroyed"] = proc_used()
res["trim_rc"] = rt.cudaDeviceGraphMemTrim(0) if rt else None
res["trimmed"] = proc_used()
t = time.perf_counter()
graphs = []
for b in buffers[:500]:
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        for _ in range(32):
            b.add_(1)
    graphs.append(g)
torch.cuda.synchronize()
res["captured_keep_500"] = proc_used()
res["capture_s"] = time.perf_counter() - t
t = time.perf_counter()
for g in graphs:
    g.instantiate()
torch.cuda.synchronize()
res["instantiate_500_s"] = time.perf_counter() - t
res["instantiated_500"] = proc_used()
print(json.dumps(res), flush=True)
