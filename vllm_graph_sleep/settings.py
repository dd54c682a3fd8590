"""Every environment switch of the plugin, declared once, and the settings a
process builds from them at its edge.

A switch is a name, its default, a parser and a one-line doc. The worker (graph
offload active) reads the allocator's switches once, at `init_device`, into
`AllocatorSettings`, and hands them to the allocator; the API server reads the
asleep gate's into `GateSettings` when it mounts the gate. doctor, the
unknown-name warning and docs/environment.md iterate `SWITCHES`. Nothing below
this module reads `os.environ` for a switch of ours.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

PREFIX = "VLLM_GRAPH_SLEEP_"

#: The spellings of yes and no that our settings accept (parse_yes_no); any other
#: is refused (config.flag_value for the flag, yes_no for the environment).
YES_VALUES = ("1", "true", "yes", "on")
NO_VALUES = ("0", "false", "no", "off")


def parse_yes_no(text: str) -> bool | None:
    """True or False for a yes or no spelling (any case, spaces around); None
    for anything else, which the caller refuses."""
    value = text.strip().lower()
    if value in YES_VALUES or value in NO_VALUES:
        return value in YES_VALUES
    return None


def yes_no(name: str, raw: str | None) -> bool | None:
    """A yes/no switch's value; None when unset or empty. Any other value is
    refused, so a typo cannot silently pick the other side."""
    if raw is None or not raw.strip():
        return None
    value = parse_yes_no(raw)
    if value is not None:
        return value
    raise ValueError(
        f"{name}={raw!r} is not a yes/no value: yes is {'/'.join(YES_VALUES)}, "
        f"no is {'/'.join(NO_VALUES)}"
    )


REGISTERED_HOST_BUFFERS = "registered"
TORCH_HOST_BUFFERS = "torch"


def host_buffers(name: str, raw: str | None) -> str:
    value = (raw or "").strip().lower() or REGISTERED_HOST_BUFFERS
    if value not in (REGISTERED_HOST_BUFFERS, TORCH_HOST_BUFFERS):
        raise ValueError(
            f"{name}={raw!r} is not a known value: use "
            f"{REGISTERED_HOST_BUFFERS!r} (the default) or {TORCH_HOST_BUFFERS!r}"
        )
    return value


DEFAULT_ASLEEP_WAIT_S = 30.0
DEFAULT_MAX_HELD = 1024


def seconds(name: str, raw: str | None) -> float:
    if not raw or not raw.strip():
        return DEFAULT_ASLEEP_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(
            f"{name}={raw!r}: expected seconds >= 0 (0 refuses requests at once "
            f"while the engine sleeps; unset: {DEFAULT_ASLEEP_WAIT_S:g})"
        )
    return value


def request_count(name: str, raw: str | None) -> int:
    if not raw or not raw.strip():
        return DEFAULT_MAX_HELD
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{name}={raw!r}: expected a whole number >= 0 of requests (0 holds none; "
            f"unset: {DEFAULT_MAX_HELD})"
        )
    return value


#: Who reads a switch: a worker with graph offload active, or the API server in dev mode.
WORKER = "worker with graph offload active"
DEV_MODE_SERVER = "dev-mode API server"


@dataclasses.dataclass(frozen=True)
class Switch:
    name: str
    default: str
    parse: Callable[[str, str | None], Any]
    doc: str
    reader: str = WORKER
    test_only: bool = False

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value in `environ` (default: the process's); ValueError
        for a value the parser refuses."""
        return self.parse(self.name, (os.environ if environ is None else environ).get(self.name))


