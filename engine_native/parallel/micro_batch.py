"""Cutting a step's `ForwardBatch` into pipeline micro-batches, the same way on every rank.

A micro-batch is a run of whole sequences (so each sequence's K/V writes and attention stay in
one micro-batch), cut where the running token count passes an equal share:

    tokens:  | seq0 (30) | seq1 (1) | seq2 (1) | seq3 (20) |      2 micro-batches, 52 tokens
    cut:     | mb0: seq0            | mb1: seq1 seq2 seq3  |      (the first reaching 26 ends mb0)

Each keeps its sequences' rows of the block tables and the logits rows that fall in its tokens, in
order, so concatenating the micro-batches' logits rows gives the step's.
"""

from __future__ import annotations

import itertools

import torch

from engine_native.forward_batch import ForwardBatch


def split_micro_batches(batch: ForwardBatch, parts: int) -> list[ForwardBatch]:
    """At most `parts` non-empty micro-batches of whole sequences, in order."""
    n = batch.num_seqs
    if parts <= 1 or n <= 1:
        return [batch]
    share = batch.num_tokens / min(parts, n)
    bounds, tokens = [0], 0
    for i, q in enumerate(batch.query_lens):
        tokens += q
        if tokens >= share * len(bounds) and len(bounds) < parts and i + 1 < n:
            bounds.append(i + 1)
    bounds.append(n)
    return [_slice(batch, a, b) for a, b in itertools.pairwise(bounds) if b > a]


def _slice(batch: ForwardBatch, first: int, end: int) -> ForwardBatch:
    t0 = batch.query_starts[first]
    t1 = batch.query_starts[end - 1] + batch.query_lens[end - 1]
    logits = batch.logits_indices
    wanted = logits[(logits >= t0) & (logits < t1)] - t0
    return ForwardBatch(
        input_ids=batch.input_ids[t0:t1],
        positions=batch.positions[t0:t1],
        slot_mapping=batch.slot_mapping[t0:t1],
        query_starts=[s - t0 for s in batch.query_starts[first:end]],
        query_lens=batch.query_lens[first:end],
        context_lens=batch.context_lens[first:end],
        block_tables=batch.block_tables[first:end],
        logits_indices=wanted.to(torch.int64),
        block_size=batch.block_size,
    )
