"""`vllm-graph-sleep doctor [--platform detected|cuda|rocm] [vllm serve args...]`.

Reads the arguments with vLLM's own `vllm serve` parser (our plugin registered
first, so --sleep-mode-offload-cudagraph exists), builds the EngineArgs, and
resolves the compilation and parallel settings with vLLM's own VllmConfig (its
optimization-level defaults and the rules that turn graphs off), on a stand-in
for the CUDA or ROCm platform, so the verdict follows what the engine does
rather than a copy of its rules. The model itself is not loaded (that needs the
GPU): a local model path is checked to exist, a Hub id is not fetched. It says
what a server started with these arguments would do: whether graph offload is
active and why not, what each sleep level keeps and drops per tag,
NCCL_GRAPH_REGISTER, the custom all-reduce mode, and the versions found. Needs
no GPU. Exits 1, naming the fix, for a configuration that cannot work; 2, with
one line, for arguments vLLM rejects.

The platform is the one detected here when it is CUDA or ROCm. Without a GPU
and without --platform, the answer is given for both (only the lines that
differ are repeated per platform). vLLM can still turn graphs off at start for
reasons of the model (e.g. a model class without graph support), and the
server then logs why and the plugin warns.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from types import SimpleNamespace
from typing import Any
from unittest import mock

from vllm_graph_sleep import settings
from vllm_graph_sleep.allocator import (
    DEFAULT_TAG,
    GRAPH_TAG,
    KV_CACHE_TAG,
    RUNTIME_TAG,
    WEIGHTS_TAG,
)
from vllm_graph_sleep.breakable_order import AUTO_BREAKABLE_ARCHITECTURES, BREAKABLE_ENV

PLATFORM_CHOICES = ("detected", "cuda", "rocm")
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "graph_sleep"
ENV_PREFIX = settings.PREFIX
TAG_NOTES = {
    WEIGHTS_TAG: "model weights",
    KV_CACHE_TAG: "KV cache",
    GRAPH_TAG: "CUDA/HIP graph pool",
    RUNTIME_TAG: "state built with the KV cache (attention metadata, block tables)",
    DEFAULT_TAG: "other sleep-mode memory",
}
USAGE = """\
usage: vllm-graph-sleep doctor [--platform {detected,cuda,rocm}] [vllm serve args...]

Says what `vllm serve` with these arguments would do about graph memory in sleep
mode: whether graph offload is active (and why not), what each sleep level keeps
and drops per tag, NCCL_GRAPH_REGISTER, the custom all-reduce mode, versions.
No GPU needed. Exit 0: works; 1: cannot work (the fix is printed); 2: vLLM
rejects the arguments.

  --platform P   unset: this machine's platform, or both cuda and rocm where
                 this machine has no GPU; detected: this machine as it is,
                 GPU or none; cuda, rocm: plan for that platform from any machine
  serve args     exactly what you would give `vllm serve` (a leading `serve` is
                 skipped), e.g. MODEL --enable-sleep-mode --sleep-mode-offload-cudagraph
"""


class DoctorUsageError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class PlannedPlatform:
    """A CUDA or ROCm platform to plan for, with the methods the gate asks."""

    name: str

    def is_cuda_alike(self) -> bool:
        return True

    def is_rocm(self) -> bool:
        return self.name == "rocm"

    def is_cuda(self) -> bool:
        return self.name == "cuda"


@dataclasses.dataclass
class Diagnosis:
    lines: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    problems: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (what, fix)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def add(self, label: str, text: str) -> None:
        self.lines.append((label, text))


# -- arguments ----------------------------------------------------------------


def split_args(argv: Sequence[str]) -> tuple[str, list[str], bool]:
    """(--platform value or None, the vllm serve arguments, whether help was asked)."""
    platform = None
    rest: list[str] = []
    wants_help = False
    items = list(argv)
    if items and items[0] == "serve":
        items = items[1:]
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--platform":
            if i + 1 >= len(items):
                raise DoctorUsageError("--platform needs a value: detected, cuda or rocm")
            platform = items[i + 1]
            i += 2
            continue
        if item.startswith("--platform="):
            platform = item.split("=", 1)[1]
        elif item in ("-h", "--help") or item.startswith("--help="):
            wants_help = True
        else:
            rest.append(item)
        i += 1
    if platform is not None and platform not in PLATFORM_CHOICES:
        raise DoctorUsageError(
            f"--platform {platform!r}: choose one of {', '.join(PLATFORM_CHOICES)}"
        )
    return platform, rest, wants_help


@contextlib.contextmanager
def _quiet_imports() -> Iterator[None]:
    """vLLM logs at import about Triton, vllm._C and the missing GPU; on a machine
    without one that is noise in a diagnosis. Only applies before vLLM's first import."""
    if "vllm" in sys.modules or "VLLM_LOGGING_LEVEL" in os.environ:
        yield
        return
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    cpp_extension = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_extension.level
    cpp_extension.setLevel(logging.ERROR)
    try:
        yield
    finally:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)
        cpp_extension.setLevel(level)


