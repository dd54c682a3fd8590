"""Sleep side of coded backups on the GPU: old per-piece coder vs the pipelined one, with a
breakdown and kernel variants. Runs without vLLM (PYTHONPATH=repo root)."""

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from vllm_graph_sleep import coded_backup as cb

MIB = 1 << 20
OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
res = {"device": torch.cuda.get_device_name()}


def log(*a):
    print(*a, flush=True)


def wall(fn, reps=3):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(1000 * (time.perf_counter() - t))
    return ts


def gpu_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


layers = int(os.environ.get("LAYERS", "8"))
sizes = []
for _ in range(layers):
    sizes += [48 * MIB, 32 * MIB, 224 * MIB, 112 * MIB, 2 * MIB]
sizes.append(1002 * MIB)
g = torch.Generator(dev).manual_seed(0)
devs = []
for n in sizes:
    t = torch.empty(n // 2, dtype=torch.bfloat16, device=dev)
    t.normal_(0, 0.02, generator=g)
    if n == 2 * MIB:
        t.fill_(1.0)
        t[:4096].normal_(1, 0.05, generator=g)
    devs.append(t.view(torch.uint8))
total = sum(sizes)
hosts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
allocs = [[(d, h)] for d, h in zip(devs, hosts, strict=True)]
res["gib"] = total / (1 << 30)
res["allocations"] = len(sizes)
log("made", res)

started = time.perf_counter()
res["prepare_ok"] = cb.prepare(dev)
res["prepare_s"] = time.perf_counter() - started
log("prepare", res["prepare_ok"], res["prepare_s"])


def raw_backup():
    for d, h in zip(devs, hosts, strict=True):
        h.copy_(d, non_blocking=True)


res["raw_backup_ms"] = wall(raw_backup)
log("raw", res["raw_backup_ms"])


def raw_restore():
    for d, h in zip(devs, hosts, strict=True):
        d.copy_(h, non_blocking=True)


backups = []


def new_coder():
    backups.clear()
    backups.extend(cb.back_up(allocs))


res["new_coder_ms"] = wall(new_coder, reps=4)
coded = sum(b.coded_bytes for b in backups)
res["coded_share"] = coded / total
res["coded_pieces"] = sum(p.coded is not None for b in backups for p in b.pieces)
res["pieces"] = sum(len(b.pieces) for b in backups)
log("new", res["new_coder_ms"], res["coded_share"], res["coded_pieces"], res["pieces"])

# restore check + wake timing
originals = [d.clone() for d in devs]


def wake_coded():
    r = cb.Restore(backups)
    for b, pairs in zip(backups, allocs, strict=True):
        r.add(b, pairs)


for d in devs:
    d.fill_(0x5A)
res["wake_coded_ms"] = wall(wake_coded)
res["bit_exact"] = all(torch.equal(d, o) for d, o in zip(devs, originals, strict=True))
res["raw_restore_ms"] = wall(raw_restore)  # hosts hold coded bytes now: timing only
for d, o in zip(devs, originals, strict=True):
    d.copy_(o)
log("wake", res["wake_coded_ms"], res["bit_exact"], res["raw_restore_ms"])


# breakdown
def hist_pass():
    cb._histograms(allocs, dev)


res["histograms_ms"] = wall(hist_pass)
counts = cb._histograms(allocs, dev)
t = time.perf_counter()
for i, p in enumerate(allocs):
    cb._plan(p, i, counts[i])
res["plan_cpu_ms"] = 1000 * (time.perf_counter() - t)
log("breakdown", res["histograms_ms"], res["plan_cpu_ms"])
json.dump(res, open(os.path.join(OUT, "coder_profile.json"), "w"), indent=1)
log("RESULT", json.dumps(res))
