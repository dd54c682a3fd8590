"""One configuration from start to stop: the measurements of the bench.

Order: baseline memory (before the server), warm-up starts (the same server
started to /health and stopped, --warm-starts times, so that the measured start
finds its compile caches warm), start and /health (engine start time), a
warm-up completion of all prompts in one request, reference tokens and the same
completion once more (one request per prompt, each set after a prefix cache
reset: whether the server gives the same tokens twice before any sleep), decode
speed, awake memory and probe report, then for every (cycle, level, wake mode):
sleep, /is_sleeping, asleep memory and report, wake (full, or staged: weights,
then kv_cache; level 2 reloads the weights after the weights are back),
/is_sleeping, completions (one request per prompt) compared token by token with
the reference; then decode speed again (it is measured twice before the first
sleep, so the change after the wakes can be read against how far two
measurements of the same server differ). The server is stopped whatever
happens, and the memory it held is waited for before returning.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from vllm_graph_sleep.bench.client import Client, Completion
from vllm_graph_sleep.bench.gpu import MemorySampler, MemorySource, settle, wait_released
from vllm_graph_sleep.bench.server import CHECKPOINTED, Server, ServerError
from vllm_graph_sleep.bench.settings import DECODE_PROMPT, PROMPTS, BenchSettings
from vllm_graph_sleep.units import MiB

Progress = Callable[[str], None]


def _mib(values: list[int]) -> str:
    return "/".join(f"{v / MiB:.0f}" for v in values) + " MiB"


def measure_decode(client: Client, settings: BenchSettings) -> dict[str, Any]:
    """Single-stream decode: time for `decode_tokens` tokens minus time for one
    token (prefill and overhead), medians over `decode_repeats` runs."""
    one, full = [], []
    tokens = settings.decode_tokens
    for _ in range(settings.decode_repeats):
        one.append(client.complete([DECODE_PROMPT], 1).seconds)
        full.append(client.complete([DECODE_PROMPT], tokens).seconds)
    decode_s = statistics.median(full) - statistics.median(one)
    return {
        "tokens": tokens,
        "one_token_s": one,
        "all_tokens_s": full,
        "tokens_per_s": (tokens - 1) / decode_s if decode_s > 0 else None,
    }


def first_difference(want: list[int], got: list[int]) -> int:
    """Index of the first token where two continuations differ (the shorter
    one's length when one is a prefix of the other)."""
    return next(
        (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
        min(len(want), len(got)),
    )


def _compare(reference: Completion, now: Completion) -> dict[str, Any]:
    exact = now.token_ids == reference.token_ids
    result: dict[str, Any] = {"bit_exact": exact}
    if not exact:
        for index, (want, got) in enumerate(zip(reference.token_ids, now.token_ids, strict=False)):
            if want != got:
                first = first_difference(want, got)
                result["mismatch"] = {"prompt": index, "first_token": first, "got": got[:64]}
                break
    return result


#: How often, and how far apart, the bench asks vLLM to empty its prefix cache.
PREFIX_CACHE_RESET_ATTEMPTS = 5
PREFIX_CACHE_RESET_RETRY_S = 0.2


def _yes_or_where(comparison: dict[str, Any]) -> str:
    """A comparison of `_compare` in words: "yes", or "NO" and where it differs."""
    if comparison["bit_exact"]:
        return "yes"
    mismatch = comparison.get("mismatch")
    return (
        f"NO (prompt {mismatch['prompt']}, token {mismatch['first_token']})" if mismatch else "NO"
    )


class Scenario:
    def __init__(
        self,
        name: str,
        server: Server,
        client: Client,
        memory: MemorySource,
        settings: BenchSettings,
        progress: Progress,
    ):
        self.name = name
        self.server = server
        self.client = client
        self.memory = memory
        self.settings = settings
        self.progress = progress
        self.origin = 0.0
        self.events: list[dict[str, Any]] = []
        self.record: dict[str, Any] = {"config": name, "log": str(server.log_path)}

    def _event(self, kind: str, **details: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.origin, 3), "kind": kind, **details})

    def _say(self, text: str) -> None:
        self.progress(f"[{self.name}] {text}")

    def _waiting(self, what: str) -> Callable[[float, str], None]:
        """The progress of a start: seconds so far and what vLLM's log says it does."""
        return lambda seconds, phase: self._say(
            f"waiting for {what}: {seconds:.0f} s (vLLM: {phase})"
        )

    def _report(self) -> list[dict[str, Any]] | None:
        try:
            return self.client.memory_report()
        except ServerError as error:
            if self.server.exit_code() is not None:
                raise
            self._say(f"probe report unavailable: {error}")
            return None

    def run(self) -> dict[str, Any]:
        record = self.record
        record["serve_command"] = self.server.command
        record["baseline_used_bytes"] = baseline = settle(self.memory)
        record["warm_up_start_s"] = []  # each kept as it ends: a failing one keeps the rest
        for number in range(1, self.settings.warm_starts + 1):
            record["warm_up_start_s"].append(self._warm_start(number, baseline))
        self.origin = time.monotonic()  # samples and events count from the measured start
        record["log"] = str(self.server.log_path)
        sampler = MemorySampler(self.memory, self.origin, self.settings.sample_interval)
        try:
            with sampler:
                self._say(f"starting vllm serve ({self.server.where()})")
                self.server.start(self.client.base_url)
                record["start_s"] = self.server.wait_healthy(
                    self.settings.start_timeout, self._waiting("/health")
                )
                self._event("ready")
                record["ready_t"] = self.events[-1]["t"]
                self._say(f"healthy after {record['start_s']:.1f} s")
                record["engine_init"] = self.server.engine_init()
                self._measure()
        finally:
            code = self.server.stop()
            record["server_exit_code"] = code
            # Read once the server has stopped: every line it logged is in the file.
            record["sleeps_in_engine_s"] = self.server.sleeps_in_engine()
            record["sleeps_in_allocator_s"] = self.server.sleeps_in_allocator()
            record["backup_ahead_s"] = self.server.backup_ahead_s()
            record["samples"] = sampler.as_dict()
            record["events"] = self.events
            record["after_stop_used_bytes"] = wait_released(
                self.memory, baseline, slack=256 * MiB, timeout=30
            )
        return record

    def _warm_start(self, number: int, baseline: list[int]) -> float:
        """Starts the same server to /health and stops it (it fills the compile
        caches the measured start then finds warm); returns its start time."""
        measured = self.server
        log = measured.log_path.with_name(f"{self.name}.warm-start-{number}.server.log")
        self.record["log"] = str(log)  # the log to read if this start fails
        server = Server(self.name, measured.command, measured.env, log)
        self._say(f"warm-up start {number} of {self.settings.warm_starts} (server log: {log})")
        try:
            seconds = server.start_to_health(
                self.client.base_url,
                self.settings.start_timeout,
                self._waiting(f"/health (warm-up start {number})"),
            )
        finally:
            self.record["server_exit_code"] = server.exit_code()
            wait_released(self.memory, baseline, slack=256 * MiB, timeout=30)
        self._say(f"warm-up start healthy after {seconds:.1f} s")
        return seconds

    def _measure(self) -> None:
        client, settings, record = self.client, self.settings, self.record
        record["model_id"] = client.served_model()
        client.complete(PROMPTS, settings.max_tokens)  # warm-up, not measured
        # vLLM empties its prefix cache at every sleep, so every completion after a
        # wake runs without it: the reference and its repeat do the same.
        resets = record["prefix_cache_reset"] = {"before_reference": self._reset_prefix_cache()}
        reference = client.complete_one_at_a_time(PROMPTS, settings.max_tokens)
        record["reference"] = {"token_ids": reference.token_ids, "texts": reference.texts}
        # The same prompts again before any sleep: a server that differs from
        # itself here cannot show, by differing after a wake, that sleep broke it.
        resets["before_repeat"] = self._reset_prefix_cache()
        repeat = record["reference_repeat"] = _compare(
            reference, client.complete_one_at_a_time(PROMPTS, settings.max_tokens)
        )
        self._say(f"reference tokens repeat before any sleep: {_yes_or_where(repeat)}")
        record["decode_before"] = measure_decode(client, settings)
        # The same measurement again before any sleep: how far two measurements
        # of one server differ, against which the change after the wakes is read.
        record["decode_before_again"] = measure_decode(client, settings)
        self._say(
            f"decode {record['decode_before']['tokens_per_s'] or 0:.0f} tok/s (1 stream), "
            f"again {record['decode_before_again']['tokens_per_s'] or 0:.0f} tok/s"
        )
        record["awake_used_bytes"] = settle(self.memory)
        record["awake_report"] = self._report()
        self._say(f"awake: {_mib(record['awake_used_bytes'])}")
        steps = record["steps"] = []
        plan = settings.steps()
        for number, (cycle, level, wake) in enumerate(plan, start=1):
            step = self._step(cycle, level, wake, reference)
            steps.append(step)
            self._say(
                f"{number}/{len(plan)} level {level}, {wake} wake: sleep {step['sleep_s']:.2f} s, "
                f"asleep {_mib(step['asleep_used_bytes'])}, wake {step['wake_s']:.2f} s, "
                + ("bit-exact" if step["bit_exact"] else "TOKENS DIFFER")
            )
        record["decode_after"] = measure_decode(client, settings)
        self._say(
            f"decode after the last wake {record['decode_after']['tokens_per_s'] or 0:.0f} tok/s"
        )
        record["final_used_bytes"] = settle(self.memory)

    def _reset_prefix_cache(self) -> bool:
        # vLLM refuses while blocks are still held, e.g. by a request it is still
        # finishing after answering it; its route asks callers to retry.
        for attempt in range(PREFIX_CACHE_RESET_ATTEMPTS):
            if self.client.reset_prefix_cache():
                return True
            if attempt + 1 < PREFIX_CACHE_RESET_ATTEMPTS:
                time.sleep(PREFIX_CACHE_RESET_RETRY_S)
        self._say(
            f"prefix cache not reset after {PREFIX_CACHE_RESET_ATTEMPTS} attempts (vLLM still "
            "held blocks): the next completion may use it"
        )
        return False

    def _step(self, cycle: int, level: int, wake: str, reference: Completion) -> dict[str, Any]:
        client = self.client
        step: dict[str, Any] = {"cycle": cycle, "level": level, "wake": wake}
        # What the sleep frees is measured from here: after the wake the last
        # step's completions grew torch's cache and the sampler scratch again.
        step["before_sleep_used_bytes"] = settle(self.memory)
        self._event("sleep", level=level)
        deep = self.name in CHECKPOINTED
        step["sleep_s"] = client.sleep(level, checkpoint=deep)
        slept_at = time.monotonic()
        step["is_sleeping_asleep"] = client.is_sleeping()
        step["asleep_used_bytes"] = settle(self.memory)
        # A checkpointed engine runs nothing until its wake, the probe included.
        step["asleep_report"] = None if deep else self._report()
        # The first driver call some time after a sleep pays work the driver deferred,
        # more the later it comes (H200 run 11), so how long each configuration stayed
        # asleep before its wake is part of comparing their wakes.
        step["asleep_s"] = time.monotonic() - slept_at
        self._event("wake", level=level, wake=wake)
        parts: list[dict[str, Any]] = []
        if wake == "full":
            parts.append({"what": "wake_up", "s": client.wake_up()})
            if level == 2:
                parts.append({"what": "reload_weights", "s": client.reload_weights()})
        else:
            parts.append({"what": "wake_up weights", "s": client.wake_up(["weights"])})
            step["is_sleeping_staged"] = client.is_sleeping()
            if level == 2:
                parts.append({"what": "reload_weights", "s": client.reload_weights()})
            parts.append({"what": "wake_up kv_cache", "s": client.wake_up(["kv_cache"])})
        self._event("awake")
        step["wake_parts"] = parts
        step["wake_s"] = sum(p["s"] for p in parts if p["what"].startswith("wake_up"))
        step["reload_s"] = sum(p["s"] for p in parts if p["what"] == "reload_weights")
        step["is_sleeping_awake"] = client.is_sleeping()
        step["awake_used_bytes"] = settle(self.memory)
        now = client.complete_one_at_a_time(PROMPTS, self.settings.max_tokens)
        step.update(_compare(reference, now))
        return step
