"""The attention-backend seam: how one forward's layers attend over the paged KV cache.

A backend is chosen once at start (`build_attention_backend`) and set on the model
(`LlamaForCausalLM.attention_backend`). Per forward, `plan(batch, kv_cache)` turns the
`ForwardBatch` into a `StepAttention` that every layer calls after writing its new K/V
(`attend(q, k_cache, v_cache)`), so the step's index work is done once, not once per layer.

| name         | runs on     | what it is                                                                  |
|--------------|-------------|-----------------------------------------------------------------------------|
| `native`     | CPU         | model/attention.py: Sluice's C++ decode kernel over an fp32 cache, SDPA per prefill chunk; the model's own path (attention_backend None) |
| `sdpa`       | CPU or CUDA | torch SDPA over each sequence's blocks gathered into one tensor; a pure-decode step does no host work, so it can be captured in a CUDA graph (cuda_graphs.py) |
| `flashinfer` | CUDA        | FlashInfer's paged prefill / decode wrappers, which read the pool in place (its NHD layout is ours) |

`sdpa` is tested on CPU against `native` (same greedy output in fp32) and on CUDA against Hugging Face
(scripts/gpu_check.sh, on an H200); `flashinfer` has not run on a GPU yet (that machine lacked it).
"""

from __future__ import annotations

import importlib.util
from itertools import accumulate
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine_native.config import ModelConfig
from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.model.attention import PrefillChunk, prefill_chunk_attention, prefill_chunks

NATIVE, SDPA, FLASHINFER = "native", "sdpa", "flashinfer"
BACKEND_CHOICES = ("auto", NATIVE, SDPA, FLASHINFER)


class StepAttention(Protocol):
    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] (this step's queries; their K/V already written) -> attention output [T, H, D]."""
        ...


class AttentionBackend(Protocol):
    name: str

    def plan(self, batch: ForwardBatch, kv_cache: KVCache) -> StepAttention:
        """Everything the layers share for one forward; built once per step."""
        ...


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


FLASHINFER_DTYPES = (torch.bfloat16, torch.float16)  # its kernels have no fp32 variant


def resolve_backend_name(requested: str, device: torch.device, kv_dtype: torch.dtype = torch.bfloat16) -> str:
    """'auto' -> native on CPU; on CUDA flashinfer when importable and the cache is 16-bit, else sdpa."""
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"unsupported attention backend {requested!r}; choose one of {', '.join(BACKEND_CHOICES)}")
    if requested == "auto":
        if device.type == "cpu":
            return NATIVE
        return FLASHINFER if flashinfer_available() and kv_dtype in FLASHINFER_DTYPES else SDPA
    if requested == NATIVE and device.type != "cpu":
        raise ValueError("the native attention backend runs on CPU only; use sdpa or flashinfer on CUDA")
    if requested == FLASHINFER and (device.type != "cuda" or not flashinfer_available()):
        raise ValueError("the flashinfer backend needs CUDA and the flashinfer package (`make install-gpu`)")
    if requested == FLASHINFER and kv_dtype not in FLASHINFER_DTYPES:
        raise ValueError(f"the flashinfer backend reads a bf16 or fp16 KV cache, not {kv_dtype}")
    return requested


def build_attention_backend(
    name: str, model: ModelConfig, device: torch.device, kv_dtype: torch.dtype
) -> AttentionBackend | None:
    """The backend called `name` (resolved already); None for native, the model's own path."""
    if name == NATIVE:
        return None
    if name == SDPA:
        return SdpaAttention()
    return FlashInferAttention(model, device, kv_dtype)


# ----- sdpa: torch SDPA over gathered blocks ----------------------------------------------


def _gathered_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """q [B, H, D], one query per sequence; tables [B, W]; mask [B, 1, 1, W * block_size] -> [B, H, D]."""
    b, _, d = q.shape
    hkv = k_cache.shape[2]
    flat = tables.reshape(-1)
    k = k_cache.index_select(0, flat).view(b, -1, hkv, d).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(b, -1, hkv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.to(k.dtype).unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True)
    return o.squeeze(2).to(q.dtype)


