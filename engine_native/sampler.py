"""The batched sampler: one call per engine step turns float32 logits [S, V] into one token per row.

Pipeline per row, in this order (each stage runs only over the rows that need it):

    raw logits ──> logprobs (log_softmax of the raw logits, see below)
        │
        ├─> repetition penalty (HF, over prompt + output) ─> presence/frequency penalty (OpenAI, over output)
        │     ─> logit_bias (OpenAI, added to the tokens it names)
        │
        ├─ greedy rows ─> argmax
        └─ random rows ─> / temperature ─> top_k ─> top_p ─> min_p ─> softmax ─> inverse-CDF draw

Logprobs are taken from the model's raw distribution, before penalties,
temperature and truncation (vLLM's default `raw_logprobs`). We chose that over
"the distribution actually sampled from" because after top-k/top-p most
alternatives are -inf and the numbers stop saying anything about the model;
the raw numbers are also the same for greedy and sampled requests.

Reproducibility: a seeded row draws its one uniform per step only from its own
`torch.Generator`, and every other stage is row-wise, so a seeded request gets
the same tokens whatever else shares the batch and whatever row it is in.
We draw by inverse CDF (cumsum + searchsorted) rather than an exponential race
(argmax(p / q), q ~ Exp(1)): the race needs V random numbers per row per step,
which on CPU cost more than the rest of the pipeline together.

Device: the sampler runs where the logits are. On a GPU (device_runner.py) the
[S, V] logits never cross to the host: only the S token ids (and any logprobs
asked for) do; the uniforms are drawn on the host (the generators live there)
and cross the other way, S floats.

Cost: top-k and top-p never sort the whole vocabulary. They work on the
`topk` candidates (top_k, or at most `TOP_P_CANDIDATES` for top-p) and fall back
to a full sort only for a row whose candidates hold less than top_p of the mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine_native.kernels import cpu_kernels
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


def make_generator(seed: int | None) -> torch.Generator | None:
    """A host generator for one request: its uniforms are drawn on the host whatever the logits' device."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def _has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        or bool(params.logit_bias)
    )


def _top_k_enabled(params: SamplingParams) -> bool:
    return params.top_k > 0


