"""`vllm-graph-sleep doctor [--platform detected|cuda|rocm] [vllm serve args...]`.

Reads the arguments with vLLM's own `vllm serve` parser (our plugin registered
first, so --sleep-mode-offload-cudagraph exists), builds the EngineArgs but not
the engine config (that needs a GPU and the model), and says what a server
started with these arguments would do: whether graph offload is active and why
not, what each sleep level keeps and drops per tag, NCCL_GRAPH_REGISTER, the
custom all-reduce mode, and the versions found. Needs no GPU. Exits 1, naming
the fix, for a configuration that cannot work; 2 for arguments vLLM rejects.

The platform is the one detected here unless --platform plans for CUDA or ROCm
from another machine. CUDA graphs are judged from the arguments (--enforce-eager,
cudagraph_mode, -O0); vLLM can still turn them off at start for reasons of the
model or the GPU, and the server then logs why and the plugin warns.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator, MutableMapping, Sequence
from types import SimpleNamespace
from typing import Any

PLATFORM_CHOICES = ("detected", "cuda", "rocm")
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "graph_sleep"
TAGS = ("weights", "kv_cache", "cudagraph", "runtime", "default")
TAG_NOTES = {
    "weights": "model weights",
    "kv_cache": "KV cache",
    "cudagraph": "CUDA/HIP graph pool",
    "runtime": "state built with the KV cache (attention metadata, block tables)",
    "default": "other sleep-mode memory",
}
USAGE = """\
usage: vllm-graph-sleep doctor [--platform {detected,cuda,rocm}] [vllm serve args...]

Says what `vllm serve` with these arguments would do about graph memory in sleep
mode: whether graph offload is active (and why not), what each sleep level keeps
and drops per tag, NCCL_GRAPH_REGISTER, the custom all-reduce mode, versions.
No GPU needed. Exit 0: works; 1: cannot work (the fix is printed); 2: vLLM
rejects the arguments.

  --platform P   detected (default): the platform of this machine;
                 cuda, rocm: plan for that platform from any machine
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
    """(--platform value, the vllm serve arguments, whether help was asked)."""
    platform = "detected"
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
    if platform not in PLATFORM_CHOICES:
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
    if platform.is_cuda_alike():
        return "rocm" if platform.is_rocm() else "cuda"
    name = type(platform).__name__.removesuffix("Platform").lower()
    return "none" if name == "unspecified" else name


def _allow_parsing_without_gpu(platform: Any) -> None:
    """vLLM's argument defaults build a DeviceConfig, which cannot infer a device
    when no platform was detected; the CPU platform is what such a machine is
    (the same approach as tests/unit/force_cpu_platform.py). Arguments only: the
    gate is judged against the detected or planned platform."""
    if getattr(platform, "device_type", "") == "":
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


def parse_serve_args(serve_args: Sequence[str]) -> Any:
    """EngineArgs exactly as `vllm serve` builds them from these arguments."""
    import vllm_graph_sleep

    vllm_graph_sleep.register()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm-graph-sleep doctor"))
    args = parser.parse_args(list(serve_args))
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    try:
        validate_parsed_serve_args(args)
        return AsyncEngineArgs.from_cli_args(args)
    except (TypeError, ValueError) as error:
        raise DoctorUsageError(f"vllm serve would reject these arguments: {error}") from None


# -- what the arguments mean ----------------------------------------------------


def _mode_name(mode: Any) -> str | None:
    if mode is None:
        return None
    return str(getattr(mode, "name", mode)).upper()


def graphs_state(engine_args: Any) -> tuple[bool, str, str]:
    """(CUDA graphs on, why, how to turn them on) from the arguments alone."""
    if engine_args.enforce_eager:
        return (
            False,
            "--enforce-eager",
            "drop --enforce-eager (without CUDA graphs there is no graph memory to offload; "
            "stock sleep mode already frees everything)",
        )
    compilation = engine_args.compilation_config
    mode = _mode_name(getattr(compilation, "cudagraph_mode", None))
    if mode == "NONE":
        return (
            False,
            "cudagraph_mode NONE",
            "drop cudagraph_mode NONE from -cc/--compilation-config",
        )
    level = engine_args.optimization_level
    level = getattr(level, "value", level)
    if mode is None and str(level) == "0":
        return (
            False,
            "-O0 (its cudagraph_mode is NONE)",
            "use -O1 or higher, or set -cc.cudagraph_mode explicitly",
        )
    return True, f"cudagraph_mode {mode}" if mode else "vLLM's default cudagraph_mode", ""


