"""The batched sampler: per-request reproducibility, each truncation rule, penalties, logprobs."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from engine_native.sampler import (
    TOP_P_CANDIDATES,
    Sampler,
    SamplingInput,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
)
from engine_native.sampling_params import SamplingParams

VOCAB = 1000


def _row(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> SamplingInput:
    return SamplingInput(
        params=params,
        generator=make_generator(params.seed),
        prompt_token_ids=prompt if prompt is not None else [0],
        output_token_ids=output if output is not None else [],
    )


TARGET = SamplingParams(temperature=0.8, top_p=0.9, top_k=200, presence_penalty=0.3, seed=1234)


def _neighbours() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, top_p=0.5),  # unseeded: global RNG
        SamplingParams(temperature=0.7, min_p=0.1, repetition_penalty=1.3, seed=99),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, logprobs=2),
    ]


def _run(
    target: SamplingParams, neighbours: list[SamplingParams], position: int, steps: int = 20
) -> list[int]:
    """Sample `steps` tokens for `target` at row `position`, feeding the same target logits every run."""
    target_logits = torch.Generator().manual_seed(0)
    noise = torch.Generator().manual_seed(position + 100 * len(neighbours))  # neighbours differ per run
    target_row = _row(target)
    others = [_row(p) for p in neighbours]
    rows = others[:position] + [target_row] + others[position:]
    sampler = Sampler()
    produced: list[int] = []
    for _ in range(steps):
        logits = torch.randn(len(rows), VOCAB, generator=noise) * 3
        logits[position] = torch.randn(VOCAB, generator=target_logits) * 3
        out = sampler(logits, rows)
        for row, token in zip(rows, out.token_ids, strict=True):
            row.output_token_ids.append(token)
        produced.append(out.token_ids[position])
    return produced


def test_seeded_request_reproducible_whatever_the_batch() -> None:
    alone = _run(TARGET, [], 0)
    assert _run(TARGET, _neighbours()[:4], 0) == alone
    assert _run(TARGET, _neighbours(), 3) == alone
    assert _run(TARGET, list(reversed(_neighbours())), 5) == alone
    assert len(set(alone)) > 1  # actually sampling, not collapsing to argmax


def test_different_seeds_differ() -> None:
    first = _run(TARGET, [], 0)
    second = _run(msgspec.structs.replace(TARGET, seed=4321), [], 0)
    assert first != second


def test_greedy_is_argmax_and_fast_path_leaves_logits_alone() -> None:
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0)) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8
    assert torch.equal(logits, before)


def test_mixed_batch_greedy_rows_are_argmax_and_logits_untouched() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.3, seed=1),
        SamplingParams(temperature=0.0, seed=5),
        SamplingParams(temperature=2.0, top_k=3, min_p=0.2),
    ]
    out = Sampler()(logits, [_row(p, output=[0]) for p in params])
    argmax = logits.argmax(dim=-1).tolist()
    assert out.token_ids[0] == argmax[0] and out.token_ids[2] == argmax[2]
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=2e-5),  # just above the greedy cut-off
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
    ids=["top_k=1", "top_p tiny", "temperature->0", "min_p=1"],
)
def test_degenerate_truncation_is_argmax(params: SamplingParams) -> None:
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [_row(msgspec.structs.replace(params, seed=i)) for i in range(16)]
    assert Sampler()(logits, rows).token_ids == logits.argmax(dim=-1).tolist()


def _frequencies(params: SamplingParams, logits: torch.Tensor, draws: int) -> list[float]:
    """Draw `draws` tokens from one seeded row (the per-row generator path)."""
    row = _row(params)
    sampler = Sampler()
    counts = [0] * logits.shape[-1]
    for _ in range(draws):
        counts[sampler(logits[None], [row]).token_ids[0]] += 1
    return [c / draws for c in counts]


PROBS = [0.1, 0.2, 0.3, 0.4]
LOG_PROBS = torch.tensor(PROBS).log()


def _chi_square(observed_counts: list[int], expected_probs: list[float]) -> float:
    total = sum(observed_counts)
    return sum(
        (o - total * p) ** 2 / (total * p) for o, p in zip(observed_counts, expected_probs, strict=True)
    )


def test_temperature_one_matches_softmax_seeded_rows() -> None:
    draws = 4000
    freqs = _frequencies(SamplingParams(temperature=1.0, seed=11), LOG_PROBS, draws)
    # 3 degrees of freedom: P(chi2 > 25) ~ 1.6e-5, and the seed is fixed anyway.
    assert _chi_square([round(f * draws) for f in freqs], PROBS) < 25


def test_temperature_one_matches_softmax_unseeded_batch() -> None:
    torch.manual_seed(0)
    rows = 20000
    out = Sampler()(LOG_PROBS.expand(rows, 4).contiguous(), [_row(SamplingParams()) for _ in range(rows)])
    counts = [out.token_ids.count(t) for t in range(4)]
    assert _chi_square(counts, PROBS) < 25


def test_temperature_sharpens() -> None:
    freqs = _frequencies(SamplingParams(temperature=0.5, seed=12), LOG_PROBS, 3000)
    sharpened = [p**2 / sum(q**2 for q in PROBS) for p in PROBS]  # softmax(log p / 0.5) = p^2 / sum
    assert _chi_square([round(f * 3000) for f in freqs], sharpened) < 25


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2, seed=1), {2, 3}),
        (SamplingParams(top_p=0.5, seed=2), {2, 3}),  # 0.4 alone < 0.5, 0.4 + 0.3 reaches it
        (SamplingParams(top_p=0.35, seed=3), {3}),
        (SamplingParams(min_p=0.6, seed=4), {2, 3}),  # keeps p >= 0.24
        (SamplingParams(min_p=0.8, seed=5), {3}),  # keeps p >= 0.32
        (SamplingParams(min_p=0.2, seed=6), {0, 1, 2, 3}),  # keeps p >= 0.08
    ],
)
def test_truncation_keeps_exactly_the_expected_tokens(params: SamplingParams, allowed: set[int]) -> None:
    freqs = _frequencies(params, LOG_PROBS, 600)
    assert {t for t, f in enumerate(freqs) if f > 0} == allowed


def test_top_p_renormalises_over_the_kept_set() -> None:
    freqs = _frequencies(SamplingParams(top_p=0.5, seed=8), LOG_PROBS, 3000)
    counts = [round(f * 3000) for f in freqs]
    assert _chi_square(counts[2:], [0.3 / 0.7, 0.4 / 0.7]) < 25


def _kept_by_sorting(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Reference top-k then top-p: sort everything, walk down the list."""
    order = row.argsort(descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    probs = torch.softmax(row[order], dim=-1).tolist()
    kept, mass = [], 0.0
    for token, p in zip(order, probs, strict=True):
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append(token)
        mass += p
    return set(kept)


@pytest.mark.parametrize(
    ("vocab", "scale"),
    [(50, 3.0), (5000, 3.0), (5000, 0.05)],  # the flat one forces the full-sort fallback
    ids=["small", "peaky", "flat"],
)
def test_top_k_top_p_matches_a_full_sort(vocab: int, scale: float) -> None:
    generator = torch.Generator().manual_seed(vocab)
    settings = [(0, 0.9), (10, 1.0), (10, 0.5), (0, 0.3), (2000, 0.95), (0, 1.0), (7000, 0.99), (1, 0.9)]
    logits = torch.randn(len(settings), vocab, generator=generator, dtype=torch.float64).float() * scale
    rows = [_row(SamplingParams(top_k=k, top_p=p)) for k, p in settings]
    if scale < 1:
        assert vocab > TOP_P_CANDIDATES  # the fallback really is exercised
    truncated = logits.clone()
    apply_top_k_top_p(truncated, rows)
    for i, (k, p) in enumerate(settings):
        kept = set(torch.isfinite(truncated[i]).nonzero().squeeze(1).tolist())
        assert kept == _kept_by_sorting(logits[i], k, p), (k, p)
        assert torch.equal(truncated[i][list(kept)], logits[i][list(kept)])


def test_min_p_keeps_probabilities_above_a_fraction_of_the_top() -> None:
    logits = torch.tensor([[0.0, -1.0, -2.0, -3.0], [5.0, 5.0, 4.0, 0.0]])
    rows = [_row(SamplingParams(min_p=0.3)), _row(SamplingParams(min_p=0.5))]
    apply_min_p(logits, rows)
    # exp(-1) = 0.37 >= 0.3 kept, exp(-2) = 0.14 dropped; exp(-1) = 0.37 < 0.5 dropped
    assert torch.isfinite(logits).tolist() == [[True, True, False, False], [True, True, False, False]]


def test_penalties_exact_numbers() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    row = _row(params, prompt=[0], output=[1, 3, 3])
    penalised = apply_penalties(logits, [row], [0])
    # repetition (seen: 0 from the prompt, 1 and 3 from the output): 2 -> 1, -1 -> -2, 3 -> 1.5
    # then presence + frequency over the output only: token 1 (x1) -0.75, token 3 (x2) -1.0
    assert penalised.tolist() == [[1.0, -2.75, 0.5, 0.5, 1.0]]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, 1.0]]


