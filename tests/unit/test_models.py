"""Locally made random-weight models (vllm_graph_sleep.testing.models), checked on the CPU.

Besides transformers' own loading, ``test_vllm_loads_every_weight`` runs vLLM 0.26.0's real
model class and ``load_weights`` for each kind in a child process, on the CPU: it forces a
host-only platform and stubs the two GPU-only selections made at construction time (MLA
prefill backend, unquantized MoE backend), fills every parameter with NaN, loads the
checkpoint, and asserts that no NaN is left and vLLM's strict loaded-weights check passes.
Run this file as a script (``python tests/unit/test_models.py MODEL_DIR...``) for that
check alone.

The vision-language kind is also run through transformers' processor and model, and
through vLLM's multimodal processing (what the engine runs on each image prompt, and on the
dummy image it profiles with).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_graph_sleep.testing import models
from vllm_graph_sleep.testing.models import (
    ARCHITECTURES,
    IMAGE_TOKEN,
    KINDS,
    MARKER_NAME,
    VIDEO_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    make_model,
)

SENTENCE = "The quick brown fox jumps over the lazy dog at 12:34, said Zoë. 你好!"
IMAGE_PROMPT = f"{VISION_START_TOKEN}{IMAGE_TOKEN}{VISION_END_TOKEN}Describe the picture."


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def _image(seed: int, height: int, width: int):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: make_model(kind, root / kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_config_and_tokenizer_load(built, kind):
    from transformers import AutoConfig, AutoTokenizer

    path = built[kind]
    assert path.is_absolute()
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER_NAME,
    } <= names
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == kind
    text = config.get_text_config()  # the config itself, except for the vision kind
    assert text.vocab_size % 64 == 0
    assert not config.tie_word_embeddings

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= text.vocab_size
    assert 1024 <= len(tok) <= 4096  # 2010 with tokenizers 0.23 (+4 vision tokens)
    ids = tok(SENTENCE)["input_ids"]
    assert ids[0] == tok.bos_token_id == text.bos_token_id
    assert max(ids) < len(tok)
    assert tok.decode(ids, skip_special_tokens=True) == SENTENCE
    assert tok.eos_token_id == text.eos_token_id
    assert tok.pad_token_id == text.pad_token_id
    assert tok.unk_token is not None
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|user|>\nHi<|eos|>\n<|assistant|>\n"


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_config_loader_accepts(built, kind):
    import torch
    from vllm.transformers_utils.config import get_config

    config = get_config(str(built[kind]), trust_remote_code=False)
    arch = {
        "llama": "LlamaForCausalLM",
        "deepseek_v2": "DeepseekV2ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    }[kind]
    assert config.architectures == [arch]
    assert ARCHITECTURES[kind] == arch  # what the bench warms vLLM's model-info cache for
    assert config.dtype == torch.bfloat16
    if kind == "qwen2_5_vl":
        text, vision = config.text_config, config.vision_config
        # Head dims vLLM's kernels take: text 128 (mrope over half of it), vision 64.
        assert text.hidden_size // text.num_attention_heads == 128
        assert sum(text.rope_parameters["mrope_section"]) == 128 // 2
        assert vision.hidden_size // vision.num_heads == 64
        assert vision.out_hidden_size == text.hidden_size
        assert (vision.depth, vision.patch_size, vision.spatial_merge_size) == (2, 14, 2)
        assert vision.fullatt_block_indexes == [1]
        tok = json.loads((built[kind] / "tokenizer.json").read_text())
        ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
        assert config.image_token_id == ids[IMAGE_TOKEN]
        assert config.video_token_id == ids[VIDEO_TOKEN]
        assert config.vision_start_token_id == ids[VISION_START_TOKEN]
        assert config.vision_end_token_id == ids[VISION_END_TOKEN]
    if kind == "deepseek_v2":
        # DeepSeek-V2-Lite's MLA dims (vLLM on the H200 has no MLA prefill for smaller ones).
        assert (config.kv_lora_rank, config.qk_nope_head_dim) == (512, 128)
        assert (config.qk_rope_head_dim, config.v_head_dim) == (64, 128)
        assert config.q_lora_rank is None
        assert (config.n_routed_experts, config.n_group, config.topk_group) == (8, 1, 1)
    if kind == "qwen3_moe":
        assert config.num_experts == 8
        assert json.loads((built[kind] / "config.json").read_text())["num_experts"] == 8


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_names_and_dtype(built, kind):
    path = built[kind]
    header = _safetensors_header(path / "model.safetensors")
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    assert "lm_head.weight" in header
    assert header["model.embed_tokens.weight"]["shape"] == [
        text["vocab_size"],
        text["hidden_size"],
    ]
    layers = text["num_hidden_layers"]
    assert {int(k.split(".")[2]) for k in header if k.startswith("model.layers.")} == set(
        range(layers)
    )
    # Per-expert checkpoint names, which vLLM's expert mapping expects
    # (fused_moe_make_expert_params_mapping: experts.{e}.gate_proj/up_proj/down_proj).
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in header)
    if kind == "deepseek_v2":
        a = "model.layers.1.self_attn."
        assert header[a + "kv_a_proj_with_mqa.weight"]["shape"] == [512 + 64, 1024]
        assert header[a + "kv_a_layernorm.weight"]["shape"] == [512]
        assert header[a + "kv_b_proj.weight"]["shape"] == [16 * (128 + 128), 512]
        assert header[a + "q_proj.weight"]["shape"] == [16 * (128 + 64), 1024]
        assert header[a + "o_proj.weight"]["shape"] == [1024, 16 * 128]
        assert "model.layers.0.mlp.gate_proj.weight" in header  # first_k_dense_replace=1
        assert "model.layers.0.mlp.gate.weight" not in header
        for layer in range(1, layers):
            m = f"model.layers.{layer}.mlp."
            assert header[m + "gate.weight"]["shape"] == [8, 1024]
            assert header[m + "shared_experts.down_proj.weight"]["shape"] == [1024, 256]
            for e in range(8):
                assert header[m + f"experts.{e}.gate_proj.weight"]["shape"] == [256, 1024]
                assert header[m + f"experts.{e}.up_proj.weight"]["shape"] == [256, 1024]
                assert header[m + f"experts.{e}.down_proj.weight"]["shape"] == [1024, 256]
    elif kind == "qwen3_moe":
        for layer in range(layers):
            m = f"model.layers.{layer}."
            assert header[m + "self_attn.q_norm.weight"]["shape"] == [64]
            assert header[m + "mlp.gate.weight"]["shape"] == [8, 1024]
            for e in range(8):
                assert header[m + f"mlp.experts.{e}.gate_proj.weight"]["shape"] == [256, 1024]
    elif kind == "qwen2_5_vl":
        # The hub checkpoint's names (vLLM's Qwen2.5-VL mapper expects these).
        assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [2 * 128, 512]
        assert header["model.layers.0.self_attn.k_proj.bias"]["shape"] == [2 * 128]
        assert {int(k.split(".")[2]) for k in header if k.startswith("visual.blocks.")} == {0, 1}
        assert header["visual.patch_embed.proj.weight"]["shape"] == [256, 3, 2, 14, 14]
        assert header["visual.blocks.0.attn.qkv.weight"]["shape"] == [3 * 256, 256]
        assert header["visual.merger.mlp.0.weight"]["shape"] == [4 * 256, 4 * 256]
        assert header["visual.merger.mlp.2.weight"]["shape"] == [512, 4 * 256]
        assert not any(k.startswith("model.visual.") for k in header)
    else:
        assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [8 * 64, 1024]
        assert header["model.layers.0.mlp.gate_proj.weight"]["shape"] == [2816, 1024]
        assert not any(".experts." in k for k in header)
    assert (path / "model.safetensors").stat().st_size < 300 * 2**20


def test_vision_kind_processor(built):
    """transformers' AutoProcessor loads the directory and expands the image placeholder."""
    import torch
    from transformers import AutoConfig, AutoProcessor

    path = built["qwen2_5_vl"]
    assert "processor_config.json" in {p.name for p in path.iterdir()}
    config = AutoConfig.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    assert processor.image_token_id == config.image_token_id
    assert processor.video_token_id == config.video_token_id
    size = processor.image_processor.size
    assert (size.shortest_edge, size.longest_edge) == (4 * 28 * 28, 64 * 28 * 28)

    # 84x112 pixels: 6x8 patches of 14, merged 2x2 into 3x4 = 12 image tokens.
    out = processor(text=[IMAGE_PROMPT], images=[_image(0, 84, 112)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert list(out["pixel_values"].shape) == [6 * 8, 3 * 2 * 14 * 14]
    ids = out["input_ids"][0].tolist()
    assert ids[:2] == [config.text_config.bos_token_id, config.vision_start_token_id]
    assert ids[2:14] == [config.image_token_id] * 12
    assert ids[14] == config.vision_end_token_id
    tokenizer = processor.tokenizer
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Describe the picture."

    # Larger images are scaled down to at most 8x8 image tokens (224x224 pixels).
    out = processor(text=[IMAGE_PROMPT], images=[_image(0, 480, 640)], return_tensors="pt")
    assert int(out["image_grid_thw"].prod()) // 4 <= 64
    assert out["input_ids"][0].tolist().count(config.image_token_id) <= 64
    assert not torch.isnan(out["pixel_values"]).any()


def test_vision_kind_images_decide_the_logits(built):
    """Image embeddings are not zero and depend on the image, so the tokens an engine
    generates for an image prompt depend on its vision encoder (and its graphs)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = built["qwen2_5_vl"]
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    logits = []
    for seed in (1, 2):
        inputs = processor(text=[IMAGE_PROMPT], images=[_image(seed, 84, 112)], return_tensors="pt")
        with torch.no_grad():
            features = model.model.get_image_features(
                inputs["pixel_values"], inputs["image_grid_thw"]
            ).pooler_output
            assert all(f.abs().max() > 0.01 for f in features)
            logits.append(model(**inputs).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 0.1


def test_vllm_processes_image_prompts(built):
    """vLLM's model config and multimodal processor for the vision kind, on the CPU: what
    the engine runs on an image prompt and on the dummy image it profiles with."""
    from tests.unit.force_cpu_platform import force_cpu_platform

    force_cpu_platform()
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    model_config = ModelConfig(
        model=str(built["qwen2_5_vl"]),
        max_model_len=512,
        limit_mm_per_prompt={"image": 1, "video": 0},
    )
    assert model_config.architectures == ["Qwen2_5_VLForConditionalGeneration"]
    assert model_config.is_multimodal_model and model_config.uses_mrope
    assert model_config.get_head_size() == 128
    config = model_config.hf_config

    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    # The largest image fills the smallest encoder CUDA graph budget vLLM 0.26 captures
    # for Qwen2.5-VL (64 tokens).
    assert processor.info.get_max_image_tokens() == 64
    items = processor.info.parse_mm_data({"image": _image(0, 112, 112)})
    result = processor.apply(ProcessorInputs(IMAGE_PROMPT, items), TimingContext())
    ids = result["prompt_token_ids"]
    (placeholder,) = result["mm_placeholders"]["image"]
    assert (placeholder.offset, placeholder.length) == (2, 16)  # after BOS, vision start
    assert ids[2:18] == [config.image_token_id] * 16
    assert ids[1] == config.vision_start_token_id and ids[18] == config.vision_end_token_id
    (item,) = result["mm_kwargs"]["image"]
    assert item["image_grid_thw"].data.tolist() == [1, 8, 8]
    assert list(item["pixel_values"].data.shape) == [64, 3 * 2 * 14 * 14]

    dummy = MULTIMODAL_REGISTRY.get_dummy_mm_inputs(model_config, {"image": 1}, processor=processor)
    assert dummy["prompt_token_ids"].count(config.image_token_id) == 64


@pytest.mark.slow
def test_vllm_loads_every_weight(built):
    # One child process for all kinds: importing vLLM dominates the time.
    result = subprocess.run(
        [sys.executable, __file__, *(str(built[kind]) for kind in KINDS)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stdout.count("OK ") == len(KINDS), result.stdout[-3000:]


def test_same_seed_same_bytes_other_seed_other_bytes(built, tmp_path):
    again = make_model("llama", tmp_path / "again", seed=0)
    other = make_model("llama", tmp_path / "other", seed=1)
    ref = built["llama"]
    assert _sha(again / "model.safetensors") == _sha(ref / "model.safetensors")
    assert _sha(again / "tokenizer.json") == _sha(ref / "tokenizer.json")
    assert (again / "config.json").read_bytes() == (ref / "config.json").read_bytes()
    assert _sha(other / "model.safetensors") != _sha(ref / "model.safetensors")
    assert (other / "tokenizer.json").read_bytes() == (ref / "tokenizer.json").read_bytes()


def _stamps(path: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in path.iterdir()}


def test_second_call_reuses_the_model(tmp_path, monkeypatch):
    path = make_model("llama", tmp_path / "m")
    before = _stamps(path)

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a complete model")

    monkeypatch.setattr(models, "_build", no_build)
    assert make_model("llama", tmp_path / "m") == path
    assert make_model("llama", str(tmp_path / "m")) == path
    assert _stamps(path) == before


@pytest.mark.slow
def test_incomplete_or_other_models_are_rebuilt(tmp_path):
    path = make_model("llama", tmp_path / "m")
    digest = _sha(path / "model.safetensors")

    # Marker missing (e.g. a build killed before it wrote the marker): rebuilt.
    (path / MARKER_NAME).unlink()
    assert not models.is_complete(path, "llama")
    before = _stamps(path)
    assert make_model("llama", path) == path
    assert models.is_complete(path, "llama")
    assert _stamps(path) != before
    assert _sha(path / "model.safetensors") == digest

    # Truncated weights (size differs from the marker's record): rebuilt.
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    assert not models.is_complete(path, "llama")
    make_model("llama", path)
    assert _sha(path / "model.safetensors") == digest

    # Another kind or seed asked for: replaced.
    make_model("qwen3_moe", path)
    assert models.read_marker(path)["kind"] == "qwen3_moe"
    assert not models.is_complete(path, "llama")
    make_model("qwen3_moe", path, seed=3)
    assert models.is_complete(path, "qwen3_moe", seed=3)

    # No leftovers beside the model.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_refuses_to_replace_foreign_directories(tmp_path):
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        make_model("llama", foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert models.is_complete(make_model("llama", empty), "llama")


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown model kind"):
        make_model("gpt2", tmp_path / "x")
    with pytest.raises(ValueError, match="seed"):
        make_model("llama", tmp_path / "x", seed=-1)
    assert not (tmp_path / "x").exists()


def test_cli_prints_the_path(tmp_path, capsys):
    assert models.main(["llama", str(tmp_path / "cli")]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str((tmp_path / "cli").resolve())
    assert models.is_complete(out, "llama")


# --------------------------------------------------------------------------------------
# Child process: vLLM's own model class and load_weights, on the CPU.
# --------------------------------------------------------------------------------------


def _vllm_load_check(paths: list[str]) -> None:
    import tempfile

    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.platforms.interface import PlatformEnum

    class HostOnly(CpuPlatform):
        # Neither CPU nor CUDA: layers then look up no vllm._C ops (this CUDA build of
        # vLLM has no CPU kernels); parameters are created on the host.
        _enum = PlatformEnum.UNSPECIFIED

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            if attn_selector_config.use_mla:
                return AttentionBackendEnum.TRITON_MLA.get_path()
            return AttentionBackendEnum.CPU_ATTN.get_path()

    platforms._current_platform = HostOnly()

    import torch
    import vllm.model_executor.layers.attention.mla_attention as mla_attention
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as moe_method
    from safetensors import safe_open
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
        UnquantizedMoeBackend,
        backend_to_kernel_cls,
    )
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.interfaces import supports_encoder_cudagraph

    class NoPrefill:  # the MLA prefill backend is chosen by GPU capability
        def __init__(self, *args, **kwargs):
            pass

    mla_attention.get_mla_prefill_backend = lambda vllm_config: NoPrefill
    triton = UnquantizedMoeBackend.TRITON
    moe_method.select_unquantized_moe_backend = lambda *a, **k: (
        triton,
        backend_to_kernel_cls(triton)[0],
    )

    for i, path in enumerate(paths):
        engine_args = EngineArgs(
            model=path, dtype="bfloat16", max_model_len=1024, enforce_eager=True
        )
        vllm_config = engine_args.create_engine_config()
        with set_current_vllm_config(vllm_config):
            if i == 0:
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    distributed_init_method=f"file://{tempfile.mktemp()}",
                    backend="gloo",
                )
            # Groups depend on the model (an expert-parallel group only for MoE ones).
            destroy_model_parallel()
            initialize_model_parallel(1, 1)
            with torch.device("cpu"):
                model = initialize_model(vllm_config=vllm_config)
            with torch.no_grad():
                for param in model.parameters():
                    param.fill_(float("nan"))
            with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
                weights = [(name, f.get_tensor(name)) for name in f.keys()]
            loaded = model.load_weights(iter(weights))
        # vLLM's strict check (raises on parameters the checkpoint did not initialise) ...
        DefaultModelLoader(LoadConfig()).track_weights_loading(model, set(loaded))
        # ... which skips layers with post-processing (MoE): so also check every element.
        unwritten = [n for n, p in model.named_parameters() if torch.isnan(p.float()).any()]
        assert not unwritten, f"{path}: parameters not (fully) loaded: {unwritten}"
        arch = vllm_config.model_config.architectures[0]
        if arch == "DeepseekV2ForCausalLM":
            assert vllm_config.model_config.use_mla
            assert vllm_config.model_config.get_head_size() == 512 + 64
        if arch == "Qwen2_5_VLForConditionalGeneration":
            # vLLM's class for this checkpoint captures its vision encoder in CUDA graphs
            # (cudagraph_mm_encoder), images included.
            with set_current_vllm_config(vllm_config):
                assert supports_encoder_cudagraph(model)
                assert "image" in model.get_encoder_cudagraph_config().modalities
        print("OK", arch, len(loaded), "weights", flush=True)
        del model, weights


def test_the_large_kind_has_llama_3_8bs_shapes_and_draws_its_weights_on_the_gpu(monkeypatch):
    # Not built here (14 GB): its config, counted on the meta device, and where it is drawn.
    import torch
    from transformers import AutoModelForCausalLM

    config = models._config("llama_8b", vocab_size=4096)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert type(model).__name__ == "LlamaForCausalLM"
    params = sum(p.numel() for p in model.parameters())
    assert 6.9e9 < params < 7.1e9, params  # Llama-3-8B less its 128k-token embeddings
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (
        32,
        4096,
        8,
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models._weights_device("llama_8b") == "cuda"
    assert models._weights_device("llama") == "cpu"  # small kinds: the same bytes everywhere
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert models._weights_device("llama_8b") == "cpu"


if __name__ == "__main__":
    _vllm_load_check(sys.argv[1:])