def full_mode_warning(engine_args: Any) -> str | None:
    """cudagraph_mode FULL gave wrong tokens on both of vLLM 0.26's model runners, stock
    vLLM included, with or without sleep (docs/results/engine-h200.md, third and fourth
    runs): V2 replays FULL graphs captured with one token per request on short prefills;
    V1 decoded a Qwen3-MoE-shaped model wrongly where FULL_DECODE_ONLY decoded it right."""
    mode = _mode_name(getattr(engine_args.compilation_config, "cudagraph_mode", None))
    if mode != "FULL":
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


def level_policy(active: bool) -> list[tuple[str, str]]:
    """Per level: what it keeps (backed up to pinned host memory, restored in
    place on wake) and drops (discarded, refilled after wake)."""
    from vllm_graph_sleep.backend import SLEEP_LEVELS, offload_tags_for

    rows = []
    for level in SLEEP_LEVELS:
        if active:
            kept = offload_tags_for(level, set(TAGS))
            dropped = sorted(set(TAGS) - set(kept))
            text = f"keeps {', '.join(kept)}; drops {', '.join(dropped)}"
        elif level == 1:
            text = "keeps weights; drops kv_cache; CUDA graphs stay on the GPU (stock)"
        else:
            text = "drops weights, kv_cache; CUDA graphs stay on the GPU (stock)"
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
    if current is None:
        return f"{value} (set by the plugin before NCCL starts: graph buffers are not registered)"
    if current.strip() == "0":
        return f"{value} (from your environment, as the plugin wants)"
    return (
        f"{value} (from your environment, kept; WARNING: NCCL may register graph buffers, "
        "which pins the graph pool so sleep frees less, and goes stale after wake; set 0)"
    )


def _truthy_env(environ: MutableMapping[str, str], name: str, default: str) -> bool:
    return environ.get(name, default).strip().lower() in ("1", "true")


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
    from vllm_graph_sleep.patches import (
        distributed_device_communicators_aiter_custom_all_reduce as p,
    )

    try:
        p._require_keyword(p._aiter_class())
    except p.IncompatibleAiterError:
        return p.aiter_version(), False
    except Exception as error:  # an AITER that does not even import here
        return f"{p.aiter_version()} (import failed: {error})", None
    return p.aiter_version(), True


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
        and _truthy_env(environ, "VLLM_ROCM_USE_AITER", "false")
        and _truthy_env(environ, "VLLM_ROCM_USE_AITER_CUSTOM_AR", "true")
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


def versions() -> str:
    import torch
    import vllm

    from vllm_graph_sleep.patches._wrap import VERIFIED_VLLM

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
                "pip install -e . (or pip install vllm-graph-sleep) into the environment that "
                "runs vllm",
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


def diagnose(
    engine_args: Any,
    platform: Any,
    platform_note: str,
    environ: MutableMapping[str, str] | None = None,
) -> Diagnosis:
    from vllm_graph_sleep import config

    environ = os.environ if environ is None else environ
    diag = Diagnosis()
    graphs_on, graphs_why, graphs_fix = graphs_state(engine_args)
    gate = config.evaluate_gate(gate_config(engine_args, graphs_on), platform)
    cuda_alike = platform.is_cuda_alike()

    diag.add("platform", f"{platform_label(platform)} ({platform_note})")
    diag.add(
        "sleep mode", "on" if engine_args.enable_sleep_mode else "off (no --enable-sleep-mode)"
    )
    diag.add("CUDA graphs", f"{'on' if graphs_on else 'off'}: {graphs_why}")
    full_mode = full_mode_warning(engine_args)
    if full_mode:
        diag.warnings.append(full_mode)
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
            fix = "add --enable-sleep-mode"
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
    for label, text in level_policy(gate.active):
        diag.add(label, text)
    diag.add("NCCL_GRAPH_REGISTER", nccl_graph_register(gate.active, environ))
    diag.add(
        "custom all-reduce",
        all_reduce_mode(engine_args, platform, gate.active, environ, diag),
    )
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
        _allow_parsing_without_gpu(detected)
        try:
            engine_args = parse_serve_args(serve_args)
        except DoctorUsageError as error:
            print(f"vllm-graph-sleep doctor: {error}", file=sys.stderr)
            return 2
    if platform_choice == "detected":
        platform, note = detected, "detected on this machine"
    else:
        platform = PlannedPlatform(platform_choice)
        note = f"planned with --platform; this machine: {platform_label(detected)}"
    diag = diagnose(engine_args, platform, note)
    print(render(diag))
    return 1 if diag.problems else 0
