"""A sleep that every rank of an engine takes, or none takes; a wake whose
failure on one rank leaves every later reply in step.

vLLM 0.26's `Executor.sleep` sends "sleep" to every worker and records the
engine asleep only when no worker raised. With more than one rank (TP, PP) one
rank can fail after others slept (host memory for the pinned backups is shared
by the node), and then
- the executor records the engine awake while the other ranks are asleep:
  `POST /wake_up` answers "Executor is not sleeping" without reaching them, but
  resumes the scheduler, and the next step replays on their unmapped weights;
- `MultiprocExecutor.collective_rpc` raises at the first failed reply without
  reading the later ranks' replies, so every later call reads the reply meant
  for the call before it.

So the executor's sleep sends every worker `sleep_answering`, which answers
a sleep the worker could not complete with a `RankFailure` reply instead of
raising: every rank's reply is read. The worker's own `sleep` and `wake_up`
raise as stock's do, for every other caller (`LLM.collective_rpc("sleep")`,
`POST /collective_rpc`, a worker extension).
`sleep_every_rank` then wakes every rank back up (`wake_back`, which answers
the same way) and raises `SleepError`: the engine is awake on every rank. If a
rank cannot be woken back up, the engine is recorded asleep, so that the next
wake reaches every rank. Either way vLLM keeps scheduling paused (it paused
before the sleep) until `POST /wake_up` or `LLM.wake_up()`.

A wake that fails on one rank (no room to map its memory back) raised there,
so the executor read no later rank's reply either. The executor's wake sends
`wake_answering`, answered with a `RankFailure` too; `wake_every_rank` reads every reply and
raises `WakeUpError` naming the ranks: the executor keeps the engine recorded
asleep with the tags it had, so that a retried wake reaches every rank again
(a rank that woke has nothing left asleep, and its wake does nothing).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from vllm_graph_sleep import config
from vllm_graph_sleep.allocator import RESUME_HINT, SleepError, WakeUpError

logger = logging.getLogger("vllm.graph_sleep")


@dataclasses.dataclass(frozen=True)
class RankFailure:
    """A worker's reply to a sleep or wake it could not complete (it did not raise)."""

    error: str


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _answered(call: Callable[[], Any], failed: str) -> Any:
    """What `call` returns, or, where graph offload is active in this worker,
    the RankFailure it raised (logged as `failed`); stock's contract
    otherwise: it raises."""
    if not config.is_active():
        return call()
    try:
        return call()
    except Exception as error:
        logger.exception("graph-sleep: %s", failed)
        return RankFailure(_describe(error))


def sleep_answering(worker: Any, level: int) -> RankFailure | None:
    """Run on every rank (collective_rpc) by the executor's sleep: the
    worker's sleep, whose failure is answered, not raised (`_answered`)."""
    return _answered(
        lambda: worker.sleep(level=level),
        "this rank could not sleep; every rank is woken back up",
    )


def wake_answering(worker: Any, tags: list[str] | None) -> Any:
    """Run on every rank by the executor's wake: the worker's wake, answered
    as `sleep_answering` answers."""
    return _answered(
        lambda: worker.wake_up(tags), "this rank could not wake; the engine stays asleep"
    )


def wake_back(worker: Any) -> str | None:
    """Run on every rank (collective_rpc) after a failed sleep: wakes this
    rank's memory, a no-op where nothing sleeps, and answers what failed
    instead of raising."""
    try:
        worker.wake_up(None)
    except Exception as error:
        logger.exception("graph-sleep: this rank could not be woken back up after a failed sleep")
        return _describe(error)
    return None


def _rank_failures(replies: list[Any]) -> dict[int, str]:
    """Rank -> error of every RankFailure among a collective call's replies."""
    return _failures(replies, lambda reply: reply.error if isinstance(reply, RankFailure) else None)


def _failures(replies: list[Any], failed: Callable[[Any], str | None]) -> dict[int, str]:
    # collective_rpc answers in rank order.
    return {rank: error for rank, reply in enumerate(replies) if (error := failed(reply))}


def _ranks(failures: dict[int, str]) -> str:
    return "; ".join(f"rank {rank}: {error}" for rank, error in failures.items())


def sleep_every_rank(
    collective_rpc: Callable[..., list[Any]], level: int, record_asleep: Callable[[], None]
) -> None:
    """Has every rank sleep (sleep_answering) and reads every reply. All slept: records
    the engine asleep. Otherwise every rank is woken back up and SleepError is
    raised; a rank that cannot be woken back leaves the engine recorded asleep."""
    replies = collective_rpc(sleep_answering, kwargs={"level": level})
    failed = _rank_failures(replies)
    if not failed:
        record_asleep()
        return
    left_asleep = _failures(collective_rpc(wake_back), lambda error: error)
    what = f"sleep(level={level}) failed on {len(failed)} of {len(replies)} rank(s): "
    what += _ranks(failed)
    if level >= 2 and len(failed) < len(replies):
        # Level 2 keeps no copy of the weights: the ranks that slept woke without them.
        what += (
            ". The other ranks had dropped their weights (level 2): reload them "
            "(reload_weights or a weight update) before serving"
        )
    if not left_asleep:
        raise SleepError(
            f"{what}. Every rank was woken back up: the engine is awake, but {RESUME_HINT}; "
            "the sleep can be retried."
        )
    record_asleep()
    raise SleepError(
        f"{what}. And {len(left_asleep)} rank(s) could not be woken back up: "
        f"{_ranks(left_asleep)}. The engine is recorded asleep: {RESUME_HINT}, which wakes "
        "every rank."
    )


def wake_every_rank(collective_rpc: Callable[..., list[Any]], tags: list[str] | None) -> None:
    """Has every rank wake (wake_answering) and reads every reply; raises WakeUpError
    naming the ranks that could not wake (the caller then records nothing)."""
    replies = collective_rpc(wake_answering, kwargs={"tags": tags})
    failed = _rank_failures(replies)
    if failed:
        raise WakeUpError(
            f"wake_up(tags={tags}) failed on {len(failed)} of {len(replies)} rank(s): "
            f"{_ranks(failed)}. The engine stays recorded asleep: free the device memory held "
            "elsewhere and wake it again, which reaches every rank (one that woke has nothing "
            "left to wake)."
        )
