"""Vision encoder CUDA graphs (vLLM's ``cudagraph_mm_encoder``) with graph offload, end to
end through vllm.LLM on a locally made Qwen2.5-VL (random weights, GPU, fresh process).

vLLM 0.26 captures one encoder graph per token budget (EncoderCudaGraphManager, model
runner V1 only) into a pool of its own; with the flag, patches/v1_worker_encoder_cudagraph.py
captures them into our graph pool, so they sleep and wake with the decoder's graphs.
Correctness is bit-exact greedy tokens of image prompts after every wake, each generation
encoding its images afresh through the encoder graphs.
"""

from __future__ import annotations

import os

from tests.utils import fresh_process, requires_gpu
from vllm_graph_sleep.testing import (
    cycles,
    mapped,
    repeat_without_sleep,
    report,
    sleep_wake_cycles,
    start_engine,
)
from vllm_graph_sleep.testing.models import IMAGE_TOKEN, VISION_END_TOKEN, VISION_START_TOKEN

pytestmark = requires_gpu

KIND = "qwen2_5_vl"
#: One image of this test (16 tokens) or both together fit the smallest budget; the model
#: scales every image to at most 64 tokens, so none falls back to the eager encoder.
ENCODER_BUDGETS = [64, 128]
#: Images per encoder graph (vLLM requires at most the smallest budget).
ENCODER_ITEMS_PER_GRAPH = 2
#: The same text with a different image each: the image decides the continuation.
PROMPT_TEXT = f"{VISION_START_TOKEN}{IMAGE_TOKEN}{VISION_END_TOKEN}Describe the picture."
IMAGE_SEEDS = (1, 2)
IMAGE_SIZE = (112, 112)  # 8x8 patches of 14 pixels, merged 2x2: 16 image tokens
MAX_TOKENS = 16
RUNS_BEFORE_SLEEP = 3


def start_vl_engine():
    # vLLM 0.26's model runner V2, its default for dense models, captures no encoder graphs.
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return start_engine(
        KIND,
        "full_and_piecewise",
        compilation={
            "cudagraph_mm_encoder": True,
            "encoder_cudagraph_token_budgets": ENCODER_BUDGETS,
            "encoder_cudagraph_max_vision_items_per_batch": ENCODER_ITEMS_PER_GRAPH,
        },
        # No video: the encoder graphs are then laid out for images alone.
        limit_mm_per_prompt={"image": 1, "video": 0},
    )


def encoder_graph_stats(worker) -> dict | None:
    """This worker's encoder graphs, through collective_rpc: how many were captured, into
    which pool, and how many images replayed through them or ran eagerly instead."""
    from vllm_graph_sleep.probe import our_pool_ids

    manager = worker.model_runner.encoder_cudagraph_manager
    if manager is None:
        return None
    return {
        "graphs": sum(len(graphs) for graphs in manager.budget_graphs.values()),
        "budgets": list(manager.token_budgets),
        "in_our_pool": manager.graph_pool is not None
        and tuple(manager.graph_pool) in our_pool_ids(),
        "hits": manager.graph_hits,
        "misses": manager.graph_misses,
    }


def encoder_stats(llm) -> dict:
    stats = llm.collective_rpc(encoder_graph_stats)[0]
    assert stats is not None, "no encoder CUDA graph manager (model runner V2, or no graphs)"
    return stats


def image_prompts() -> list[dict]:
    import numpy as np
    from PIL import Image

    prompts = []
    for seed in IMAGE_SEEDS:
        pixels = np.random.default_rng(seed).integers(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8)
        image = Image.fromarray(pixels, "RGB")
        prompts.append({"prompt": PROMPT_TEXT, "multi_modal_data": {"image": image}})
    return prompts


def encoded_greedy_tokens(llm, prompts: list[dict]) -> list[list[int]]:
    """Greedy tokens with every image encoded afresh (no cached encoder output or prefix
    skips the encoder), each through an encoder graph."""
    from vllm import SamplingParams

    llm.llm_engine.reset_encoder_cache()
    assert llm.reset_prefix_cache()
    before = encoder_stats(llm)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    after = encoder_stats(llm)
    assert after["hits"] - before["hits"] == len(prompts), (before, after)
    assert after["misses"] == before["misses"], (before, after)
    return [list(output.outputs[0].token_ids) for output in outputs]


@fresh_process
def test_encoder_graphs_live_in_the_pool_and_tokens_survive_cycles():
    llm = start_vl_engine()
    awake = report(llm)
    assert awake["graph_offload_active"] and awake["allocator"] == "vllm_graph_sleep"
    assert mapped(awake)["cudagraph"] > 0
    # No graph, encoder graphs included, kept its memory in a private pool other than ours.
    assert awake["foreign_pool_bytes"] == 0, awake["foreign_pool_bytes"]
    graphs = encoder_stats(llm)
    assert graphs["budgets"] == ENCODER_BUDGETS, graphs
    assert graphs["graphs"] == len(ENCODER_BUDGETS), graphs
    assert graphs["in_our_pool"], graphs

    prompts = image_prompts()
    reference = encoded_greedy_tokens(llm, prompts)
    # Only the images differ: a wrong encoder output would show in the tokens.
    assert reference[0] != reference[1], reference

    def generate() -> list[list[int]]:
        return encoded_greedy_tokens(llm, prompts)

    repeat_without_sleep(llm, reference, RUNS_BEFORE_SLEEP, generate=generate)
    sleep_wake_cycles(llm, reference, cycles(), generate=generate)
    assert mapped(report(llm)) == mapped(awake)
    assert encoder_stats(llm)["graphs"] == len(ENCODER_BUDGETS)  # replayed, not recaptured
