"""The `vllm-graph-sleep` command: `bench` (the main job) and `doctor`.

    vllm-graph-sleep bench [--model DIR] [--tp N] [--cycles N] [--levels 1,2] ...
    vllm-graph-sleep bench --report bench-results/STAMP/results.json [more.json ...]
    vllm-graph-sleep doctor [--platform detected|cuda|rocm] [vllm serve args...]

Expected failures (no GPU, a server that does not start or dies, bad
arguments) end with one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_graph_sleep.bench.settings import (
    ALL_CONFIGS,
    CONFIGS,
    LEVELS,
    WAKES,
    BenchSettings,
    positive_seconds,
)

PROG = "vllm-graph-sleep"
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_EXACT = 3
EXIT_INTERRUPTED = 130


def _list_of(choices: Sequence[str], convert=str):
    """An argparse type for "a,b" (and, with nargs, "a b"), each one of `choices`."""

    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        for item in items:
            if item not in choices:
                raise argparse.ArgumentTypeError(
                    f"{item!r} is not one of {', '.join(map(str, choices))}"
                )
        return [convert(item) for item in items]

    return parse


def _flatten(groups: list[list] | None, default: Sequence) -> tuple:
    if not groups:
        return tuple(default)
    flat = [item for group in groups for item in group]
    return tuple(dict.fromkeys(flat))  # keep order, drop repeats


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _decode_tokens(text: str) -> int:
    # Decode speed is (tokens - 1) / time after the first token: one token has none.
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, not {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _shell_words(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as error:  # an unbalanced quote
        raise argparse.ArgumentTypeError(f"{error} in {text!r}") from None


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {value}")
    return value


def bench_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from vllm_graph_sleep.testing.models import ALL_KINDS

    parser.add_argument(
        "--model",
        metavar="DIR",
        help="a local model directory (default: make a random-weight --model-kind model once, "
        "in --cache-dir, and reuse it)",
    )
    parser.add_argument("--model-kind", choices=ALL_KINDS, default="llama")
    parser.add_argument("--cache-dir", type=Path, default=BenchSettings.cache_dir)
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size")
    parser.add_argument(
        "--cycles",
        type=_positive_int,
        default=BenchSettings.cycles,
        help="cycles; each goes through every level with every wake mode (default %(default)s)",
    )
    parser.add_argument(
        "--levels",
        nargs="+",
        type=_list_of([str(lv) for lv in LEVELS], int),
        metavar="L",
        help="sleep levels, e.g. 1,2 (default) or 1",
    )
    parser.add_argument(
        "--wakes",
        nargs="+",
        type=_list_of(WAKES),
        metavar="W",
        help="wake modes: full (one wake_up), staged (weights, then kv_cache); default both",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        type=_list_of(ALL_CONFIGS),
        metavar="C",
        help="among ours, stock_graphs, stock_eager (default all three, in this order), "
        "ours_coded and ours_raw (ours with VLLM_GRAPH_SLEEP_COMPRESS_BACKUPS=1 or 0: weight "
        "backups coded, the default on CUDA, or copied as they are), ours_deep (ours with "
        "every sleep checkpointed by the CUDA driver, /sleep?checkpoint=1)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=_fraction, default=BenchSettings.gpu_memory_utilization
    )
    parser.add_argument("--max-model-len", type=_positive_int, default=BenchSettings.max_model_len)
    parser.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=BenchSettings.max_tokens,
        help="greedy tokens per prompt compared after every wake (default %(default)s)",
    )
    parser.add_argument(
        "--decode-tokens",
        type=_decode_tokens,
        default=BenchSettings.decode_tokens,
        help="tokens of the single-stream decode measurement (default %(default)s)",
    )
    parser.add_argument(
        "--start-timeout",
        type=positive_seconds,
        default=BenchSettings.start_timeout,
        help="seconds a server may take to answer /health (default %(default)s)",
    )
    parser.add_argument(
        "--warm-starts",
        type=_non_negative_int,
        default=BenchSettings.warm_starts,
        metavar="N",
        help="the start-time comparison: start each configuration's server N times to "
        "/health and stop it before the measured start, so engine start is measured with "
        "warm compile caches (2 warms both of vLLM's Triton caches; each start adds about a "
        "minute); 0 measures each configuration's first start (default %(default)s)",
    )
    parser.add_argument(
        "--start-rounds",
        type=_non_negative_int,
        default=BenchSettings.start_rounds,
        metavar="N",
        help="after every configuration ran, start each configuration's server N more times "
        "to /health and stop it, the order rotated each round, and report the median start "
        "and engine core init of each (default %(default)s)",
    )
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=BenchSettings.floor,
        help="before the servers, measure the floor: NVML memory held by a bare CUDA context "
        "with a cuBLAS handle and its stack reservation released (default: on)",
    )
    parser.add_argument(
        "--serve-args",
        type=_shell_words,
        default="",
        metavar="ARGS",
        help="more `vllm serve` arguments for every configuration, one string",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default bench-results/<timestamp>)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="no run: print the table and redraw the plot of a recorded results.json; "
        "several files (runs of different --configs) are merged into merged.json",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="vLLM sleep mode that also frees CUDA/HIP graph memory: bench and doctor.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{bench,doctor}")
    bench_parser(
        commands.add_parser(
            "bench",
            help="run stock vs ours through sleep/wake cycles on this GPU; table, JSON, PNG",
            description="Starts a real `vllm serve` per configuration and measures sleep "
            "and wake: memory (NVML and per tag), latency, engine start, decode speed, "
            "bit-exact tokens after every wake. Needs an NVIDIA GPU; says before it starts "
            "how long it will take (a few minutes with the defaults). Writes results.json, "
            "table.txt and, with the bench extra (matplotlib), memory.png, asleep.png and "
            "wake.png.",
        )
    )
    commands.add_parser(
        "doctor",
        help="what `vllm serve ARGS` would do about graph memory (no GPU needed)",
        add_help=False,
    )
    return parser


def settings_from(args: argparse.Namespace) -> BenchSettings:
    return BenchSettings(
        model=args.model,
        model_kind=args.model_kind,
        cache_dir=args.cache_dir,
        tp=args.tp,
        cycles=args.cycles,
        levels=tuple(sorted(_flatten(args.levels, LEVELS))),
        wakes=_flatten(args.wakes, WAKES),
        configs=_flatten(args.configs, CONFIGS),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_tokens=args.max_tokens,
        decode_tokens=args.decode_tokens,
        start_timeout=args.start_timeout,
        warm_starts=args.warm_starts,
        start_rounds=args.start_rounds,
        floor=args.floor,
        serve_args=args.serve_args,
        out=args.out,
    )


def _fail(text: str, code: int = EXIT_FAILED) -> int:
    print(f"{PROG} bench: {text}", file=sys.stderr, flush=True)
    return code


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def bench_main(args: argparse.Namespace) -> int:
    from vllm_graph_sleep.bench.runner import BenchError, rerender, write_outputs

    if args.report is not None:
        try:
            table, pngs, missing = rerender(args.report, args.out)
        except (OSError, ValueError) as error:
            names = " ".join(map(str, args.report))
            return _fail(f"--report {names}: {error}", EXIT_USAGE)
        print(table)
        print(_plots_line(pngs, missing))
        return 0

    from vllm_graph_sleep.bench.gpu import NoGpuError, NvmlMemory
    from vllm_graph_sleep.bench.runner import run
    from vllm_graph_sleep.bench.server import ServerError

    settings = settings_from(args)
    try:
        memory = NvmlMemory(settings.tp)
    except NoGpuError as error:
        return _fail(f"{error}; the bench needs an NVIDIA GPU (doctor runs anywhere)")
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        results = run(settings, memory)
    except (BenchError, ServerError) as error:
        return _fail(str(error))
    except KeyboardInterrupt:
        return _fail("interrupted (servers stopped)", EXIT_INTERRUPTED)
    finally:
        signal.signal(signal.SIGTERM, previous)
    table, json_path, pngs, missing = write_outputs(results, settings.out)
    print(table)
    print(
        f"results: {json_path}\n{_plots_line(pngs, missing)}\nlogs:    {settings.out}/*.server.log"
    )
    return bench_verdict(results)


def _plots_line(pngs: list[Path], missing: str | None) -> str:
    return f"plots:   {missing}" if missing else "plots:   " + ", ".join(map(str, pngs))


def bench_verdict(results: dict) -> int:
    """The exit status of a finished run: EXIT_FAILED when a server's
    /is_sleeping contradicted a sleep or a wake; EXIT_NOT_EXACT when tokens
    after a wake differ from the reference, saying which of those servers also
    differed from themselves before any sleep, where a difference neither shows
    nor rules out corruption."""
    from vllm_graph_sleep.bench.report import not_exact, not_repeatable, not_told_asleep

    contradicted = not_told_asleep(results)
    if contradicted:
        return _fail(
            "/is_sleeping did not say asleep after every sleep and awake after every wake in: "
            f"{', '.join(contradicted)} (results.json has each cycle's answers)"
        )
    differ = not_exact(results)
    unrepeatable = not_repeatable(results)
    # Every wake of these gave the reference's tokens exactly: no sign of
    # corruption, so they pass; but a later run of the same server may differ
    # after a wake for no fault of sleep, and the reader should know that.
    matched = [name for name in unrepeatable if name not in differ]
    if matched:
        print(
            f"{PROG} bench: warning: {', '.join(matched)} gave different tokens for the same "
            "prompts twice before any sleep (not deterministic on this model) but the same "
            "after every wake; on such a server a difference after wake would not show "
            "corruption by sleep",
            file=sys.stderr,
            flush=True,
        )
    if not differ:
        return 0
    message = f"tokens after wake differ from before the first sleep in: {', '.join(differ)}"
    also = [name for name in differ if name in unrepeatable]
    if also:
        message += (
            f"; of these, {', '.join(also)} also gave different tokens for the same prompts "
            "twice before any sleep (not deterministic on this model), so "
            f"{'its' if len(also) == 1 else 'their'} differences after wake neither show nor "
            "rule out corruption by sleep"
        )
    return _fail(message, EXIT_NOT_EXACT)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "doctor":
        from vllm_graph_sleep.doctor import main as doctor_main

        return doctor_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    return bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
