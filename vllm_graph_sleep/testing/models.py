"""Small locally made models for tests and benchmarks (no model hub needed).

``make_model(kind, out_dir)`` writes a complete Hugging Face-style model directory that
vLLM can load with ``LLM(model=str(path))`` or ``vllm serve path``: ``config.json``,
``model.safetensors`` (random bf16 weights, deterministic from ``seed``),
``generation_config.json`` and a byte-level BPE tokenizer trained on the fly on a small
built-in English corpus.

The architectures are real ones (``LlamaForCausalLM``, ``DeepseekV2ForCausalLM`` with MLA
and MoE, ``Qwen3MoeForCausalLM``, the vision-language ``Qwen2_5_VLForConditionalGeneration``)
at small sizes, so vLLM runs its real model code, attention backends and MoE kernels on
them. The weights are built with transformers' own model classes and written with
``save_pretrained``, so the tensor names are the checkpoint names that vLLM's loaders map
(per-expert ``mlp.experts.{e}.gate_proj.weight`` etc.).

The vision-language kind also writes ``processor_config.json`` (transformers' Qwen2-VL image
and video processors, limited to small images) and its tokenizer has Qwen's vision tokens,
so ``AutoProcessor`` and vLLM's multimodal processing load it as they load a hub checkpoint.
Its vision encoder is one vLLM 0.26 can capture in CUDA graphs (``cudagraph_mm_encoder``).

The result is cached: a marker file, written last, records kind, seed and format version;
a directory holding a matching marker and all the files it lists (at their recorded sizes)
is returned as it is. Otherwise the model is built in a temporary sibling directory and
renamed into place.

CLI: ``python -m vllm_graph_sleep.testing.models KIND OUT_DIR [--seed N] [--force]``
prints the path.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Raised whenever the files a kind and seed give change, so that cached models are
#: made again: 2 draws the weights in float32 (_init_weights).
FORMAT_VERSION = 2
MARKER_NAME = ".vllm_graph_sleep_model.json"
KINDS = ("llama", "deepseek_v2", "qwen3_moe", "qwen2_5_vl")
#: Kinds of real size, for benchmarks where the weight copy dominates (issue 15's 8B-class
#: Llama): Llama-3-8B's shapes with our small vocabulary (7.0 B parameters, 14 GB in bf16).
#: Their weights are drawn on the GPU when one is visible (on CPU the draw takes minutes);
#: the tests build only KINDS.
LARGE_KINDS = ("llama_8b",)
ALL_KINDS = KINDS + LARGE_KINDS
#: The Llama kinds' shapes: hidden, intermediate, layers, attention heads, KV heads,
#: head dim, rope theta.
LLAMA_SHAPES = {
    "llama": (1024, 2816, 8, 16, 8, 64, 10000.0),
    "llama_8b": (4096, 14336, 32, 32, 8, 128, 500000.0),
}
#: The architecture each kind's config.json names (what vLLM's model registry inspects).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "llama_8b": "LlamaForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
#: Kinds with a vision encoder (and an image processor beside the tokenizer).
VISION_KINDS = frozenset({"qwen2_5_vl"})

#: Standard deviation of the random normal initialisation of all matrices.
INIT_STD = 0.02
#: The trainer's target; the real size is what the corpus supports (see ``_train_tokenizer``).
TOKENIZER_VOCAB_TARGET = 4096
MAX_POSITION_EMBEDDINGS = 4096

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
UNK_TOKEN = "<|unk|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Ids 0..6, in this order (the trainer assigns special tokens first).
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS)

# Qwen2.5-VL's vision tokens, with the names its processor and vLLM look up. Vision kinds
# train with them after SPECIAL_TOKENS (ids 7..10), so their ids are known without the
# tokenizer; the other kinds' tokenizers do not have them (and stay as they were).
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_SPECIAL_TOKENS = (
    *SPECIAL_TOKENS,
    VISION_START_TOKEN,
    VISION_END_TOKEN,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
)
#: One image token per 28x28 pixels (14-pixel patches, merged 2x2). Images are resized to
#: 4 to 64 tokens: prompts stay short, and the largest image (224x224) fills exactly the
#: smallest encoder CUDA graph budget vLLM 0.26 infers for Qwen2.5-VL (64 tokens).
IMAGE_MIN_PIXELS = 4 * 28 * 28
IMAGE_MAX_PIXELS = 64 * 28 * 28

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|eos|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Files a built model directory holds besides the marker. Existing directories are only
# ever replaced when they hold nothing else (see ``_check_replaceable``).
_KNOWN_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "processor_config.json",
        MARKER_NAME,
    }
)


# --------------------------------------------------------------------------------------
# Tokenizer corpus
# --------------------------------------------------------------------------------------

_NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Noah Olivia "
    "Peter Quinn Rachel Samuel Tara Umar Victor Wendy Xavier Yara Zoe"
).split()
_NOUNS = (
    "apple river mountain garden teacher student computer engine window village forest "
    "ocean island kitchen table chair letter story song painting bridge castle train "
    "station market doctor farmer baker artist scientist engineer library museum "
    "hospital school city country planet star moon cloud storm winter summer spring "
    "autumn morning evening night question answer problem solution idea memory dream "
    "machine network server program model graph kernel memory device battery signal "
    "picture camera phone message friend family neighbour child horse dog cat bird fish "
    "tree flower stone road house door wall floor roof bottle glass coffee bread cheese "
    "water fire light sound voice language number season journey holiday meeting report"
).split()
_VERBS = (
    "walk talk open close watch paint build carry follow visit answer explain describe "
    "discover remember imagine consider cook clean climb cross design develop measure "
    "compare collect deliver enjoy finish help jump kick laugh learn listen look move "
    "need offer order plant play print pull push reach repair return share start stop "
    "study test train travel turn wait want wash work compute allocate release capture "
    "replay restore offload"
).split()
_ADJECTIVES = (
    "quick slow bright dark quiet loud small large old young happy sad warm cold soft "
    "hard green blue red yellow white black gentle strong careful curious ancient modern "
    "simple complex empty full heavy light early late honest brave clever calm busy "
    "famous strange friendly hungry tired rich poor clean dirty narrow wide deep shallow"
).split()
_ADVERBS = (
    "quickly slowly quietly carefully happily suddenly often rarely always never "
    "sometimes usually gently loudly early finally simply really almost nearly"
).split()
_PLACES = (
    "in the park|near the river|at the station|behind the house|under the bridge|"
    "on the hill|inside the museum|across the street|by the sea|in the old town|"
    "at the market|in the garden|on the train|at school|in the kitchen|on the roof"
).split("|")
_TIMES = (
    "yesterday|today|tomorrow|last week|next month|every morning|in the evening|"
    "on Monday|on Friday|during the winter|after lunch|before dinner|at midnight"
).split("|")
_DETERMINERS = ("the", "a", "one", "every", "that", "this", "my", "our", "their", "her", "his")


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _past(verb: str) -> str:
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _gerund(verb: str) -> str:
    if verb.endswith("e") and not verb.endswith("ee"):
        return verb[:-1] + "ing"
    return verb + "ing"


def _plural(noun: str) -> str:
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _corpus(num_sentences: int = 1200) -> list[str]:
    """A fixed, seeded English-like corpus (independent of the model seed)."""
    rng = random.Random(20240611)
    c = rng.choice

    def noun_phrase() -> str:
        if rng.random() < 0.25:
            return c(_NAMES)
        if rng.random() < 0.2:
            return f"{rng.randint(2, 99)} {c(_ADJECTIVES)} {_plural(c(_NOUNS))}"
        return f"{c(_DETERMINERS)} {c(_ADJECTIVES)} {c(_NOUNS)}"

    templates = (
        lambda: f"{noun_phrase()} {_past(c(_VERBS))} {noun_phrase()} {c(_PLACES)}.",
        lambda: f"{noun_phrase()} {_third_person(c(_VERBS))} {c(_ADVERBS)} {c(_TIMES)}.",
        lambda: f"{c(_TIMES).capitalize()}, {noun_phrase()} was {_gerund(c(_VERBS))} {c(_PLACES)}.",
        lambda: f"Why did {noun_phrase()} {c(_VERBS)} {noun_phrase()}?",
        lambda: f"Can you {c(_VERBS)} the {c(_NOUNS)} and {c(_VERBS)} the {c(_NOUNS)}?",
        lambda: f"The {c(_NOUNS)} is {c(_ADJECTIVES)}, but the {c(_NOUNS)} is {c(_ADJECTIVES)}.",
        lambda: f'"{c(_ADJECTIVES).capitalize()} {_plural(c(_NOUNS))}!" said {c(_NAMES)}.',
        lambda: (
            f"{c(_NAMES)} has {rng.randint(0, 1000)} {_plural(c(_NOUNS))} and "
            f"{rng.randint(0, 100)} {_plural(c(_NOUNS))}."
        ),
        lambda: (
            f"In {rng.randint(1800, 2030)}, {noun_phrase()} {_past(c(_VERBS))} "
            f"{rng.randint(1, 500)} times."
        ),
        lambda: f"{c(_NAMES)} and {c(_NAMES)} will {c(_VERBS)} {c(_ADVERBS)} {c(_PLACES)}.",
        lambda: (
            f"It is {rng.randint(1, 12)}:{rng.randint(0, 59):02d} and {noun_phrase()} "
            f"is still {_gerund(c(_VERBS))}."
        ),
        lambda: (
            f"{c(_ADVERBS).capitalize()} {noun_phrase()} {_third_person(c(_VERBS))} "
            f"{noun_phrase()}; {noun_phrase()} {_third_person(c(_VERBS))} {noun_phrase()}."
        ),
    )
    fixed = [
        "The quick brown fox jumps over the lazy dog.",
        "Pack my box with five dozen liquor jugs.",
        "Hello, world! How are you today?",
        "The capital of France is Paris. The capital of Japan is Tokyo.",
        "One, two, three, four, five, six, seven, eight, nine, ten.",
        "Graph capture records kernels; graph replay launches them again.",
        "Sleep mode releases memory and wake up restores it.",
        "def add(a, b):\n    return a + b\n",
        "for i in range(10):\n    print(i * i)\n",
    ]
    sentences = [rng.choice(templates)() for _ in range(num_sentences)]
    return fixed + sentences


# --------------------------------------------------------------------------------------
# Model specs
# --------------------------------------------------------------------------------------


def _config(kind: str, vocab_size: int) -> Any:
    import torch
    from transformers import DeepseekV2Config, LlamaConfig, Qwen2_5_VLConfig, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        bos_token_id=SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        initializer_range=INIT_STD,
    )
    if kind in LLAMA_SHAPES:
        hidden, intermediate, layers, heads, kv_heads, head_dim, rope_theta = LLAMA_SHAPES[kind]
        cfg = LlamaConfig(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
            **common,
        )
    elif kind == "deepseek_v2":
        # MLA with DeepSeek-V2-Lite's attention shapes (kv_lora_rank 512, qk_nope 128,
        # qk_rope 64, v 128, no q LoRA, 16 heads): on the H200 vLLM 0.26.0 finds no MLA
        # prefill backend for smaller head dimensions. Everything else is small.
        cfg = DeepseekV2Config(
            hidden_size=1024,
            intermediate_size=1024,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            first_k_dense_replace=1,
            moe_layer_freq=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=256,
            # As in DeepSeek-V2-Lite. vLLM passes n_group/topk_group to FusedMoE with
            # use_grouped_topk=True, so they must be set (None is not "1").
            topk_method="greedy",
            scoring_func="softmax",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            hidden_size=1024,
            intermediate_size=2816,  # only used by dense (mlp_only) layers: there are none
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=256,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            use_sliding_window=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **common,
        )
    elif kind == "qwen2_5_vl":
        # Text head dim 128 and mrope_section [16, 24, 24] (sum 64, half the head dim) as
        # in the released Qwen2.5-VL models; vision head dim 64 (256 / 4), which vLLM's
        # vision attention backends accept. One of the two vision blocks uses full attention
        # and the other windowed attention, as the real encoder mixes them.
        cfg = Qwen2_5_VLConfig(
            text_config=dict(
                hidden_size=512,
                intermediate_size=1024,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1000000.0,
                    "mrope_section": [16, 24, 24],
                },
                **common,
            ),
            vision_config=dict(
                depth=2,
                hidden_size=256,
                intermediate_size=512,
                num_heads=4,
                hidden_act="silu",
                patch_size=14,
                temporal_patch_size=2,
                spatial_merge_size=2,
                window_size=112,
                fullatt_block_indexes=[1],
                tokens_per_second=2,
                out_hidden_size=512,  # the text hidden size: image embeddings replace tokens
                initializer_range=INIT_STD,
            ),
            image_token_id=VISION_SPECIAL_TOKENS.index(IMAGE_TOKEN),
            video_token_id=VISION_SPECIAL_TOKENS.index(VIDEO_TOKEN),
            vision_start_token_id=VISION_SPECIAL_TOKENS.index(VISION_START_TOKEN),
            vision_end_token_id=VISION_SPECIAL_TOKENS.index(VISION_END_TOKEN),
            tie_word_embeddings=False,
        )
    else:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(ALL_KINDS)}")
    cfg.dtype = torch.bfloat16
    return cfg


# --------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------


def _train_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Any:
    """Byte-level BPE trained on ``_corpus()``, wrapped as a transformers fast tokenizer.

    ``special_tokens`` get the first ids, in order; it must start with ``SPECIAL_TOKENS``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        min_frequency=1,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _init_weights(model: Any, seed: int) -> None:
    """Deterministic init: norms 1, other vectors 0, matrices N(0, INIT_STD), drawn
    on the device the model is on (the same device, seed and torch give the same
    weights).

    The matrices are drawn in float32 and rounded to their own dtype: torch's CPU
    normal_ has a vectorised float32 kernel but draws bfloat16 one element at a
    time, about 3x slower for the whole draw (2.3 s against 0.8 s for the llama
    kind on a 2-core machine), the largest part of making that model after the
    imports."""
    import torch

    # Norms are found by their module's class, not by parameter name: Qwen2.5-VL's merger
    # norm is "ln_q", and a zero scale there would zero every image embedding.
    norm_weights = {
        f"{module_name}.{name}" if module_name else name
        for module_name, module in model.named_modules()
        if "norm" in type(module).__name__.lower()
        for name, _ in module.named_parameters(recurse=False)
    }
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if param.ndim == 1:
                param.fill_(1.0 if name in norm_weights else 0.0)
            else:
                drawn = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                param.copy_(drawn.normal_(mean=0.0, std=INIT_STD, generator=gen))


