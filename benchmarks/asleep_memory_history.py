"""What a sleeping engine still holds in torch's memory outside our pools, and who made it.

Records torch's allocation history (Python stacks) over an engine running in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the worker is this process),
started as the engine tests start it (vllm_graph_sleep.testing.start_engine:
graph offload on, vLLM's defaults unless --small, graph scratch and remapped
weights poisoned at wake), generates, sleeps it and, for every torch segment
outside the sleep pools (the ledger's own rule), lists each block still in use
with the Python stack that allocated it; then wakes it, generates again and
compares the tokens. H200 run 8 found vLLM's top-k/top-p sampler scratch this
way (docs/results/archive/bench-h200-run8.md).

    python benchmarks/asleep_memory_history.py --out memory-history            # as run 8, before
    python benchmarks/asleep_memory_history.py --history state --out after     # as run 8, after

Writes to --out:
  memory-history.json  the segments outside the pools asleep (every frame) and awake, the
                       worker's ledger asleep, and whether the tokens came back equal
  memory-history.txt   the same for reading (the first --frames frames per block)
  asleep.pickle        with --pickle: torch.cuda.memory._snapshot() taken asleep, for
                       https://pytorch.org/memory_viz
Exit status: 0 same tokens after the wake, 3 different, 4 the worker was not in
this process (no history of it), 2 nothing to run on (no GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import sys
import time
from pathlib import Path

from vllm_graph_sleep.units import MiB

T0 = time.monotonic()


def log(*parts) -> None:
    print(f"[memory history {time.monotonic() - T0:7.1f} s]", *parts, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--kind", default="llama", help="model kind (models.KINDS; bench default: llama)"
    )
    p.add_argument(
        "--mode",
        default="full_and_piecewise",
        choices=("full_and_piecewise", "full", "piecewise", "full_decode_only", "breakable"),
        help="testing.MODES key (vLLM's default cudagraph mode: full_and_piecewise)",
    )
    p.add_argument("--level", type=int, choices=(1, 2), default=1, help="sleep level")
    p.add_argument("--out", default="memory-history", help="output folder")
    p.add_argument("--frames", type=int, default=25, help="frames per block in the .txt")
    p.add_argument("--pickle", action="store_true", help="also write the snapshot (large)")
    p.add_argument("--max-entries", type=int, default=1_000_000, help="history entries kept")
    p.add_argument(
        "--history",
        choices=("all", "state"),
        default="all",
        help="'state': only live blocks' stacks (cheaper snapshots; no segment_alloc history)",
    )
    p.add_argument(
        "--small", action="store_true", help="the tests' shrunk engine instead of vLLM's defaults"
    )
    return p.parse_args(argv)


def frame_text(frame: dict) -> str:
    return f"{frame.get('filename')}:{frame.get('line')}:{frame.get('name')}"


def segment_allocs(snapshot: dict) -> dict[int, dict]:
    """address -> the latest segment_alloc trace entry (history 'all' only)."""
    found: dict[int, dict] = {}
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            if entry.get("action") == "segment_alloc":
                found[entry["addr"]] = entry
    return found


def describe(segments: list[dict], snapshot: dict | None = None, frames: bool = True) -> list[dict]:
    """The segments outside the sleep pools, with their blocks in use (and the
    stacks that allocated them where `frames`)."""
    from vllm_graph_sleep.ledger import _segments_outside_pools, stream_key

    created = segment_allocs(snapshot) if snapshot else {}
    out = []
    for seg in _segments_outside_pools(segments):
        entry = {
            "address": hex(seg["address"]),
            "stream": stream_key(seg.get("stream", 0)),
            "pool": list(seg.get("segment_pool_id", ())),
            "segment_type": seg.get("segment_type"),
            "total_size": seg["total_size"],
            "allocated_size": seg.get("allocated_size", 0),
            "active_size": seg.get("active_size", 0),
            "blocks": [
                {
                    "address": hex(block["address"]),
                    "offset": block["address"] - seg["address"],
                    "size": block["size"],
                    "requested_size": block.get("requested_size"),
                    "state": block["state"],
                    **(
                        {"frames": [frame_text(f) for f in block.get("frames", [])]}
                        if frames
                        else {}
                    ),
                }
                for block in seg.get("blocks", [])
                if block["state"] != "inactive"
            ],
        }
        if seg["address"] in created:
            alloc = created[seg["address"]]
            entry["segment_alloc"] = {
                "size": alloc.get("size"),
                "stream": stream_key(alloc.get("stream", 0)),
                "frames": [frame_text(f) for f in alloc.get("frames", [])],
            }
        out.append(entry)
    return sorted(out, key=lambda s: -s["total_size"])


def mib(n: int | None) -> str:
    return f"{(n or 0) / MiB:.2f} MiB"


def text_summary(asleep: list[dict], awake: list[dict], by_stream: dict, frames: int) -> str:
    lines = ["(stacks: innermost frame first, file:line:function)"]
    lines.append("== torch outside the sleep pools, asleep, by stream (ledger rule)")
    lines += [f"  {stream}: {v}" for stream, v in by_stream.items()]
    lines.append("== awake (before sleep): segments outside the pools")
    for s in awake:
        lines.append(
            f"  {s['address']} stream {s['stream']} total {mib(s['total_size'])} "
            f"allocated {mib(s['allocated_size'])} blocks in use {len(s['blocks'])}"
        )
    lines.append(
        "== asleep: segments outside the pools, blocks in use with their allocation stacks"
    )
    for s in asleep:
        lines.append(
            f"\nSEGMENT {s['address']} stream {s['stream']} pool {s['pool']} {s['segment_type']} "
            f"total {mib(s['total_size'])} allocated {mib(s['allocated_size'])} "
            f"active {mib(s['active_size'])}"
        )
        if "segment_alloc" in s:
            made = s["segment_alloc"]
            lines.append(
                f"  segment_alloc ({mib(made['size'])} cudaMalloc) from the allocation at:"
            )
            lines += [f"      {f}" for f in made["frames"][:frames]]
        for b in s["blocks"]:
            lines.append(
                f"  BLOCK {b['address']} (+{b['offset']}) {mib(b['size'])} "
                f"(requested {b['requested_size']}) {b['state']}; allocated at:"
            )
            lines += [f"      {f}" for f in b["frames"][:frames]] or ["      (no frames recorded)"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("asleep_memory_history: no CUDA or ROCm GPU visible; nothing to run", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Before the first engine starts: testing.vllm_defaults reads it once.
    os.environ["GRAPH_SLEEP_TEST_VLLM_DEFAULTS"] = "0" if args.small else "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm_graph_sleep import config
    from vllm_graph_sleep.allocator import POISON_GRAPH_SCRATCH_ENV, POISON_REMAPPED_ENV
    from vllm_graph_sleep.ledger import ledger, torch_outside_pools_by_stream
    from vllm_graph_sleep.testing import greedy_tokens, prompts_for, start_engine

    # As the engine tests run (poisoned scratch and remapped weights at wake).
    os.environ.setdefault(POISON_GRAPH_SCRATCH_ENV, "1")
    os.environ.setdefault(POISON_REMAPPED_ENV, "1")

    torch.cuda.memory._record_memory_history(
        enabled=args.history,
        context=args.history,  # "state": stacks of live blocks only
        stacks="python",
        max_entries=args.max_entries,
    )
    log(
        f"recording history ({args.history}); starting {args.kind} {args.mode} "
        f"{'small' if args.small else 'vLLM defaults'}, level {args.level}"
    )
    llm = start_engine(args.kind, args.mode)
    worker_pids = llm.collective_rpc(_worker_pid)
    log(f"engine up; worker pids {worker_pids}, this {os.getpid()}, offload {config.is_active()}")
    if worker_pids != [os.getpid()]:
        log("the worker is not in this process: the history does not cover it")
        return 4

    prompts = prompts_for(args.mode)
    before = greedy_tokens(llm, prompts)
    stable = greedy_tokens(llm, prompts) == before
    log(f"generated; same tokens twice before sleep: {stable}")
    awake = describe(torch.cuda.memory_snapshot(include_traces=False), frames=False)

    llm.sleep(level=args.level)
    log("asleep; taking the snapshot")
    snapshot = torch.cuda.memory._snapshot()
    segments = snapshot["segments"]
    asleep = describe(segments, snapshot)
    by_stream = torch_outside_pools_by_stream(segments)
    try:
        the_ledger = ledger(torch.cuda.current_device(), segments)
    except Exception as error:  # the diagnosis must not hang on it
        the_ledger = {"error": f"{type(error).__name__}: {error}"}
    result = {
        "kind": args.kind,
        "mode": args.mode,
        "level": args.level,
        "vllm_defaults": not args.small,
        "offload_active": config.is_active(),
        "history": args.history,
        "trace_entries": sum(len(t) for t in snapshot.get("device_traces", [])),
        "outside_pools_by_stream": by_stream,
        "asleep_outside_pools": asleep,
        "awake_outside_pools": awake,
        "ledger": the_ledger,
    }
    (out / "memory-history.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "memory-history.txt").write_text(text_summary(asleep, awake, by_stream, args.frames))
    if args.pickle:
        with open(out / "asleep.pickle", "wb") as f:
            pickle.dump(snapshot, f)
    log(f"{len(asleep)} segment(s) outside the pools; by stream {by_stream}; written to {out}")
    del snapshot, segments

    if args.level == 1:
        llm.wake_up()
    else:  # as testing.sleep_wake_cycles wakes a level-2 sleep
        llm.wake_up(tags=["weights"])
        llm.collective_rpc("reload_weights")
        llm.wake_up(tags=["kv_cache"])
    after = greedy_tokens(llm, prompts)
    same = after == before
    log(f"woke; tokens after the wake equal to before: {same} (stable before sleep: {stable})")
    result.update(tokens_equal=same, stable_before_sleep=stable)
    (out / "memory-history.json").write_text(json.dumps(result, indent=1, default=str))

    torch.cuda.memory._record_memory_history(enabled=None)
    stop_engine_core(llm)
    # As tests' in-process engines end (test_graph_offload.py): the last
    # reference first, then what the engine's garbage still holds.
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    log("done")
    return 0 if same else 3


def _worker_pid(worker) -> int:
    return os.getpid()


def stop_engine_core(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as error:
        log(f"shutdown: {type(error).__name__}: {error}")


if __name__ == "__main__":
    sys.exit(main())
