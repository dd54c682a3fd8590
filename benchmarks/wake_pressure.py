"""Wake under memory pressure through a live `vllm serve` with graph offload.

One server (--enable-sleep-mode --sleep-mode-offload-cudagraph, dev endpoints on),
greedy reference tokens before any sleep, then one case per sleep level and wake
kind (full; staged: weights, then kv_cache; at level 2 reload_weights once the
weights are back, after the full wake or between the stages):

1. POST /sleep?level=L;
2. a second process (this script's `hog` mode, torch) takes all free GPU memory
   but --hog-margin-mib, so the wake cannot get its memory back;
3. POST /wake_up (the first stage of the wake) must answer an HTTP error, the
   server must live on, /is_sleeping stay true and the allocator's report (bytes
   mapped, backed up, dropped per tag) be what it was before the call;
4. the second process exits, the wake is retried and must answer 200; a staged
   case then takes the memory again before the kv_cache stage and checks the
   same of it;
5. the completions must give the reference tokens, bit for bit.

    python benchmarks/wake_pressure.py --out docs/results/pressure-h200.json

With --checkpoint every sleep asks for the CUDA driver's checkpoint too (deep
sleep, issue 39): the first wake of each case must then find no room for the
restore, answer an error and leave the engine asleep and checkpointed (the
probe cannot run while it is); the rest is as above.

The JSON (rewritten after every case, and on any failure) holds the environment
and "cases": per case level, wake, status (of the refused wake), still_sleeping,
retry_status, retry_exact, and the details behind them; "ok" is the verdict.
Exit status: 0 when every case met its expectations, 1 when one did not or the
run failed, 2 when there is nothing to run on (no GPU).
"""

from __future__ import annotations

import argparse
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vllm_graph_sleep.bench import live
from vllm_graph_sleep.bench.gpu import MemorySource, NoGpuError, settle, wait_released
from vllm_graph_sleep.bench.runner import Progress
from vllm_graph_sleep.bench.server import ServerError
from vllm_graph_sleep.deep_sleep import RESTORE_HEADROOM
from vllm_graph_sleep.testing import PROMPTS, model_dir
from vllm_graph_sleep.units import GiB, MiB

CASES = ((1, "full"), (1, "staged"), (2, "full"), (2, "staged"))
#: What the second process prints once it holds the memory:
#: "READY <bytes held> <free bytes before> <free bytes after>".
READY = "READY"
#: NVML used memory may stay this far above its level before the second process
#: started once that process is gone (driver bookkeeping noise).
RELEASE_SLACK = 8 * MiB
HOG_START_TIMEOUT = 120.0


# -- the second process -------------------------------------------------------------


def take_memory(
    free: Callable[[], int],
    allocate: Callable[[int], None],
    margin: int,
    out_of_memory: type[BaseException] | tuple[type[BaseException], ...],
    chunk: int = GiB,
    granule: int = 2 * MiB,
    smallest: int = 10 * MiB,
) -> int:
    """Allocates until `free()` is within `margin` + `smallest`; returns the bytes
    allocated. In chunks, not one block, so that no allocation needs the whole
    free range in one piece; a chunk that fails is halved. Nothing below
    `smallest` is asked for: torch serves a request under 10 MiB from a 20 MiB
    block, which could take the memory below the margin."""
    held = 0
    size = chunk
    while True:
        size = min(size, (free() - margin) // granule * granule)
        if size < smallest:
            return held
        try:
            allocate(size)
        except out_of_memory:
            size = size // 2 // granule * granule
            continue
        held += size


def hog_main(margin: int) -> int:
    """The second process: holds nearly all free memory of the first visible GPU
    until its stdin closes or it is terminated (the driver frees it then)."""
    import torch

    blocks = []
    free_before = torch.cuda.mem_get_info()[0]
    held = take_memory(
        lambda: torch.cuda.mem_get_info()[0],
        lambda size: blocks.append(torch.empty(size, dtype=torch.uint8, device="cuda")),
        margin,
        torch.OutOfMemoryError,
    )
    print(f"{READY} {held} {free_before} {torch.cuda.mem_get_info()[0]}", flush=True)
    sys.stdin.read()
    return 0


class HogError(RuntimeError):
    """The second process did not take the memory."""


class Hog:
    """Runs `command` (the second process) and waits for its READY line; `stop`
    ends it. Its stderr goes to `log_path` (appended, one file for all cases)."""

    def __init__(self, command: list[str], log_path: Path):
        self.command = command
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self) -> dict[str, int]:
        with open(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(self.command) + "\n").encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                start_new_session=True,
            )
        stdout = self.process.stdout
        assert stdout is not None
        ready, _, _ = select.select([stdout], [], [], HOG_START_TIMEOUT)
        line = stdout.readline() if ready else ""
        words = line.split()
        if len(words) != 4 or words[0] != READY:
            code = self.process.poll()
            raise HogError(
                f"the memory-taking process did not report {READY} "
                f"({'no line in ' + str(HOG_START_TIMEOUT) + ' s' if not ready else repr(line)}, "
                f"exit code {code}); its log: {self.log_path}"
            )
        held, free_before, free_after = map(int, words[1:])
        return {"held": held, "free_before": free_before, "free_after": free_after}

    def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.stdin is not None:
            try:
                process.stdin.close()
            except BrokenPipeError:
                pass
        try:
            process.terminate()
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        except ProcessLookupError:
            pass
        if process.stdout is not None:
            process.stdout.close()
        self.process = None