def _update_json(path: Path, **items: Any) -> None:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.update(items)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def _save_processor(tokenizer: Any, out: Path) -> None:
    """Qwen2.5-VL's processor around ``tokenizer``: transformers writes the tokenizer files
    and processor_config.json (the image and video processors, sized for small images)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    sizes = dict(min_pixels=IMAGE_MIN_PIXELS, max_pixels=IMAGE_MAX_PIXELS)
    Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(**sizes),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**sizes),
    ).save_pretrained(out)


def _weights_device(kind: str) -> str:
    import torch

    return "cuda" if kind in LARGE_KINDS and torch.cuda.is_available() else "cpu"


def _write_weights(kind: str, vocab_size: int, seed: int, out: Path) -> int:
    """Write config.json, generation_config.json and model.safetensors; return #params."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    config = _config(kind, vocab_size)
    auto_class = AutoModelForImageTextToText if kind in VISION_KINDS else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto_class.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device=_weights_device(kind)).to(torch.bfloat16)
    _init_weights(model, seed)
    # lm_head must be its own tensor (tie_word_embeddings=False), not a shared one.
    assert model.get_output_embeddings().weight.data_ptr() != (
        model.get_input_embeddings().weight.data_ptr()
    )
    model.save_pretrained(out, max_shard_size="100GB")
    if kind == "qwen3_moe":
        # transformers 5 writes the expert count as "num_local_experts" (its attribute_map
        # target); real Qwen3-MoE checkpoints say "num_experts". Write both, so readers of
        # either spelling (other transformers versions, raw-JSON readers) see 8, not 128.
        _update_json(out / "config.json", num_experts=config.num_experts)
    text_config = config.get_text_config()  # the config itself, except for vision kinds
    GenerationConfig(
        bos_token_id=text_config.bos_token_id,
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
    ).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _build(kind: str, seed: int, out: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    if kind in VISION_KINDS:
        tokenizer = _train_tokenizer(VISION_SPECIAL_TOKENS)
        _save_processor(tokenizer, out)
    else:
        tokenizer = _train_tokenizer()
        tokenizer.save_pretrained(out)
    vocab_size = -(-len(tokenizer) // 64) * 64
    num_params = _write_weights(kind, vocab_size, seed, out)
    files = {}
    for p in sorted(out.iterdir()):
        os.chmod(p, 0o644)  # save_pretrained leaves model.safetensors at 0600
        files[p.name] = p.stat().st_size
    return {
        "kind": kind,
        "seed": seed,
        "format_version": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "tokenizer_size": len(tokenizer),
        "num_params": num_params,
        "build_seconds": round(time.monotonic() - t0, 2),
        "files": files,
    }


# --------------------------------------------------------------------------------------
# Caching
# --------------------------------------------------------------------------------------


def read_marker(path: str | Path) -> dict[str, Any] | None:
    """The marker of a model directory, or None if it is missing or unreadable."""
    try:
        with open(Path(path) / MARKER_NAME, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_complete(path: str | Path, kind: str, seed: int = 0) -> bool:
    """Whether ``path`` holds a complete model of this kind, seed and format version."""
    path = Path(path)
    marker = read_marker(path)
    if marker is None:
        return False
    identity = (marker.get("kind"), marker.get("seed"), marker.get("format_version"))
    if identity != (kind, seed, FORMAT_VERSION):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return False
    for name, size in files.items():
        try:
            if (path / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _check_replaceable(path: Path) -> None:
    """Refuse to delete a directory that holds anything make_model would not write."""
    if not path.exists():
        return
    if not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    unknown = sorted(p.name for p in path.iterdir() if p.name not in _KNOWN_FILES)
    if unknown:
        raise FileExistsError(
            f"{path} exists, is not a complete model of the requested kind, and holds files "
            f"make_model did not write ({', '.join(unknown[:5])}); refusing to replace it"
        )


@contextlib.contextmanager
def _lock(out: Path) -> Iterator[None]:
    """Serialise builders of the same directory (across processes) with a lock file."""
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def make_model(kind: str, out_dir: str | Path, *, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) a small random-weight model of ``kind`` in ``out_dir``.

    ``kind`` is one of ``KINDS``: ``"llama"`` (LlamaForCausalLM, dense), ``"deepseek_v2"``
    (DeepseekV2ForCausalLM, MLA + MoE), ``"qwen3_moe"`` (Qwen3MoeForCausalLM) or
    ``"qwen2_5_vl"`` (Qwen2_5_VLForConditionalGeneration, vision-language); or of
    ``LARGE_KINDS``: ``"llama_8b"`` (Llama-3-8B's shapes). The same kind and seed give
    byte-identical weights (with the same torch version, and for large kinds the same
    device: GPU when one is visible). Returns the
    absolute path of the model directory. If ``out_dir`` already holds a complete model of
    this kind, seed and format version it is returned untouched unless ``force``. An existing
    incomplete or different model there is replaced; a directory holding any file this
    function would not write raises FileExistsError instead.
    """
    if kind not in ALL_KINDS:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(ALL_KINDS)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    out = Path(out_dir).expanduser().resolve()
    if not force and is_complete(out, kind, seed):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _lock(out):
        if not force and is_complete(out, kind, seed):  # built by another process meanwhile
            return out
        _check_replaceable(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
        try:
            marker = _build(kind, seed, tmp)
            # Marker last: its presence means every other file is complete.
            with open(tmp / MARKER_NAME, "w", encoding="utf-8") as f:
                json.dump(marker, f, indent=2, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o755)
            old = None
            if out.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
                os.rename(out, old / "m")
            os.rename(tmp, out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_graph_sleep.testing.models",
        description="Build a random-weight model directory that vLLM can load.",
    )
    parser.add_argument("kind", choices=ALL_KINDS)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    print(make_model(args.kind, args.out_dir, seed=args.seed, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
