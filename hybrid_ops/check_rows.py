"""Checks declared as rows, `(condition, message)`, that run in Python and are written out in C++.

A condition is Python that is also C++ once `and`, `or` and `not` are spelled `&&`, `||` and `!`: sizes through `dim()`
and `size(i)`, dtypes and devices through the helpers below (kernels/cpu/dispatch.cpp defines each of them too), `inf`,
and `|` for an "or" of sizes that may be symbolic (Python's `or` would guard on them). A message is an f-string's text
over the same names. The ops' tensor checks (`validation.TENSOR_CHECKS`) and option checks (`options.Options`) are
such rows; `validation.cpp_header` writes both into the cpu kernels' checks.h.
"""

import math
import re

import torch

from .errors import check_input
from .fp8 import FP8_DTYPES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def same_device(t, q) -> bool:
    return t.device == q.device


def same_dtype(t, other) -> bool:
    return t.dtype == other.dtype


def is_float(t) -> bool:
    return t.dtype in FLOAT_DTYPES


def is_float32(t) -> bool:
    return t.dtype == torch.float32


def is_bool(t) -> bool:
    return t.dtype == torch.bool


def is_fp8(t) -> bool:
    return t.dtype in FP8_DTYPES


def is_int32(t) -> bool:
    return t.dtype == torch.int32


def given(option) -> bool:
    """An optional option (None: not given)."""
    return option is not None


def value_rows_ok(v_cache) -> bool:
    """v_cache [num_pages, page_size, Hkv, Dv] is contiguous, or the leading Dv values of each row of a contiguous
    [num_pages, page_size, Hkv, E] tensor (E > Dv): MLA's latent cache passes `k_cache[..., :Dv]`, whose values are
    the first Dv of its keys, stored once."""
    if v_cache.is_contiguous():
        return True
    _, page_size, num_kv_heads, v_head_dim = v_cache.shape
    row = v_cache.stride(2)
    return v_cache.stride() == (page_size * num_kv_heads * row, num_kv_heads * row, row, 1) and row > v_head_dim


HELPERS = {
    "inf": math.inf,
    **{
        f.__name__: f
        for f in (same_device, same_dtype, is_float, is_float32, is_bool, is_fp8, is_int32, given, value_rows_ok)
    },
}
# The helpers written out, for `all_hold`: calling a Python function costs as much as the check it makes.
_INLINE = {
    "same_device": "{0}.device == {1}.device",
    "same_dtype": "{0}.dtype == {1}.dtype",
    "is_float": "{0}.dtype in FLOAT_DTYPES",
    "is_float32": "{0}.dtype == FLOAT32",
    "is_bool": "{0}.dtype == BOOL",
    "is_fp8": "{0}.dtype in FP8_DTYPES",
    "is_int32": "{0}.dtype == INT32",
    "given": "{0} is not None",
}
_CONSTANTS = {
    "FLOAT_DTYPES": FLOAT_DTYPES,
    "FP8_DTYPES": FP8_DTYPES,
    "FLOAT32": torch.float32,
    "BOOL": torch.bool,
    "INT32": torch.int32,
}


def _inline(condition: str, tensors) -> str:
    """`condition` with the sizes of `tensors` read once (`q.size(0)` as `q_shape[0]`) and the helpers written out."""
    names = "|".join(tensors)
    if names:
        condition = re.sub(rf"\b({names})\.size\((\d)\)", r"\1_shape[\2]", condition)
        condition = re.sub(rf"\b({names})\.dim\(\)", r"len(\1_shape)", condition)
    return re.sub(
        r"\b(\w+)\(([\w., ]+)\)",
        lambda m: f"({_INLINE[m[1]].format(*m[2].split(', '))})" if m[1] in _INLINE else m[0],
        condition,
    )


def all_hold(name: str, parameters, conditions, tensors=()):
    """A function of `parameters` that returns whether every condition holds: one expression, the sizes of the
    parameters named in `tensors` read once. For real tensors: comparing symbolic sizes with `==` would guard."""
    shapes = "".join(f"    {t}_shape = {t}.shape\n" for t in tensors)
    body = " and ".join(f"({_inline(c, tensors)})" for c in conditions) or "True"
    scope = {**HELPERS, **_CONSTANTS}
    exec(f"def {name}({', '.join(parameters)}):\n{shapes}    return {body}\n", scope)
    return scope[name]


def compiled(rows) -> list:
    """The rows with their conditions and messages compiled, for `check`."""
    return [(compile(c, c, "eval"), compile(f"f{m!r}", m, "eval")) for c, m in rows]


def check(rows, scope: dict) -> None:
    """Each of the `compiled` rows in order over `scope`'s names: raises `HybridInputError` with the message of the
    first that fails. Sizes may be symbolic (`check_input`)."""
    for condition, message in rows:
        check_input(eval(condition, HELPERS, scope), lambda: eval(message, HELPERS, scope))


def cpp(condition: str) -> str:
    """The condition in C++."""
    return re.sub(r"\bnot\b ?", "!", condition.replace(" and ", " && ").replace(" or ", " || "))
