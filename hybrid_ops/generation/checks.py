"""Checks of the generation API's arguments: each raises `HybridInputError` naming the argument."""

import math
import numbers

from ..errors import HybridInputError


def is_int(value, low: int) -> bool:
    """An int (numpy's included, bool not) of at least `low`."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def is_real(value) -> bool:
    """A finite real number (numpy's included, bool not)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def max_positions(config) -> int | None:
    """The model's max_position_embeddings, None for no limit (none, or -1 as XLNet's says)."""
    value = getattr(config, "max_position_embeddings", None)
    return value if is_int(value, 1) else None


def token_list(name, prompt, vocab_size) -> list:
    """prompt: a list or tuple of ints, a 1-D int tensor or numpy array -> a list of ids in [0, vocab_size)."""
    if not isinstance(prompt, (list, tuple)) and hasattr(prompt, "tolist"):  # a tensor or an array
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise HybridInputError(f"{name} must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise HybridInputError(f"{name} is empty: a prompt needs at least one token")
    for position, token in enumerate(prompt):
        if not (is_int(token, 0) and token < vocab_size):
            raise HybridInputError(f"{name}[{position}] must be a token id in [0, {vocab_size}), got {token!r}")
    return [int(t) for t in prompt]


def prompt_list(prompts) -> list:
    """prompts: any iterable of prompts (not a string) -> a list."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise HybridInputError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    return list(prompts)
