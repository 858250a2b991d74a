"""Checks of the generation API's arguments: each raises `HybridInputError` naming the argument."""

import math
import numbers

from ..errors import HybridInputError
from ..fp8 import FP8_DTYPES


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


def check_sizes(limit, max_seq_len, **sizes) -> int:
    """Raises unless every size of `sizes` (None: its default) and `max_seq_len` is a positive int and max_seq_len is
    at most `limit` (the model's max_position_embeddings, None for none) -> max_seq_len, by default `limit` capped at
    1024."""
    if max_seq_len is None:
        max_seq_len = min(1024, limit or 1024)
    for name, value in {"max_seq_len": max_seq_len, **sizes}.items():
        if value is not None and not is_int(value, 1):
            raise HybridInputError(f"{name} must be a positive int, got {value!r}")
    if limit and max_seq_len > limit:
        raise HybridInputError(
            f"max_seq_len ({max_seq_len}) exceeds the model's max_position_embeddings "
            f"({limit}); raise model.config.max_position_embeddings to go past it"
        )
    return max_seq_len


def check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise HybridInputError(f"{name} must be a bool, got {value!r}")


def check_compile_options(options) -> None:
    """None, or a dict of names in Inductor's config: an unknown name raises here, not at every step's call."""
    if options is None:
        return
    if not isinstance(options, dict):
        raise HybridInputError(f"compile_options must be a dict of Inductor's options or None, got {options!r}")
    from torch._inductor import config

    try:
        with config.patch(options):
            pass
    except AttributeError as e:  # names the first option Inductor does not have
        raise HybridInputError(f"compile_options: {e}") from None


def cache_dtype(kv_cache_dtype, model_dtype):
    """The KV cache's dtype: `kv_cache_dtype`, None meaning the model's, or an fp8 dtype."""
    kv_cache_dtype = model_dtype if kv_cache_dtype is None else kv_cache_dtype
    if kv_cache_dtype not in (model_dtype, *FP8_DTYPES):
        raise HybridInputError(
            f"kv_cache_dtype must be None (the model's {model_dtype}), torch.float8_e4m3fn "
            f"or torch.float8_e5m2, got {kv_cache_dtype!r}"
        )
    return kv_cache_dtype


def check_model_sizes(model, max_seq_len, kv_cache_dtype, **sizes):
    """`check_sizes` against the model's max_position_embeddings and `cache_dtype` against its parameters' dtype ->
    (max_seq_len, the cache's dtype)."""
    max_seq_len = check_sizes(max_positions(model.config.get_text_config()), max_seq_len, **sizes)
    return max_seq_len, cache_dtype(kv_cache_dtype, next(model.parameters()).dtype)
