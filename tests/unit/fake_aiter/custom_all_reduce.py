"""Fake of aiter.dist.device_communicators.custom_all_reduce for a current AITER
(with ROCm/aiter#2075's enable_register_for_capturing and the per-group FP8
launcher of ROCm/aiter#2823). See tests/unit/fake_aiter/__init__.py."""

from __future__ import annotations

from contextlib import contextmanager

import torch

FAKE_VERSION = "0.1.99+fake"


class CustomAllreduce:
    _SUPPORTED_WORLD_SIZES = [2, 4, 6, 8]

    # Test hook, not in AITER: the raw arguments of every construction, so a
    # test can check how vLLM called the constructor.
    constructions: list = []

    def __new__(cls, *args, **kwargs):
        cls.constructions.append((args, kwargs))
        return super().__new__(cls)

    def __init__(
        self,
        group,
        device,
        max_size=1024 * 1024 * 1024,
        enable_register_for_capturing: bool = True,
    ) -> None:
        # A two-rank, fully connected group; no devices or IPC are touched.
        self._IS_CAPTURING = False
        self.disabled = False
        self.group = group
        self.device = device
        self.max_size = max_size
        self.rank = 0
        self.world_size = 2
        self.fully_connected = True
        self.enable_register_for_capturing = enable_register_for_capturing
        self._pool = {"input": object()}  # vLLM's supports_dynamic_hidden_dim probes this
        # What the fake records in place of kernels:
        self.launches: list[tuple[str, bool]] = []  # (launcher, registered), in order
        self._graph_inputs: list[torch.Tensor] = []  # read in place during capture
        self.ipc_registered: list[torch.Tensor] = []  # what capture() exported

    # --- capture and registration -------------------------------------------------

    @contextmanager
    def capture(self):
        try:
            self._IS_CAPTURING = True
            yield
        finally:
            self._IS_CAPTURING = False
            if not self.disabled:
                # AITER's flush_graph_buffers: IPC-export what capture recorded.
                self.ipc_registered.extend(self._graph_inputs)
                self._graph_inputs.clear()

    def _launch(self, name: str, inp: torch.Tensor, registered: bool) -> None:
        self.launches.append((name, registered))
        if registered and torch.cuda.is_current_stream_capturing():
            # The kernel reads inp in place; its address is exported at flush.
            self._graph_inputs.append(inp)

    def should_custom_ar(self, inp: torch.Tensor, prefill_support: bool = False):
        if self.disabled:
            return False
        size = inp.numel() * inp.element_size()
        return size % 16 == 0 and inp.is_contiguous() and size <= self.max_size

    # --- plain all-reduce ---------------------------------------------------------

    def all_reduce(
        self,
        inp: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        use_new: bool = True,
        open_fp8_quant: bool = False,
        registered_input: bool = False,
    ):
        self._launch("all_reduce", inp, registered_input)
        return torch.empty_like(inp) if out is None else out

    def custom_all_reduce(
        self, input: torch.Tensor, use_new: bool = True, open_fp8_quant: bool = False
    ):
        if self.disabled or not self.should_custom_ar(input):
            return None
        if self._IS_CAPTURING:
            if torch.cuda.is_current_stream_capturing():
                # As in AITER: the keyword picks in-place read or copy-in.
                return self.all_reduce(
                    input,
                    use_new=use_new,
                    open_fp8_quant=open_fp8_quant,
                    registered_input=self.enable_register_for_capturing,
                )
            return torch.zeros_like(input)  # warm-up pass
        return self.all_reduce(
            input, use_new=use_new, open_fp8_quant=open_fp8_quant, registered_input=False
        )

    # --- fused all-reduce + RMSNorm ---------------------------------------------

    def fused_ar_rms(
        self,
        inp: torch.Tensor,
        res_inp: torch.Tensor,
        *,
        res_out: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        scale_out: torch.Tensor | None = None,
        w: torch.Tensor,
        eps: float,
        registered: bool = False,
        use_1stage: bool = False,
        post_per_token_quant: bool = False,
        out_hidden_dim: int = 0,
        gemma_norm: bool = False,
        emit_bf16: bool = False,
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
        out_hidden_dim: int = 0,
        gemma_norm: bool = False,
    ):
        if self.disabled or not self.should_custom_ar(input):
            return None
        if self._IS_CAPTURING:
            if torch.cuda.is_current_stream_capturing():
                # As in AITER: registered=True whatever the keyword says.
                return self.fused_ar_rms(
                    input,
                    residual_inp,
                    w=weight,
                    eps=eps,
                    registered=True,
                    use_1stage=use_1stage,
                    out_hidden_dim=out_hidden_dim,
                    gemma_norm=gemma_norm,
                )
            return torch.zeros_like(input), torch.zeros_like(residual_inp)
        return self.fused_ar_rms(
            input,
            residual_inp,
            w=weight,
            eps=eps,
            registered=False,
            use_1stage=use_1stage,
            out_hidden_dim=out_hidden_dim,
            gemma_norm=gemma_norm,
        )

    def fused_ar_rms_per_group_quant(
        self,
        inp: torch.Tensor,
        res_inp: torch.Tensor,
        *,
        w: torch.Tensor,
        eps: float,
        group_size: int = 128,
        registered: bool = False,
        use_1stage: bool = False,
        emit_bf16: bool = False,
    ):
        self._launch("fused_ar_rms_per_group_quant", inp, registered)
        groups = inp.shape[-1] // group_size
        quantized = torch.empty(inp.shape, dtype=torch.float8_e4m3fn)
        scales = torch.empty(inp.shape[:-1] + (groups,), dtype=torch.float32)
        if emit_bf16:
            return quantized, torch.empty_like(inp), scales, torch.empty_like(inp)
        return quantized, torch.empty_like(inp), scales

    # --- fused QK-norm + all-reduce (MiniMax) ---------------------------------------

    def fused_qknorm_ar(
        self,
        qkv_in: torch.Tensor,
        q_w: torch.Tensor,
        k_w: torch.Tensor,
        eps: float,
        registered: bool = False,
    ):
        self._launch("fused_qknorm_ar", qkv_in, registered)
        tokens = qkv_in.shape[0]
        q, k = q_w.shape[-1], k_w.shape[-1]
        return (
            qkv_in.new_empty((tokens, q)),
            qkv_in.new_empty((tokens, k)),
            qkv_in.new_empty((tokens, qkv_in.shape[1] - q - k)),
        )

    def custom_fused_qknorm_ar(
        self, qkv_in: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float
    ):
        if self._IS_CAPTURING and torch.cuda.is_current_stream_capturing():
            # As in AITER: registered=True whatever the keyword says.
            return self.fused_qknorm_ar(qkv_in, q_w, k_w, eps, registered=True)
        return self.fused_qknorm_ar(qkv_in, q_w, k_w, eps, registered=False)

    def close(self) -> None:
        pass