def detect_platform() -> Any:
    import vllm.platforms

    return vllm.platforms.current_platform


def platform_label(platform: Any) -> str:
    if isinstance(platform, PlannedPlatform):
        return platform.name
    from vllm_graph_sleep.config import platform_name

    return platform_name(platform)


@contextlib.contextmanager
def _parsable_without_gpu(platform: Any) -> Iterator[None]:
    """vLLM's argument defaults build a DeviceConfig, which cannot infer a device
    when no platform was detected; the CPU platform is what such a machine is
    (the same approach as tests/unit/force_cpu_platform.py), for parsing only:
    the gate is judged against the detected or planned platform."""
    if getattr(platform, "device_type", "") != "":
        yield
        return
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    previous = platforms._current_platform
    platforms._current_platform = CpuPlatform()
    try:
        yield
    finally:
        platforms._current_platform = previous


def parse_serve_args(serve_args: Sequence[str]) -> Any:
    """EngineArgs exactly as `vllm serve` builds them from these arguments."""
    import vllm_graph_sleep

    vllm_graph_sleep.register()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class OneLineErrors(FlexibleArgumentParser):
        """A bad flag or bad JSON is one line, not vLLM's whole usage text."""

        def error(self, message: str):
            raise DoctorUsageError(f"vllm serve would reject these arguments: {_one_line(message)}")

    parser = make_arg_parser(OneLineErrors(prog="vllm-graph-sleep doctor"))
    try:
        args = parser.parse_args(list(serve_args))
    except OSError as error:  # --config FILE, read while parsing
        raise DoctorUsageError(f"vllm serve would reject these arguments: {error}") from None
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    try:
        validate_parsed_serve_args(args)
        return AsyncEngineArgs.from_cli_args(args)
    except (TypeError, ValueError) as error:
        raise DoctorUsageError(f"vllm serve would reject these arguments: {error}") from None


class _StandIn:
    """What vLLM's config resolution asks of the platform, answered as CUDA and
    ROCm answer it (graphs supported) without a GPU here; vLLM's own CUDA
    platform cannot even be imported without the driver."""

    def __new__(cls, planned: PlannedPlatform):
        from vllm.platforms.interface import Platform, PlatformEnum

        class StandIn(Platform):
            _enum = PlatformEnum.ROCM if planned.is_rocm() else PlatformEnum.CUDA
            device_name = device_type = "cuda"
            dispatch_key = "CUDA"

            @classmethod
            def support_static_graph_mode(cls) -> bool:
                return True

        return StandIn()


def _one_line(message: str) -> str:
    """pydantic's multi-line messages (with a documentation URL) as one line."""
    parts = [p.strip() for p in message.splitlines() if p.strip()]
    return " ".join(p for p in parts if "errors.pydantic.dev" not in p)


def _validation_text(error: Exception) -> str:
    errors = getattr(error, "errors", None)
    if callable(errors):  # pydantic: field and message, without the URL lines
        return "; ".join(
            f"{'.'.join(map(str, e.get('loc', ()))) or 'value'}: {e.get('msg')}" for e in errors()
        )
    return _one_line(str(error))


