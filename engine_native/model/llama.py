"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Weights arrive under Hugging Face names (`model.layers.N.self_attn.q_proj.weight`, ...)
from either loader and are re-laid out for CPU speed: q/k/v become one matrix and
gate/up another, so a layer is four GEMMs. Qwen2 differs only by a bias on q/k/v.

Activations stay float32 whatever the weights' dtype: with bf16 weights only the inputs
of the dense GEMMs are rounded to bf16, and their outputs come back as fp32. SmolLM2
carries activations of ~25,000 in a few channels, where bf16's spacing is 128, so a bf16
residual drops every smaller update there; an fp32 one costs a few kilobytes per token.

Steps of at most `quantized_max_rows` tokens multiply by the GGUF blocks of the
weights instead (model/quant.py) where the loader kept them, in fp32, whatever `dtype`
the dense weights have: so a host with native bf16 runs big steps as bf16 GEMMs (twice
the fp32 rate there) and small, weight-bandwidth-bound ones through the blocks, and a
pure-decode step of up to `quantized_max_rows` sequences computes the same fp32 values
whether a sequence is alone or in a batch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from engine_native.config import ModelConfig
from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.kernels import cpu_kernels
from engine_native.model.attention import AttentionPlan, paged_attention, prefill_kernel_fits, write_kv
from engine_native.model.attention_backends import AttentionBackend, StepAttention
from engine_native.model.bf16_panel import MAX_MEMORY_FRACTION as BF16_PANEL_MEMORY_FRACTION
from engine_native.model.bf16_panel import (
    Bf16Panel,
    bf16_panel_available,
    bf16_panel_fits,
    bf16_panel_linear,
    panels_fit_in_memory,
    to_bf16_panel,
)
from engine_native.model.errors import ModelLoadError
from engine_native.model.quant import (
    NO_ROUNDING,
    ActivationRounding,
    PanelWeight,
    Q41Weight,
    Q80Weight,
    QuantWeight,
    amx_available,
    amx_fits,
    amx_linear,
    concat,
    kernels_available,
    panel_blocks,
    panel_fits,
    panel_linear,
    quant_linear,
)
from engine_native.model.rope import RotaryTable, apply_rotary
from engine_native.precision import native_bf16
from engine_native.sizing import available_memory_bytes

log = logging.getLogger(__name__)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


_DENSE = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")


_T = TypeVar("_T")


def _sole(values: Iterable[_T]) -> _T | None:
    """The one value all of `values` are, or None where they differ (or there are none)."""
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def can_pack(dtype: torch.dtype) -> bool:
    """Whether oneDNN can hold this model's dense weights pre-packed here: fp32 weights, or bf16 ones on a
    CPU that computes bf16 natively (elsewhere PyTorch emulates the bf16 GEMM and packing gains nothing).
    fp32 F.linear goes to MKL's sgemm, which on the AVX2 EPYC measured 1.1-1.35x slower than oneDNN's packed
    GEMM on prompt-sized steps (docs/engine.md, "oneDNN for the fp32 prompts")."""
    return (
        (dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16()))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# Steps of at most this many tokens multiply by the GGUF blocks where EngineConfig.quantized_max_rows is None...
QUANTIZED_MAX_ROWS = 8
# ...or at most this many where the bf16 panels take the pure-decode steps above it. The blocks compute in fp32
# (16 multiply-adds an instruction against vdpbf16ps' 32) from 0.625 bytes a weight against the panels' 2: up to
# 2 rows the bytes bound a step and the blocks win, from 3 the products do and the panels win. In-process on a
# 2-core AVX-512 BF16 EPYC, the bundled model, decode steps at 192 tokens of context, blocks against panels:
# 1 sequence 6.5 / 11.9 ms, 2 8.6 / 9.9, 3 11.0 / 10.7, 4 13.2 / 10.6, 8 26.5 / 13.5 (docs/engine.md).
QUANTIZED_MAX_ROWS_BESIDE_BF16_PANELS = 2


