"""Collectives under the graph pool (CPU): with graph offload active, vLLM's and
AITER's custom all-reduce never IPC-register graph-pool memory during capture;
with it off they behave exactly as stock vLLM 0.26.0.

No GPU here: vLLM's CustomAllreduce is built with object.__new__ and its C++ op
is replaced by a recorder; AITER is the fake in tests/unit/fake_aiter; "the
stream is capturing" is torch.cuda.is_current_stream_capturing returning True.
"""

import pytest
import torch
import vllm._aiter_ops as aiter_ops
from vllm.distributed.device_communicators import custom_all_reduce as vllm_ca
from vllm.distributed.device_communicators.aiter_custom_all_reduce import AiterCustomAllreduce

from tests.unit import fake_aiter
from vllm_graph_sleep import aiter_all_reduce, config
from vllm_graph_sleep.all_reduce_counts import captured_all_reduces
from vllm_graph_sleep.patches import (
    distributed_device_communicators_aiter_custom_all_reduce as aiter_patch,
)
from vllm_graph_sleep.patches import distributed_device_communicators_custom_all_reduce as ca_patch
from vllm_graph_sleep.patches._wrap import IncompatibleVllmError, is_wrapped, original_of

ACTIVE = pytest.mark.parametrize("active", [True, False], ids=["active", "inactive"])


@pytest.fixture(autouse=True)
def patched():
    ca_patch.apply()
    aiter_patch.apply()


@pytest.fixture
def gate(monkeypatch):
    def set_active(value: bool) -> None:
        monkeypatch.setattr(config, "_active_in_this_process", value)

    set_active(False)
    return set_active


@pytest.fixture
def stream(monkeypatch):
    """stream.capturing is what torch.cuda.is_current_stream_capturing() says."""

    class Stream:
        capturing = False

    state = Stream()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    return state


def hidden(tokens=4, width=256):
    return torch.randn(tokens, width, dtype=torch.bfloat16)


# --- vLLM's CustomAllreduce ------------------------------------------------------

STAGING = [0x7000_0000, 0x7100_0000]  # buffer_ptrs: the pre-registered IPC buffers
HANDLE = 0xCA


@pytest.fixture
def vllm_comm(monkeypatch):
    """A CustomAllreduce as __init__ leaves it on rank 1 of 2, without a GPU.
    comm.launches records (handle, reg_buffer, reg_buffer_sz_bytes) of every
    ops.all_reduce: reg_buffer 0 means the kernel reads the input in place
    (registered=True); otherwise the input is first copied into reg_buffer."""
    launches = []

    def all_reduce(fa, inp, out, reg_buffer, reg_buffer_sz_bytes):
        launches.append((fa, reg_buffer, reg_buffer_sz_bytes))

    monkeypatch.setattr(vllm_ca.ops, "all_reduce", all_reduce)
    comm = object.__new__(vllm_ca.CustomAllreduce)
    comm._IS_CAPTURING = False
    comm.disabled = False
    comm._ptr = HANDLE
    comm.rank = 1
    comm.world_size = 2
    comm.fully_connected = True
    comm.max_size = 8192 * 1024
    comm.buffer_ptrs = STAGING
    comm.launches = launches
    # capture() exports the recorded graph inputs at exit; no peers here.
    comm.register_graph_buffers = lambda: None
    yield comm
    comm._ptr = 0  # close() from __del__ must not dispose the fake handle


def test_vllm_capture_stages_through_the_ipc_buffer_when_active(gate, stream, vllm_comm):
    gate(True)
    x = hidden()
    with vllm_comm.capture():
        stream.capturing = True
        out = vllm_comm.custom_all_reduce(x)
        assert vllm_comm.launches == [(HANDLE, STAGING[1], vllm_comm.max_size)]
        assert out.shape == x.shape and out.dtype == x.dtype
        vllm_comm.custom_all_reduce(x)
    assert captured_all_reduces(vllm_comm) == {"copy_in": 2, "registered": 0}


