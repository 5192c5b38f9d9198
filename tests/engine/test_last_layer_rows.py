"""The last layer's projection and MLP run only on the rows whose logits a step wants (model/llama.py,
`DecoderLayer.forward`'s `rows_out`). Those rows go through the kernels a step of all its rows takes, and every
row's K and V are still written. Where oneDNN computes a row from that row alone, whatever the rows beside it
(the AVX-512 BF16 hosts without AMX: checked at 33-2,048 rows), the logits are the whole layer's bit for bit; where
it picks its kernel by the number of rows (with AMX; on AVX-512 without BF16, where it emulates bf16: docs/engine.md,
Numerics) they agree to the bf16 GEMM's rounding."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch

from engine_native.config import ModelConfig
from engine_native.model.bf16_panel import bf16_panel_available
from engine_native.model.llama import LlamaForCausalLM
from engine_native.model.quant import amx_available

sys.path.insert(0, str(Path(__file__).parent))
from test_model_support import PagedSequences, bundled_as_the_engine_lays_it_out

# Where oneDNN's bf16 GEMM computes each row alone: native bf16 dot products without AMX (measured).
rows_alone_here = bf16_panel_available() and not amx_available()

# Prompts of 1 to 200 tokens, and a step mixing a prompt chunk with decodes.
PROMPTS = [list(range(100 + 3 * i, 100 + 3 * i + n)) for i, n in enumerate([1, 7, 33, 200, 64])]


def _steps(model: LlamaForCausalLM, cfg: ModelConfig, last_only: bool) -> tuple[list[torch.Tensor], PagedSequences]:
    seqs = PagedSequences(cfg, num_blocks=128, block_size=16, dtype=torch.bfloat16, seed=7)
    first = model.forward(seqs.step(list(enumerate(PROMPTS[:4])), last_only=last_only), seqs.cache)
    mixed = model.forward(seqs.step([(0, [500]), (1, [501]), (4, PROMPTS[4])], last_only=last_only), seqs.cache)
    return [first, mixed], seqs


def test_the_sampled_rows_logits_and_the_cache_are_the_whole_layers() -> None:
    # The blocks for steps of up to 2 rows: the LM head of the 3 and 4 sampled rows then stays on the dense GEMM as
    # the whole step's does (with an AMX host's 8, those rows' logits would come from the Q8_0 blocks in fp32).
    loaded = bundled_as_the_engine_lays_it_out(blocks_max_rows=2)
    model = loaded.model
    assert isinstance(model, LlamaForCausalLM)
    # Every row wanted: the last layer runs on all of them (the reference). Last rows only: on those alone.
    every, every_seqs = _steps(model, loaded.config, last_only=False)
    last, last_seqs = _steps(model, loaded.config, last_only=True)
    first_rows = torch.tensor([len(p) for p in PROMPTS[:4]]).cumsum(0) - 1
    assert last[0].shape[0] == 4 and every[0].shape[0] == sum(len(p) for p in PROMPTS[:4])
    mixed_rows = torch.tensor([0, 1, 2 + len(PROMPTS[4]) - 1])
    for wanted, whole in ((last[0], every[0][first_rows]), (last[1], every[1][mixed_rows])):
        if rows_alone_here:
            assert torch.equal(wanted, whole)
        else:
            torch.testing.assert_close(wanted, whole, rtol=0.02, atol=0.05)
    for layer in range(loaded.config.num_layers):  # the last layer's K and V of every row, too
        assert torch.equal(last_seqs.cache.k[layer], every_seqs.cache.k[layer])
        assert torch.equal(last_seqs.cache.v[layer], every_seqs.cache.v[layer])
