"""Sampling in generation: draws follow transformers' warpers (temperature, top-k, top-p, min-p, in its order) and
never leave the tokens they keep; at ties the filters keep exactly the tokens the warpers keep."""

import math
import random

import pytest
import torch
from helpers.models import PROMPTS, small_model
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hybrid_ops
from hybrid_ops.generation.sampler import SamplingParams, sample, top_p_filter, warp

DRAWS = 40_000  # per row: a frequency's standard deviation is at most 0.0025
# Two rows with distinct values (no ties at the k-th largest), in different orders.
LOGITS = torch.tensor(
    [[0.3, -1.2, 2.0, 0.9, -0.4, 1.5, 0.0, -2.5, 1.1, 0.6], [1.0, 0.2, -0.7, 2.4, -1.9, 0.5, 1.7, -0.1, 0.8, -3.0]]
)


def sampled(temperature, top_k, top_p, min_p):
    return SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def transformers_warpers(sampling):
    """transformers' own warpers, in the order its generate(do_sample=True) applies them."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p:
        warpers.append(MinPLogitsWarper(sampling.min_p))
    return warpers


def expected_probs(logits, sampling):
    """float64 probabilities after transformers' own warpers."""
    return transformers_warpers(sampling)(None, logits.double()).softmax(-1)


@pytest.mark.parametrize(
    "sampling",
    [
        sampled(1.0, 0, 1.0, 0.0),
        sampled(0.5, 0, 1.0, 0.0),
        sampled(2.0, 0, 1.0, 0.0),
        sampled(1.0, 3, 1.0, 0.0),
        sampled(0.7, 5, 1.0, 0.0),
        sampled(1.3, 1, 1.0, 0.0),
        sampled(1.0, 0, 0.8, 0.0),
        sampled(1.5, 0, 0.5, 0.0),
        sampled(1.0, 0, 1.0, 0.2),
        sampled(2.0, 0, 1.0, 0.4),
        sampled(1.2, 6, 0.9, 0.1),
    ],
    ids=lambda s: f"t{s.temperature}-k{s.top_k}-p{s.top_p}-m{s.min_p}",
)
def test_frequencies_follow_the_distribution(sampling):
    rows, vocab = LOGITS.shape
    generator = torch.Generator().manual_seed(1234)
    tokens = sample(LOGITS.repeat_interleave(DRAWS, 0), sampling, generator).view(rows, DRAWS)
    want = expected_probs(LOGITS, sampling)
    assert ((want > 0).sum(-1) < vocab).all() or sampling.top_k == sampling.min_p == 0 and sampling.top_p == 1
    for i in range(rows):
        freq = torch.bincount(tokens[i], minlength=vocab).double() / DRAWS
        assert freq[want[i] == 0].sum() == 0, f"row {i}: drew a token the warpers remove"
        # 5 standard deviations of a frequency: a 10% change in the temperature moves some past it.
        bound = 5 * (want[i] * (1 - want[i]) / DRAWS).sqrt()
        assert ((freq - want[i]).abs() <= bound).all(), f"row {i}: frequencies {freq} against {want[i]}"


# Exact ties at the top-p boundary: n equal logits are probabilities of exactly 1/n (n a power of two), so the
# cumulative probability meets 1 - top_p exactly; a token goes when its cumulative probability is at most 1 - top_p.
TIED = [  # (logits row, top_p, how many tokens stay: counted by hand)
    ([0.0] * 4, 0.5, 2),
    ([0.0] * 4, 0.75, 3),
    ([0.0] * 8, 0.25, 2),
    ([2.0] * 16, 1 / 16, 1),
    ([0.0] * 8 + [-math.inf] * 3, 0.625, 5),
    ([-math.inf, 1.5, -math.inf, 1.5, 1.5, -math.inf, 1.5], 0.5, 2),
]


def kept(logits):
    """[n, vocab] -> bool [n, vocab]: the tokens a filter leaves (not -inf)."""
    return logits > -math.inf