@ACTIVE
def test_vllm_captured_all_reduces_are_counted_only_when_active(gate, stream, vllm_comm, active):
    gate(active)
    with vllm_comm.capture():
        vllm_comm.all_reduce(hidden())  # warm-up pass: the stream is not capturing
        stream.capturing = True
        vllm_comm.all_reduce(hidden(), registered=True)  # what stock capture does
        vllm_comm.all_reduce(hidden())
    expected = {"copy_in": 1, "registered": 1} if active else {"copy_in": 0, "registered": 0}
    assert captured_all_reduces(vllm_comm) == expected


def test_vllm_counting_stays_out_of_eager_all_reduces(gate, stream, vllm_comm):
    """The counter is test instrumentation: it exists only inside capture(), so the
    all_reduce of every eager step is vLLM's own method, not a wrapper."""
    gate(True)
    assert not is_wrapped(vllm_ca.CustomAllreduce.all_reduce)
    with vllm_comm.capture():
        assert "all_reduce" in vars(vllm_comm)
    assert "all_reduce" not in vars(vllm_comm)
    stream.capturing = True  # even a capture outside capture() is not counted
    vllm_comm.all_reduce(hidden())
    assert captured_all_reduces(vllm_comm) == {"copy_in": 0, "registered": 0}


def test_vllm_capture_registers_the_input_when_inactive(gate, stream, vllm_comm):
    vllm_comm._IS_CAPTURING = stream.capturing = True
    vllm_comm.custom_all_reduce(hidden())
    assert vllm_comm.launches == [(HANDLE, 0, 0)]  # stock: registered=True


@ACTIVE
def test_vllm_eager_all_reduce_is_unchanged(gate, stream, vllm_comm, active):
    gate(active)
    vllm_comm.custom_all_reduce(hidden())
    assert vllm_comm.launches == [(HANDLE, STAGING[1], vllm_comm.max_size)]


@ACTIVE
def test_vllm_warm_up_pass_is_unchanged(gate, stream, vllm_comm, active):
    """Capturing flag set, stream not capturing: stock returns an empty tensor."""
    gate(active)
    vllm_comm._IS_CAPTURING = True
    x = hidden()
    out = vllm_comm.custom_all_reduce(x)
    assert vllm_comm.launches == [] and out.shape == x.shape


@ACTIVE
@pytest.mark.parametrize("why", ["disabled", "ineligible"])
def test_vllm_capture_declines_as_stock(gate, stream, vllm_comm, active, why):
    gate(active)
    vllm_comm._IS_CAPTURING = stream.capturing = True
    x = hidden()
    if why == "disabled":
        vllm_comm.disabled = True
    else:
        x = torch.randn(3, dtype=torch.bfloat16)  # 6 bytes: not a multiple of 16
    assert vllm_comm.custom_all_reduce(x) is None
    assert vllm_comm.launches == []


@ACTIVE
def test_vllm_capture_context_still_registers_at_exit(gate, vllm_comm, active):
    """capture() keeps its behaviour: it registers what was captured at exit (with
    copy-in, that is the staging buffer) and clears the capturing flag."""
    gate(active)
    exports = []
    vllm_comm.register_graph_buffers = lambda: exports.append(True)
    with vllm_comm.capture():
        assert vllm_comm._IS_CAPTURING
    assert exports == [True] and not vllm_comm._IS_CAPTURING
    assert not is_wrapped(vllm_ca.CustomAllreduce.register_graph_buffers)


def test_vllm_patch_fails_loudly_on_an_unexpected_shape(monkeypatch):
    monkeypatch.setattr(vllm_ca.CustomAllreduce, "all_reduce", lambda self, inp: None)
    with pytest.raises(IncompatibleVllmError, match=r"all_reduce.*registered.*0\.26\.0"):
        ca_patch.apply()


# --- AITER ------------------------------------------------------------------------


@pytest.fixture
def aiter(monkeypatch):
    return fake_aiter.install(monkeypatch)