def resolve(engine_args: Any, platform: Any) -> Any:
    """vLLM's own VllmConfig for these arguments (compilation and parallel
    settings; no model, which would need the GPU and the weights)."""
    import vllm._aiter_ops  # noqa: F401
    import vllm.platforms as platforms
    from vllm.config import ParallelConfig, VllmConfig

    # vllm._aiter_ops, which VllmConfig imports on ROCm, is imported above under
    # the real platform: imported under the ROCm stand-in, it would load
    # vllm.platforms.rocm, which asks the GPU for its architecture at import.
    planned = platform if isinstance(platform, PlannedPlatform) else None
    if planned is None:  # a detected platform: resolve as its kind, CUDA for a non-GPU one
        planned = PlannedPlatform("rocm" if platform.is_rocm() else "cuda")
    stand_in = _StandIn(planned)
    previous = platforms._current_platform
    platforms._current_platform = stand_in
    # A GPU host has Triton (model runner V2 requires it); this one may have
    # disabled it for want of a driver.
    has_triton = mock.patch.object(sys.modules[VllmConfig.__module__], "HAS_TRITON", True)
    try:
        parallel = ParallelConfig(
            tensor_parallel_size=engine_args.tensor_parallel_size,
            pipeline_parallel_size=engine_args.pipeline_parallel_size,
            data_parallel_size=engine_args.data_parallel_size,
        )
        # A copy: VllmConfig resolves the compilation config in place, and the
        # arguments as given are still needed to name the fix.
        with has_triton:
            return VllmConfig(
                compilation_config=copy.deepcopy(engine_args.compilation_config),
                optimization_level=engine_args.optimization_level,
                parallel_config=parallel,
            )
    except (TypeError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        raise DoctorUsageError(
            f"vllm serve would reject these arguments: {_validation_text(error)}"
        ) from None
    finally:
        platforms._current_platform = previous


def model_problem(model: str) -> str | None:
    """A model given as a local path that is not there (vLLM would take it for a
    Hub id and fail at start); Hub ids are not fetched here."""
    if os.path.exists(os.path.expanduser(model)):
        return None
    looks_local = model.startswith(("/", "./", "../", "~")) or model.count("/") > 1
    if looks_local:
        return f"model {model!r}: no such file or folder"
    return None


# -- what the arguments mean ----------------------------------------------------


def _mode_name(mode: Any) -> str | None:
    if mode is None:
        return None
    return str(getattr(mode, "name", mode)).upper()


def graphs_state(engine_args: Any, resolved: Any) -> tuple[bool, str, str]:
    """(CUDA graphs on, why, how to turn them on), as vLLM resolved the config."""
    if engine_args.enforce_eager:
        return (
            False,
            "--enforce-eager",
            "drop --enforce-eager (without CUDA graphs there is no graph memory to offload; "
            "stock sleep mode already frees everything)",
        )
    compilation = resolved.compilation_config
    mode = _mode_name(compilation.cudagraph_mode)
    if mode != "NONE":
        return True, f"cudagraph_mode {mode} (as vLLM resolves these arguments)", ""
    asked = _mode_name(getattr(engine_args.compilation_config, "cudagraph_mode", None))
    if asked == "NONE":
        fix = "drop cudagraph_mode NONE from -cc/--compilation-config"
        return False, "cudagraph_mode NONE", fix
    level = engine_args.optimization_level
    level = getattr(level, "value", level)
    compile_mode = _mode_name(compilation.mode)
    why = f"vLLM resolves cudagraph_mode to NONE (compilation mode {compile_mode}, -O{level})"
    fix = "compilation mode 3 (VLLM_COMPILE) with the cudagraph_mode you want"
    if not isinstance(level, int) or level < 1:  # at -O1 and above the mode is what turns them off
        fix = f"use -O1 or higher, or {fix}"
    else:
        fix = f"use {fix}"
    return False, why, f"{fix}; cudagraph_mode FULL_DECODE_ONLY also works without compilation"


def _local_architectures(model: str) -> list[str]:
    """The architectures a local model folder's config.json names (none for a Hub id)."""
    path = os.path.join(os.path.expanduser(model), "config.json")
    try:
        with open(path) as config:
            architectures = json.load(config).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in architectures if isinstance(name, str)]


