"""Patch: vllm.entrypoints.serve.utils.server_utils (GUARDED_PREFIX).

vLLM symbols: the module global GUARDED_PREFIX, which AuthenticationMiddleware
reads on every request to decide which paths need the API key. Verified
against vLLM 0.26.0.

Why: with --api-key (or VLLM_API_KEY), vLLM 0.26 adds AuthenticationMiddleware,
but it checks only paths under /v1, /v2 and /inference. Every other route is
open to anyone who reaches the port, key or no key: with VLLM_SERVER_DEV_MODE=1
that is /sleep, /wake_up, /collective_rpc (any worker method by name), the
cache resets, /pause, the weight-update routes and /server_info; without dev
mode it is still /invocations (SageMaker's door to the same completion and
embedding handlers as /v1), /tokenize, the pooling and scoring routes and the
LoRA adapter routes. vLLM 0.33 checks the same prefixes plus /cohere.

How: GUARDED_PREFIX gets every such path added, so vLLM's own middleware
guards them with its own key handling (several --api-key values,
VLLM_API_KEY, Bearer scheme, constant-time compare, --root-path, 401 body).
Without a key vLLM adds no middleware and nothing changes. PUBLIC_PATHS are
the routes left open on purpose: liveness and readiness probes (/health,
/ping), /load and /metrics (load balancers and Prometheus poll them; they hold
counters, not engine state or content), /version, and the API docs (the route
list, which is vLLM's public source anyway). tests/unit/test_http_auth.py
builds vLLM's app with every optional router and fails on a route that is in
neither list, so a route a new vLLM adds cannot slip through unclassified.

Applied where the API server runs: in a process that has imported this vLLM
module already (`vllm serve` imports it before plugins load), or in dev mode
(where the sleep-router patch imports FastAPI anyway); elsewhere importing
FastAPI would only slow engine and worker start-up.

Remove when: vLLM guards its non-/v1 routes with the API key (not so in 0.33).
"""

from __future__ import annotations

import sys

from vllm_graph_sleep.patches._wrap import (
    VERIFIED_VLLM,
    IncompatibleVllmError,
    require,
    vllm_version,
)

WHERE = "vllm.entrypoints.serve.utils.server_utils"

#: Routes outside vLLM's guarded prefixes that change or reveal engine state or
#: serve the model; with a key configured they need it too. Matched as path
#: prefixes, as vLLM matches its own (a longer path can only gain the check).
GUARDED_PATHS = (
    # dev mode (VLLM_SERVER_DEV_MODE=1): vllm/entrypoints/serve/dev/*
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/server_info",
    "/pause",
    "/resume",
    "/is_paused",
    "/abort_requests",  # also --tokens-only's
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/get_world_size",
    # elastic expert parallelism (generate models)
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    # --profiler-config
    "/start_profile",
    "/stop_profile",
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (SageMaker's adapter routes)
    "/adapters",
    # model serving outside /v1: SageMaker, tokenizer, generative scoring, pooling
    "/invocations",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/generative_scoring",
    "/pooling",
    "/classify",
    "/score",
    "/rerank",
)

#: Routes left open with a key configured (see the module docstring for why).
PUBLIC_PATHS = (
    "/health",
    "/ping",
    "/load",
    "/metrics",
    "/version",
    "/openapi.json",
    "/docs",
    "/docs/oauth2-redirect",
    "/redoc",
    "/static",  # --enable-offline-docs: the Swagger UI's files
)


def _require_prefix_check(server_utils) -> tuple[str, ...]:
    """GUARDED_PREFIX must still be a tuple of prefixes that the middleware
    reads per request; otherwise changing it would guard nothing."""
    prefixes = require(server_utils, "GUARDED_PREFIX", where=WHERE)
    middleware = require(server_utils, "AuthenticationMiddleware", where=WHERE)
    code = getattr(vars(middleware).get("__call__"), "__code__", None)
    reads_global = "GUARDED_PREFIX" in getattr(code, "co_names", ())
    if not (isinstance(prefixes, tuple) and "/v1" in prefixes and reads_global):
        raise IncompatibleVllmError(
            f"vllm-graph-sleep: {WHERE}.AuthenticationMiddleware no longer reads the "
            f"GUARDED_PREFIX tuple per request in vLLM {vllm_version()} (verified against "
            f"{VERIFIED_VLLM}); the API key would not guard the dev endpoints"
        )
    return prefixes


def apply() -> None:
    from vllm import envs

    if WHERE not in sys.modules and not envs.VLLM_SERVER_DEV_MODE:
        return
    from vllm.entrypoints.serve.utils import server_utils

    prefixes = _require_prefix_check(server_utils)
    missing = tuple(p for p in GUARDED_PATHS if not p.startswith(prefixes))
    if missing:
        server_utils.GUARDED_PREFIX = prefixes + missing