@pytest.fixture
def old_aiter(monkeypatch):
    return fake_aiter.install(monkeypatch, old=True)


@pytest.fixture
def tp_group(monkeypatch):
    """Makes rocm_aiter_ops.get_aiter_allreduce() return the given communicator."""

    def use(comm):
        monkeypatch.setattr(aiter_ops.rocm_aiter_ops, "get_aiter_allreduce", lambda: comm)

    return use


def test_aiter_is_built_without_capture_registration_when_active(gate, aiter):
    gate(True)
    comm = AiterCustomAllreduce(group="tp", device="cuda:0")
    assert aiter.CustomAllreduce.constructions == [
        (
            ("tp", "cuda:0"),
            {"max_size": AiterCustomAllreduce.MAX_SIZE, aiter_all_reduce.KEYWORD: False},
        )
    ]
    assert comm.aiter_ca.enable_register_for_capturing is False
    assert comm.aiter_ca.max_size == AiterCustomAllreduce.MAX_SIZE


def test_aiter_keeps_an_explicit_max_size_when_active(gate, aiter):
    gate(True)
    comm = AiterCustomAllreduce("tp", "cuda:0", 1 << 20)
    assert comm.aiter_ca.max_size == 1 << 20
    assert comm.aiter_ca.enable_register_for_capturing is False


@pytest.mark.parametrize("old", [False, True], ids=["aiter", "old-aiter"])
def test_aiter_is_built_exactly_as_stock_when_inactive(gate, monkeypatch, old):
    module = fake_aiter.install(monkeypatch, old=old)
    comm = AiterCustomAllreduce(group="tp", device="cuda:0")
    assert module.CustomAllreduce.constructions == [
        (("tp", "cuda:0"), {"max_size": AiterCustomAllreduce.MAX_SIZE})
    ]
    # No launcher is shadowed on the instance: every call reaches AITER's own.
    assert not set(aiter_all_reduce.LAUNCHERS) & set(vars(comm.aiter_ca))


def test_old_aiter_is_refused_with_the_fix_when_active(gate, old_aiter):
    gate(True)
    with pytest.raises(aiter_all_reduce.IncompatibleAiterError) as error:
        AiterCustomAllreduce(group="tp", device="cuda:0")
    message = str(error.value)
    for expected in (
        "enable_register_for_capturing",
        old_aiter.FAKE_VERSION,
        "ROCm/aiter#2075",
        "upgrade AITER",
        "--disable-custom-all-reduce",
        "VLLM_ROCM_USE_AITER_CUSTOM_AR=0",
    ):
        assert expected in message
    assert old_aiter.CustomAllreduce.constructions == []  # nothing built, no IPC buffers


def test_aiter_launcher_without_registered_is_refused_when_active(gate, aiter, monkeypatch):
    monkeypatch.setattr(
        aiter.CustomAllreduce, "fused_qknorm_ar", lambda self, qkv_in, q_w, k_w, eps: None
    )
    gate(True)
    with pytest.raises(
        aiter_all_reduce.IncompatibleAiterError, match="fused_qknorm_ar.*registered"
    ):
        AiterCustomAllreduce(group="tp", device="cuda:0")


@ACTIVE
def test_aiter_all_reduce_capture(gate, stream, aiter, active):
    gate(active)
    comm = AiterCustomAllreduce(group="tp", device="cuda:0")
    x = hidden()
    with comm.capture():
        stream.capturing = True
        comm.custom_all_reduce(x)
        stream.capturing = False
    assert comm.aiter_ca.launches == [("all_reduce", not active)]
    assert comm.aiter_ca.ipc_registered == ([] if active else [x])


PER_GROUP_OPS = pytest.mark.parametrize(
    "impl,outputs",
    [
        (aiter_ops._rocm_aiter_fused_allreduce_rmsnorm_quant_per_group_impl, 3),
        (aiter_ops._rocm_aiter_fused_allreduce_rmsnorm_quant_per_group_with_bf16_norm_impl, 4),
    ],
    ids=["per-group", "per-group-bf16-norm"],
)


