"""Lets vLLM's config code run on a machine without a GPU.

vLLM resolves its platform from the hardware; on a CI machine with no GPU the
CUDA wheel resolves an unspecified platform that cannot infer a device, and
config construction fails. The CPU platform is what such a machine is, so the
tests that build vLLM configs force it there (and leave a GPU machine alone).
"""

import torch


def force_cpu_platform() -> None:
    if torch.cuda.is_available():
        return
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