ZERO_ON_WAKE = Switch(
    PREFIX + "ZERO_ON_WAKE",
    "unset: zero on ROCm only",
    yes_no,
    "zero memory that comes back without a backup (yes: on any platform; no: never)",
)
RELEASE_HOST_MEMORY = Switch(
    PREFIX + "RELEASE_HOST_MEMORY",
    "unset: keep",
    yes_no,
    "yes: free the pinned host buffers after each wake instead of keeping them for the next sleep",
)
RELEASE_STACK = Switch(
    PREFIX + "RELEASE_STACK",
    "unset: release",
    yes_no,
    "no: keep the context's per-thread stack reservation while asleep",
)
RELEASE_BLAS_WORKSPACES = Switch(
    PREFIX + "RELEASE_BLAS_WORKSPACES",
    "unset: release when safe",
    yes_no,
    "no: keep torch's cuBLAS workspaces while asleep",
)
SETTLE_AFTER_SLEEP = Switch(
    PREFIX + "SETTLE_AFTER_SLEEP",
    "unset: probe",
    yes_no,
    "no: no background driver probes after a sleep",
)
COMPRESS_BACKUPS = Switch(
    PREFIX + "COMPRESS_BACKUPS",
    "unset: on with the CUDA build where Triton imports, off with the ROCm build",
    yes_no,
    "code weight backups on the GPU before copying them to host memory (Triton)",
)
KEEP_UNCHANGED_BACKUPS = Switch(
    PREFIX + "KEEP_UNCHANGED_BACKUPS",
    "unset: on where Triton imports",
    yes_no,
    "a sleep copies again only the 1 MiB blocks changed since the backup it kept (fingerprints)",
)
BACK_UP_AT_START = Switch(
    PREFIX + "BACK_UP_AT_START",
    "unset: on where backups are kept",
    yes_no,
    "no: leave the weights' first backup to the first sleep (yes pins and fills it at start)",
)
WHOLE_GRAPH_POOL_BACKUP = Switch(
    PREFIX + "BACK_UP_WHOLE_GRAPH_POOL",
    "unset: live blocks only",
    yes_no,
    "yes: back up the whole graph pool at sleep, graph scratch included",
)
HOST_BUFFERS = Switch(
    PREFIX + "HOST_BUFFERS",
    REGISTERED_HOST_BUFFERS,
    host_buffers,
    "how sleep pins its host backups: registered (exact size, cudaHostRegister) or torch",
)
POISON_GRAPH_SCRATCH = Switch(
    PREFIX + "POISON_GRAPH_SCRATCH",
    "unset: off",
    yes_no,
    "test switch: a wake fills the graph scratch a backup left out with 0xFF bytes",
    test_only=True,
)
POISON_REMAPPED = Switch(
    PREFIX + "POISON_REMAPPED",
    "unset: off",
    yes_no,
    "test switch: a wake fills what it maps back without a backup (not the KV cache) with 0xFF",
    test_only=True,
)
ASLEEP_WAIT_S = Switch(
    PREFIX + "ASLEEP_WAIT_S",
    f"{DEFAULT_ASLEEP_WAIT_S:g}",
    seconds,
    "seconds an inference request waits while the engine sleeps before it gets 503",
    reader=DEV_MODE_SERVER,
)
MAX_HELD_REQUESTS = Switch(
    PREFIX + "MAX_HELD_REQUESTS",
    f"{DEFAULT_MAX_HELD}",
    request_count,
    "inference requests held at once while the engine sleeps; one more gets 503 at once",
    reader=DEV_MODE_SERVER,
)

#: Every switch a server reads, in the order the docs list them.
SWITCHES: tuple[Switch, ...] = (
    ZERO_ON_WAKE,
    RELEASE_HOST_MEMORY,
    RELEASE_STACK,
    RELEASE_BLAS_WORKSPACES,
    SETTLE_AFTER_SLEEP,
    COMPRESS_BACKUPS,
    KEEP_UNCHANGED_BACKUPS,
    BACK_UP_AT_START,
    WHOLE_GRAPH_POOL_BACKUP,
    HOST_BUFFERS,
    POISON_GRAPH_SCRATCH,
    POISON_REMAPPED,
    ASLEEP_WAIT_S,
    MAX_HELD_REQUESTS,
)
BY_NAME: dict[str, Switch] = {switch.name: switch for switch in SWITCHES}
#: The names of the yes/no switches a worker reads (AllocatorSettings reads them all).
WORKER_YES_NO: tuple[str, ...] = tuple(
    switch.name for switch in SWITCHES if switch.reader == WORKER and switch.parse is yes_no
)

#: Who reads the test suite's switches: the tests and their engine helpers.
TEST_SUITE = "test suite"


def cycles_or(default: str) -> Callable[[str, str | None], int]:
    def parse(name: str, raw: str | None) -> int:
        try:
            value = int((raw or "").strip() or default)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"{name}={raw!r}: expected a whole number of cycles >= 1")
        return value

    return parse


