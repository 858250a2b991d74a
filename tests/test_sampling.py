"""Sampling in generation: draws follow transformers' warpers (temperature, top-k, top-p, min-p, in its order) and
never leave the tokens they keep."""

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
from hybrid_ops.generator import _sample, _Sampling

DRAWS = 40_000  # per row: a frequency's standard deviation is at most 0.0025
# Two rows with distinct values (no ties at the k-th largest), in different orders.
LOGITS = torch.tensor(
    [[0.3, -1.2, 2.0, 0.9, -0.4, 1.5, 0.0, -2.5, 1.1, 0.6], [1.0, 0.2, -0.7, 2.4, -1.9, 0.5, 1.7, -0.1, 0.8, -3.0]]
)


def expected_probs(logits, sampling):
    """float64 probabilities after transformers' own warpers, as its generate(do_sample=True) applies them."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(sampling.temperature)])
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    if sampling.min_p:
        warpers.append(MinPLogitsWarper(sampling.min_p))
    return warpers(None, logits.double()).softmax(-1)


@pytest.mark.parametrize(
    "sampling",
    [
        _Sampling(1.0, 0, 1.0, 0.0),
        _Sampling(0.5, 0, 1.0, 0.0),
        _Sampling(2.0, 0, 1.0, 0.0),
        _Sampling(1.0, 3, 1.0, 0.0),
        _Sampling(0.7, 5, 1.0, 0.0),
        _Sampling(1.3, 1, 1.0, 0.0),
        _Sampling(1.0, 0, 0.8, 0.0),
        _Sampling(1.5, 0, 0.5, 0.0),
        _Sampling(1.0, 0, 1.0, 0.2),
        _Sampling(2.0, 0, 1.0, 0.4),
        _Sampling(1.2, 6, 0.9, 0.1),
    ],
    ids=str,
)
def test_frequencies_follow_the_distribution(sampling):
    rows, vocab = LOGITS.shape
    generator = torch.Generator().manual_seed(1234)
    tokens = _sample(LOGITS.repeat_interleave(DRAWS, 0), sampling, generator).view(rows, DRAWS)
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
    model = small_model("llama", "sdpa")
    greedy = hybrid_ops.generate(model, PROMPTS, 6, compile=False)
    assert hybrid_ops.generate(model, PROMPTS, 6, compile=False, do_sample=True, top_k=1, seed=3) == greedy
    runs = [
        hybrid_ops.generate(model, PROMPTS, 6, compile=False, do_sample=True, temperature=2.0, seed=s)
        for s in (5, 5, 6)
    ]
    assert runs[0] == runs[1] != runs[2]
