"""Sampling: a request's `SamplingParams`, and the next token of each request from its logits row.

The filters are transformers' logits warpers, written as their code does it, so that a sampled request keeps exactly
the tokens transformers' `generate(do_sample=True)` keeps (tests/test_sampling.py compares with the warpers).
"""

from dataclasses import dataclass

import torch

from ..errors import HybridInputError
from .checks import is_int, is_real


@dataclass(frozen=True)
class SamplingParams:
    """How a request chooses its tokens and when it stops; checked on construction (`HybridInputError` naming the
    field). The keywords of `HybridGenerator.add_request`, `generate` and `stream` are these fields.

    do_sample: False for greedy (argmax); the four warper fields are then neither checked nor used.
    temperature (> 0), top_k (>= 0, 0: no limit), top_p (in (0, 1]), min_p (in [0, 1]): applied in that order
        (`warp`), as transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper.
    seed: the request's own `torch.Generator`, so its draws depend on nothing else in its batch; None draws from
        torch's default generator (`torch.manual_seed`).
    eos_token_id: an int or a list of ints after any of which the request stops; None: the model's
        generation_config's; [] for none (kept as a tuple).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    eos_token_id: int | tuple | None = None

    def __post_init__(self):
        if not isinstance(self.do_sample, bool):
            raise HybridInputError(f"do_sample must be a bool, got {self.do_sample!r}")
        if self.do_sample:
            if not (is_real(self.temperature) and self.temperature > 0):
                raise HybridInputError(
                    f"temperature must be a finite number > 0 when do_sample=True, got {self.temperature!r}"
                )
            if not is_int(self.top_k, 0):
                raise HybridInputError(f"top_k must be a non-negative int (0: no limit), got {self.top_k!r}")
            if not (is_real(self.top_p) and 0 < self.top_p <= 1):
                raise HybridInputError(f"top_p must be in (0, 1], got {self.top_p!r}")
            if not (is_real(self.min_p) and 0 <= self.min_p <= 1):
                raise HybridInputError(f"min_p must be in [0, 1], got {self.min_p!r}")
            self._set(temperature=float(self.temperature), top_k=int(self.top_k))
            self._set(top_p=float(self.top_p), min_p=float(self.min_p))
        if self.seed is not None:
            if not is_int(self.seed, 0):
                raise HybridInputError(f"seed must be None or a non-negative int, got {self.seed!r}")
            self._set(seed=int(self.seed))
        eos = self.eos_token_id
        if eos is not None and not is_int(eos, 0):
            if not (isinstance(eos, (list, tuple)) and all(is_int(t, 0) for t in eos)):
                raise HybridInputError(f"eos_token_id must be None, a non-negative int or a list of them, got {eos!r}")
            self._set(eos_token_id=tuple(map(int, eos)))

    def _set(self, **fields):
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def stop_token_ids(self, default) -> frozenset:
        """The ids after which the request stops: eos_token_id, or `default` (the model's generation_config's: None,
        an int or a list) when it is None."""
        eos = default if self.eos_token_id is None else self.eos_token_id
        eos = [] if eos is None else [eos] if is_int(eos, 0) else eos
        return frozenset(map(int, eos))

    def generator(self, device) -> torch.Generator | None:
        """The request's own generator, seeded; None (torch's default generator) without a seed or do_sample."""
        if self.seed is None or not self.do_sample:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def top_k_filter(logits, top_k: int):
    """logits: [n, vocab] -> the same with -inf below the k-th largest of each row (ties with it stay), as
    transformers' TopKLogitsWarper."""
    kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits, top_p: float):
    """logits: [n, vocab] -> the same with -inf on the tokens outside the smallest set whose probability reaches
    top_p, as transformers' TopPLogitsWarper: sorted ascending, a token goes when the cumulative probability up to
    and including it is at most 1 - top_p; the most likely token always stays. Tokens of equal logits leave in the
    order that the same `sort` call gives, so ties at the boundary keep the same tokens as transformers."""
    ascending, order = logits.sort(-1)
    drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def min_p_filter(logits, min_p: float):
    """logits: [n, vocab] -> the same with -inf on tokens of probability below min_p times the row's top one, as
    transformers' MinPLogitsWarper (the top token always stays, since min_p <= 1)."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))


def warp(logits, params: SamplingParams):
    """logits: [n, vocab] -> float32 [n, vocab]: divided by the temperature, then top-k, top-p and min-p filtered
    (-inf on the tokens they remove), in transformers' order."""
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        logits = top_k_filter(logits, params.top_k)
    if params.top_p < 1:
        logits = top_p_filter(logits, params.top_p)
    if params.min_p > 0:
        logits = min_p_filter(logits, params.min_p)
    return logits


def sample(logits, params: SamplingParams, generator=None):
    """logits: [n, vocab] -> [n] int64 token ids drawn from the warped distribution; generator None: torch's
    default generator."""
    return torch.multinomial(warp(logits, params).softmax(-1), 1, generator=generator).squeeze(-1)


def next_tokens(logits, params, generators):
    """logits: [n, vocab], one row per request; params, generators: each request's SamplingParams and generator
    (`SamplingParams.generator`) -> [n] int64 token ids: the argmax, or a draw where do_sample is set."""
    next_ids = logits.argmax(-1)
    for i, (sampling, generator) in enumerate(zip(params, generators)):
        if sampling.do_sample:
            next_ids[i] = sample(logits[i : i + 1], sampling, generator)[0]
    return next_ids
