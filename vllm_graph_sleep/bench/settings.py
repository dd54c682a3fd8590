"""What one bench run does: the settings the CLI parses, and the fixed prompts."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from vllm_graph_sleep.settings import DEFAULT_MODEL_CACHE

CONFIGS = ("ours", "stock_graphs", "stock_eager")
#: What --configs accepts: the default three, ours with weight backups coded
#: (the default on CUDA, opt-in on ROCm) or copied raw, whatever the default,
#: and ours with every sleep checkpointed by the CUDA driver (deep sleep).
ALL_CONFIGS = (*CONFIGS, "ours_coded", "ours_raw", "ours_deep")
LEVELS = (1, 2)
WAKES = ("full", "staged")

#: Greedy completions of these are compared token by token after every wake.
PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Sleep mode releases memory and wake up restores it, so",
    "In 1999, the old engineer visited the museum near the river and",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n",
)
#: The single-stream decode measurement continues this one.
DECODE_PROMPT = "Once upon a time, in a small village by the sea,"


def positive_seconds(text: str) -> float:
    """An option's seconds (argparse type): above 0 and finite. A time limit of
    0 would set no timer (setitimer), and nan passes no comparison."""
    value = float(text)
    if not 0 < value < math.inf:  # nan fails this too
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text}")
    return value


def made_on_the_cpu(kind: str) -> bool:
    """Whether a model of `kind` is made without a GPU (a large kind draws its
    weights on one: testing.models)."""
    from vllm_graph_sleep.testing.models import LARGE_KINDS

    return kind not in LARGE_KINDS


@dataclasses.dataclass
class BenchSettings:
    model: str | None = None  # a local model directory; None: make one of model_kind
    model_kind: str = "llama"
    cache_dir: Path = Path(DEFAULT_MODEL_CACHE)
    tp: int = 1
    cycles: int = 2
    levels: tuple[int, ...] = LEVELS
    wakes: tuple[str, ...] = WAKES
    configs: tuple[str, ...] = CONFIGS
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 1024
    max_tokens: int = 32
    # 64 tokens, not 128 (issue 35: the run's time). The runs of one measurement
    # scatter with the host's pace from one run to the next (H200 run 17: 415 to
    # 585 tok/s among one server's five), which a shorter run does not change,
    # and the one-token time it subtracts varies by 1-2 ms, 1-2 % of a 64-token
    # run. At 128, stock --enforce-eager's three measurements took 13 s of that run.
    decode_tokens: int = 64
    # Medians over this many runs (with 3, two measurements of the same server
    # differed by 10-20 % on an H200: docs/results/archive/bench-h200-run5.md).
    decode_repeats: int = 5
    start_timeout: float = 900.0
    # Starts to /health (then stopped) before the measured one, so that the
    # measured engine start finds torch.compile's and Triton's caches warm: the
    # start-time comparison (`--warm-starts 2`), off by default because the
    # starts are what a run's time goes to (issue 35). Two, when on, because
    # vLLM 0.26 fills two Triton caches: a start that compiles points
    # TRITON_CACHE_DIR into its torch.compile cache, so the Triton kernels of
    # vLLM's own ops (sampler, input preparation) land there, while a start that
    # loads the compiled model leaves it unset and looks in Triton's default
    # cache. With one warm-up, the configuration run first compiled those
    # kernels in its measured start and the next configuration found them: that
    # was the +17 % start of issue 16 (the bench's Triton compile log, 2026-12-01).
    warm_starts: int = 0
    # After every configuration ran, start each this many more times to /health,
    # in alternating order (bench/start_rounds.py): a start comparison of a few
    # percent needs more than one start per configuration.
    start_rounds: int = 0
    # Measure the floor (bench/floor.py) before the first server starts.
    floor: bool = True
    request_timeout: float = 300.0
    sample_interval: float = 0.1
    serve_args: tuple[str, ...] = ()
    out: Path | None = None

    def steps(self) -> list[tuple[int, int, str]]:
        """(cycle, level, wake) in the order they run: each cycle goes through
        every level with every wake mode."""
        return [
            (cycle, level, wake)
            for cycle in range(self.cycles)
            for level in self.levels
            for wake in self.wakes
        ]

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["cache_dir"] = str(self.cache_dir)
        data["out"] = None if self.out is None else str(self.out)
        data["prompts"] = list(PROMPTS)
        data["decode_prompt"] = DECODE_PROMPT
        return data