def _length_mask(tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, 1, 1, W * block_size] bool, True where a key position is inside its sequence."""
    key_pos = torch.arange(tables.shape[1] * block_size, device=tables.device)
    return (key_pos.unsqueeze(0) < context_lens.unsqueeze(1)).view(tables.shape[0], 1, 1, -1)


class SdpaStep:
    """One forward's plan for `SdpaAttention`. A pure-decode step reads only the batch's tensors
    (block tables, `context_lens_tensor`), so replaying it from a CUDA graph sees new values."""

    def __init__(self, batch: ForwardBatch) -> None:
        dev = batch.input_ids.device
        bs = batch.block_size
        self.block_size = bs
        self.whole_decode: tuple[torch.Tensor, torch.Tensor] | None = None
        self.decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # index, tables, mask
        self.chunks: list[PrefillChunk] = []
        if batch.is_pure_decode:
            ctx = batch.context_lens_tensor
            if ctx is None:
                ctx = torch.tensor(batch.context_lens, dtype=torch.int64, device=dev)
            self.whole_decode = (batch.block_tables, _length_mask(batch.block_tables, ctx, bs))
            return
        decodes = [i for i, q in enumerate(batch.query_lens) if q == 1]
        if decodes:
            ctx_list = [batch.context_lens[i] for i in decodes]
            width = -(-max(ctx_list) // bs)
            rows = torch.tensor(decodes, dtype=torch.int64, device=dev)
            tables = batch.block_tables.index_select(0, rows)[:, :width]
            ctx = torch.tensor(ctx_list, dtype=torch.int64, device=dev)
            index = torch.tensor([batch.query_starts[i] for i in decodes], dtype=torch.int64, device=dev)
            self.decode = (index, tables, _length_mask(tables, ctx, bs))
        self.chunks = prefill_chunks(batch, dev)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if self.whole_decode is not None:
            return _gathered_decode(q, k_cache, v_cache, *self.whole_decode)
        out = torch.empty_like(q)
        if self.decode is not None:
            index, tables, mask = self.decode
            out[index] = _gathered_decode(q[index], k_cache, v_cache, tables, mask)
        for c in self.chunks:  # in the cache's dtype, as the decodes above
            out[c.start : c.start + c.query_len] = prefill_chunk_attention(
                q, k_cache, v_cache, c, k_cache.dtype
            )
        return out


class SdpaAttention:
    name = SDPA

    def plan(self, batch: ForwardBatch, kv_cache: KVCache) -> StepAttention:
        return SdpaStep(batch)


# ----- flashinfer: paged wrappers, not yet run on a GPU --------------------------------------

FLASHINFER_WORKSPACE_BYTES = 128 * 1024**2


class _FlashInferStep:
    def __init__(self, wrapper: Any, kv_dtype: torch.dtype) -> None:
        self.wrapper = wrapper
        self.kv_dtype = kv_dtype

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.wrapper.run(q.to(self.kv_dtype).contiguous(), (k_cache, v_cache))
        return out.to(q.dtype)


class FlashInferAttention:
    """FlashInfer's paged wrappers over our pool as is: [num_blocks, block_size, Hkv, D] per layer is
    its "NHD" layout. A pure-decode step plans the decode wrapper; a mixed one the prefill wrapper,
    whose causal mask aligns each chunk's queries to the end of its context, as ours does."""

    name = FLASHINFER

    def __init__(self, model: ModelConfig, device: torch.device, kv_dtype: torch.dtype) -> None:
        import flashinfer

        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        # Tensor cores: any query-per-KV-head ratio (SmolLM2's is 3), not only the ones with a CUDA-core kernel.
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        self.model = model
        self.device = device
        self.kv_dtype = kv_dtype

    def plan(self, batch: ForwardBatch, kv_cache: KVCache) -> StepAttention:
        bs = batch.block_size
        num_blocks = [-(-c // bs) for c in batch.context_lens]
        width = int(batch.block_tables.shape[1])
        # The CSR page list, gathered from the device-side tables by host-computed flat positions: no sync.
        flat = [i * width + j for i, n in enumerate(num_blocks) for j in range(n)]
        indices = batch.block_tables.reshape(-1).index_select(
            0, torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)
        ).to(torch.int32)
        indptr = torch.tensor([0, *accumulate(num_blocks)], dtype=torch.int32)
        last_len = torch.tensor([c - (n - 1) * bs for c, n in zip(batch.context_lens, num_blocks, strict=True)],
                                dtype=torch.int32)
        cfg = self.model
        if batch.is_pure_decode:
            self._decode.plan(indptr, indices, last_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bs,
                              q_data_type=self.kv_dtype, kv_data_type=self.kv_dtype)
            return _FlashInferStep(self._decode, self.kv_dtype)
        qo_indptr = torch.tensor([*batch.query_starts, batch.num_tokens], dtype=torch.int32)
        self._prefill.plan(qo_indptr, indptr, indices, last_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, bs,
                           causal=True, q_data_type=self.kv_dtype, kv_data_type=self.kv_dtype)
        return _FlashInferStep(self._prefill, self.kv_dtype)