def breakable_graphs(
    resolved: Any, model: str, environ: Mapping[str, str]
) -> tuple[str, str | None]:
    """Which case of vLLM's breakable CUDA graphs these arguments are in, and a
    warning for the one the plugin cannot help with (vllm_graph_sleep.breakable_order)."""
    value = environ.get(BREAKABLE_ENV)
    auto = [name for name in _local_architectures(model) if name in AUTO_BREAKABLE_ARCHITECTURES]
    if value == "1":
        why = f"{BREAKABLE_ENV}=1"
    elif value is None and auto:
        why = f"vLLM turns {BREAKABLE_ENV} on for {auto[0]}"
    elif auto:
        return f"off: {BREAKABLE_ENV}={value!r} opts out of what vLLM turns on for {auto[0]}", None
    elif value is None:
        return f"off ({BREAKABLE_ENV} unset)", None
    else:
        return f"off ({BREAKABLE_ENV}={value!r})", None
    mode = resolved.compilation_config.cudagraph_mode
    if mode is None or not mode.has_piecewise_cudagraphs():
        return f"on ({why}), but cudagraph_mode {_mode_name(mode)} captures attention whole", None
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT_NAME not in allowed.split(","):
        return f"on ({why}), without the plugin (VLLM_PLUGINS={allowed!r})", (
            f"without the plugin, {BREAKABLE_ENV} must be in effect before the process that "
            "starts the engine imports vLLM's attention layers: otherwise vLLM 0.26 captures "
            "attention inside its breakable graphs and fails at the first request with an "
            f"illegal memory access; add {ENTRY_POINT_NAME} to VLLM_PLUGINS"
        )
    return (
        f"on ({why}): graphs break at the ops vLLM marks (attention, MLA attention, the sparse "
        "attention indexer); ops imported before the variable was set are marked as each "
        "worker starts, so the import order does not matter",
        None,
    )


def full_mode_warning(resolved: Any) -> str | None:
    """cudagraph_mode FULL gave wrong tokens on both of vLLM 0.26's model runners, stock
    vLLM included, with or without sleep (docs/results/engine-h200.md, third and fourth
    runs): V2 replays FULL graphs captured with one token per request on short prefills;
    V1 decoded a Qwen3-MoE-shaped model wrongly where FULL_DECODE_ONLY decoded it right."""
    if _mode_name(resolved.compilation_config.cudagraph_mode) != "FULL":
        return None
    return (
        "cudagraph_mode FULL gives wrong tokens in vLLM 0.26, stock vLLM too, with or without "
        "sleep: model runner V2 replays FULL graphs captured for one token per request on "
        "short prefills, and model runner V1 decoded a MoE model wrongly; use "
        "FULL_AND_PIECEWISE (the default), PIECEWISE or FULL_DECODE_ONLY"
    )


def gate_config(engine_args: Any, graphs_on: bool) -> SimpleNamespace:
    """The parts of a VllmConfig that config.evaluate_gate reads."""
    return SimpleNamespace(
        additional_config=engine_args.additional_config or {},
        model_config=SimpleNamespace(
            enable_sleep_mode=bool(engine_args.enable_sleep_mode),
            enforce_eager=bool(engine_args.enforce_eager),
        ),
        compilation_config=SimpleNamespace(cudagraph_mode=None if graphs_on else "NONE"),
    )


def level_policy(active: bool, graphs_on: bool) -> list[tuple[str, str]]:
    """Per level: what it keeps (backed up to pinned host memory, restored in
    place on wake) and drops (discarded, refilled after wake)."""
    from vllm_graph_sleep.backend import SLEEP_LEVELS, offload_tags_for

    tags = set(TAG_NOTES)
    graphs = "CUDA graphs stay on the GPU (stock)" if graphs_on else "no CUDA graphs"
    rows = []
    for level in SLEEP_LEVELS:
        if active:
            kept = offload_tags_for(level, tags)
            dropped = sorted(tags - set(kept))
            text = f"keeps {', '.join(kept)}; drops {', '.join(dropped)}"
        elif level == 1:
            text = f"keeps weights; drops kv_cache; {graphs}"
        else:
            text = f"drops weights, kv_cache; {graphs}"
        if level == 2:
            text += "; after wake_up(weights): reload_weights, then wake_up(kv_cache)"
        rows.append((f"  level {level}", text))
    return rows