def test_penalties_only_touch_their_own_rows() -> None:
    logits = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])
    rows = [
        _row(SamplingParams(), output=[1]),
        _row(SamplingParams(frequency_penalty=1.0), output=[1, 1]),
        _row(SamplingParams(repetition_penalty=4.0), prompt=[0], output=[]),
    ]
    penalised = apply_penalties(logits, rows, [1, 2])
    assert penalised.tolist() == [[1.0, 2.0], [1.0, 0.0], [0.25, 2.0]]


def test_penalties_match_a_dense_reference() -> None:
    generator = torch.Generator().manual_seed(9)
    vocab = 50
    logits = torch.randn(6, vocab, generator=generator)
    rows = []
    for i in range(6):
        prompt = torch.randint(0, vocab, (30,), generator=generator).tolist()
        output = torch.randint(0, vocab, (i * 7,), generator=generator).tolist()
        params = SamplingParams(
            repetition_penalty=[1.0, 1.3, 0.8][i % 3],
            presence_penalty=[0.0, 0.5, -0.4][i % 3 - 1],
            frequency_penalty=[0.2, 0.0, 1.1][i % 3],
        )
        rows.append(_row(params, prompt=prompt, output=output))
    penalised = apply_penalties(logits, rows, [1, 2, 3, 4, 5])
    for i, row in enumerate(rows):
        expected = logits[i].tolist()
        if i > 0:
            p = row.params
            for token in set(row.prompt_token_ids + row.output_token_ids):
                value = expected[token]
                expected[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            for token in set(row.output_token_ids):
                count = row.output_token_ids.count(token)
                expected[token] -= p.presence_penalty + p.frequency_penalty * count
        assert penalised[i].tolist() == pytest.approx(expected, abs=1e-5)


def test_penalties_steer_greedy() -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    greedy_pen = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert Sampler()(logits, [_row(greedy_pen, output=[0])]).token_ids == [1]
    assert Sampler()(logits, [_row(greedy_pen, output=[])]).token_ids == [0]
    negative = torch.tensor([[-1.0, -1.5]])
    repeat = SamplingParams(temperature=0.0, repetition_penalty=2.0)  # -1 * 2 = -2 < -1.5
    assert Sampler()(negative, [_row(repeat, prompt=[0])]).token_ids == [1]


def test_logprobs_are_raw_and_top_n_sorted() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(temperature=0.7, top_k=5, logprobs=4, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = Sampler()(logits, [_row(p) for p in params])
    raw = torch.log_softmax(logits, dim=-1)
    first, none, zero = out.logprobs
    assert none is None
    assert first is not None and zero is not None
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-6)
    assert [t for t, _ in first.top] == raw[0].topk(4).indices.tolist()
    values = [v for _, v in first.top]
    assert values == sorted(values, reverse=True)
    assert first.token_id in {t for t, _ in first.top}  # top_k=5 sampled among the top 5; top-4 shown
    assert zero.top == [] and zero.token_id == out.token_ids[2] == logits[2].argmax().item()
    assert math.isclose(zero.logprob, raw[2].max().item(), abs_tol=1e-6)


def test_logprobs_on_greedy_fast_path() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    out = Sampler()(logits, [_row(SamplingParams(temperature=0.0, logprobs=2)) for _ in range(2)])
    raw = torch.log_softmax(logits, dim=-1)
    for i, entry in enumerate(out.logprobs):
        assert entry is not None and entry.token_id == raw[i].argmax().item()
        assert entry.top[0][0] == entry.token_id and len(entry.top) == 2


def test_make_generator() -> None:
    assert make_generator(None) is None
    first, second = make_generator(5), make_generator(5)
    assert first is not None and second is not None
    assert torch.rand(3, generator=first).tolist() == torch.rand(3, generator=second).tolist()


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(torch.zeros(2, 4), [_row(SamplingParams())])


@pytest.mark.parametrize("vocab", [4096, 1000, 50])
def test_the_fused_draw_picks_what_the_inverse_cdf_picks(vocab: int) -> None:
    """kernels/sample.cpp draws a row's token in two passes and a walk over block sums; at the same uniform
    it picks the token PyTorch's softmax, cumsum and search pick (up to float rounding at a boundary), for
    vocabularies of whole 64-token blocks, of a part block at the end, and of less than one block."""
    from engine_native.kernels import cpu_kernels

    kernels = cpu_kernels()
    assert kernels is not None
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(400, vocab, generator=g) * 3
    logits[:, 7] = float("-inf")  # a masked token is never drawn
    inverse = torch.rand(400, generator=g) * 2 + 0.25
    uniforms = torch.rand(400, generator=g)
    ours = kernels.sample_rows(logits, inverse, uniforms)
    probs = torch.softmax(logits.double() * inverse[:, None].double(), dim=-1)
    cdf = probs.cumsum(dim=-1)
    theirs = torch.searchsorted(cdf, (uniforms[:, None].double() * cdf[:, -1:]), right=True).squeeze(1)
    assert (ours == theirs).float().mean() >= 0.99
    assert not (ours == 7).any()
    assert torch.equal(kernels.sample_rows(logits, inverse, torch.zeros(400)), (probs > 0).float().argmax(-1))
    # The last token of the vocabulary is drawn where u sits past everything before it.
    last = torch.full((1, vocab), float("-inf"))
    last[0, vocab - 1] = 0.0
    assert kernels.sample_rows(last, torch.ones(1), torch.tensor([0.999])).tolist() == [vocab - 1]


def test_the_fused_draw_of_rows_without_a_finite_maximum() -> None:
    """A row with +inf draws its first +inf; a row of -inf and NaN only draws token 0 (the first maximum as
    `>` sees it); NaNs beside finite logits are skipped by the maximum and never win it."""
    from engine_native.kernels import cpu_kernels

    kernels = cpu_kernels()
    assert kernels is not None
    logits = torch.zeros(3, 200)
    logits[0, 130] = logits[0, 190] = float("inf")
    logits[1] = float("-inf")
    logits[1, 3] = float("nan")
    logits[2, 0] = float("nan")
    logits[2, 150] = 50.0  # e^-50 for every other token: u below 1 - 2e-20 lands here
    drawn = kernels.sample_rows(logits, torch.ones(3), torch.tensor([0.5, 0.5, 0.5])).tolist()
    assert drawn == [130, 0, 150]


def test_the_argmax_kernel_picks_what_torch_argmax_picks() -> None:
    from engine_native.kernels import cpu_kernels

    kernels = cpu_kernels()
    assert kernels is not None
    g = torch.Generator().manual_seed(4)
    for vocab in (1, 7, 8, 49152, 49157):  # whole vectors and a scalar tail
        logits = torch.randn(40, vocab, generator=g) * 8
        logits[1] = 3.0  # all tied: the first
        logits[2] = float("-inf")
        if vocab > 5:
            logits[3, [2, vocab - 1]] = 100.0  # a tie at the top, one in the tail
            logits[4, 5] = float("nan")  # a NaN is the maximum
            logits[4, vocab - 1] = float("nan")
            logits[5, :] = -0.0
            logits[5, vocab - 1] = 0.0  # -0.0 == 0.0: the first
            logits[6, vocab - 1] = float("inf")
        assert torch.equal(kernels.argmax_rows(logits), logits.argmax(dim=-1)), vocab
    with pytest.raises(RuntimeError, match="contiguous fp32"):
        kernels.argmax_rows(torch.zeros(2, 8).t())


def test_logit_bias_adds_to_the_named_tokens_of_its_own_row_only() -> None:
    """+100 all but forces a token in greedy and sampled rows alike, -100 bans the argmax; a row without a
    bias beside them keeps the model's argmax and every other logit, and logprobs stay the raw model's."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    top = int(logits[1].argmax())
    rows = [
        _row(SamplingParams(temperature=0.0, logit_bias={17: 100.0})),
        _row(SamplingParams(temperature=0.0, logit_bias={top: -100.0})),
        _row(SamplingParams(temperature=0.0, logprobs=0)),
        _row(SamplingParams(temperature=1.0, seed=5, logit_bias={423: 100.0})),
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == 17 and out.token_ids[3] == 423
    assert out.token_ids[1] == int(logits[1].topk(2).indices[1]) and out.token_ids[2] == int(logits[2].argmax())
    biased = apply_penalties(logits, rows, [0, 1, 3])
    changed = (biased != logits).nonzero().tolist()
    assert changed == [[0, 17], [1, top], [3, 423]]
    assert biased[1, top] == pytest.approx(float(logits[1, top]) - 100.0)
