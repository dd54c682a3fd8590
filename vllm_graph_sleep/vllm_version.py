"""Which vLLM this process runs, and the release every patch and probe was verified against."""

from __future__ import annotations

VERIFIED_VLLM = "0.26.0"


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")