@ACTIVE
@PER_GROUP_OPS
def test_aiter_per_group_quant_op_under_capture(
    gate, stream, aiter, tp_group, active, impl, outputs
):
    gate(active)
    comm = AiterCustomAllreduce(group="tp", device="cuda:0")
    tp_group(comm)
    x = hidden()
    with comm.capture():
        stream.capturing = True
        result = impl(x, hidden(), torch.ones(256, dtype=torch.bfloat16), 1e-6, 128)
        stream.capturing = False
    assert len(result) == outputs
    # Stock vLLM passes registered=torch.cuda.is_current_stream_capturing().
    assert comm.aiter_ca.launches == [("fused_ar_rms_per_group_quant", not active)]
    assert comm.aiter_ca.ipc_registered == ([] if active else [x])


@ACTIVE
@PER_GROUP_OPS
def test_aiter_per_group_quant_op_eager_is_unchanged(
    gate, stream, aiter, tp_group, active, impl, outputs
):
    gate(active)
    comm = AiterCustomAllreduce(group="tp", device="cuda:0")
    tp_group(comm)
    impl(hidden(), hidden(), torch.ones(256, dtype=torch.bfloat16), 1e-6, 128)
    assert comm.aiter_ca.launches == [("fused_ar_rms_per_group_quant", False)]


@ACTIVE
def test_aiter_fused_ar_rmsnorm_op_under_capture(gate, stream, aiter, tp_group, active):
    """AITER's custom_fused_ar_rms passes registered=True while capturing
    whatever enable_register_for_capturing says; active, the launcher is forced
    to the copy-in path."""
    gate(active)
    comm = AiterCustomAllreduce(group="tp", device="cuda:0")
    tp_group(comm)
    x = hidden()
    with comm.capture():
        stream.capturing = True
        aiter_ops._rocm_aiter_fused_allreduce_rmsnorm_impl(
            x, hidden(), torch.ones(256, dtype=torch.bfloat16), 1e-6
        )
        stream.capturing = False
    assert comm.aiter_ca.launches == [("fused_ar_rms", not active)]
    assert comm.aiter_ca.ipc_registered == ([] if active else [x])


@ACTIVE
def test_aiter_fused_qknorm_under_capture(gate, stream, aiter, active):
    """MiniMax's path (rms_norm_tp.py) calls aiter_ca.custom_fused_qknorm_ar."""
    gate(active)
    comm = AiterCustomAllreduce(group="tp", device="cuda:0")
    qkv = torch.randn(4, 512, dtype=torch.bfloat16)
    q_w = torch.ones(256, dtype=torch.bfloat16)
    k_w = torch.ones(128, dtype=torch.bfloat16)
    with comm.capture():
        stream.capturing = True
        comm.aiter_ca.custom_fused_qknorm_ar(qkv, q_w, k_w, 1e-6)
        stream.capturing = False
    assert comm.aiter_ca.launches == [("fused_qknorm_ar", not active)]
    assert comm.aiter_ca.ipc_registered == ([] if active else [qkv])


def test_aiter_capture_refuses_an_instance_built_before_activation(gate, aiter):
    comm = AiterCustomAllreduce(group="tp", device="cuda:0")  # gate still off
    gate(True)
    with pytest.raises(RuntimeError, match="built before"):
        comm.capture()


# --- both -------------------------------------------------------------------------


def test_apply_twice_is_a_no_op():
    def current():
        return (
            vllm_ca.CustomAllreduce.custom_all_reduce,
            AiterCustomAllreduce.__init__,
            AiterCustomAllreduce.capture,
        )

    first = current()
    ca_patch.apply()
    aiter_patch.apply()
    ca_patch.apply()
    aiter_patch.apply()
    assert current() == first
    for wrapper in first:
        assert is_wrapped(wrapper)
        assert not is_wrapped(original_of(wrapper))  # wrapped once, not twice
