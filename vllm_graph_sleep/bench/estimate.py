"""How long a bench run will take, said before it starts and recorded beside how
long it took (results.json: estimate_s, duration_s).

The figures are typical of the bench's default model on one H200 (the bench
runs in docs/results): the `vllm serve` starts are most of a run, seconds each
of imports, model inspection, compilation, graph capture and kernel warm-up;
a configuration's measurements take seconds, stock --enforce-eager's the
longest (its decode, measured three times, is the slowest).
"""

from __future__ import annotations

from vllm_graph_sleep.bench.settings import BenchSettings

#: One `vllm serve` start to /health; a host's first start pays more (nothing
#: cached yet), a start with warm caches less.
START_S = 60.0
#: Stopping a server, its memory back, the next configuration's idle baseline.
STOP_S = 3.0
#: Making the default model, the first time (it is cached in --cache-dir).
MODEL_S = 20.0
#: The floor's child process (bench/floor.py).
FLOOR_S = 5.0
#: Per configuration: seconds of measurements outside the sleep/wake steps
#: (reference tokens, decode three times), and seconds per step.
MEASURE_S = {"stock_eager": (16.0, 1.4)}
OTHER_MEASURE_S = (4.0, 0.7)


def server_starts(settings: BenchSettings) -> int:
    """Every `vllm serve` start of the run: per configuration the measured one,
    its warm-up starts and its start rounds."""
    return len(settings.configs) * (1 + settings.warm_starts + settings.start_rounds)


def estimate_s(settings: BenchSettings, model_to_make: bool) -> float:
    steps = len(settings.steps())
    measuring = 0.0
    for name in settings.configs:
        fixed, per_step = MEASURE_S.get(name, OTHER_MEASURE_S)
        measuring += fixed + per_step * steps
    return (
        server_starts(settings) * (START_S + STOP_S)
        + measuring
        + (FLOOR_S if settings.floor else 0.0)
        + (MODEL_S if model_to_make else 0.0)
    )


def minutes(seconds: float) -> str:
    """Seconds as a person says them: "45 s", "3 min 20 s"."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    return f"{whole // 60} min {whole % 60:02d} s"


def describe(settings: BenchSettings, model_to_make: bool) -> str:
    """One line: how long the run will take, and where the time goes."""
    starts = server_starts(settings)
    line = (
        f"this run takes about {minutes(estimate_s(settings, model_to_make))} on one H200: "
        f"{len(settings.configs)} configuration(s), {starts} `vllm serve` start(s) of about "
        f"{START_S:.0f} s each (most of the run), {len(settings.steps())} sleep/wake step(s) each"
    )
    if model_to_make:
        line += ", the model made first"
    return line
