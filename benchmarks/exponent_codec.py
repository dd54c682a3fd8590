"""What the exponent codec would give a level-1 wake, measured on one GPU.

An 8B-class Llama's level-1 wake is its weight copy over the PCIe link (H200
run 12: copies 254.9 ms of a 274 ms wake, stock with graphs 322 ms; issue 15
asks for 0.6x, 193 ms). This makes `--gib` GiB of bf16 weights the way the
bench's models are made (N(0, 0.02), on the GPU), and measures, each
`--repeats` times:

- `plain`: the wake today: one copy of the raw bytes from page-locked host
  memory into device memory;
- `pipelined`: the codec's wake: the encoded pieces (`--piece-mib` MiB each,
  in page-locked host memory) copied on a stream of their own while the
  previous piece decodes (`exponent_codec.restore`);
- `decode`: decoding alone, from device memory;
- `encode` and `backup_encoded`: what a sleep would add (encoding on the device)
  and copy (the encoded bytes, device to host), against `backup_plain`.

Every restore (plain, decode, pipelined) is checked bit for bit. The
projection applies the pipelined/plain ratio to run 12's 8B copy time:
19 ms outside the copy + 254.9 ms x ratio, against stock's 321.7 ms.

    python benchmarks/exponent_codec.py --gib 4 --piece-mib 64 8 --repeats 3 --out codec.json

Prints `RESULT {json}` per piece size (a small piece has fewer lanes to decode
in parallel: weight allocations come in many sizes). Exit status: 0 when every
restore was bit-exact, 1 when one was not, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from vllm_graph_sleep import exponent_codec
from vllm_graph_sleep.units import GiB, MiB

# H200 run 12, 8B-class Llama (docs/results/archive/bench-h200-run12.md).
RUN12_OUTSIDE_COPY_MS = 274.0 - 254.9
RUN12_COPY_MS = 254.9
RUN12_STOCK_WAKE_MS = 321.7


def timed(work) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start)


def pinned_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=True)


def measure(data: torch.Tensor, piece_bytes: int, repeats: int) -> dict:
    """The runs of the module docstring for `data` coded in pieces of `piece_bytes`."""
    device = data.device
    total = data.numel()
    pieces = list(data.split(piece_bytes))
    encoded: list[exponent_codec.Encoded] = []
    encode_ms = timed(lambda: encoded.extend(exponent_codec.encode(p) for p in pieces))
    if any(e is None for e in encoded):
        raise RuntimeError("a piece did not shrink")
    lookups = {e.piece.table: e.piece.table.decoder_tensor(device) for e in encoded}
    raw_host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    hosts = [
        exponent_codec.Encoded(
            e.piece, pinned_like(e.stream), pinned_like(e.starts), pinned_like(e.raw)
        )
        for e in encoded
    ]

    def back_up_encoded() -> None:
        for e, h in zip(encoded, hosts, strict=True):
            h.stream.copy_(e.stream, non_blocking=True)
            h.starts.copy_(e.starts, non_blocking=True)
            h.raw.copy_(e.raw, non_blocking=True)

    def decode() -> None:
        for e, o in zip(encoded, destinations, strict=True):
            exponent_codec.decode_into(e, o, lookups[e.piece.table])

    out = torch.empty_like(data)
    destinations = list(out.split(piece_bytes))
    pairs = list(zip(hosts, destinations, strict=True))
    runs: dict[str, list[float]] = {
        name: [] for name in ("backup_plain", "backup_encoded", "plain", "decode", "pipelined")
    }
    exact = True
    for _ in range(repeats):
        runs["backup_plain"].append(timed(lambda: raw_host.copy_(data, non_blocking=True)))
        runs["backup_encoded"].append(timed(back_up_encoded))
        for name, work in (
            ("plain", lambda: out.copy_(raw_host, non_blocking=True)),
            ("decode", decode),
            ("pipelined", lambda: exponent_codec.restore(pairs, lookups)),
        ):
            out.fill_(0xA5)
            runs[name].append(timed(work))
            exact &= torch.equal(out, data)
    median = {name: statistics.median(times) for name, times in runs.items()}
    projected = RUN12_OUTSIDE_COPY_MS + RUN12_COPY_MS * median["pipelined"] / median["plain"]
    return {
        "piece_mib": piece_bytes / MiB,
        "encoded_share": sum(e.piece.encoded_bytes for e in encoded) / total,
        "encode_ms": encode_ms,
        "runs_ms": runs,
        "median_ms": median,
        "plain_gb_s": total / median["plain"] / 1e6,
        "pipelined_over_plain": median["pipelined"] / median["plain"],
        "decode_gb_s": total / median["decode"] / 1e6,
        "projected_8b_wake_ms": projected,
        "projected_8b_wake_ratio": projected / RUN12_STOCK_WAKE_MS,
        "bit_exact": exact,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=int, default=4)
    parser.add_argument("--piece-mib", type=int, nargs="+", default=[64, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    weights = torch.randn(args.gib * GiB // 2, generator=generator, device=device) * 0.02
    data = weights.to(torch.bfloat16).view(torch.uint8)
    del weights
    # Compile the kernels before anything is timed.
    warm = exponent_codec.encode(data[: 4 * MiB])
    exponent_codec.decode_into(warm, torch.empty(4 * MiB, dtype=torch.uint8, device=device))
    results = []
    for piece_mib in args.piece_mib:
        result = measure(data, piece_mib * MiB, args.repeats)
        print("RESULT " + json.dumps(result), flush=True)
        results.append(result)
    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gib": args.gib,
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return 0 if all(result["bit_exact"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