def kernels_take_cache(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C++ kernels attend over a CPU cache of this dtype and head_dim: fp32 anywhere they run, bf16
    too where the head_dim is a multiple of 16."""
    if not kernels_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and head_dim % 16 == 0)


def cache_in_kernels(cache: torch.Tensor) -> bool:
    """Whether the C++ kernels take this layer's cache (kernels_take_cache, on the CPU)."""
    return cache.device.type == "cpu" and kernels_take_cache(cache.dtype, cache.shape[-1])


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


class DecoderLayer(nn.Module):
    """One pre-norm block: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x))."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        prefix: str,
        blocks: Mapping[str, QuantWeight],
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        w = lambda name: _take(weights, prefix + name)
        self.input_norm = _frozen(w("input_layernorm.weight").float())
        self.qkv_weight = _frozen(
            torch.cat(
                [w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]
            )
        )
        self.qkv_bias: nn.Parameter | None = None
        if config.attention_bias:
            self.qkv_bias = _frozen(
                torch.cat(
                    [w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")]
                )
            )
        self.o_weight = _frozen(w("self_attn.o_proj.weight"))
        self.post_norm = _frozen(w("post_attention_layernorm.weight").float())
        self.gate_up_weight = _frozen(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]))
        self.down_weight = _frozen(w("mlp.down_proj.weight"))
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # The C++ row-wise steps work on whole AVX vectors: RoPE on half-heads of 8 floats.
        self.rowwise_kernels = (
            config.head_dim % 16 == 0 and config.hidden_size % 8 == 0 and config.intermediate_size % 8 == 0
        )
        b = lambda name: blocks.get(prefix + name)
        available = {
            "qkv_weight": concat([b("self_attn.q_proj.weight"), b("self_attn.k_proj.weight"),
                                  b("self_attn.v_proj.weight")]),
            "o_weight": b("self_attn.o_proj.weight"),
            "gate_up_weight": concat([b("mlp.gate_proj.weight"), b("mlp.up_proj.weight")]),
            "down_weight": b("mlp.down_proj.weight"),
        }
        self._available: dict[str, QuantWeight] = {k: v for k, v in available.items() if v is not None}
        # Blocks used for steps of at most `quantized_max_rows` tokens; empty = dense only.
        self.quantized: dict[str, QuantWeight] = {}
        self.quantized_max_rows = 0
        # Which block steps round their activations to integer blocks (enable_quantized).
        self.rounding = NO_ROUNDING
        # Q4_1 blocks multiplied through AMX in steps of more than quantized_max_rows, up to amx_max_rows.
        self.amx: dict[str, Q41Weight] = {}
        self.amx_max_rows = 0
        # The blocks re-laid out for the panel kernels, used in steps of more than quantized_max_rows, up to
        # panel_max_rows, where the dense weights are fp32.
        self.panel: dict[str, PanelWeight] = {}
        self.panel_max_rows = 0
        # The dense matrices in oneDNN's own layout (pack_dense), which replace the plain ones.
        self.packed: dict[str, torch.Tensor] = {}
        # The dense bf16 matrices laid out for kernels/bf16_panel.cpp (pack_dense), used in pure-decode steps
        # of more than quantized_max_rows sequences, up to bf16_panel_max_rows; the bias widened to fp32.
        self.bf16_panels: dict[str, Bf16Panel] = {}
        self.bf16_panel_max_rows = 0
        self.qkv_bias_fp32: torch.Tensor | None = None

    def pack_dense(self, batch_hint: int, bf16_panel_max_rows: int = 0) -> int:
        """Keep the four dense matrices in oneDNN's blocked layout and drop the plain copies; returns
        how many. F.linear on a bf16 CPU re-lays the weight out on every call, which at 32 tokens a
        step costs a third of the GEMM (the same products and sums: results are bit-identical); fp32
        F.linear is MKL's sgemm, slower than oneDNN's on prompt-sized steps (other sums, in fp32 too).
        With `bf16_panel_max_rows` (the caller checked the kernel) each matrix that fits is also laid out
        for the bf16 panel kernel, for pure-decode steps of up to that many sequences."""
        self.bf16_panel_max_rows = bf16_panel_max_rows
        for name in _DENSE:
            weight = getattr(self, name)
            if bf16_panel_max_rows > 0 and bf16_panel_fits(weight.data):
                self.bf16_panels[name] = to_bf16_panel(weight.data)
            self.packed[name] = torch.ops.mkldnn._reorder_linear_weight(weight.data, batch_hint)
            setattr(self, name, _frozen(torch.empty(0, dtype=weight.dtype)))
        if self.bf16_panels and self.qkv_bias is not None:
            self.qkv_bias_fp32 = self.qkv_bias.data.float()  # oneDNN too adds the bias to the fp32 sums
        return len(_DENSE)

    def enable_quantized(self, max_rows: int, amx_max_rows: int = 0, panel_max_rows: int = 0,
                         rounding: ActivationRounding = NO_ROUNDING) -> int:
        """Multiply by the kept blocks in steps of at most `max_rows` tokens, by the Q4_1 ones through
        AMX in steps of at most `amx_max_rows` (the caller checked AMX and bf16), and by all of them
        through the panel kernels in steps of at most `panel_max_rows` (the caller checked the kernels and
        fp32); the blocks' steps round their activations as `rounding` says. Returns how many matrices."""
        self.quantized = dict(self._available) if max_rows > 0 else {}
        self.quantized_max_rows = max_rows
        self.rounding = rounding
        # The AMX kernel takes no bias: a Qwen2 qkv stays on the dense GEMM.
        self.amx = {
            name: w for name, w in self._available.items()
            if isinstance(w, Q41Weight) and amx_fits(w) and not (name == "qkv_weight" and self.qkv_bias is not None)
        } if amx_max_rows > max_rows else {}
        self.amx_max_rows = amx_max_rows if self.amx else 0
        self.panel = {
            name: panel_blocks(w) for name, w in self._available.items() if panel_fits(w)
        } if panel_max_rows > max_rows else {}
        self.panel_max_rows = panel_max_rows if self.panel else 0
        return len(self.quantized.keys() | self.amx.keys() | self.panel.keys())

    def _linear(
        self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None, keep_dtype: bool = False,
        pure_decode: bool = False, step_rows: int | None = None,
    ) -> torch.Tensor:
        """x @ W^T in float32, or with `keep_dtype` (only where `_bf16_io`) as the dense GEMM returns it;
        `pure_decode`: a step of decodes only, which may take the AMX or the bf16 panel kernel. The kernel is
        the one for a step of `step_rows` tokens (default: x's rows), whatever share of them x holds."""
        rows = x.shape[0] if step_rows is None else step_rows
        kernel = self._kernel(name, rows, pure_decode)
        if kernel == "blocks":
            return quant_linear(x, self.quantized[name], bias, activations=self.rounding.for_rows(rows))
        if kernel == "panel":
            return panel_linear(x, self.panel[name], bias)
        if kernel == "amx":
            out = amx_linear(x, self.amx[name])
            return out if keep_dtype else out.float()
        if kernel == "bf16_panel":
            bias_fp32 = self.qkv_bias_fp32 if bias is not None else None  # only q/k/v has a bias
            return bf16_panel_linear(x, self.bf16_panels[name], bias_fp32, out_bf16=keep_dtype)
        packed = self.packed.get(name)
        out = (
            _packed_linear(x.to(self.dtype), packed, bias)
            if packed is not None
            else F.linear(x.to(self.dtype), getattr(self, name), bias)
        )
        return out if keep_dtype else out.float()

    def _kernel(self, name: str, rows: int, pure_decode: bool) -> str:
        """Which kernel multiplies by matrix `name` in a step of `rows` tokens: "blocks" (the GGUF blocks in
        fp32), "panel" (the fp32 panels), "amx", "bf16_panel" (those two in pure-decode steps only) or "dense"
        (oneDNN). `_linear` runs it; `decode_gemm` asks it of all four matrices."""
        if name in self.quantized and rows <= self.quantized_max_rows:
            return "blocks"
        if name in self.panel and rows <= self.panel_max_rows:
            return "panel"
        if name in self.amx and pure_decode and rows <= self.amx_max_rows:
            return "amx"
        if name in self.bf16_panels and pure_decode and rows <= self.bf16_panel_max_rows:
            return "bf16_panel"
        return "dense"

    def decode_gemm(self, rows: int) -> str | None:
        """The one kernel that takes all four matrices of a pure-decode step of `rows` sequences with bf16 in and
        out, the row-wise kernels between (`_kernel` for each): "amx" or "bf16_panel", else None (the matrices go
        to different kernels, or to one the C++ loop does not call). What kernels/panel_decode.cpp's DecodeLayers
        runs."""
        if not (self.rowwise_kernels and self._bf16_io(rows)):
            return None
        kernel = _sole(self._kernel(name, rows, pure_decode=True) for name in _DENSE)
        return kernel if kernel in ("amx", "bf16_panel") else None

    def _bf16_io(self, rows: int) -> bool:
        """A step of `rows` tokens multiplies by all four dense matrices in bf16: the row-wise kernels
        then read the GEMMs' bf16 outputs and write bf16 inputs for them, the values the casts would give."""
        return self.dtype == torch.bfloat16 and (rows > self.quantized_max_rows or not self.quantized)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan | StepAttention,
        pure_decode: bool = False,
        rows_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: the float32 residual stream [T, hidden]; `pure_decode`: a step of decodes only (`_linear`).
        `rows_out`: only these rows of the output are wanted (the last layer: the rows whose logits the step
        samples). Every row's K and V are still written; the projection and the MLP after the attention run on
        those rows alone, through the kernels a step of T rows takes: the same bits wherever oneDNN computes a
        row whatever the rows beside it (bf16 weights on AVX-512 BF16 without AMX), elsewhere to its rounding
        (docs/engine.md, Numerics)."""
        cfg = self.config
        t = x.shape[0]
        kernels = cpu_kernels() if self.rowwise_kernels and cache_in_kernels(k_cache) else None
        if kernels is not None:  # the row-wise steps as one C++ pass each (kernels/elementwise.cpp)
            bf16 = self._bf16_io(t)
            h = kernels.rms_norm(x, self.input_norm, cfg.rms_norm_eps, out_bf16=bf16)
            qkv = self._linear(h, "qkv_weight", self.qkv_bias, keep_dtype=bf16, pure_decode=pure_decode)
            q = kernels.rope_write_kv(qkv, cos.view(t, -1), sin.view(t, -1), k_cache, v_cache, slots,
                                      cfg.num_heads, cfg.num_kv_heads)
            if isinstance(plan, AttentionPlan):
                attn = paged_attention(q, k_cache, v_cache, plan)
            else:  # another backend (model/attention_backends.py)
                attn = plan.attend(q, k_cache, v_cache)
            attn = attn.reshape(t, self.q_size)
            if rows_out is not None:
                x, attn = x[rows_out], attn[rows_out]
            linear = partial(self._linear, keep_dtype=bf16, pure_decode=pure_decode, step_rows=t)
            h = kernels.add_rms_norm(x, linear(attn, "o_weight"), self.post_norm, cfg.rms_norm_eps, out_bf16=bf16)
            act = kernels.silu_mul(linear(h, "gate_up_weight"), out_bf16=bf16)
            return x.add_(linear(act, "down_weight"))  # fp32 += bf16 widens exactly
        h = F.rms_norm(x, (x.shape[-1],), self.input_norm, cfg.rms_norm_eps)
        qkv = self._linear(h, "qkv_weight", self.qkv_bias, pure_decode=pure_decode)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = apply_rotary(k.view(t, cfg.num_kv_heads, cfg.head_dim), cos, sin)
        write_kv(k_cache, v_cache, k, v.view(t, cfg.num_kv_heads, cfg.head_dim), slots)
        if isinstance(plan, AttentionPlan):
            attn = paged_attention(q, k_cache, v_cache, plan)
        else:  # another backend (model/attention_backends.py)
            attn = plan.attend(q, k_cache, v_cache)
        attn = attn.reshape(t, self.q_size)
        if rows_out is not None:
            x, attn = x[rows_out], attn[rows_out]
        linear = partial(self._linear, pure_decode=pure_decode, step_rows=t)
        x = x + linear(attn, "o_weight")
        h = F.rms_norm(x, (x.shape[-1],), self.post_norm, cfg.rms_norm_eps)
        gate, up = linear(h, "gate_up_weight").chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, "down_weight")


class LlamaForCausalLM(nn.Module):
    """Implements `CausalLM`: token ids of a mixed step in, float32 logits of chosen rows out."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        blocks: Mapping[str, QuantWeight] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        blocks = blocks or {}
        weights = {name: t.to(dtype) for name, t in weights.items()}
        self.embed = _frozen(_take(weights, "model.embed_tokens.weight"))
        self.layers = nn.ModuleList(
            DecoderLayer(config, weights, f"model.layers.{i}.", blocks, dtype) for i in range(config.num_layers)
        )
        self.final_norm = _frozen(_take(weights, "model.norm.weight").float())
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = self.embed if tied else _frozen(weights["lm_head.weight"])
        self._lm_head_available = blocks.get("model.embed_tokens.weight" if tied else "lm_head.weight")
        self.lm_head_quantized: QuantWeight | None = None
        self.lm_head_panel: PanelWeight | None = None
        self.panel_max_rows = 0
        self.lm_head_packed: torch.Tensor | None = None
        self.lm_head_bf16_panel: Bf16Panel | None = None
        self.bf16_panel_max_rows = 0
        self.quantized_max_rows = 0
        self.rounding = NO_ROUNDING  # which block steps round their activations (enable_quantized)
        self.amx_max_rows = 0  # where the CPU and the weights take AMX's kernel (enable_quantized)
        self._fused: Any | None = None  # kernels.FusedDecoder, built at the first step that can use it
        self._fused_key: int | None = None
        # kernels.DecodeLayers for pure-decode steps whose four matrices one kernel takes (`_layer_decoder_for`),
        # likewise; off: the same steps layer by layer (the same bits, tests/engine/test_panel_decode.py).
        self.layer_decoder_on = True
        self._layer_decoder: Any | None = None
        self._layer_decoder_key: tuple[int, str] | None = None
        # None: model/attention.py's CPU path (and the fused decoder); else the backend chosen at start.
        self.attention_backend: AttentionBackend | None = None
        self.prefill_attention_dtype = torch.float32
        self.prefill_attention_kernel_on = True  # fp32 prefill attention through Sluice's kernel where it fits
        self.rope = RotaryTable(  # fp32 like every activation (and the fused decoder reads it)
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling, torch.float32
        )
        self._check_shapes()

    def enable_quantized(self, max_rows: int, amx_max_rows: int = 0, panel_max_rows: int = 0,
                         rounding: ActivationRounding = NO_ROUNDING) -> int:
        """Multiply by the GGUF blocks the loader kept in steps of at most `max_rows` tokens (0: never),
        by the Q4_1 ones through AMX in steps of at most `amx_max_rows` where the dense weights are
        bf16 (the AMX path's values are theirs) and the CPU has AMX-BF16, and through the panel kernels
        in steps of at most `panel_max_rows` where the dense weights are fp32 (their values too) and the
        kernels built; the blocks' steps (the fused decoder's too) round their activations to integer blocks
        of 32 as `rounding` says (kernels/quant_rounded.cpp). Returns the number of weight
        matrices that will; 0 where the kernels cannot run here."""
        if max_rows <= 0 or not kernels_available():
            max_rows = 0
        if not (amx_max_rows > 0 and self.dtype == torch.bfloat16 and amx_available()):
            amx_max_rows = 0
        if not (panel_max_rows > max_rows and self.dtype == torch.float32 and kernels_available()):
            panel_max_rows = 0
        self.quantized_max_rows = max_rows
        self.rounding = rounding.within(max_rows)
        self.lm_head_quantized = self._lm_head_available if max_rows else None
        lm_head = self._lm_head_available
        self.lm_head_panel = None
        if panel_max_rows > 0 and lm_head is not None and panel_fits(lm_head):
            self.lm_head_panel = panel_blocks(lm_head)
        self.panel_max_rows = panel_max_rows
        self.amx_max_rows = amx_max_rows
        self._fused, self._fused_key = None, None
        layers = sum(layer.enable_quantized(max_rows, amx_max_rows, panel_max_rows,  # type: ignore[operator]
                                            self.rounding)
                     for layer in self.layers)
        return layers + (self.lm_head_quantized is not None or self.lm_head_panel is not None)

    def pack_dense(self, batch_hint: int = 32, bf16_panel_max_rows: int = 0) -> int:
        """Pre-pack every dense weight matrix for oneDNN where that is faster (`can_pack`); returns
        how many were. The LM head gets a packed copy: a tied one is the embedding table too.
        Where the CPU has AVX-512 BF16 but no AMX (whose own kernels take such steps), the matrices are also
        laid out for the bf16 panel kernel, used by pure-decode steps of more than quantized_max_rows
        sequences, up to `bf16_panel_max_rows` (0: never); a second copy of the dense weights."""
        if not can_pack(self.dtype) or self.lm_head_packed is not None:
            return 0
        # The panels hold bf16 weights: an fp32 model (packed for oneDNN since fp32 packing) makes none.
        if not (bf16_panel_max_rows > self.quantized_max_rows and self.dtype == torch.bfloat16
                and bf16_panel_available() and not amx_available()):
            bf16_panel_max_rows = 0
        dense = [getattr(layer, name).data for layer in self.layers for name in _DENSE] + [self.lm_head.data]
        if bf16_panel_max_rows and not panels_fit_in_memory(dense, available_memory_bytes()):
            log.warning("the bf16 panels would take more than %.0f%% of the available memory: decode steps stay "
                        "on oneDNN", 100 * BF16_PANEL_MEMORY_FRACTION)
            bf16_panel_max_rows = 0
        self.bf16_panel_max_rows = bf16_panel_max_rows
        if bf16_panel_max_rows and bf16_panel_fits(self.lm_head.data):
            self.lm_head_bf16_panel = to_bf16_panel(self.lm_head.data)
        packed = sum(layer.pack_dense(batch_hint, bf16_panel_max_rows)  # type: ignore[operator]
                     for layer in self.layers)
        self.lm_head_packed = torch.ops.mkldnn._reorder_linear_weight(self.lm_head.data, batch_hint)
        if self.lm_head is not self.embed:
            self.lm_head = _frozen(torch.empty(0, dtype=self.dtype))
        return packed + 1

    def _fused_for(self, batch: ForwardBatch, kv_cache: KVCache) -> Any | None:
        """The whole-step C++ decoder (kernels/fused_decode.cpp) when this step can use it: every
        sequence computes one token and samples it, within `quantized_max_rows`, a KV cache the kernels
        take (cache_in_kernels), every weight in blocks. Built once per KV cache."""
        if (
            self.lm_head_quantized is None
            or batch.num_tokens > self.quantized_max_rows
            or not batch.is_pure_decode
            or int(batch.logits_indices.shape[0]) != batch.num_tokens
            or not self.use_decode_kernel(kv_cache)
        ):
            return None
        key = id(kv_cache.k[0])
        if self._fused_key != key:
            self._fused = self._build_fused(kv_cache)
            self._fused_key = key
        return self._fused

    def _build_fused(self, kv_cache: KVCache) -> Any | None:
        kernels = cpu_kernels()
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        mats = [layer.quantized.get(n) for layer in layers for n in names] + [self.lm_head_quantized]
        if kernels is None or any(m is None for m in mats):
            return None
        formats, qs, scales = [], [], []
        for m in mats:
            if isinstance(m, Q41Weight):
                formats.append(0)
                qs.append(m.qs)
                scales.append(m.dm)
            elif isinstance(m, Q80Weight):
                formats.append(1)
                qs.append(m.qs)
                scales.append(m.d)
        cfg = self.config
        biases = [layer.qkv_bias.data.float() for layer in layers if layer.qkv_bias is not None]
        norms = [t for layer in layers for t in (layer.input_norm.data, layer.post_norm.data)]
        return kernels.FusedDecoder(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
            formats, qs, scales, biases, norms, self.final_norm.data, kv_cache.k, kv_cache.v,
            self.rope.cos, self.rope.sin, self.rounding.int16_max_rows, self.rounding.int8_max_rows,
        )

    def _layer_decoder_for(self, batch: ForwardBatch, kv_cache: KVCache) -> Any | None:
        """The C++ loop over the layers (kernels/panel_decode.cpp) when one kernel would take every layer's
        matrices in this step (`DecoderLayer.decode_gemm`: the AMX one or the bf16 panels), a pure-decode step
        attending through Sluice's kernel. Built once per KV cache and kernel."""
        rows = batch.num_tokens
        # Cheap bounds first: most steps of a few sequences (the blocks') or of prompts end here.
        if not (self.layer_decoder_on and batch.is_pure_decode
                and self.quantized_max_rows < rows <= max(self.amx_max_rows, self.bf16_panel_max_rows)
                and self.use_decode_kernel(kv_cache)):
            return None
        # Asked each step (~50 us for 30 layers): the layers' bounds are plain attributes that may change.
        gemm = _sole(layer.decode_gemm(rows) if isinstance(layer, DecoderLayer) else None for layer in self.layers)
        if gemm is None:
            return None
        key = (id(kv_cache.k[0]), gemm)
        if self._layer_decoder_key != key:
            self._layer_decoder = self._build_layer_decoder(kv_cache, amx=key[1] == "amx")
            self._layer_decoder_key = key
        return self._layer_decoder

    def _build_layer_decoder(self, kv_cache: KVCache, amx: bool) -> Any | None:
        kernels = cpu_kernels()
        if kernels is None:
            return None
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        cfg = self.config
        if amx:
            weights = [t for layer in layers for name in _DENSE for t in (layer.amx[name].qs, layer.amx[name].dm)]
            biases: list[torch.Tensor] = []  # the AMX kernel takes no bias: a qkv with one is never in layer.amx
        else:
            weights = [layer.bf16_panels[name].data for layer in layers for name in _DENSE]
            biases = [layer.qkv_bias_fp32 for layer in layers if layer.qkv_bias_fp32 is not None]
        return kernels.DecodeLayers(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps,
            amx, weights, biases, [t for layer in layers for t in (layer.input_norm.data, layer.post_norm.data)],
            kv_cache.k, kv_cache.v, self.rope.cos, self.rope.sin,
        )

    def place_on(self, device: torch.device) -> None:
        """Move the weights and the RoPE table to `device` (the engine does this once, before the KV pool)."""
        self.to(device)
        self.rope.cos, self.rope.sin = self.rope.cos.to(device), self.rope.sin.to(device)

    def use_decode_kernel(self, kv_cache: KVCache) -> bool:
        """Whether decodes attend through Sluice's C++ kernel (an fp32 cache, or a bf16 one on AVX-512)."""
        return cache_in_kernels(kv_cache.k[0])

    def _check_shapes(self) -> None:
        cfg = self.config
        expected_qkv = ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
        if tuple(self.embed.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ModelLoadError(f"embedding shape {tuple(self.embed.shape)} does not match config {cfg}")
        layer = self.layers[0]
        assert isinstance(layer, DecoderLayer)
        if tuple(layer.qkv_weight.shape) != expected_qkv:
            raise ModelLoadError(f"q/k/v weights {tuple(layer.qkv_weight.shape)}, expected {expected_qkv}")
        if tuple(layer.gate_up_weight.shape) != (2 * cfg.intermediate_size, cfg.hidden_size):
            raise ModelLoadError(f"gate/up weights {tuple(layer.gate_up_weight.shape)} do not match config")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:  # type: ignore[override]
        # The last position of a sequence is its context length - 1: read on the host, never a device sync.
        if max(batch.context_lens) > self.rope.max_positions:
            raise ValueError(f"position beyond max_position_embeddings={self.rope.max_positions}")
        fused = self._fused_for(batch, kv_cache) if self.attention_backend is None else None
        if fused is not None:
            x = F.embedding(batch.input_ids, self.embed).float()
            context_lens = torch.tensor(batch.context_lens, dtype=torch.int64)
            logits: torch.Tensor = fused.forward(x, batch.positions, batch.slot_mapping, batch.block_tables,
                                                 context_lens)
            return logits
        x = F.embedding(batch.input_ids, self.embed).float()
        # The AMX and bf16 panel kernels take pure-decode steps only: a prompt is multiplied by oneDNN
        # whatever its length, so its first token does not depend on which kernel a prompt of its size gets.
        pure_decode = batch.is_pure_decode
        layer_decoder = self._layer_decoder_for(batch, kv_cache) if self.attention_backend is None else None
        if layer_decoder is not None:  # the same layers in one call, bit for bit
            context_lens = torch.tensor(batch.context_lens, dtype=torch.int64)
            x = layer_decoder.forward(x, batch.positions, batch.slot_mapping, batch.block_tables, context_lens)
            h = x[batch.logits_indices]
        else:
            plan: AttentionPlan | StepAttention
            if self.attention_backend is not None:
                plan = self.attention_backend.plan(batch, kv_cache)
            else:
                plan = AttentionPlan.from_batch(
                    batch, decode_kernel=self.use_decode_kernel(kv_cache), prefill_dtype=self.prefill_attention_dtype,
                    prefill_kernel=self.prefill_attention_kernel_on and prefill_kernel_fits(kv_cache.k[0]))
            cos, sin = self.rope.lookup(batch.positions)
            # Only the rows whose logits are wanted leave the last layer: a step of prompts samples one row a
            # sequence, and the rest of that layer's projection and MLP (84% of its multiplies) is never read.
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, batch.slot_mapping, kv_cache.k[i], kv_cache.v[i], plan,
                          pure_decode=pure_decode, rows_out=batch.logits_indices if i == last else None)
            h = x
        # Norm and lm_head only on the rows whose logits are wanted: the vocab GEMM dominates.
        h = F.rms_norm(h, (h.shape[-1],), self.final_norm, self.config.rms_norm_eps)
        if self.lm_head_quantized is not None and h.shape[0] <= self.quantized_max_rows:
            return quant_linear(h, self.lm_head_quantized, activations=self.rounding.for_rows(batch.num_tokens))
        if self.lm_head_panel is not None and h.shape[0] <= self.panel_max_rows:
            return panel_linear(h, self.lm_head_panel)
        if self.lm_head_bf16_panel is not None and pure_decode and h.shape[0] <= self.bf16_panel_max_rows:
            return bf16_panel_linear(h, self.lm_head_bf16_panel)
        if self.lm_head_packed is not None:
            return _packed_linear(h.to(self.dtype), self.lm_head_packed).float()
        return F.linear(h.to(self.dtype), self.lm_head).float()


def _take(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return weights[name]
    except KeyError:
        raise ModelLoadError(f"weight {name!r} missing from the checkpoint") from None