# -- the cases ------------------------------------------------------------------------


def attempt(call: Callable[[], object]) -> tuple[int | None, str | None, float]:
    """(HTTP status, error text, seconds) of one call: 200 when it succeeded,
    the error status when it answered one, None when no answer came."""
    started = time.perf_counter()
    try:
        call()
    except ServerError as error:
        return error.status, str(error), time.perf_counter() - started
    return 200, None, time.perf_counter() - started


def wake_need(awake_tags: dict[str, dict[str, int]], stage: str) -> int:
    """Bytes one stage of a wake maps, from the allocator's report of the awake
    engine: a full wake maps every tag; the weights stage of a staged wake also
    brings back every other tag but kv_cache (the graph pool and runtime memory
    return with any wake); the kv_cache stage after it maps the KV cache."""
    if stage == "full":
        return sum(usage["mapped"] for usage in awake_tags.values())
    if stage == "weights":
        return sum(usage["mapped"] for tag, usage in awake_tags.items() if tag != "kv_cache")
    return awake_tags["kv_cache"]["mapped"]


#: The wake_up tags of each stage (none: everything).
STAGE_TAGS = {"full": (), "weights": ("weights",), "kv_cache": ("kv_cache",)}


class Run:
    """One server, the reference tokens, and the cases in turn."""

    def __init__(
        self,
        args: argparse.Namespace,
        server: live.LiveServer,
        memory: MemorySource,
        hog_command: list[str],
    ):
        self.args = args
        self.server = server
        self.client = server.client
        self.memory = memory
        self.hog_command = hog_command
        self.reference: list[list[int]] = []
        self.awake_tags: dict[str, dict[str, int]] = {}

    def blocked_wake(self, stage: str, checkpointed: bool = False) -> dict[str, Any]:
        """One wake stage while the second process holds the memory, and the
        state of the server right after it, still under pressure. A
        `checkpointed` engine runs nothing, the probe included: what its wake
        needs first is room for the restore, and it must stay checkpointed."""
        result: dict[str, Any] = {}
        need = RESTORE_HEADROOM if checkpointed else wake_need(self.awake_tags, stage)
        before = None if checkpointed else self.client.memory_report()[0]["tags"]
        used_before = settle(self.memory)
        result["used_before_mib"] = live.mib(used_before[0])
        hog = Hog(self.hog_command, self.args.out.with_suffix(".hog.log"))
        try:
            taken = hog.start()
            result["hog_mib"] = live.mib(taken["held"])
            result["free_under_hog_mib"] = live.mib(taken["free_after"])
            result["need_mib"] = live.mib(need)
            result["pressure"] = taken["free_after"] < need
            offset = self.server.log_size()
            status, error, seconds = attempt(lambda: self.client.wake_up(STAGE_TAGS[stage]))
            result.update(status=status, error=error, failed_wake_s=round(seconds, 3))
            result["server_alive"] = self.server.alive()
            if result["server_alive"]:
                result["still_sleeping"] = self.client.is_sleeping()
            if result["server_alive"] and checkpointed:
                result["still_checkpointed"] = self.client.checkpointed()
            elif result["server_alive"]:
                after = self.client.memory_report()[0]["tags"]
                result["backups_intact"] = after == before
                if after != before:
                    result["report_before"], result["report_after"] = before, after
            result["log_errors"] = self.server.log_errors_since(offset)
            under_hog = self.memory.used()
        finally:
            hog.stop()
        # The second process's memory takes a moment to come back after it exits.
        gone = [used - taken["held"] for used in under_hog]
        wait_released(self.memory, gone, RELEASE_SLACK, timeout=60)
        # Device memory the refused wake left behind (NVML, server asleep).
        result["left_behind_mib"] = live.mib(settle(self.memory)[0] - used_before[0])
        return result

    def case(self, level: int, wake: str, record: dict[str, Any]) -> None:
        client = self.client
        started = time.perf_counter()
        checkpoint = self.args.checkpoint
        client.sleep(level, checkpoint=checkpoint)
        record["asleep"] = client.is_sleeping()
        record["checkpointed"] = checkpoint
        first = "full" if wake == "full" else "weights"
        record.update(self.blocked_wake(first, checkpointed=checkpoint))
        if not record["server_alive"]:
            return
        record["retry_status"], record["retry_error"], _ = attempt(
            lambda: client.wake_up(STAGE_TAGS[first])
        )
        # Level 2 discarded the weights: reloaded once their memory is back, as
        # the bench does (after a full wake, or between the stages of a staged one).
        if level == 2 and record["retry_status"] == 200:
            client.reload_weights()
        if wake == "staged" and record["retry_status"] == 200:
            kv = self.blocked_wake("kv_cache")
            record.update({f"kv_{key}": value for key, value in kv.items()})
            if not kv["server_alive"]:
                return
            record["kv_retry_status"], record["kv_retry_error"], _ = attempt(
                lambda: client.wake_up(STAGE_TAGS["kv_cache"])
            )
        record["awake_after_retry"] = not client.is_sleeping()
        if record["awake_after_retry"]:
            tokens = client.complete(PROMPTS, self.args.max_tokens).token_ids
            check = live.compare(self.reference, tokens)
            record["retry_exact"] = check["exact"]
            if "mismatch" in check:
                record["mismatch"] = check["mismatch"]
        record["case_s"] = round(time.perf_counter() - started, 3)


