"""The FULL-mode prompts keep every prefill out of FULL graphs (see
vllm_graph_sleep.testing.FULL_MODE_PROMPTS): checked with the tokenizer the test
models are made with."""

from __future__ import annotations

from vllm_graph_sleep import testing
from vllm_graph_sleep.testing import (
    DEFAULT_LARGEST_CAPTURE_SIZE,
    FULL_MODE_LONG_PROMPTS,
    FULL_MODE_PROMPTS,
    LARGEST_CAPTURE_SIZE,
    PROMPTS,
    prompts_for,
)
from vllm_graph_sleep.testing.models import MAX_POSITION_EMBEDDINGS

KV_BLOCK_SIZE = 16  # vLLM's default block size for the FlashAttention backend


def test_full_mode_prompts_prefill_longer_than_any_graph_and_shorter_than_a_block():
    from vllm_graph_sleep.testing.models import _train_tokenizer

    tokenizer = _train_tokenizer()
    lengths = [len(tokenizer(prompt)["input_ids"]) for prompt in FULL_MODE_PROMPTS]
    assert all(LARGEST_CAPTURE_SIZE < n < KV_BLOCK_SIZE for n in lengths), lengths


def test_with_vllm_defaults_full_mode_prompts_prefill_longer_than_any_default_graph():
    from vllm_graph_sleep.testing.models import _train_tokenizer

    tokenizer = _train_tokenizer()
    lengths = [len(tokenizer(prompt)["input_ids"]) for prompt in FULL_MODE_LONG_PROMPTS]
    room = MAX_POSITION_EMBEDDINGS - 24  # the default max_model_len, less the tokens generated
    assert all(DEFAULT_LARGEST_CAPTURE_SIZE < n < room for n in lengths), lengths


def test_only_full_mode_uses_them(monkeypatch):
    assert prompts_for("full") == FULL_MODE_PROMPTS
    monkeypatch.setattr(testing, "vllm_defaults", lambda: True)
    assert prompts_for("full") == FULL_MODE_LONG_PROMPTS
    for defaults in (False, True):
        monkeypatch.setattr(testing, "vllm_defaults", lambda defaults=defaults: defaults)
        for mode in ("piecewise", "full_and_piecewise", "breakable"):
            assert prompts_for(mode) == PROMPTS