class Sampler:
    """Stateless; per-request state (generator, token history) travels in `SamplingInput`."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingInput]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {len(rows)} rows")
        all_params = [row.params for row in rows]

        # Computed from the untouched logits, before any stage below makes its own copy.
        logprob_rows = [i for i, p in enumerate(all_params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(_select(logits, logprob_rows)[0], dim=-1) if logprob_rows else None

        if all(p.greedy and not _has_penalties(p) for p in all_params):
            tokens = _argmax(logits)  # the common fast path: one kernel for the whole batch
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
            tokens[greedy_index] = _argmax(logits[greedy_index])
        if random:
            random_rows = [rows[i] for i in random]
            kernels = cpu_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
            if kernels is not None and not any(_truncates(r.params) for r in random_rows):
                # One C++ pass per row instead of divide, softmax, cumsum and search over the vocabulary.
                sub = logits if len(random) == len(rows) else logits[_index(random, device)]
                inverse = torch.tensor([1.0 / r.params.temperature for r in random_rows], dtype=torch.float32)
                tokens[_index(random, device)] = kernels.sample_rows(
                    sub.contiguous(), inverse, _uniforms(random_rows, device).view(-1))
                return tokens
            temperatures = torch.tensor([r.params.temperature for r in random_rows], device=device)
            # Division is out of place, so from here on `scaled` is ours to edit in place.
            if len(random) == len(rows):
                scaled = logits / temperatures[:, None]
            else:
                scaled = logits[_index(random, device)].div_(temperatures[:, None])
            apply_top_k_top_p(scaled, random_rows)
            apply_min_p(scaled, random_rows)
            tokens[_index(random, device)] = _draw(torch.softmax(scaled, dim=-1), random_rows)
        return tokens


TOP_P_CANDIDATES = 1024  # top-p looks for its cut among this many most likely tokens before sorting all V


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1); on CPU through Sluice's kernel (kernels/sample.cpp), the same indices."""
    kernels = cpu_kernels() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if kernels is not None and logits.dim() == 2 and logits.shape[1] > 0:
        return kernels.argmax_rows(logits.contiguous())  # type: ignore[no-any-return]
    return logits.argmax(dim=-1)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _select(tensor: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The given rows: a view of the whole tensor when that is all of them (no copy,
    no write-back), else a copy plus the index to write it back through."""
    if len(rows) == tensor.shape[0]:
        return tensor, None
    index = _index(rows, tensor.device)
    return tensor[index], index


def apply_penalties(logits: torch.Tensor, rows: list[SamplingInput], penalised: list[int]) -> torch.Tensor:
    """Return a copy of `logits` with penalties applied to the rows in `penalised`.

    repetition_penalty (HF): a token seen in prompt or output has its logit
    divided by the penalty if positive, multiplied if negative.
    presence/frequency (OpenAI): logit -= presence * [count > 0] + frequency * count,
    counting output tokens only.
    logit_bias (OpenAI): logit += bias of each token the row's map names, last.

    Each touches only the tokens a row has seen or names, so they work on those (row, token)
    positions of the flattened tensor, not on every [S, V] entry.
    """
    device = logits.device
    vocab_size = logits.shape[1]
    out = logits.clone()  # the caller's tensor stays as the model produced it
    flat = out.view(-1)

    def _positions(histories: dict[int, list[int]]) -> torch.Tensor:
        parts = [torch.tensor(h, dtype=torch.long) + row * vocab_size for row, h in histories.items() if h]
        return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.long, device=device)

    def _per_row(values: dict[int, float], default: float) -> torch.Tensor:
        table = torch.full((logits.shape[0],), default, device=device)
        table[_index(list(values), device)] = torch.tensor(list(values.values()), device=device)
        return table

    repetition = {i: rows[i].params.repetition_penalty for i in penalised}
    repetition = {i: p for i, p in repetition.items() if p != 1.0}
    if repetition:
        seen = _positions(
            {i: rows[i].prompt_token_ids + rows[i].output_token_ids for i in repetition}
        ).unique()
        penalty = _per_row(repetition, 1.0)[seen // vocab_size]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)

    additive = [i for i in penalised if rows[i].params.presence_penalty or rows[i].params.frequency_penalty]
    if additive:
        generated, counts = _positions({i: rows[i].output_token_ids for i in additive}).unique(
            return_counts=True
        )
        owner = generated // vocab_size
        presence = _per_row({i: rows[i].params.presence_penalty for i in additive}, 0.0)[owner]
        frequency = _per_row({i: rows[i].params.frequency_penalty for i in additive}, 0.0)[owner]
        flat[generated] -= presence + frequency * counts

    biased = [i for i in penalised if rows[i].params.logit_bias]
    if biased:
        positions = _positions({i: list(rows[i].params.logit_bias) for i in biased})
        flat[positions] += torch.tensor([v for i in biased for v in rows[i].params.logit_bias.values()],
                                        dtype=out.dtype, device=device)
    return out


def apply_top_k_top_p(scaled: torch.Tensor, rows: list[SamplingInput]) -> None:
    """Keep each row's top_k most likely tokens, then the fewest of those whose
    (renormalised) probability reaches top_p; always at least the top token.
    Ties at the cut are all kept. In place."""
    selected = [j for j, r in enumerate(rows) if _top_k_enabled(r.params) or r.params.top_p < 1.0]
    if not selected:
        return
    device = scaled.device
    vocab_size = scaled.shape[1]
    params = [rows[j].params for j in selected]
    ks = [min(p.top_k, vocab_size) if _top_k_enabled(p) else vocab_size for p in params]
    # A top-k row needs all k candidates (top-p renormalises over them); a top-p-only row
    # hopes its cut lies within the first TOP_P_CANDIDATES.
    width = max(k if k < vocab_size else min(vocab_size, TOP_P_CANDIDATES) for k in ks)
    sub, write_back = _select(scaled, selected)

    candidates = sub.topk(width, dim=-1).values  # sorted, most likely first
    k = torch.tensor(ks, device=device)[:, None]
    keep = torch.arange(width, device=device)[None, :] < k
    need_full_sort: list[int] = []
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
        # The top-p mass is measured after top-k: over the candidates for a top-k row,
        # over the whole row for the others.
        in_candidates = candidates.masked_fill(~keep, float("-inf"))
        log_total = torch.where(
            k <= width,
            torch.logsumexp(in_candidates, dim=-1, keepdim=True),
            torch.logsumexp(sub, dim=-1, keepdim=True),
        )
        probs = (in_candidates - log_total).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= mass_before < top_p
        # All candidates kept yet short of top_p: the cut lies beyond them (top-p-only rows).
        short = (k > width) & (probs.sum(dim=-1, keepdim=True) < top_p)
        need_full_sort = short.squeeze(1).nonzero().squeeze(1).tolist()
    last_kept = keep.sum(dim=-1, keepdim=True).clamp_(min=1) - 1
    cutoff = candidates.gather(1, last_kept)
    for j in need_full_sort:
        cutoff[j] = _top_p_cutoff_full_sort(sub[j], params[j].top_p)
    sub.masked_fill_(sub < cutoff, float("-inf"))
    if write_back is not None:
        scaled[write_back] = sub


def _top_p_cutoff_full_sort(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest logit top-p keeps in `row`, from a sort of the whole row (the rare case)."""
    ordered = row.sort(descending=True).values
    probs = ordered.softmax(dim=-1)
    keep = (probs.cumsum(dim=-1) - probs) < top_p
    return ordered[keep.sum().clamp(min=1) - 1]


def apply_min_p(scaled: torch.Tensor, rows: list[SamplingInput]) -> None:
    """Drop tokens whose probability is below min_p times the row's top probability. In place.

    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed, and
    the earlier truncation does not change the answer (it keeps the top token).
    """
    selected = [j for j, r in enumerate(rows) if r.params.min_p > 0.0]
    if not selected:
        return
    device = scaled.device
    sub, write_back = _select(scaled, selected)
    log_min_p = torch.tensor([math.log(rows[j].params.min_p) for j in selected], device=device)[:, None]
    threshold = sub.amax(dim=-1, keepdim=True) + log_min_p
    sub.masked_fill_(sub < threshold, float("-inf"))
    if write_back is not None:
        scaled[write_back] = sub


def _truncates(params: SamplingParams) -> bool:
    """Whether a row cuts its distribution (top-k, top-p or min-p) before the draw."""
    return _top_k_enabled(params) or params.top_p < 1.0 or params.min_p > 0.0


def _uniforms(rows: list[SamplingInput], device: torch.device) -> torch.Tensor:
    """u ~ U[0, 1) per row, [R, 1]; seeded rows draw theirs from their own generator.

    Drawn on the host whatever the logits' device, then moved there in one copy: the generators are
    host ones, and a seeded request gets the same uniforms, so the same tokens, on a CPU and a GPU."""
    uniforms = torch.empty(len(rows), 1)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if unseeded:
        uniforms[_index(unseeded, uniforms.device)] = torch.rand(len(unseeded), 1)
    for j, row in enumerate(rows):
        if row.generator is not None:
            uniforms[j] = torch.rand(1, generator=row.generator)
    return uniforms.to(device)


def _draw(probs: torch.Tensor, rows: list[SamplingInput]) -> torch.Tensor:
    """One token per row by inverse CDF: the first token whose cumulative probability
    exceeds u * total, u ~ U[0, 1). Seeded rows draw u from their own generator."""
    uniforms = _uniforms(rows, probs.device)
    cdf = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)
    # Rounding can land u * total on the very end of the CDF, past the last token that
    # has any probability; such a row takes its most likely token instead.
    impossible = probs.gather(1, tokens) == 0
    if impossible.any():
        tokens = torch.where(impossible, probs.argmax(dim=-1, keepdim=True), tokens)
    return tokens.squeeze(1)


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