def tied_rows(vocab, rng):
    """A [1, vocab] float32 row of a few distinct values, each repeated; and the top_p values at which the
    cumulative probability of the ascending row meets 1 - top_p exactly at the end of a run of equal values."""
    levels = rng.sample([-3.0, -1.5, -1.0, 0.0, 0.5, 1.0, 2.5], rng.randint(1, 4))
    logits = torch.tensor([[rng.choice(levels) for _ in range(vocab)]])
    ascending = logits.sort(-1).values[0]
    cumulative = ascending.softmax(-1).cumsum(-1)
    ends = [i for i in range(vocab - 1) if ascending[i] < ascending[i + 1]]
    return logits, [1 - cumulative[i].item() for i in ends if 0 < cumulative[i] < 1]


@pytest.mark.parametrize("row, top_p, stay", TIED)
def test_top_p_at_an_exact_tie_keeps_transformers_tokens(row, top_p, stay):
    """The kept set equals TopPLogitsWarper's exactly, its size is the hand count, and draws land only on it, evenly
    (the tied tokens that stay are equally likely)."""
    logits = torch.tensor([row])
    want = kept(TopPLogitsWarper(top_p)(None, logits))
    assert torch.equal(kept(top_p_filter(logits, top_p)), want) and want.sum() == stay
    tokens = sample(logits.expand(DRAWS, -1), sampled(1.0, 0, top_p, 0.0), torch.Generator().manual_seed(7))
    freq = torch.bincount(tokens, minlength=len(row)).double() / DRAWS
    assert freq[~want[0]].sum() == 0
    bound = 5 * ((1 / stay) * (1 - 1 / stay) / DRAWS) ** 0.5
    assert ((freq[want[0]] - 1 / stay).abs() <= bound).all(), freq


@pytest.mark.parametrize("vocab", [5, 64, 1000])
def test_top_p_over_tied_logits_keeps_transformers_tokens(vocab):
    """Rows of a few repeated values, top_p at every run's boundary: the kept set is TopPLogitsWarper's, token for
    token (past 100 tokens torch's sort orders equal values other than by index; transformers' call decides)."""
    rng = random.Random(vocab)
    cases = 0
    for _ in range(30):
        logits, boundaries = tied_rows(vocab, rng)
        for top_p in boundaries:
            want = kept(TopPLogitsWarper(top_p)(None, logits))
            assert torch.equal(kept(top_p_filter(logits, top_p)), want), (logits.tolist(), top_p)
            cases += 1
    assert cases >= 30


@pytest.mark.parametrize("temperature, top_k, min_p", [(1.0, 3, 0.0), (0.7, 0, 0.3), (1.3, 10, 0.05)])
def test_every_filter_over_tied_logits_keeps_transformers_tokens(temperature, top_k, min_p):
    """Temperature, then top-k (ties at the k-th value), top-p at a tie's boundary, min-p: the kept set is that of
    transformers' warpers in their order."""
    rng = random.Random(top_k)
    for _ in range(20):
        logits, boundaries = tied_rows(64, rng)
        for top_p in boundaries[:3] + [1.0]:
            sampling = sampled(temperature, top_k, top_p, min_p)
            want = kept(transformers_warpers(sampling)(None, logits))
            assert torch.equal(kept(warp(logits, sampling)), want), (logits.tolist(), sampling)


def test_generate_passes_top_k_and_seed_through():
    """top_k = 1 leaves one token to draw: sampled generation gives greedy generation's tokens."""
    model = small_model("llama", "sdpa")
    greedy = hybrid_ops.generate(model, PROMPTS, 6, compile=False)
    assert hybrid_ops.generate(model, PROMPTS, 6, compile=False, do_sample=True, top_k=1, seed=3) == greedy
    runs = [
        hybrid_ops.generate(model, PROMPTS, 6, compile=False, do_sample=True, temperature=2.0, seed=s)
        for s in (5, 5, 6)
    ]
    assert runs[0] == runs[1] != runs[2]