def timeout_or(default: str) -> Callable[[str, str | None], float]:
    def parse(name: str, raw: str | None) -> float:
        try:
            value = float((raw or "").strip() or default)
        except ValueError:
            value = 0.0
        if not 0 < value < float("inf"):
            raise ValueError(f"{name}={raw!r}: expected seconds > 0")
        return value

    return parse


def yes_or_no(name: str, raw: str | None) -> bool:
    """A yes/no test switch: unset or empty is no; anything else as yes_no."""
    return bool(yes_no(name, raw))


def text(name: str, raw: str | None) -> str | None:
    return raw if raw and raw.strip() else None


TEST_CYCLES = Switch(
    "GRAPH_SLEEP_TEST_CYCLES",
    "10",
    cycles_or("10"),
    "sleep/wake cycles each engine test runs",
    reader=TEST_SUITE,
    test_only=True,
)
TEST_VLLM_DEFAULTS = Switch(
    "GRAPH_SLEEP_TEST_VLLM_DEFAULTS",
    "0",
    yes_or_no,
    "yes: test engines keep vLLM's defaults (memory utilization, capture sizes, lengths)",
    reader=TEST_SUITE,
    test_only=True,
)
TEST_TIMEOUT = Switch(
    "GRAPH_SLEEP_TEST_TIMEOUT",
    "900",
    timeout_or("900"),
    "seconds a fresh-process test may run before it is stopped and reported",
    reader=TEST_SUITE,
    test_only=True,
)
TEST_LOG = Switch(
    "GRAPH_SLEEP_TEST_LOG",
    "unset: none",
    text,
    "a file every fresh-process test's whole output is appended to",
    reader=TEST_SUITE,
    test_only=True,
)
TEST_EXTENSION = Switch(
    "GRAPH_SLEEP_TEST_EXTENSION",
    "unset: the installed build",
    text,
    "path of a built _cumem*.so the tests load instead (the rocm-on-cuda build)",
    reader=TEST_SUITE,
    test_only=True,
)
DEFAULT_MODEL_CACHE = "~/.cache/vllm-graph-sleep"


def model_cache(name: str, raw: str | None) -> str:
    return (raw or "").strip() or DEFAULT_MODEL_CACHE


MODEL_CACHE = Switch(
    PREFIX + "MODEL_CACHE",
    DEFAULT_MODEL_CACHE,
    model_cache,
    "where the tests and benchmarks make their local models, one folder per kind "
    "(vllm-graph-sleep bench: --cache-dir)",
    reader=TEST_SUITE,
    test_only=True,
)
#: The test suite's switches (no server reads them).
TEST_SWITCHES: tuple[Switch, ...] = (
    TEST_CYCLES,
    TEST_VLLM_DEFAULTS,
    TEST_TIMEOUT,
    TEST_LOG,
    TEST_EXTENSION,
    MODEL_CACHE,
)

#: Variables of ours that no server reads: the build's, and the tests'.
NOT_READ_BY_SERVERS = (
    "VLLM_GRAPH_SLEEP_TARGET",
    MODEL_CACHE.name,
    "VLLM_GRAPH_SLEEP_TEST_CHILD",
)


