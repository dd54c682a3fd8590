"""Fake of aiter.dist.device_communicators.custom_all_reduce for an AITER from
before ROCm/aiter#2075: the constructor has no enable_register_for_capturing,
capture always reads graph inputs in place, and there is no per-group FP8
launcher. See tests/unit/fake_aiter/__init__.py."""

from __future__ import annotations

from contextlib import contextmanager

import torch

FAKE_VERSION = "0.1.0+fake-old"


class CustomAllreduce:
    _SUPPORTED_WORLD_SIZES = [2, 4, 6, 8]

    # Test hook, not in AITER: the raw arguments of every construction.
    constructions: list = []

    def __new__(cls, *args, **kwargs):
        cls.constructions.append((args, kwargs))
        return super().__new__(cls)

    def __init__(self, group, device, max_size=8192 * 1024 * 8) -> None:
        self._IS_CAPTURING = False
        self.disabled = False
        self.group = group
        self.device = device
        self.max_size = max_size
        self.rank = 0
        self.world_size = 2
        self.fully_connected = True
        self.launches: list[tuple[str, bool]] = []
        self.ipc_registered: list[torch.Tensor] = []
        self._graph_inputs: list[torch.Tensor] = []

    @contextmanager
    def capture(self):
        try:
            self._IS_CAPTURING = True
            yield
        finally:
            self._IS_CAPTURING = False
            if not self.disabled:
                self.ipc_registered.extend(self._graph_inputs)
                self._graph_inputs.clear()

    def _launch(self, name: str, inp: torch.Tensor, registered: bool) -> None:
        self.launches.append((name, registered))
        if registered and torch.cuda.is_current_stream_capturing():
            self._graph_inputs.append(inp)

    def should_custom_ar(self, inp: torch.Tensor):
        size = inp.numel() * inp.element_size()
        return not self.disabled and size % 16 == 0 and size <= self.max_size

    def all_reduce(
        self,
        inp: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        use_new: bool = True,
        open_fp8_quant: bool = False,
        registered: bool = False,
    ):
        self._launch("all_reduce", inp, registered)
        return torch.empty_like(inp) if out is None else out

    def custom_all_reduce(
        self, input: torch.Tensor, use_new: bool = True, open_fp8_quant: bool = False
    ):
        if self.disabled or not self.should_custom_ar(input):
            return None
        if self._IS_CAPTURING:
            if torch.cuda.is_current_stream_capturing():
                return self.all_reduce(input, registered=True)
            return torch.zeros_like(input)
        return self.all_reduce(input, registered=False)

    def fused_ar_rms(
        self,
        inp: torch.Tensor,
        res_inp: torch.Tensor,
        *,
        res_out: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        w: torch.Tensor,
        eps: float,
        registered: bool = False,
        use_1stage: bool = False,
    ):
        self._launch("fused_ar_rms", inp, registered)
        return torch.empty_like(inp), torch.empty_like(res_inp)

    def custom_fused_ar_rms(
        self,
        input: torch.Tensor,
        residual_inp: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        use_1stage: bool,
    ):
        if self.disabled or not self.should_custom_ar(input):
            return None
        if self._IS_CAPTURING:
            if torch.cuda.is_current_stream_capturing():
                return self.fused_ar_rms(
                    input, residual_inp, w=weight, eps=eps, registered=True, use_1stage=use_1stage
                )
            return torch.zeros_like(input), torch.zeros_like(residual_inp)
        return self.fused_ar_rms(
            input, residual_inp, w=weight, eps=eps, registered=False, use_1stage=use_1stage
        )

    def close(self) -> None:
        pass
