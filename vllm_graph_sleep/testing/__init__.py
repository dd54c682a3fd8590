"""Engine helpers shared by the GPU tests (tests/) and benchmarks/: local models
(testing.models), engines, probes, sleep/wake cycles. Part of the package so that
both import it from here and neither imports the other; off the serving path: only
tests, benchmarks and `vllm-graph-sleep bench` (which makes its model with
testing.models) import it (tests/unit/test_runtime_imports.py)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

from vllm_graph_sleep import settings


# The test suite's switches are read at their first use, not at import:
# `vllm-graph-sleep bench` imports testing.models and reads none of them, so a
# value it would refuse must not stop the bench.
@functools.cache
def cycles() -> int:
    """The sleep/wake cycles each engine test runs (settings.TEST_CYCLES)."""
    return settings.TEST_CYCLES.read()


@functools.cache
def vllm_defaults() -> bool:
    """Whether engines keep vLLM's defaults (settings.TEST_VLLM_DEFAULTS) where
    these tests otherwise shrink them for speed: gpu_memory_utilization (0.92 instead
    of 0.25), capture sizes (up to 512 instead of 1/2/4/8), max_model_len and
    max_num_seqs. Held-out suites, vLLM's own included, run with the defaults."""
    return settings.TEST_VLLM_DEFAULTS.read()


PROMPTS = [
    "The quick brown fox",
    "In a distant galaxy, the engineers",
    "Sleep mode lets a server",
    "Numbers: one two three",
]
#: FULL mode's prompts: each longer than the largest capture size below (8
#: tokens), so no prefill is replayed through a FULL graph, and shorter than one
#: KV block (16), so the prefix cache cannot shrink a repeated prefill to fit one.
#: vLLM 0.26's model runner V2 captures every FULL graph of at most max_num_seqs
#: tokens with one token per request (max_query_len 1 in the attention launch)
#: yet replays it for any batch that fits, prefills included: stock vLLM then
#: gives wrong tokens, with or without sleep (docs/results/engine-h200.md).
FULL_MODE_PROMPTS = [
    "The quick brown fox jumps over the lazy dog today",
    "In a distant galaxy, the engineers",
    "Numbers: one two three four five six seven",
    "The old engineer visited the museum near the river",
]
LARGEST_CAPTURE_SIZE = 8
#: The largest capture size vLLM 0.26 picks by default on an H200.
DEFAULT_LARGEST_CAPTURE_SIZE = 512
#: FULL mode with vLLM's defaults: each prompt prefills more tokens than the
#: largest default graph, for the reason given above. The prefix cache is off
#: for these engines (start_engine) and the prompts go one per step
#: (greedy_tokens): a cached prefix or a chunked prefill would leave a short
#: remainder that a FULL graph replays.
FULL_MODE_LONG_PROMPTS = [" ".join([prompt] * 80) for prompt in FULL_MODE_PROMPTS]
MODES = {
    "full": {"cudagraph_mode": "FULL"},
    "piecewise": {"cudagraph_mode": "PIECEWISE"},
    "full_and_piecewise": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
    "full_decode_only": {"cudagraph_mode": "FULL_DECODE_ONLY"},
    "breakable": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
}


def model_dir(kind: str) -> str:
    from vllm_graph_sleep.testing.models import make_model

    cache = Path(settings.MODEL_CACHE.read())
    return str(make_model(kind, cache.expanduser() / kind))


def set_engine_env() -> None:
    """The environment engines of these tests (and their workers) start with;
    call it before anything starts worker processes (Ray included)."""
    from vllm_graph_sleep.allocator import ZERO_ON_WAKE_ENV
    from vllm_graph_sleep.bench.server import keep_multicast_off

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc probes
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # skips a ~96 s JIT build
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # CUDA is up in pytest
    # Dropped memory comes back zeroed: state that wrongly lives in a dropped tag
    # breaks the first cycle instead of surviving by luck in reused pages.
    os.environ.setdefault(ZERO_ON_WAKE_ENV, "1")

    keep_multicast_off(os.environ)