def problems(record: dict[str, Any]) -> list[str]:
    """Each expectation of a case that does not hold (a missing field: the case
    did not get that far)."""
    found = []
    if record.get("asleep") is not True:
        found.append("/is_sleeping was not true after /sleep")
    stages = [("", "first wake")]
    if record["wake"] == "staged":
        stages.append(("kv_", "kv_cache wake"))
    for prefix, what in stages:
        status = record.get(prefix + "status")
        if status is None or status == 200:
            detail = record.get(prefix + "error") or "no error"
            found.append(f"{what} under pressure answered {status} ({detail}); want an HTTP error")
        if record.get(prefix + "pressure") is not True:
            found.append(
                f"{what}: the second process left {record.get(prefix + 'free_under_hog_mib')} "
                f"MiB free, the wake needs {record.get(prefix + 'need_mib')} MiB: no pressure "
                "(lower --hog-margin-mib)"
            )
        for key, want in (("server_alive", True), ("still_sleeping", True)):
            if record.get(prefix + key) is not want:
                found.append(f"{what}: {key} is {record.get(prefix + key)}, want {want}")
        if prefix == "" and record.get("checkpointed"):
            if record.get("still_checkpointed") is not True:
                found.append(f"{what}: the engine is no longer checkpointed after the refused wake")
        elif record.get(prefix + "backups_intact") is not True:
            found.append(f"{what}: the allocator's report changed across the refused wake")
        if record.get(prefix + "retry_status") != 200:
            found.append(
                f"{what} retried after the memory was freed answered "
                f"{record.get(prefix + 'retry_status')}: {record.get(prefix + 'retry_error')}"
            )
    if record.get("awake_after_retry") is not True:
        found.append("not awake after the retried wake")
    if record.get("retry_exact") is not True:
        found.append(f"tokens after the retried wake differ: {record.get('mismatch')}")
    return found


