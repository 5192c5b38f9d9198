"""Shared helpers for the model tests (no tests here): hand-built ForwardBatches over a
paged cache whose blocks are handed out in shuffled order, like a real allocator after churn."""

from __future__ import annotations

import os
import random
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import torch

from engine_native.config import ModelConfig
from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.model.base import LoadedModel
from engine_native.model.bf16_panel import bf16_panel_available
from engine_native.model.bundled import bundled_model_path
from engine_native.model.loader import load_model
from engine_native.model.quant import amx_available


class PagedSequences:
    """Per-sequence block tables and computed-token counts, enough to drive a CausalLM by hand."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, seed: int = 0):
        self.block_size = block_size
        self.cache = KVCache.allocate(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def step(self, work: list[tuple[int, list[int]]], last_only: bool = False) -> ForwardBatch:
        """One step: for each (seq_id, new token ids) append those tokens. Logits rows: every
        new token, or only each sequence's last one."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        qlens: list[int] = []
        ctx_lens: list[int] = []
        logits_idx: list[int] = []
        for seq, toks in work:
            table = self.tables.setdefault(seq, [])
            done = self.computed.get(seq, 0)
            total = done + len(toks)
            while len(table) * self.block_size < total:
                table.append(self.free.pop())
            starts.append(len(ids))
            for j, tok in enumerate(toks):
                pos = done + j
                ids.append(tok)
                positions.append(pos)
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            qlens.append(len(toks))
            ctx_lens.append(total)
            first = starts[-1]
            logits_idx.extend([first + len(toks) - 1] if last_only else range(first, first + len(toks)))
            self.computed[seq] = total
        width = max(len(self.tables[s]) for s, _ in work)
        tables = torch.zeros(len(work), width, dtype=torch.long)
        for i, (seq, _) in enumerate(work):
            tables[i, : len(self.tables[seq])] = torch.tensor(self.tables[seq])
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            query_starts=starts,
            query_lens=qlens,
            context_lens=ctx_lens,
            block_tables=tables,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long),
            block_size=self.block_size,
        )


def prompts_then_a_decode(model: Any, cfg: ModelConfig, dtype: torch.dtype) -> list[torch.Tensor]:
    """The logits of 12 five-token prompts computed in one 60-row step, then of one decode each in a 12-row
    pure-decode step: the kernel tests compare which kernel a step of each kind takes."""
    seqs = PagedSequences(cfg, num_blocks=128, block_size=16, dtype=dtype, seed=3)
    prompts = [list(range(100 + 7 * i, 105 + 7 * i)) for i in range(12)]
    prefill = model.forward(seqs.step([(i, p) for i, p in enumerate(prompts)]), seqs.cache)
    decode = model.forward(seqs.step([(i, [300 + i]) for i in range(len(prompts))]), seqs.cache)
    return [prefill, decode]


def bundled_as_the_engine_lays_it_out(blocks_max_rows: int | None = None) -> LoadedModel:
    """The bundled model in bf16, laid out as an engine with defaults lays it out on this CPU: the quantized blocks for
    steps of up to 2 rows where the bf16 panels take decode steps of up to 64 (AVX-512 BF16 without AMX), else of up
    to 8 with AMX's kernel for decode steps of up to 64 (where it runs); the dense matrices packed for oneDNN.
    `blocks_max_rows` sets the blocks' bound instead."""
    loaded = load_model(bundled_model_path(), dtype=torch.bfloat16, progress=False)
    panels = bf16_panel_available() and not amx_available()
    default = 2 if panels else 8
    loaded.model.enable_quantized(default if blocks_max_rows is None else blocks_max_rows, amx_max_rows=64)
    loaded.model.pack_dense(bf16_panel_max_rows=64)
    return loaded