def start_engine(
    kind: str,
    mode: str,
    offload: bool = True,
    pass_config: dict | None = None,
    compilation: dict | None = None,
    **overrides,
):
    """vllm.LLM on a local `kind` model in graph `mode`; `compilation` adds
    compilation_config entries, `overrides` other LLM arguments."""
    set_engine_env()
    if mode == "breakable":
        os.environ["VLLM_USE_BREAKABLE_CUDAGRAPH"] = "1"
    from vllm import LLM

    kwargs = dict(
        model=model_dir(kind),
        enable_sleep_mode=True,
        seed=0,
        compilation_config={
            **MODES[mode],
            **({"pass_config": pass_config} if pass_config else {}),
            **(compilation or {}),
        },
    )
    if vllm_defaults():
        if mode == "full":
            kwargs["enable_prefix_caching"] = False
    else:
        kwargs.update(gpu_memory_utilization=0.25, max_model_len=512, max_num_seqs=8)
        kwargs["compilation_config"].setdefault(
            "cudagraph_capture_sizes", [1, 2, 4, LARGEST_CAPTURE_SIZE]
        )
    if offload:
        kwargs["additional_config"] = {"sleep_mode_offload_cudagraph": True}
    kwargs.update(overrides)
    return LLM(**kwargs)


def prompts_for(mode: str) -> list[str]:
    if mode != "full":
        return PROMPTS
    return FULL_MODE_LONG_PROMPTS if vllm_defaults() else FULL_MODE_PROMPTS


def greedy_tokens(llm, prompts: list[str] = PROMPTS) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24)
    batches = [[prompt] for prompt in prompts] if prompts == FULL_MODE_LONG_PROMPTS else [prompts]
    outputs = [output for batch in batches for output in llm.generate(batch, params)]
    return [list(output.outputs[0].token_ids) for output in outputs]


def reports(llm) -> list[dict]:
    """One memory report per worker (rank order)."""
    from vllm_graph_sleep.probe import memory_report

    return llm.collective_rpc(memory_report)


def report(llm) -> dict:
    return reports(llm)[0]


def mapped(report_: dict) -> dict[str, int]:
    return {tag: usage["mapped"] for tag, usage in report_["tags"].items()}


#: Greedy tokens of one generation (a test's own prompts and inputs).
Generate = Callable[[], list[list[int]]]


def repeat_without_sleep(
    llm,
    reference: list[list[int]],
    runs: int,
    prompts: list[str] = PROMPTS,
    generate: Generate | None = None,
) -> None:
    """Greedy decoding must already be stable without any sleep (later runs hit
    the prefix cache): otherwise a difference after a wake proves nothing.
    `generate` replaces greedy decoding of `prompts` (e.g. image prompts)."""
    generate = generate or (lambda: greedy_tokens(llm, prompts))
    for run in range(runs):
        assert_same_tokens(generate(), reference, f"run {run + 2} before any sleep")


def sleep_wake_cycles(
    llm,
    reference: list[list[int]],
    cycles: int,
    graph_offload: bool = True,
    prompts: list[str] = PROMPTS,
    generate: Generate | None = None,
) -> None:
    """Mixes level 1 + full wake, level 1 + staged wake, level 2 + reload."""
    generate = generate or (lambda: greedy_tokens(llm, prompts))
    for cycle in range(cycles):
        kind = cycle % 3
        llm.sleep(level=1 if kind < 2 else 2)
        for asleep in reports(llm):
            assert sum(mapped(asleep).values()) == 0, (cycle, asleep["tags"])
            # Our sleep drops vLLM's sampler scratch (sampler_scratch.py); stock keeps it.
            scratch = asleep["ledger"]["vllm_sampler_scratch"]
            assert not graph_offload or scratch == 0, (cycle, scratch)
        if kind == 0:
            llm.wake_up()
        elif kind == 1:
            llm.wake_up(tags=["weights"])
            for rank_report in reports(llm):
                after_weights = mapped(rank_report)
                assert after_weights["kv_cache"] == 0
                assert not graph_offload or after_weights["cudagraph"] > 0
            llm.wake_up(tags=["kv_cache"])
        else:
            llm.wake_up(tags=["weights"])
            llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
        assert_same_tokens(generate(), reference, f"cycle {cycle} (kind {kind})")


def assert_same_tokens(got: list[list[int]], reference: list[list[int]], when: str) -> None:
    """Names the first prompt and position that differ, with both continuations."""
    from vllm_graph_sleep.bench.scenario import first_difference

    for prompt, (new, old) in enumerate(zip(got, reference, strict=True)):
        if new != old:
            at = first_difference(new, old)
            raise AssertionError(
                f"{when}: prompt {prompt} differs from token {at} on: "
                f"got {new[at : at + 8]}, reference {old[at : at + 8]}"
            )
