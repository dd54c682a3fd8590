"""The gate, the NCCL policy, the flag's path into the engine config, and the
backend's level policy (CPU)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import pickle
from types import SimpleNamespace

import cloudpickle
import pytest

from tests.unit.fake_vmm import PAGE
from tests.unit.force_cpu_platform import force_cpu_platform
from vllm_graph_sleep import config

force_cpu_platform()

import vllm_graph_sleep  # noqa: E402
from vllm_graph_sleep.backend import offload_tags_for  # noqa: E402
from vllm_graph_sleep.patches import v1_worker_gpu_worker  # noqa: E402


class FakePlatform:
    def __init__(self, cuda_alike: bool):
        self._cuda_alike = cuda_alike

    def is_cuda_alike(self) -> bool:
        return self._cuda_alike


PLATFORMS = {"cuda": FakePlatform(True), "rocm": FakePlatform(True), "cpu": FakePlatform(False)}


def fake_vllm_config(flag=True, sleep=True, eager=False, cudagraph_mode="FULL_AND_PIECEWISE"):
    return SimpleNamespace(
        additional_config={config.FLAG: True} if flag else {},
        model_config=SimpleNamespace(enable_sleep_mode=sleep, enforce_eager=eager),
        compilation_config=SimpleNamespace(
            cudagraph_mode=SimpleNamespace(name="NONE" if eager else cudagraph_mode)
        ),
    )


@pytest.mark.parametrize(
    "flag,sleep,eager,platform",
    list(itertools.product([True, False], [True, False], [True, False], PLATFORMS)),
)
def test_gate_truth_table(flag, sleep, eager, platform):
    gate = config.evaluate_gate(fake_vllm_config(flag, sleep, eager), PLATFORMS[platform])
    assert gate.active == (flag and sleep and not eager and platform in ("cuda", "rocm"))
    assert gate.requested == flag
    assert bool(gate.reason) == (flag and not gate.active)


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_gate_is_on_for_every_cudagraph_mode_but_none(mode):
    assert config.evaluate_gate(fake_vllm_config(cudagraph_mode=mode), PLATFORMS["cuda"]).active
    off = config.evaluate_gate(fake_vllm_config(cudagraph_mode="NONE"), PLATFORMS["cuda"])
    assert not off.active and "CUDA graphs are off" in off.reason


def test_flag_as_string_from_json_is_understood():
    vllm_config = fake_vllm_config()
    vllm_config.additional_config = {config.FLAG: "true"}
    assert config.evaluate_gate(vllm_config, PLATFORMS["cuda"]).active


def test_ineffective_flag_warns_once_with_the_reason(caplog):
    gate = config.evaluate_gate(fake_vllm_config(sleep=False), PLATFORMS["cuda"])
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        config.warn_if_ineffective(gate)
        config.warn_if_ineffective(config.evaluate_gate(fake_vllm_config(flag=False)))
    assert len(caplog.records) == 1
    assert "--enable-sleep-mode" in caplog.records[0].getMessage()


def test_nccl_policy_defaults_to_zero_and_keeps_an_explicit_value(caplog):
    environ: dict[str, str] = {}
    assert config.apply_nccl_policy(environ) == "0" and environ == {"NCCL_GRAPH_REGISTER": "0"}
    environ = {"NCCL_GRAPH_REGISTER": "0"}
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        assert config.apply_nccl_policy(environ) == "0"
    assert not caplog.records
    environ = {"NCCL_GRAPH_REGISTER": "1"}
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        assert config.apply_nccl_policy(environ) == "1"
    assert environ == {"NCCL_GRAPH_REGISTER": "1"}
    assert "NCCL_GRAPH_REGISTER=1 is kept" in caplog.records[0].getMessage()
    # NCCL reads an empty value as unset (its default: registration on).
    environ = {"NCCL_GRAPH_REGISTER": " "}
    assert config.apply_nccl_policy(environ) == "0" and environ == {"NCCL_GRAPH_REGISTER": "0"}


class FakeWorker:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.seen_nccl = "unset"

    def init_device(self):
        import os

        self.seen_nccl = os.environ.get("NCCL_GRAPH_REGISTER", "unset")


@pytest.fixture
def fake_allocator(install_allocator):
    from tests.unit.fake_vmm import FakeVmmDriver
    from vllm_graph_sleep.allocator import GraphSleepAllocator

    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    install_allocator(manager)
    return driver, manager


def engine_config(on: bool) -> SimpleNamespace:
    """What the init_device wrapper reads of a VllmConfig; `on` is the gate."""
    from vllm.config.compilation import CUDAGraphMode

    compilation = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    return SimpleNamespace(on=on, model_config=SimpleNamespace(), compilation_config=compilation)


@pytest.fixture
def worker_patch(monkeypatch, fake_allocator):
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)
    monkeypatch.setattr(config, "_active_in_this_process", False)
    routed = []
    monkeypatch.setattr(
        v1_worker_gpu_worker, "route_graph_capture_to_pool", lambda: routed.append(1)
    )
    monkeypatch.setattr(
        config, "evaluate_gate", lambda vc, platform=None: config.Gate(vc.on, vc.on)
    )
    init_device = v1_worker_gpu_worker._wrap_init_device(FakeWorker.init_device)
    return init_device, routed


def test_worker_sets_nccl_before_init_device_and_activates_after(worker_patch):
    init_device, routed = worker_patch
    worker = FakeWorker(engine_config(on=True))
    init_device(worker)
    assert worker.seen_nccl == "0"
    assert config.is_active() and routed == [1]
    assert worker.vllm_config.model_config.sleep_mode_backend == config.BACKEND_NAME


@pytest.mark.parametrize(
    ("name", "value"),
    [("VLLM_GRAPH_SLEEP_RELEASE_STACK", "ture"), ("VLLM_GRAPH_SLEEP_HOST_BUFFERS", "pinned")],
)
def test_a_refused_switch_stops_the_worker_before_it_sets_anything_up(
    worker_patch, monkeypatch, name, value
):
    init_device, routed = worker_patch
    monkeypatch.setenv(name, value)
    worker = FakeWorker(engine_config(on=True))
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        init_device(worker)
    assert worker.seen_nccl == "unset"  # the original init_device never ran
    assert os.environ.get("NCCL_GRAPH_REGISTER") is None
    assert not config.is_active() and routed == []
    monkeypatch.setenv(name, "")  # unset or empty: the defaults, and it starts
    init_device(worker)
    assert config.is_active()


def test_a_next_engine_whose_switches_changed_is_refused_before_it_sets_anything_up(
    worker_patch, monkeypatch
):
    """The process's allocator was made with the first engine's switches and
    keeps them; a next engine in the process that read others is told so,
    instead of running with switches it did not ask for."""
    init_device, routed = worker_patch
    monkeypatch.setenv("VLLM_GRAPH_SLEEP_RELEASE_STACK", "0")
    worker = FakeWorker(engine_config(on=True))
    with pytest.raises(ValueError, match=r"VLLM_GRAPH_SLEEP_RELEASE_STACK \(was True, now False\)"):
        init_device(worker)
    assert worker.seen_nccl == "unset" and not config.is_active() and routed == []
    monkeypatch.delenv("VLLM_GRAPH_SLEEP_RELEASE_STACK")  # as the first engine read them
    init_device(worker)
    assert config.is_active()


def test_a_worker_whose_init_device_fails_leaves_the_process_inactive(monkeypatch):
    """vLLM's own init_device failing (no memory, a bad device): the process
    must not stay marked active for a next engine, nor its shutdown make an
    allocator only to release pools."""
    monkeypatch.delenv("NCCL_GRAPH_REGISTER", raising=False)  # set back after the test
    monkeypatch.setattr(config, "_active_in_this_process", False)
    monkeypatch.setattr(
        config, "evaluate_gate", lambda vc, platform=None: config.Gate(vc.on, vc.on)
    )

    def failing_init_device(worker):
        assert config.is_active()  # the communicators' patches saw it on
        raise RuntimeError("CUDA error: out of memory")

    init_device = v1_worker_gpu_worker._wrap_init_device(failing_init_device)
    with pytest.raises(RuntimeError, match="out of memory"):
        init_device(FakeWorker(engine_config(on=True)))
    assert not config.is_active()


def test_worker_touches_nothing_when_the_gate_is_off(worker_patch):
    init_device, routed = worker_patch
    worker = FakeWorker(engine_config(on=False))
    init_device(worker)
    assert worker.seen_nccl == "unset"
    assert not config.is_active() and routed == []
    assert not hasattr(worker.vllm_config.model_config, "sleep_mode_backend")


def test_a_second_engine_starts_beside_what_the_first_still_holds(
    worker_patch, fake_allocator, caplog
):
    init_device, routed = worker_patch
    driver, manager = fake_allocator
    with manager.use_memory_pool("weights"):
        leftover = driver.malloc(PAGE)  # e.g. a rotary table vLLM caches per process
        driver.write(leftover, 9)
    worker = FakeWorker(engine_config(on=True))
    with caplog.at_level(logging.WARNING, logger="vllm.graph_sleep"):
        init_device(worker)
    assert "2.00 MiB of an earlier engine" in caplog.text
    assert manager.get_current_usage() == 0  # what vLLM asserts before loading weights
    with manager.use_memory_pool("weights"):
        weights = driver.malloc(PAGE)
    manager.sleep(offload_tags=("weights",))
    assert leftover in driver.memory and weights not in driver.memory
    manager.wake_up()
    assert bool((driver.read(leftover) == 9).all())
    driver.tensor_dies(leftover)
    manager.sleep(offload_tags=("weights",))  # a dead orphan is handed back like any
    assert leftover not in manager.allocations


def test_shutdown_resets_the_process_for_a_next_engine(monkeypatch, fake_allocator):
    driver, manager = fake_allocator
    platform = SimpleNamespace(_global_graph_pool=(1, 2))
    monkeypatch.setattr(v1_worker_gpu_worker, "_platform_class", lambda: platform)
    monkeypatch.setattr(config, "_active_in_this_process", True)
    with manager.cudagraph_pool() as pool:
        graph_memory = driver.malloc(PAGE)
    pool.segments.append(graph_memory)
    del pool
    calls = []
    shutdown = v1_worker_gpu_worker._wrap_shutdown(lambda worker: calls.append(worker))
    driver.tensor_dies(graph_memory)  # the graphs died with the model runner
    shutdown("worker")
    assert calls == ["worker"]
    assert not config.is_active() and platform._global_graph_pool is None
    assert manager.allocations == {} and driver.mapped_bytes() == 0
    with manager.cudagraph_pool() as new_pool:
        assert new_pool.segments == []  # a new engine gets a new graph pool


class FakeKvInitWorker:
    """Worker.initialize_from_config's shape in 0.26: one "kv_cache" pool around
    all of initialize_kv_cache, which allocates state and then the KV tensors."""

    def __init__(self, manager, driver, allocate_kv_tensors):
        self.manager, self.driver = manager, driver
        self.allocate_kv_tensors = allocate_kv_tensors
        self.pool_context = v1_worker_gpu_worker._wrap_maybe_get_memory_pool_context(
            lambda worker, tag: worker.manager.use_memory_pool(tag=tag)
        )

    def initialize_from_config(self) -> tuple[int, int, int]:
        with self.pool_context(self, tag="kv_cache"):
            block_table = self.driver.malloc(PAGE)
            kv = self.allocate_kv_tensors(self.driver)
            metadata = self.driver.malloc(PAGE)
        return block_table, kv, metadata


@pytest.mark.parametrize("active", [True, False])
def test_kv_init_state_is_runtime_and_only_kv_tensors_are_kv_cache(
    monkeypatch, install_allocator, active
):
    from tests.unit.fake_vmm import FakeVmmDriver
    from vllm_graph_sleep.allocator import GraphSleepAllocator
    from vllm_graph_sleep.patches._kv_tensors import in_kv_cache_pool

    driver = FakeVmmDriver()
    manager = GraphSleepAllocator(driver)
    install_allocator(manager)
    monkeypatch.setattr(config, "_active_in_this_process", active)
    allocate_kv_tensors = in_kv_cache_pool(lambda driver: driver.malloc(4 * PAGE))
    worker = FakeKvInitWorker(manager, driver, allocate_kv_tensors)
    block_table, kv, metadata = worker.initialize_from_config()
    tags = [manager.allocations[a].tag for a in (block_table, kv, metadata)]
    if active:
        assert tags == ["runtime", "kv_cache", "runtime"]
        # Level 1 then a kv_cache-only wake: the state comes back intact.
        driver.write(block_table, 7)
        manager.sleep(offload_tags=offload_tags_for(1, set(tags)))
        manager.wake_up(["kv_cache"])
        assert bool((driver.read(block_table) == 7).all())
    else:
        assert tags == ["kv_cache"] * 3  # stock 0.26


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
    ).save_pretrained(path)
    return str(path)


def _reaches_worker(engine_args) -> bool:
    """What workers receive: the VllmConfig, pickled as vLLM ships it."""
    vllm_config = engine_args.create_engine_config()
    shipped = pickle.loads(cloudpickle.dumps(vllm_config))
    return config.flag_requested(shipped)


def test_flag_from_the_cli_reaches_the_worker_config(tiny_model):
    vllm_graph_sleep.register()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    common = ["--model", tiny_model, "--skip-tokenizer-init"]
    on = AsyncEngineArgs.from_cli_args(
        parser.parse_args([*common, "--sleep-mode-offload-cudagraph"])
    )
    off = AsyncEngineArgs.from_cli_args(parser.parse_args(common))
    assert _reaches_worker(on) and not _reaches_worker(off)
    json_path = AsyncEngineArgs.from_cli_args(
        parser.parse_args(
            [*common, "--additional-config", '{"sleep_mode_offload_cudagraph": true}']
        )
    )
    assert _reaches_worker(json_path)


def test_flag_is_listed_in_help(capsys):
    vllm_graph_sleep.register()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert any("--sleep-mode-offload-cudagraph" in a.option_strings for a in parser._actions)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=all"])
    assert "--sleep-mode-offload-cudagraph" in capsys.readouterr().out


def test_flag_from_llm_keyword_reaches_the_worker_config(tiny_model):
    vllm_graph_sleep.register()
    from vllm.engine.arg_utils import EngineArgs

    # LLM(...) forwards its keywords to EngineArgs unchanged.
    keyword = EngineArgs(
        model=tiny_model, skip_tokenizer_init=True, sleep_mode_offload_cudagraph=True
    )
    merged = EngineArgs(
        model=tiny_model,
        skip_tokenizer_init=True,
        additional_config={"other": 1},
        sleep_mode_offload_cudagraph=True,
    )
    assert _reaches_worker(keyword)
    assert merged.additional_config == {"other": 1, config.FLAG: True}
    assert not _reaches_worker(EngineArgs(model=tiny_model, skip_tokenizer_init=True))


def test_the_flag_leaves_vllms_compile_cache_keys_unchanged(tiny_model):
    """vLLM keys its torch.compile cache directory by the config hash, its AOT
    compile cache and FlashInfer autotune cache by aot_compile_hash_factors; the
    flag (which changes no compiled code) must not change them, so a server with
    it on finds what a server without it compiled. Other additional_config keys
    still count, and the config the workers get keeps the flag."""
    vllm_graph_sleep.register()
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.engine.arg_utils import EngineArgs

    def built(**kwargs):
        return EngineArgs(model=tiny_model, skip_tokenizer_init=True, **kwargs)

    stock = built().create_engine_config()
    on = built(sleep_mode_offload_cudagraph=True).create_engine_config()
    off = built(sleep_mode_offload_cudagraph=False).create_engine_config()
    json_on = built(additional_config={config.FLAG: True}).create_engine_config()
    assert {c.compute_hash() for c in (on, off, json_on)} == {stock.compute_hash()}
    assert aot_compile_hash_factors(on) == aot_compile_hash_factors(stock)
    assert config.flag_requested(on) and config.flag_requested(pickle.loads(pickle.dumps(on)))
    other = built(additional_config={"other": 1}, sleep_mode_offload_cudagraph=True)
    other_config = other.create_engine_config()
    assert other_config.compute_hash() != stock.compute_hash()
    assert other_config.additional_config == {"other": 1, config.FLAG: True}
    alone = built(additional_config={"other": 1}).create_engine_config()
    assert other_config.compute_hash() == alone.compute_hash()


def test_the_worker_choosing_our_backend_leaves_the_compile_cache_keys_unchanged(
    tiny_model, worker_patch, monkeypatch
):
    """A worker with graph offload on selects our sleep-mode backend in its
    model_config in init_device, before vLLM compiles the model and takes the
    cache keys; vLLM hashes ModelConfig.sleep_mode_backend, so the keys must
    still be a stock server's (on the H200, ours and stock with graphs compiled
    into two caches whose config hashes alone differed)."""
    vllm_graph_sleep.register()
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.engine.arg_utils import EngineArgs

    def built(**kwargs):
        return EngineArgs(model=tiny_model, skip_tokenizer_init=True, **kwargs)

    init_device, routed = worker_patch
    monkeypatch.setattr(config, "evaluate_gate", lambda vc, platform=None: config.Gate(True, True))
    stock = built().create_engine_config()
    worker = FakeWorker(built(sleep_mode_offload_cudagraph=True).create_engine_config())
    init_device(worker)
    assert routed == [1]
    assert worker.vllm_config.compute_hash() == stock.compute_hash()
    assert aot_compile_hash_factors(worker.vllm_config) == aot_compile_hash_factors(stock)
    # Hashed as without it, still ours where vLLM reads it at the first sleep.
    assert worker.vllm_config.model_config.sleep_mode_backend == config.BACKEND_NAME
    # What the hash leaves out is ours alone: a stock config choosing a
    # backend by name is hashed as vLLM hashes it.
    chosen = built(additional_config={"other": 1}).create_engine_config()
    chosen.model_config.sleep_mode_backend = config.BACKEND_NAME
    alone = built(additional_config={"other": 1}).create_engine_config()
    assert chosen.compute_hash() != alone.compute_hash()


def _serve_engine_args(*argv: str):
    """EngineArgs exactly as `vllm serve ARGV` builds them (parser and from_cli_args)."""
    vllm_graph_sleep.register()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["m", *argv])
    return AsyncEngineArgs.from_cli_args(args)


JSON_ON = '{"sleep_mode_offload_cudagraph": true, "other": 1}'


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ((), None),
        (("--sleep-mode-offload-cudagraph",), True),
        (("--no-sleep-mode-offload-cudagraph",), False),
        (("--additional-config", JSON_ON), True),
        # An explicit flag wins over the JSON, in either order.
        (("--additional-config", JSON_ON, "--no-sleep-mode-offload-cudagraph"), False),
        (("--no-sleep-mode-offload-cudagraph", "--additional-config", JSON_ON), False),
    ],
)
def test_serve_flag_forms(argv, expected):
    additional = _serve_engine_args(*argv).additional_config or {}
    assert additional.get(config.FLAG) == expected
    if "--additional-config" in argv:
        assert additional["other"] == 1  # the rest of the JSON is kept
    assert config.flag_requested(SimpleNamespace(additional_config=additional)) == bool(expected)


@pytest.mark.parametrize(
    ("value", "expected"), [(True, True), ("on", True), (1, True), (False, False), ("No", False)]
)
def test_the_additional_config_flag_reads_yes_and_no(value, expected):
    additional = {config.FLAG: value}
    assert config.flag_requested(SimpleNamespace(additional_config=additional)) is expected


@pytest.mark.parametrize("value", ["ture", 2, [True], {"on": True}])
def test_an_additional_config_flag_neither_yes_nor_no_is_refused_with_the_arguments(value):
    # A typo used to leave graph offload quietly off.
    vllm_graph_sleep.register()
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="sleep_mode_offload_cudagraph.*is not a yes/no value"):
        EngineArgs(model="m", additional_config={config.FLAG: value})
    with pytest.raises(ValueError, match="is not a yes/no value"):
        _serve_engine_args("--additional-config", json.dumps({config.FLAG: value}))
    # Refused even beside an explicit flag that would decide: it is still a typo.
    with pytest.raises(ValueError, match="is not a yes/no value"):
        EngineArgs(
            model="m", additional_config={config.FLAG: value}, sleep_mode_offload_cudagraph=False
        )


def test_llm_keyword_false_wins_over_additional_config():
    vllm_graph_sleep.register()
    from vllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs(
        model="m",
        additional_config={config.FLAG: True},
        sleep_mode_offload_cudagraph=False,
    )
    assert engine_args.additional_config == {config.FLAG: False}


@pytest.mark.parametrize(
    "level,tags,expected",
    [
        (1, {"weights", "kv_cache", "cudagraph"}, ("cudagraph", "weights")),
        (2, {"weights", "kv_cache", "cudagraph"}, ("cudagraph",)),
        (1, {"weights", "kv_cache"}, ("weights",)),
        (2, {"weights", "kv_cache", "cudagraph", "runtime"}, ("cudagraph", "runtime")),
    ],
)
def test_level_policy(level, tags, expected):
    assert offload_tags_for(level, tags) == expected


@pytest.mark.parametrize("level", [0, 3, -1, "1"])
def test_backend_rejects_levels_other_than_1_and_2(level):
    with pytest.raises(ValueError, match="sleep level must be one of"):
        offload_tags_for(level, {"weights"})


def test_backend_is_registered_in_vllms_factory():
    vllm_graph_sleep.register()
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    from vllm_graph_sleep.backend import GraphSleepBackend

    assert SleepModeBackendFactory.get_backend_class(config.BACKEND_NAME) is GraphSleepBackend
    vllm_graph_sleep.register()  # idempotent: a second registration would raise in vLLM


@pytest.mark.parametrize(
    "initialized,custom,active,expected",
    [
        (False, None, True, "off"),
        (True, None, True, "off"),
        (True, SimpleNamespace(disabled=True), True, "off"),
        (True, SimpleNamespace(disabled=False), True, "copy-in"),
        (True, SimpleNamespace(disabled=False), False, "registered"),
    ],
)
def test_probe_reports_the_custom_all_reduce_mode(
    monkeypatch, initialized, custom, active, expected
):
    from vllm.distributed import parallel_state

    from vllm_graph_sleep.probe import custom_all_reduce_mode

    group = SimpleNamespace(device_communicator=SimpleNamespace(ca_comm=custom))
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: initialized)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    monkeypatch.setattr(config, "_active_in_this_process", active)
    assert custom_all_reduce_mode() == expected


def test_probe_counts_private_pool_segments_no_sleep_allocator_made():
    from vllm_graph_sleep.probe import foreign_pool_bytes

    segments = [
        # torch's ordinary allocator, whoever made it
        {"segment_pool_id": (0, 0), "address": 0x1000, "total_size": 1 << 20},
        # a sleep-mode allocator's pools (graph pool, kv_cache pool)
        {"segment_pool_id": (3, 0), "address": 0x2000, "total_size": 2 << 20},
        {"segment_pool_id": (4, 0), "address": 0x3000, "total_size": 4 << 20},
        # a graph's own private pool, made by cudaMalloc
        {"segment_pool_id": (0, 7), "address": 0x4000, "total_size": 8 << 20},
        {"segment_pool_id": (0, 7), "address": 0x5000, "total_size": 16 << 20},
    ]
    ours = {0x2000, 0x3000}
    assert foreign_pool_bytes(segments, ours) == 24 << 20
    assert foreign_pool_bytes(segments, ours | {0x1000}) == 24 << 20
    assert foreign_pool_bytes(segments, set()) == 30 << 20
    assert foreign_pool_bytes(segments[:3], ours) == 0
    # An earlier in-process engine's graph pool is not this engine's.
    assert foreign_pool_bytes(segments, ours, frozenset({(0, 7)})) == 0
    assert foreign_pool_bytes(segments, set(), frozenset({(0, 7)})) == 6 << 20


def test_probe_remembers_pools_only_where_cuda_is_already_up(monkeypatch):
    from vllm_graph_sleep import earlier_pools, probe

    segments = [
        {"segment_pool_id": (0, 0), "address": 0x1000, "total_size": 1 << 20},
        {"segment_pool_id": (0, 7), "address": 0x4000, "total_size": 8 << 20},
    ]
    monkeypatch.setattr(earlier_pools.torch.cuda, "memory_snapshot", lambda **_: segments)
    monkeypatch.setattr(earlier_pools, "_pools_of_earlier_engines", frozenset())
    monkeypatch.setattr(earlier_pools.torch.cuda, "is_initialized", lambda: True)
    earlier_pools.remember_pools_of_earlier_engines()
    assert earlier_pools.pools_of_earlier_engines() == {(0, 7)}
    assert probe.pool_bytes(segments, earlier_pools.pools_of_earlier_engines()) == 8 << 20
    # A fresh worker process: nothing earlier, and CUDA is not started here.
    monkeypatch.setattr(earlier_pools.torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(
        earlier_pools.torch.cuda, "memory_snapshot", lambda **_: pytest.fail("CUDA started")
    )
    earlier_pools.remember_pools_of_earlier_engines()
    assert earlier_pools.pools_of_earlier_engines() == frozenset()


def test_probe_adds_registered_host_buffers_to_torchs_pinned_host_allocator(monkeypatch):
    import torch

    from vllm_graph_sleep import _native, probe

    stats = {"allocated_bytes.current": 1028 * 2**20, "host_alloc_time.total": 50_000}
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: stats)
    monkeypatch.setattr(_native, "registered_host_memory", lambda: (240 * 2**20, 0.025))
    assert probe.pinned_host() == {
        "bytes": 1268 * 2**20,
        "pinning_s": pytest.approx(0.075),
        "registered_bytes": 240 * 2**20,
    }

    def unavailable():
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(torch.cuda, "host_memory_stats", unavailable)
    assert probe.pinned_host() is None
    monkeypatch.setattr(torch.cuda, "host_memory_stats", dict)  # torch without CUDA
    assert probe.pinned_host() is None
