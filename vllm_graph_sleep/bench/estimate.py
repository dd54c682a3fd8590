"""How long a bench run will take, said before it starts and recorded beside how
long it took (results.json: estimate_s, duration_s).

The figures are typical of the bench's default model on one fresh H200 (the
bench runs in docs/results): the `vllm serve` starts are most of a run, seconds
each of imports, compilation, graph capture and kernel warm-up; before the
first, the floor, vLLM's model-info warm-up and the model's making run side by
side; a configuration's measurements take seconds, stock --enforce-eager's the
longest (its decode, measured three times, and its token checks are the
slowest).
"""

from __future__ import annotations

from vllm_graph_sleep.bench.server import CONFIG_ARGS
from vllm_graph_sleep.bench.settings import BenchSettings, made_on_the_cpu

#: One `vllm serve` start to /health. The first start of a configuration with
#: CUDA graphs compiles the model (torch.compile, Inductor, Triton) on a host
#: that has not compiled it before; the other starts with graphs load what it
#: compiled (the plugin's flag and the sleep-mode backend it selects are left
#: out of vLLM's cache key: config.hashed_as), and --enforce-eager compiles
#: nothing.
COMPILING_START_S = 63.0
START_S = 55.0
EAGER_START_S = 47.0
#: Stopping a server, its memory back, the next configuration's idle baseline.
STOP_S = 3.0
#: Before the first start, side by side: the floor's child (bench/floor.py),
#: vLLM's model-info warm-up (bench/model_info.py) and making the default model
#: the first time (it is cached in --cache-dir). A model drawn on the GPU (a
#: large kind) is made after the floor.
FLOOR_S = 5.0
MODEL_INFO_S = 20.0
MODEL_S = 20.0
#: Per configuration: seconds of measurements outside the sleep/wake steps
#: (reference tokens, decode three times), and seconds per step.
MEASURE_S = {"stock_eager": (8.0, 1.3)}
OTHER_MEASURE_S = (2.0, 0.7)


def server_starts(settings: BenchSettings) -> int:
    """Every `vllm serve` start of the run: per configuration the measured one,
    its warm-up starts and its start rounds."""
    return len(settings.configs) * (1 + settings.warm_starts + settings.start_rounds)


def _eager(name: str, settings: BenchSettings) -> bool:
    return "--enforce-eager" in (*CONFIG_ARGS.get(name, ()), *settings.serve_args)


def starts_s(settings: BenchSettings) -> float:
    """The seconds of every start and stop of the run (server_starts)."""
    total, compiled = 0.0, False
    per_config = 1 + settings.warm_starts + settings.start_rounds
    for name in settings.configs:
        if _eager(name, settings):
            first = again = EAGER_START_S
        else:
            first, again, compiled = (START_S if compiled else COMPILING_START_S), START_S, True
        total += first + again * (per_config - 1) + STOP_S * per_config
    return total


def preparation_s(settings: BenchSettings, model_to_make: bool) -> float:
    """The seconds before the first start."""
    floor = FLOOR_S if settings.floor else 0.0
    model = MODEL_S if model_to_make else 0.0
    if model_to_make and not made_on_the_cpu(settings.model_kind):
        return max(MODEL_INFO_S, floor + model)
    return max(floor, MODEL_INFO_S, model)


def estimate_s(settings: BenchSettings, model_to_make: bool) -> float:
    steps = len(settings.steps())
    measuring = 0.0
    for name in settings.configs:
        fixed, per_step = MEASURE_S.get(name, OTHER_MEASURE_S)
        measuring += fixed + per_step * steps
    return preparation_s(settings, model_to_make) + starts_s(settings) + measuring


def minutes(seconds: float) -> str:
    """Seconds as a person says them: "45 s", "3 min 20 s"."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    return f"{whole // 60} min {whole % 60:02d} s"


def describe(settings: BenchSettings, model_to_make: bool) -> str:
    """One line: how long the run will take, and where the time goes."""
    starts = server_starts(settings)
    each = starts_s(settings) / starts - STOP_S
    line = (
        f"this run takes about {minutes(estimate_s(settings, model_to_make))} on one H200: "
        f"{len(settings.configs)} configuration(s), {starts} `vllm serve` start(s) of about "
        f"{each:.0f} s each (most of the run), {len(settings.steps())} sleep/wake step(s) each"
    )
    if model_to_make:
        line += ", the model made first"
    return line