def nccl_graph_register(active: bool, environ: MutableMapping[str, str]) -> str:
    from vllm_graph_sleep import config

    current = environ.get(config.NCCL_GRAPH_REGISTER)
    if not active:
        if current is None:
            return "unset: NCCL's default (the plugin leaves it alone while inactive)"
        return f"{current} (from your environment; the plugin leaves it alone while inactive)"
    policy_logger = logging.getLogger(config.logger.name)
    disabled, policy_logger.disabled = policy_logger.disabled, True
    try:
        value = config.apply_nccl_policy(dict(environ))
    finally:
        policy_logger.disabled = disabled
    if config.nccl_value_unset(current):
        return f"{value} (set by the plugin before NCCL starts: graph buffers are not registered)"
    if current.strip() == "0":
        return f"{value} (from your environment, as the plugin wants)"
    return (
        f"{value} (from your environment, kept; WARNING: NCCL may register graph buffers, "
        "which pins the graph pool so sleep frees less, and goes stale after wake; set 0)"
    )


def _vllm_env(environ: MutableMapping[str, str], name: str) -> Any:
    """vLLM's own reading of one of its environment variables, in `environ`."""
    import vllm.envs as envs

    with mock.patch.dict(os.environ, environ, clear=True):
        return envs.environment_variables[name]()


def _aiter_installed() -> bool:
    if "aiter" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("aiter") is not None
    except (ImportError, ValueError):
        return False


def _aiter_state() -> tuple[str, bool | None]:
    """(AITER version or "not installed", whether its CustomAllreduce accepts
    enable_register_for_capturing; None when AITER is not installed)."""
    if not _aiter_installed():
        return "not installed", None
    from vllm_graph_sleep import aiter_all_reduce as aiter

    try:
        aiter.require_keyword(aiter.aiter_class())
    except aiter.IncompatibleAiterError:
        return aiter.aiter_version(), False
    except Exception as error:  # an AITER that does not even import here
        return f"{aiter.aiter_version()} (import failed: {error})", None
    return aiter.aiter_version(), True


def all_reduce_mode(
    engine_args: Any,
    platform: Any,
    active: bool,
    environ: MutableMapping[str, str],
    diag: Diagnosis,
) -> str:
    from vllm_graph_sleep import config

    tp = engine_args.tensor_parallel_size
    if tp <= 1:
        return "none (tensor parallel size 1)"
    backend = config.multicast_free_all_reduce_backend(environ)
    if platform.is_cuda() and backend is not None:
        diag.warnings.append(
            "NVLink multicast is off here (NCCL_NVLS_ENABLE=0), but at TP > 1 vLLM 0.26 picks "
            "FlashInfer's mnnvl all-reduce, which uses multicast anyway: set "
            f"{config.FLASHINFER_ALLREDUCE_BACKEND}={backend}"
        )
    if engine_args.disable_custom_all_reduce:
        return "disabled by --disable-custom-all-reduce (NCCL all-reduce; nothing registered)"
    aiter = (
        platform.is_rocm()
        and _vllm_env(environ, "VLLM_ROCM_USE_AITER")
        and _vllm_env(environ, "VLLM_ROCM_USE_AITER_CUSTOM_AR")
    )
    if aiter:
        if not active:
            return "AITER custom all-reduce (stock: registers graph inputs under capture)"
        version, has_keyword = _aiter_state()
        if has_keyword is False:
            diag.problems.append(
                (
                    f"AITER {version} cannot keep graph inputs out of IPC registration "
                    "(no enable_register_for_capturing, ROCm/aiter#2075); the server refuses "
                    "to start",
                    "upgrade AITER (amd-aiter), or add --disable-custom-all-reduce, or set "
                    "VLLM_ROCM_USE_AITER_CUSTOM_AR=0",
                )
            )
        elif has_keyword is None:
            diag.warnings.append(
                "AITER is not installed here: on the ROCm host its CustomAllreduce must accept "
                "enable_register_for_capturing (ROCm/aiter#2075), or the server refuses to start"
            )
        return (
            "AITER custom all-reduce, copy-in under capture (enable_register_for_capturing="
            "False, fused AR+RMSNorm launchers registered=False); QuickReduce unchanged"
        )
    extra = "; QuickReduce (ROCm) unchanged" if platform.is_rocm() else ""
    if active:
        return (
            "vLLM custom all-reduce, copy-in under capture (graph inputs are staged into its "
            f"IPC buffer; the graph pool is never IPC-registered){extra}"
        )
    return f"vLLM custom all-reduce (stock: registers graph inputs under capture){extra}"


