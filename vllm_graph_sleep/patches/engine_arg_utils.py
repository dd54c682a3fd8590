"""Patch: vllm.engine.arg_utils (EngineArgs, AsyncEngineArgs).

vLLM symbols: EngineArgs.add_cli_args (staticmethod), EngineArgs.from_cli_args
(classmethod), the dataclass __init__ of EngineArgs and AsyncEngineArgs.
Verified against vLLM 0.26.0.

Why: 0.26 has no --sleep-mode-offload-cudagraph and its configs forbid extra
fields. The flag is carried in VllmConfig.additional_config, which is pickled to
the engine core and every worker; this patch adds the CLI option (shown in
`vllm serve --help=all` under its own group) and the LLM(...) / EngineArgs(...)
keyword, and folds both into additional_config. `--additional-config
'{"sleep_mode_offload_cudagraph": true}'` needs no patch at all. An explicit
--no-sleep-mode-offload-cudagraph (or the keyword False) wins over the JSON, as
an explicit flag wins over a config file: it writes false there.

Remove when: vLLM 0.33+ (ModelConfig.sleep_mode_offload_cudagraph).
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_graph_sleep import config
from vllm_graph_sleep.patches._wrap import IncompatibleVllmError, wrap_function
from vllm_graph_sleep.vllm_version import VERIFIED_VLLM, vllm_version

WHERE = "vllm.engine.arg_utils"
CLI_OPTION = "--sleep-mode-offload-cudagraph"
HELP = (
    "With --enable-sleep-mode, capture CUDA/HIP graphs into a memory pool that sleep "
    "offloads to host memory and wake restores in place, so graph memory is freed while "
    "asleep and graphs replay without recapture (vllm-graph-sleep)."
)


def fold_flag(engine_args: Any, enabled: bool | None) -> None:
    """None: not given, additional_config decides; True or False: given, and it wins.
    A flag in additional_config that is neither yes nor no is refused either way,
    here, when the arguments are read, not later in a worker."""
    additional = engine_args.additional_config
    if isinstance(additional, dict):
        config.flag_value(additional.get(config.FLAG))
    if enabled is None:
        return
    if isinstance(additional, str):
        raise ValueError(
            f"{CLI_OPTION}: additional_config must be a dict here, got a string; pass JSON "
            "through --additional-config instead"
        )
    engine_args.additional_config = {**(additional or {}), config.FLAG: bool(enabled)}


def _wrap_add_cli_args(original):
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        if not any(CLI_OPTION in action.option_strings for action in parser._actions):
            group = parser.add_argument_group(
                title="GraphSleep", description="vllm-graph-sleep plugin options."
            )
            group.add_argument(
                CLI_OPTION, action=argparse.BooleanOptionalAction, default=None, help=HELP
            )
        return parser

    return add_cli_args


def _wrap_from_cli_args(original):
    def from_cli_args(cls, args, *rest, **kwargs):
        engine_args = original(cls, args, *rest, **kwargs)
        fold_flag(engine_args, getattr(args, config.FLAG, None))
        return engine_args

    return from_cli_args


def _wrap_init(original):
    def __init__(self, *args, sleep_mode_offload_cudagraph: bool | None = None, **kwargs):
        original(self, *args, **kwargs)
        fold_flag(self, sleep_mode_offload_cudagraph)

    return __init__


def apply() -> None:
    import dataclasses

    from vllm.engine import arg_utils

    # A vLLM with a field of its own by this name (expected in 0.33+) would have
    # its keyword taken by our __init__ and its option hidden behind ours.
    if any(f.name == config.FLAG for f in dataclasses.fields(arg_utils.EngineArgs)):
        raise IncompatibleVllmError(
            f"vllm-graph-sleep: {WHERE}.EngineArgs has a field {config.FLAG} of its own in "
            f"vLLM {vllm_version()} (verified against {VERIFIED_VLLM}, which has none)"
        )
    wrap_function(arg_utils.EngineArgs, "add_cli_args", _wrap_add_cli_args, where=WHERE)
    wrap_function(arg_utils.EngineArgs, "from_cli_args", _wrap_from_cli_args, where=WHERE)
    for cls in (arg_utils.EngineArgs, arg_utils.AsyncEngineArgs):
        wrap_function(cls, "__init__", _wrap_init, where=f"{WHERE}.{cls.__name__}")