@dataclasses.dataclass(frozen=True)
class AllocatorSettings:
    """What the allocator's switches say, as a worker read them at start.
    None: unset (the allocator picks the platform's default)."""

    zero_on_wake: bool | None = None
    release_host_memory: bool = False
    release_stack: bool = True
    release_blas_workspaces: bool = True
    settle_after_sleep: bool = True
    compress_backups: bool | None = None
    keep_unchanged_backups: bool | None = None
    back_up_at_start: bool = True
    whole_graph_pool_backup: bool = False
    host_buffers: str = REGISTERED_HOST_BUFFERS
    poison_graph_scratch: bool = False
    poison_remapped: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> AllocatorSettings:
        """Reads every switch a worker reads: ValueError for the first value it
        refuses, before the worker sets anything up."""
        environ = os.environ if environ is None else environ
        return cls(
            zero_on_wake=ZERO_ON_WAKE.read(environ),
            release_host_memory=bool(RELEASE_HOST_MEMORY.read(environ)),
            release_stack=RELEASE_STACK.read(environ) is not False,
            release_blas_workspaces=RELEASE_BLAS_WORKSPACES.read(environ) is not False,
            settle_after_sleep=SETTLE_AFTER_SLEEP.read(environ) is not False,
            compress_backups=COMPRESS_BACKUPS.read(environ),
            keep_unchanged_backups=KEEP_UNCHANGED_BACKUPS.read(environ),
            back_up_at_start=BACK_UP_AT_START.read(environ) is not False,
            whole_graph_pool_backup=bool(WHOLE_GRAPH_POOL_BACKUP.read(environ)),
            poison_graph_scratch=bool(POISON_GRAPH_SCRATCH.read(environ)),
            poison_remapped=bool(POISON_REMAPPED.read(environ)),
            host_buffers=HOST_BUFFERS.read(environ),
        )

    def require_same(self, now: AllocatorSettings) -> None:
        """ValueError naming each switch whose value `now` (what a next engine
        in this process read) differs from these, the ones the process's
        allocator was made with: it reads them once per process, and a
        change would otherwise be ignored without a word."""
        changed = [
            f"{_ALLOCATOR_SWITCHES[field.name].name} (was {getattr(self, field.name)!r}, now "
            f"{getattr(now, field.name)!r})"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(now, field.name)
        ]
        if changed:
            raise ValueError(
                "the allocator's switches changed since the first engine in this process: "
                f"{'; '.join(changed)}. They are read once per process (None: unset); start "
                "this engine in a process of its own (vLLM's default engine core process, "
                "VLLM_ENABLE_V1_MULTIPROCESSING=1) or keep them as they were"
            )


#: The switch each field of AllocatorSettings is read from.
_ALLOCATOR_SWITCHES = {
    "zero_on_wake": ZERO_ON_WAKE,
    "release_host_memory": RELEASE_HOST_MEMORY,
    "release_stack": RELEASE_STACK,
    "release_blas_workspaces": RELEASE_BLAS_WORKSPACES,
    "settle_after_sleep": SETTLE_AFTER_SLEEP,
    "compress_backups": COMPRESS_BACKUPS,
    "keep_unchanged_backups": KEEP_UNCHANGED_BACKUPS,
    "back_up_at_start": BACK_UP_AT_START,
    "whole_graph_pool_backup": WHOLE_GRAPH_POOL_BACKUP,
    "poison_graph_scratch": POISON_GRAPH_SCRATCH,
    "poison_remapped": POISON_REMAPPED,
    "host_buffers": HOST_BUFFERS,
}


@dataclasses.dataclass(frozen=True)
class GateSettings:
    """The asleep gate's switches, as the API server read them when it mounted the gate."""

    asleep_wait_s: float = DEFAULT_ASLEEP_WAIT_S
    max_held_requests: int = DEFAULT_MAX_HELD

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> GateSettings:
        environ = os.environ if environ is None else environ
        return cls(ASLEEP_WAIT_S.read(environ), MAX_HELD_REQUESTS.read(environ))


def environment_reference() -> str:
    """docs/environment.md: one row per switch, from the declarations above."""
    lines = [
        "# Environment variables",
        "",
        "Generated from `vllm_graph_sleep/settings.py` (`python -m vllm_graph_sleep.settings`);",
        "a test checks that this page matches it. Yes/no switches accept "
        f"{'/'.join(f'`{v}`' for v in YES_VALUES)} and {'/'.join(f'`{v}`' for v in NO_VALUES)}, "
        "in any case; unset or empty means the default. A value a switch refuses stops its "
        "reader at start with an error that names the variable. The worker's switches are read "
        "once per process: a next engine in the same process (an in-process engine core) that "
        "reads other values is stopped at start, its error naming the variables that changed.",
        "",
        "| variable | default | read by | effect |",
        "|---|---|---|---|",
    ]
    for switch in SWITCHES:
        reader = switch.reader + (" (tests only)" if switch.test_only else "")
        lines.append(f"| `{switch.name}` | {switch.default} | {reader} | {switch.doc} |")
    lines += [
        "",
        "## Switches of the test suite",
        "",
        "Read by the tests and their engine helpers, never by a server.",
        "",
        "| variable | default | effect |",
        "|---|---|---|",
    ]
    for switch in TEST_SWITCHES:
        lines.append(f"| `{switch.name}` | {switch.default} | {switch.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(environment_reference(), end="")
