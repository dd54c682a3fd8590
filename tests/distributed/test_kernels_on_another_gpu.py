"""Our Triton kernels over memory of a GPU that is not the current one (two
GPUs): Triton launches on the current device, so each kernel's caller makes
its tensors' device current (vllm_graph_sleep.triton_device). Without that,
these launches would run on cuda:0 over cuda:1's memory."""

from __future__ import annotations

import pytest
import torch

from tests.unit.fingerprint_reference import fingerprints as reference_fingerprints
from tests.utils import requires_gpu

pytestmark = [requires_gpu, pytest.mark.distributed(num_gpus=2)]


def _random_bytes(size: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(size)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).to(device)


def test_the_fingerprint_kernel_runs_where_its_memory_is():
    from vllm_graph_sleep.memory import fingerprint_kernel
    from vllm_graph_sleep.memory.fingerprints import BLOCK_BYTES, LANES, blocks

    torch.cuda.set_device(0)
    data = _random_bytes(3 * BLOCK_BYTES + 4096, "cuda:1")
    out = torch.empty((blocks(data.numel()), LANES), dtype=torch.int64, device="cuda:1")
    fingerprint_kernel.fingerprint([data], out)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert torch.equal(out.cpu(), reference_fingerprints(data.cpu()))


def test_the_codec_codes_and_decodes_where_its_memory_is():
    from vllm_graph_sleep import exponent_codec

    torch.cuda.set_device(0)
    weights = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).to(
        torch.bfloat16
    )
    data = weights.view(torch.uint8).to("cuda:1")
    encoded = exponent_codec.encode(data)
    assert encoded is not None, "bf16 weights of N(0, 0.02) shrink"
    out = torch.empty_like(data)
    exponent_codec.decode_into(encoded, out)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert torch.equal(out.cpu(), data.cpu())
