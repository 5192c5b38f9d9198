"""The model as the runner sees it on an accelerator.

`ModelRunner` builds each step's `ForwardBatch` on the host and samples on the host, as on CPU;
`DeviceForward` stands between it and the model: it moves the batch to the device (one copy per
tensor, no sync), replays a CUDA graph for a pure-decode step that fits one (cuda_graphs.py) or runs
the model eagerly, and hands the logits to the sampler where they are. The sampler runs on the device
and brings back only the token ids (and any logprobs asked for): that copy is the step's one sync.
(The logits of 256 rows are 50 MB; copied to the host they took 32 of a 48 ms step on an H200.)
"""

from __future__ import annotations

import torch

from engine_native.config import ModelConfig
from engine_native.cuda_graphs import DecodeGraphs
from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.model.attention_backends import AttentionBackend
from engine_native.model.base import CausalLM
from engine_native.model.quant import NO_ROUNDING, ActivationRounding


class DeviceForward:
    """Implements `CausalLM` over a model that lives on `device`."""

    def __init__(self, model: CausalLM, device: torch.device, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.device = device
        self.graphs = graphs
        self.config: ModelConfig = model.config

    @property
    def attention_backend(self) -> AttentionBackend | None:
        return self.model.attention_backend

    @attention_backend.setter
    def attention_backend(self, backend: AttentionBackend | None) -> None:
        self.model.attention_backend = backend

    @property
    def prefill_attention_dtype(self) -> torch.dtype:
        return self.model.prefill_attention_dtype

    @prefill_attention_dtype.setter
    def prefill_attention_dtype(self, dtype: torch.dtype) -> None:
        self.model.prefill_attention_dtype = dtype

    @property
    def prefill_attention_kernel_on(self) -> bool:
        return self.model.prefill_attention_kernel_on

    @prefill_attention_kernel_on.setter
    def prefill_attention_kernel_on(self, on: bool) -> None:
        self.model.prefill_attention_kernel_on = on

    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.run(batch)  # a view of the graph's output: valid until the next replay
        else:
            logits = self.model.forward(batch.to(self.device), kv_cache)
        return logits.float()

    def enable_quantized(self, max_rows: int, amx_max_rows: int = 0, panel_max_rows: int = 0,
                         rounding: ActivationRounding = NO_ROUNDING) -> int:
        return 0  # the quantized blocks are a CPU kernel's

    def pack_dense(self, batch_hint: int = 32, bf16_panel_max_rows: int = 0) -> int:
        return 0  # oneDNN's packed layout is a CPU GEMM's

    def place_on(self, device: torch.device) -> None:
        self.model.place_on(device)
        self.device = device
