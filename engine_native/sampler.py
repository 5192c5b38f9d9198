"""The batched sampler: one call per engine step turns float32 logits [S, V] into one token per row.

Pipeline per row, in this order (each stage runs only over the rows that need it):

    raw logits ──> logprobs (log_softmax of the raw logits, see below)
        │
        ├─> repetition penalty (HF, over prompt + output) ─> presence/frequency penalty (OpenAI, over output)
        │
        ├─ greedy rows ─> argmax
        └─ random rows ─> / temperature ─> top_k ─> top_p ─> min_p ─> softmax ─> exponential race

Logprobs are taken from the model's raw distribution, before penalties,
temperature and truncation (vLLM's default `raw_logprobs`). We chose that over
"the distribution actually sampled from" because after top-k/top-p most
alternatives are -inf and the numbers stop saying anything about the model;
the raw numbers are also the same for greedy and sampled requests.

Reproducibility: a seeded row draws its noise only from its own
`torch.Generator` (exponential race: argmax(p / q), q ~ Exp(1), which samples
exactly from p), and every other stage is row-wise, so a seeded request gets
the same tokens whatever else shares the batch and whatever row it is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_native.sampling_params import SamplingParams


@dataclass
class SamplingInput:
    """One row per sequence that samples this step."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request, from `make_generator(params.seed)`; None: global RNG
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # top-N (id, logprob), most likely first, N = params.logprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None for rows whose params.logprobs is None


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for one request; it must live on the device the logits live on."""
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    )


def _top_k_enabled(params: SamplingParams) -> bool:
    return params.top_k > 0


class Sampler:
    """Stateless; per-request state (generator, token history) travels in `SamplingInput`."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingInput]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        device = logits.device
        all_params = [row.params for row in rows]

        # Computed from the untouched logits, before any stage below makes its own copy.
        logprob_rows = [i for i, p in enumerate(all_params) if p.logprobs is not None]
        raw_logprobs = (
            torch.log_softmax(logits[_index(logprob_rows, device)], dim=-1) if logprob_rows else None
        )

        if all(p.greedy and not _has_penalties(p) for p in all_params):
            tokens = logits.argmax(dim=-1)  # the common fast path: one kernel for the whole batch
        else:
            tokens = self._sample(logits, rows)

        token_ids: list[int] = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if raw_logprobs is not None:
            _fill_logprobs(logprobs, raw_logprobs, logprob_rows, tokens, all_params)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingInput]) -> torch.Tensor:
        device = logits.device
        penalised = [i for i, r in enumerate(rows) if _has_penalties(r.params)]
        if penalised:
            logits = apply_penalties(logits, rows, penalised)  # out of place: caller's tensor untouched

        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens = torch.empty(len(rows), dtype=torch.long, device=device)
        if greedy:
            greedy_index = _index(greedy, device)
            tokens[greedy_index] = logits[greedy_index].argmax(dim=-1)
        if random:
            random_rows = [rows[i] for i in random]
            temperatures = torch.tensor([r.params.temperature for r in random_rows], device=device)
            # Division is out of place, so from here on `scaled` is ours to edit in place.
            if len(random) == len(rows):
                scaled = logits / temperatures[:, None]
            else:
                scaled = logits[_index(random, device)].div_(temperatures[:, None])
            _apply_top_k(scaled, random_rows)
            _apply_top_p(scaled, random_rows)
            _apply_min_p(scaled, random_rows)
            probs = torch.softmax(scaled, dim=-1)
            tokens[_index(random, device)] = _exponential_race(probs, random_rows)
        return tokens


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingInput], penalised: list[int]) -> torch.Tensor:
    """Return a copy of `logits` with penalties applied to the rows in `penalised`.

    repetition_penalty (HF): a token seen in prompt or output has its logit
    divided by the penalty if positive, multiplied if negative.
    presence/frequency (OpenAI): logit -= presence * [count > 0] + frequency * count,
    counting output tokens only.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    params = [rows[i].params for i in penalised]
    index = _index(penalised, device)
    sub = logits[index]  # a copy

    # Pad with an extra column (id == vocab_size) so ragged histories fit one scatter.
    def _counts(histories: list[list[int]]) -> torch.Tensor:
        width = max((len(h) for h in histories), default=0)
        padded = torch.full((len(histories), max(width, 1)), vocab_size, dtype=torch.long)
        for j, history in enumerate(histories):
            if history:
                padded[j, : len(history)] = torch.tensor(history, dtype=torch.long)
        counts = torch.zeros(len(histories), vocab_size + 1, dtype=sub.dtype, device=device)
        counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=sub.dtype, device=device))
        return counts[:, :vocab_size]

    output_counts = _counts([rows[i].output_token_ids for i in penalised])
    if any(p.repetition_penalty != 1.0 for p in params):
        prompt_counts = _counts([rows[i].prompt_token_ids for i in penalised])
        seen = (prompt_counts + output_counts) > 0
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        sub = sub - presence * (output_counts > 0) - frequency * output_counts

    if len(penalised) == logits.shape[0]:
        return sub
    return logits.index_copy(0, index, sub)


def _apply_top_k(scaled: torch.Tensor, rows: list[SamplingInput]) -> None:
    """Keep each row's k largest logits (ties at the k-th value are all kept). In place."""
    selected = [j for j, r in enumerate(rows) if _top_k_enabled(r.params)]
    if not selected:
        return
    vocab_size = scaled.shape[1]
    ks = [min(rows[j].params.top_k, vocab_size) for j in selected]
    index = _index(selected, scaled.device)
    sub = scaled[index]
    # topk of the largest k asked for is far cheaper than a full sort of V.
    top_values = sub.topk(max(ks), dim=-1).values
    kth = top_values.gather(1, torch.tensor(ks, device=scaled.device)[:, None] - 1)
    scaled[index] = sub.masked_fill_(sub < kth, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, rows: list[SamplingInput]) -> None:
    """Keep the smallest set of tokens whose probability reaches top_p (always the top one). In place."""
    selected = [j for j, r in enumerate(rows) if r.params.top_p < 1.0]
    if not selected:
        return
    device = scaled.device
    index = _index(selected, device)
    sub = scaled[index]
    sorted_logits, order = sub.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    top_p = torch.tensor([rows[j].params.top_p for j in selected], device=device)[:, None]
    # Ascending order: drop the tail whose total mass stays within 1 - top_p; the last (top) token
    # always survives, so top_p -> 0 degenerates to argmax instead of an empty set.
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[:, -1] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    scaled[index] = sub.masked_fill_(drop, float("-inf"))


