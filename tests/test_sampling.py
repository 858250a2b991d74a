"""Sampling in generation: draws follow transformers' warpers (temperature, top-k, top-p, min-p, in its order) and
never leave the tokens they keep."""

import pytest
import torch
from test_transformers import PROMPTS, make_model
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import hybrid_ops
from hybrid_ops.generation.sampler import SamplingParams, sample

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


def test_generate_passes_top_k_and_seed_through():
    """top_k = 1 leaves one token to draw: sampled generation gives greedy generation's tokens."""
    model = make_model("llama", "sdpa")
    greedy = hybrid_ops.generate(model, PROMPTS, 6, compile=False)
    assert hybrid_ops.generate(model, PROMPTS, 6, compile=False, do_sample=True, top_k=1, seed=3) == greedy
    runs = [
        hybrid_ops.generate(model, PROMPTS, 6, compile=False, do_sample=True, temperature=2.0, seed=s)
        for s in (5, 5, 6)
    ]
    assert runs[0] == runs[1] != runs[2]
