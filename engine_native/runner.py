"""Turns a SchedulerOutput into one model forward and one sampler call.

Owns the KV cache tensors (allocated once) and the flattening of a step's
prefill chunks and decodes into a `ForwardBatch`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_native.forward_batch import ForwardBatch, KVCache
from engine_native.model.base import CausalLM
from engine_native.sampler import Sampler, SamplingInput
from engine_native.scheduler import RunnerOutput, SchedulerOutput

# request id -> the block ids that hold its KV, in token order
BlockTableLookup = Callable[[str], list[int]]


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, block_size: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = Sampler()

    def build_batch(self, sched: SchedulerOutput, block_table: BlockTableLookup) -> ForwardBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_starts: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        for s in sched.scheduled:
            start, end = s.num_computed_before, s.num_computed_before + s.num_new_tokens
            table = block_table(s.request.request_id)
            tables.append(table)
            query_starts.append(len(input_ids))
            query_lens.append(s.num_new_tokens)
            context_lens.append(end)
            input_ids.extend(s.request.token_ids_slice(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if s.samples:
                logits_indices.append(len(input_ids) - 1)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_starts=query_starts,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=_pad_tables(tables),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            block_size=bs,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_table: BlockTableLookup) -> RunnerOutput:
        batch = self.build_batch(sched, block_table)
        logits = self.model.forward(batch, self.kv_cache)
        sampling = [s for s in sched.scheduled if s.samples]
        if not sampling:
            return RunnerOutput()
        rows = [
            SamplingInput(
                params=s.request.sampling_params,
                generator=s.request.generator,
                prompt_token_ids=s.request.prompt_token_ids,
                output_token_ids=s.request.output_token_ids,
            )
            for s in sampling
        ]
        sampled = self.sampler(logits, rows)
        out = RunnerOutput()
        for s, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True):
            out.sampled_token_ids[s.request.request_id] = token
            if lp is not None:
                out.logprobs[s.request.request_id] = lp
        return out