def _apply_min_p(scaled: torch.Tensor, rows: list[SamplingInput]) -> None:
    """Drop tokens whose probability is below min_p times the row's top probability. In place."""
    selected = [j for j, r in enumerate(rows) if r.params.min_p > 0.0]
    if not selected:
        return
    device = scaled.device
    index = _index(selected, device)
    sub = scaled[index]
    probs = sub.softmax(dim=-1)
    min_p = torch.tensor([rows[j].params.min_p for j in selected], device=device)[:, None]
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    scaled[index] = sub.masked_fill_(probs < threshold, float("-inf"))


def _exponential_race(probs: torch.Tensor, rows: list[SamplingInput]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i.

    Seeded rows draw q from their own generator, one row at a time, so the draw
    depends on nothing but that request's seed and step; unseeded rows share one
    draw from the global RNG.
    """
    noise = torch.empty_like(probs)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if len(unseeded) == len(rows):
        noise.exponential_()
    else:
        for j, row in enumerate(rows):
            if row.generator is not None:
                noise[j].exponential_(generator=row.generator)
        if unseeded:
            index = _index(unseeded, probs.device)
            noise[index] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    # q == 0 has probability ~0 but would turn 0/0 into NaN for filtered tokens.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return probs.div_(noise).argmax(dim=-1)


def _fill_logprobs(
    out: list[TokenLogprobs | None],
    raw_logprobs: torch.Tensor,
    logprob_rows: list[int],
    tokens: torch.Tensor,
    all_params: list[SamplingParams],
) -> None:
    device = raw_logprobs.device
    sampled = tokens[_index(logprob_rows, device)]
    sampled_logprobs: list[float] = raw_logprobs.gather(1, sampled[:, None]).squeeze(1).tolist()
    sampled_ids: list[int] = sampled.tolist()
    top_n = [all_params[i].logprobs or 0 for i in logprob_rows]
    top_values: list[list[float]] = [[] for _ in logprob_rows]
    top_ids: list[list[int]] = [[] for _ in logprob_rows]
    if max(top_n) > 0:
        values, ids = raw_logprobs.topk(max(top_n), dim=-1)  # sorted, most likely first
        top_values, top_ids = values.tolist(), ids.tolist()
    for j, row in enumerate(logprob_rows):
        n = top_n[j]
        out[row] = TokenLogprobs(
            token_id=sampled_ids[j],
            logprob=sampled_logprobs[j],
            top=list(zip(top_ids[j][:n], top_values[j][:n], strict=True)),
        )