def run(
    args: argparse.Namespace,
    memory: MemorySource,
    command_for: live.CommandFor,
    hog_command: list[str],
    model: str,
    progress: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Every case; returns the results, also written to args.out after each case
    and at the end, whatever happened."""
    progress = progress or Progress()
    results: dict[str, Any] = {
        **live.header("wake under memory pressure, live vllm serve", memory, sys.argv),
        "settings": live.settings(args, model),
        "prompts": list(PROMPTS),
        "cases": [],
    }
    server = live.LiveServer(
        command_for, args.out.with_suffix(".server.log"), args.request_timeout, env
    )
    results["server_log"] = str(server.server.log_path)
    try:
        with live.time_limit(args.timeout):
            server.start(args.timeout, progress)
            results["start_s"] = round(server.start_s or 0.0, 3)
            this = Run(args, server, memory, hog_command)
            this.reference, repeat = live.reference_tokens(server.client, PROMPTS, args.max_tokens)
            results["reference"] = this.reference
            results["stable_without_sleep"] = repeat["exact"]
            this.awake_tags = server.client.memory_report()[0]["tags"]
            results["awake_tags"] = this.awake_tags
            for index, (level, wake) in enumerate(CASES):
                record: dict[str, Any] = {"level": level, "wake": wake}
                results["cases"].append(record)
                progress(f"case {index + 1}/{len(CASES)}: level {level}, {wake} wake")
                try:
                    this.case(level, wake, record)
                finally:
                    record["problems"] = problems(record)
                    record["ok"] = not record["problems"]
                    live.write_json(results, args.out)
                kv = (
                    f"kv_cache refused with {record.get('kv_status')}, retry "
                    f"{record.get('kv_retry_status')}, "
                    if wake == "staged"
                    else ""
                )
                progress(
                    f"  refused with {record.get('status')}, still sleeping "
                    f"{record.get('still_sleeping')}, retry {record.get('retry_status')}, {kv}"
                    f"exact {record.get('retry_exact')}: "
                    + ("ok" if record["ok"] else "; ".join(record["problems"]))
                )
                if not (server.alive() and record.get("awake_after_retry")):
                    results["cases_not_run"] = [list(c) for c in CASES[index + 1 :]]
                    break
    except (ServerError, HogError, live.Overtime, live.Interrupted) as error:
        results["error"] = str(error)
        progress(f"run failed: {error}")
    finally:
        results["server_exit_code"] = server.stop()
        results["ok"] = (
            "error" not in results
            and results.get("stable_without_sleep") is True
            and len(results["cases"]) == len(CASES)
            and all(record["ok"] for record in results["cases"])
        )
        live.write_json(results, args.out)
    return results


def hog_command(args: argparse.Namespace) -> list[str]:
    """This script in its `hog` mode, with the same environment (and GPU) as the server."""
    return [sys.executable, str(Path(__file__).resolve()), "hog", str(args.hog_margin_mib * MiB)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    live.add_arguments(parser, default_timeout=500)
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="every sleep asks for the CUDA driver's checkpoint too (/sleep?checkpoint=1): "
        "the first wake of each case must find no room for the restore, answer an error and "
        "leave the engine checkpointed",
    )
    parser.add_argument(
        "--hog-margin-mib",
        type=int,
        default=64,
        help="free memory the second process leaves (default: %(default)s)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["hog"]:
        return hog_main(int(argv[1]))
    args = parse_args(argv)
    from vllm_graph_sleep.bench.gpu import NvmlMemory

    try:
        memory = NvmlMemory(1)
    except NoGpuError as error:
        print(f"wake_pressure: {error}; nothing to run", file=sys.stderr)
        return 2
    model = args.model or model_dir("llama")
    results = run(args, memory, live.real_command(args, model), hog_command(args), model)
    print(f"results: {args.out}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
