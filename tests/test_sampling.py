"""Sampling in generation: draws follow softmax(logits / temperature) over the top k tokens, and never leave them."""

import pytest
import torch
from test_transformers import PROMPTS, make_model

import hybrid_ops
from hybrid_ops.generator import _sample

DRAWS = 40_000  # per row: a frequency's standard deviation is at most 0.0025
# Two rows with distinct values (no ties at the k-th largest), in different orders.
LOGITS = torch.tensor([[0.3, -1.2, 2.0, 0.9, -0.4, 1.5, 0.0, -2.5, 1.1, 0.6],
                       [1.0, 0.2, -0.7, 2.4, -1.9, 0.5, 1.7, -0.1, 0.8, -3.0]])


def expected_probs(logits, temperature, top_k):
    """float64 softmax(logits / temperature) over each row's top_k largest (all when top_k = 0), 0 elsewhere."""
    probs = torch.zeros(logits.shape, dtype=torch.float64)
    for i, row in enumerate(logits.double()):
        keep = row.argsort(descending=True)[: top_k or row.numel()]
        probs[i, keep] = torch.softmax(row[keep] / temperature, 0)
    return probs


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.5, 0), (2.0, 0), (1.0, 3), (0.7, 5), (1.3, 1)])
def test_frequencies_follow_the_distribution(temperature, top_k):
    rows, vocab = LOGITS.shape
    generator = torch.Generator().manual_seed(1234)
    tokens = _sample(LOGITS.repeat_interleave(DRAWS, 0), True, temperature, top_k, generator).view(rows, DRAWS)
    want = expected_probs(LOGITS, temperature, top_k)
    for i in range(rows):
        freq = torch.bincount(tokens[i], minlength=vocab).double() / DRAWS
        assert freq[want[i] == 0].sum() == 0, f"row {i}: drew a token outside the top {top_k}"
        # 5 standard deviations of a frequency: a 10% change in the temperature moves some past it.
        bound = 5 * (want[i] * (1 - want[i]) / DRAWS).sqrt()
        assert ((freq - want[i]).abs() <= bound).all(), f"row {i}: frequencies {freq} against {want[i]}"


def test_generate_passes_top_k_and_seed_through():
    """top_k = 1 leaves one token to draw: sampled generation gives greedy generation's tokens."""
    model = make_model("llama", "sdpa")
    greedy = hybrid_ops.generate(model, PROMPTS, 6, compile=False)
    assert hybrid_ops.generate(model, PROMPTS, 6, compile=False, do_sample=True, top_k=1, seed=3) == greedy
    runs = [hybrid_ops.generate(model, PROMPTS, 6, compile=False, do_sample=True, temperature=2.0, seed=s)
            for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]