def deep_sleep_state(engine_args: Any, platform: Any, environ: MutableMapping[str, str]) -> str:
    """Whether `/sleep?...&checkpoint=1` (issue 39) can work for this engine."""
    from vllm_graph_sleep import deep_sleep
    from vllm_graph_sleep.cuda_checkpoint import CheckpointDriver

    world = (engine_args.tensor_parallel_size or 1) * (engine_args.pipeline_parallel_size or 1)
    in_process = settings.parse_yes_no(environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")) is False
    # Stand-ins for the engine core pids: one per data-parallel rank, none of them this process.
    pids = (
        None if in_process else [-1 - rank for rank in range(engine_args.data_parallel_size or 1)]
    )
    missing = None  # also where libcuda cannot be loaded
    if not platform.is_rocm():
        with contextlib.suppress(OSError):
            missing = CheckpointDriver.load().missing
    why = deep_sleep.refusal(pids, world, 1, platform.is_rocm(), missing)
    if why is not None:
        return f"not available: {why} (checked on this machine)"
    return (
        "available, opt-in: POST /sleep?level=1&checkpoint=1 (dev mode, one API server process) "
        "or vllm_graph_sleep.deep_sleep.sleep(llm); the CUDA driver checkpoints the engine core "
        "process after the sleep, a wake restores it first (docs/results/checkpoint-h200.md)"
    )


def versions() -> str:
    import torch
    import vllm

    from vllm_graph_sleep.vllm_version import VERIFIED_VLLM

    try:
        ours = importlib.metadata.version("vllm-graph-sleep")
    except importlib.metadata.PackageNotFoundError:
        ours = "not installed"
    aiter, _ = _aiter_state()
    vllm_note = (
        "" if vllm.__version__ == VERIFIED_VLLM else f" (plugin verified on {VERIFIED_VLLM})"
    )
    return (
        f"vllm {vllm.__version__}{vllm_note}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda or '-'}, ROCm/HIP {torch.version.hip or '-'}, "
        f"AITER {aiter}, vllm-graph-sleep {ours}"
    )


def plugin_checks(active: bool, environ: MutableMapping[str, str], diag: Diagnosis) -> str:
    points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    installed = any(ep.name == ENTRY_POINT_NAME for ep in points)
    if not installed:
        diag.problems.append(
            (
                f"the {ENTRY_POINT_GROUP} entry point {ENTRY_POINT_NAME!r} is not installed, so "
                "vllm serve does not load the plugin (and rejects --sleep-mode-offload-cudagraph)",
                "pip install -e <this repository> into the environment that runs vllm (the "
                "package is not on PyPI)",
            )
        )
    allowed = environ.get("VLLM_PLUGINS")
    if allowed is not None and ENTRY_POINT_NAME not in allowed.split(","):
        diag.problems.append(
            (
                f"VLLM_PLUGINS={allowed!r} does not list {ENTRY_POINT_NAME!r}: vLLM will not load "
                "the plugin",
                f"add {ENTRY_POINT_NAME} to VLLM_PLUGINS, or unset it",
            )
        )
    built = importlib.util.find_spec("vllm_graph_sleep._cumem") is not None
    if active and not built:
        diag.problems.append(
            (
                "the allocator extension vllm_graph_sleep._cumem is not built",
                "pip install -e . on the GPU machine (needs the CUDA or HIP headers)",
            )
        )
    return (
        f"entry point {'installed' if installed else 'MISSING'}; allocator extension "
        f"{'built' if built else 'not built'}"
    )


NOT_READ_BY_SERVERS = settings.NOT_READ_BY_SERVERS


def environment_check(active: bool, environ: MutableMapping[str, str], diag: Diagnosis) -> str:
    """The plugin's own environment variables that are set, each read as the
    worker or the API server will read it. A value they would refuse is a
    problem where it stops this command line (the allocator's variables with
    graph offload active, the asleep wait in dev mode), a warning elsewhere; a
    name none of them reads (a misspelt one) is a warning."""
    dev_mode = bool(_vllm_env(environ, "VLLM_SERVER_DEV_MODE"))
    read_where = {
        settings.WORKER: (active, "read only while graph offload is active"),
        settings.DEV_MODE_SERVER: (dev_mode, "read only in dev mode"),
    }
    readers: dict[str, tuple[Callable[[Mapping[str, str]], object], tuple[bool, str]]] = {
        switch.name: (switch.read, read_where[switch.reader]) for switch in settings.SWITCHES
    }
    seen = []
    for name in sorted(n for n in environ if n.startswith(ENV_PREFIX)):
        if name in NOT_READ_BY_SERVERS:
            continue
        seen.append(f"{name}={environ[name]!r}")
        if name not in readers:
            diag.warnings.append(
                f"{name} is not a variable of this plugin (misspelt?); known: "
                + ", ".join(sorted(readers))
            )
            continue
        read, (read_here, when) = readers[name]
        try:
            read(environ)
        except ValueError as error:
            if read_here:
                diag.problems.append((str(error), f"set {name} to an accepted value, or unset it"))
            else:
                diag.warnings.append(f"{error} ({when}; not here)")
    return ", ".join(seen) if seen else "none of the plugin's variables set (its defaults)"


def diagnose(
    engine_args: Any,
    platform: Any,
    platform_note: str,
    environ: MutableMapping[str, str] | None = None,
) -> Diagnosis:
    from vllm_graph_sleep import config

    environ = os.environ if environ is None else environ
    diag = Diagnosis()
    resolved = resolve(engine_args, platform)
    graphs_on, graphs_why, graphs_fix = graphs_state(engine_args, resolved)
    gate = config.evaluate_gate(gate_config(engine_args, graphs_on), platform)
    cuda_alike = platform.is_cuda_alike()

    diag.add("platform", f"{platform_label(platform)} ({platform_note})")
    diag.add(
        "sleep mode", "on" if engine_args.enable_sleep_mode else "off (no --enable-sleep-mode)"
    )
    diag.add("CUDA graphs", f"{'on' if graphs_on else 'off'}: {graphs_why}")
    missing_model = model_problem(engine_args.model)
    if missing_model:
        diag.problems.append(
            (missing_model, "give the folder that holds the model's config.json, or a Hub id")
        )
    breakable, breakable_warning = breakable_graphs(resolved, engine_args.model, environ)
    diag.add("breakable graphs", breakable)
    for warning in (full_mode_warning(resolved), breakable_warning):
        if warning:
            diag.warnings.append(warning)
    if gate.active:
        diag.add(
            "graph offload",
            "ACTIVE: graphs are captured into the cudagraph pool, which sleep backs up to "
            "host memory and wake restores in place (no recapture)",
        )
    elif gate.requested:
        diag.add("graph offload", f"OFF: {gate.reason}")
    else:
        diag.add(
            "graph offload",
            "not requested (stock vLLM 0.26: graphs stay on the GPU while asleep); turn it on "
            "with --enable-sleep-mode --sleep-mode-offload-cudagraph",
        )
    if gate.requested and not gate.active:
        if not engine_args.enable_sleep_mode:
            fix = "add --enable-sleep-mode" + ("" if graphs_on else f"; {graphs_fix}")
        elif not graphs_on:
            fix = graphs_fix
        else:
            fix = None  # the platform, below
        if fix:
            diag.problems.append(
                (f"--sleep-mode-offload-cudagraph has no effect: {gate.reason}", fix)
            )
    if not cuda_alike:
        diag.problems.append(
            (
                f"platform {platform_label(platform)}: sleep mode and graph offload need CUDA "
                "or ROCm",
                "run on a machine with an NVIDIA (CUDA) or AMD (ROCm) GPU; to plan for one from "
                "here, add --platform cuda or --platform rocm",
            )
        )
    diag.add(
        "sleep levels",
        "keeps = backed up to pinned host memory and restored in place; drops = discarded. "
        "Tags: " + ", ".join(f"{t} ({n})" for t, n in TAG_NOTES.items()),
    )
    for label, text in level_policy(gate.active, graphs_on):
        diag.add(label, text)
    diag.add("NCCL_GRAPH_REGISTER", nccl_graph_register(gate.active, environ))
    diag.add(
        "custom all-reduce",
        all_reduce_mode(engine_args, platform, gate.active, environ, diag),
    )
    diag.add("environment", environment_check(gate.active, environ, diag))
    diag.add("deep sleep", deep_sleep_state(engine_args, platform, environ))
    diag.add("versions", versions())
    diag.add("plugin", plugin_checks(gate.active, environ, diag))
    return diag


def render(diag: Diagnosis) -> str:
    width = max(len(label) for label, _ in diag.lines)
    out = ["vllm-graph-sleep doctor"]
    out += [f"{label.ljust(width)}  {text}" for label, text in diag.lines]
    out += [f"{'warning'.ljust(width)}  {text}" for text in diag.warnings]
    if diag.problems:
        out.append(f"{'verdict'.ljust(width)}  CANNOT WORK")
        for what, fix in diag.problems:
            out.append(f"{''.ljust(width)}  - {what}")
            out.append(f"{''.ljust(width)}    fix: {fix}")
    else:
        out.append(f"{'verdict'.ljust(width)}  OK")
    return "\n".join(out)


def merge(per_platform: dict[str, Diagnosis]) -> Diagnosis:
    """One diagnosis for several platforms: a line, warning or problem that is the
    same on all of them once; one that differs once per platform, labelled."""
    names = list(per_platform)
    diags = list(per_platform.values())
    merged = Diagnosis()
    for rows in zip(*(d.lines for d in diags), strict=True):
        if len({text for _, text in rows}) == 1:
            merged.lines.append(rows[0])
        else:
            merged.lines += [
                (f"{label} ({n})", text) for n, (label, text) in zip(names, rows, strict=True)
            ]

    def tagged(items_of) -> list:
        out = []
        for name, diag in per_platform.items():
            for item in items_of(diag):
                if all(item in items_of(d) for d in diags):
                    if item not in out:
                        out.append(item)
                elif isinstance(item, str):
                    out.append(f"{name}: {item}")
                else:
                    out.append((f"{name}: {item[0]}", item[1]))
        return out

    merged.warnings = tagged(lambda d: d.warnings)
    merged.problems = tagged(lambda d: d.problems)
    return merged


def main(argv: Sequence[str]) -> int:
    try:
        platform_choice, serve_args, wants_help = split_args(argv)
    except DoctorUsageError as error:
        print(f"vllm-graph-sleep doctor: {error}", file=sys.stderr)
        return 2
    if wants_help:
        print(USAGE, end="")
        return 0
    with _quiet_imports():
        detected = detect_platform()
        try:
            with _parsable_without_gpu(detected):
                engine_args = parse_serve_args(serve_args)
            if platform_choice is None and not detected.is_cuda_alike():
                # No GPU here and no --platform: answer for both GPU platforms.
                note = (
                    f"this machine: {platform_label(detected)}, so answered for both; "
                    "--platform cuda or --platform rocm picks one"
                )
                per_platform = {
                    name: diagnose(engine_args, PlannedPlatform(name), note)
                    for name in ("cuda", "rocm")
                }
                diag = merge(per_platform)
                diag.lines = [("platform", f"cuda and rocm ({note})")] + [
                    line for line in diag.lines if not line[0].startswith("platform")
                ]
            elif platform_choice in (None, "detected"):
                diag = diagnose(engine_args, detected, "detected on this machine")
            else:
                note = f"planned with --platform; this machine: {platform_label(detected)}"
                diag = diagnose(engine_args, PlannedPlatform(platform_choice), note)
        except DoctorUsageError as error:
            print(f"vllm-graph-sleep doctor: {error}", file=sys.stderr)
            return 2
    print(render(diag))
    return 1 if diag.problems else 0
