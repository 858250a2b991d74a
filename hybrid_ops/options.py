"""The ops' options, declared once: `Options` is the table.

Each field of `Options` is one keyword option of `prefill`, `decode`, `attn` and `plan`; its annotation gives the
schema type (`float | None` is `float?`), its default the schema default, and its `option(...)` metadata the checks of
its value (rows of `check_rows`) and the backend feature a call needs while the option is in use (not at its default).
From the table come:

    SCHEMA_TEXT        the options' part of the op schemas (ops.SCHEMAS)
    Options(**kw)      the value every backend receives, defaults filled in (`resolve`: scale resolved, fp8 scales
                       per kv head); the ops build it from the keywords the dispatcher passes
    check_options      the checks of every option, run by validation.check_args (eager, fake and compiled alike);
                       `options_ok` the same at once, and the C++ entry points' from the same rows (checks.h)
    Options.features   what a backend must serve (`Backend.features`, "auto")
    cpp_header()       kernels/cpu's options.h, written when the native kernels build: the C++ entry points' option
                       parameters, their struct and the names they pass back to Python come from this table

Adding an option: a field here with its check and feature, then the kernels that implement it and their tests
(docs/extending.md).
"""

import dataclasses
import math
import types
import typing

import torch

from .check_rows import all_hold, check, compiled
from .fp8 import FP8_DTYPES, per_head


def option(default, checks=(), feature: str | None = None, doc: str = ""):
    """A field of `Options`. checks: rows (condition, message) of `check_rows` over `value` (the option's), `name`,
    q, k_cache and `options`, run in order for a value in use (not the default). feature: what a backend must serve
    while it is in use."""
    return dataclasses.field(default=default, metadata={"checks": tuple(checks), "feature": feature, "doc": doc})


def _tensor_of(dtype: str, shape: str):
    """The rows of a tensor option: `dtype` (`check_rows`' is_float32, is_bool), as many dims as `shape` ("[T, Q]")
    names, on q's device."""
    return (
        (
            f"is_{dtype}(value) and value.dim() == {shape.count(',') + 1} and same_device(value, q)",
            f"{{name}} must be a {shape} {dtype} tensor on q's device {{q.device}}, got "
            "{value.dtype} of shape {tuple(value.shape)} on {value.device}",
        ),
    )


def _kv_scale(other: str):
    """The rows of k_scale (other: "v_scale") and v_scale (other: "k_scale")."""
    return (
        ("is_fp8(k_cache)", "{name} applies to float8 caches only; k_cache is {k_cache.dtype}"),
        (f"given(options.{other})", f"{other} must be given with {{name}}: an fp8 cache takes both scales or neither"),
        (
            "is_float32(value) and same_device(value, q) and value.dim() <= 1",
            "{name} must be a float32 tensor of shape [], [1] or [Hkv] on q's device {q.device}, "
            "got {value.dtype} of shape {tuple(value.shape)} on {value.device}",
        ),
        (
            "value.dim() == 0 or (value.size(0) == 1) | (value.size(0) == k_cache.size(2))",
            "{name} must have 1 or the caches' {k_cache.size(2)} kv heads, got {value.size(0)}",
        ),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """The options of one op call. Backends receive them resolved (`resolve`): `scale` a float, `k_scale` and
    `v_scale` [Hkv] float32 views for fp8 caches and None otherwise."""

    scale: float | None = option(
        None,
        [("value > 0 and value < inf", "{name} must be a finite positive float or None, got {value}")],
        doc="logit scale; None: 1 / sqrt(D)",
    )
    sliding_window: int = option(
        -1,
        [("value > 0", "{name} must be -1 (no window) or a positive int, got {value}")],
        doc="a token sees the last W positions up to its own; -1: all",
    )
    logit_cap: float = option(
        0.0,
        [("value >= 0 and value < inf", "{name} must be 0.0 (no soft-cap) or a finite positive float, got {value}")],
        doc="logits soft-capped as cap * tanh(x / cap); 0.0: none",
    )
    sinks: torch.Tensor | None = option(
        None,
        [
            *_tensor_of("float32", "[Hq]"),
            ("value.size(0) == q.size(1)", "{name} must have q's {q.size(1)} heads, got {value.size(0)}"),
        ],
        "sinks",
        "[Hq] float32 logits, one per query head, that join each row's softmax denominator",
    )
    attention_chunk: int = option(
        -1,
        [("value > 0", "{name} must be -1 (no chunking) or a positive int, got {value}")],
        "attention_chunk",
        "a query at position p sees keys at positions [p - p % chunk, p]; -1: none",
    )
    k_scale: torch.Tensor | None = option(
        None,
        _kv_scale("v_scale"),
        "fp8_kv",
        "fp8 caches: [], [1] or [Hkv] float32, the cache holds k / k_scale; None: 1.0",
    )
    v_scale: torch.Tensor | None = option(None, _kv_scale("k_scale"), "fp8_kv", "as k_scale, for v")
    # Of fixed size, so that a CUDA graph reads the current tree from a static buffer (ops.py says why this name).
    tree_mask: torch.Tensor | None = option(
        None,
        [
            *_tensor_of("bool", "[T, Q]"),
            ("value.size(0) == q.size(0)", "{name} must have q's {q.size(0)} rows, got {value.size(0)}"),
            ("value.size(1) > 0", "{name} must have Q >= 1 columns, got shape {tuple(value.shape)}"),
        ],
        "tree_mask",
        "[T, Q] bool: which of its request's new tokens each token sees; None: causal",
    )

    def resolve(self, head_dim: int, k_cache) -> "Options":
        """The options as backends receive them, for q's head dim and the cache (fp8: its scales [Hkv] each)."""
        scale = 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale
        if k_cache.dtype not in FP8_DTYPES:
            return self if self.scale is not None else dataclasses.replace(self, scale=scale)
        num_kv_heads, device = k_cache.shape[2], k_cache.device
        k_scale, v_scale = (per_head(s, num_kv_heads, device) for s in (self.k_scale, self.v_scale))
        return dataclasses.replace(self, scale=scale, k_scale=k_scale, v_scale=v_scale)

    def features(self) -> frozenset:
        """The backend features the options in use need (of resolved options: an fp8 cache needs "fp8_kv")."""
        return frozenset(f.metadata["feature"] for f in FIELDS if f.metadata["feature"] and _in_use(self, f))

    def keywords(self) -> dict:
        """The options as keywords of the ops (tensors are not copied, unlike `dataclasses.asdict`)."""
        return {f.name: getattr(self, f.name) for f in FIELDS}


FIELDS = dataclasses.fields(Options)
ALL_FEATURES = frozenset(f.metadata["feature"] for f in FIELDS if f.metadata["feature"])


def _in_use(options, field) -> bool:
    value = getattr(options, field.name)
    return value is not None if field.default is None else value != field.default


def in_use_condition(field) -> str:
    """`_in_use` as a condition of `check_rows` over `options`: given, or not its default."""
    return f"given(options.{field.name})" if field.default is None else f"options.{field.name} != {field.default!r}"


# Per option: its rows all at once (`options_ok`, the per-call path) and compiled for `check_options`.
_OPTION_CHECKS = [
    (
        f,
        all_hold(f"{f.name}_ok", ("value", "q", "k_cache", "options"), [c for c, _ in f.metadata["checks"]]),
        compiled(f.metadata["checks"]),
    )
    for f in FIELDS
]


def options_ok(options: Options, q, k_cache) -> bool:
    """True when `check_options` would pass, for real tensors (comparing symbolic sizes with `==` would guard)."""
    return all(ok(getattr(options, f.name), q, k_cache, options) for f, ok, _ in _OPTION_CHECKS if _in_use(options, f))


def check_options(options: Options, q, k_cache) -> None:
    """Each option in use, checked against q [T, Hq, D] and k_cache [num_pages, page_size, Hkv, D], row by row: raises
    `HybridInputError` with the first failing row's message."""
    for f, _, rows in _OPTION_CHECKS:
        if _in_use(options, f):
            scope = {"value": getattr(options, f.name), "name": f.name, "q": q, "k_cache": k_cache, "options": options}
            check(rows, scope)


# Schema and C++ types of the annotations.
_SCHEMA_TYPES = {float: "float", int: "int", bool: "bool", torch.Tensor: "Tensor"}
_CPP_TYPES = {
    "float": "double",
    "int": "int64_t",
    "bool": "bool",
    "float?": "std::optional<double>",
    "Tensor?": "const std::optional<at::Tensor>&",
}


def _schema_type(annotation) -> str:
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) and type(None) in args:
        (inner,) = (a for a in args if a is not type(None))
        return _SCHEMA_TYPES[inner] + "?"
    return _SCHEMA_TYPES[annotation]


SCHEMA_TYPES = {name: _schema_type(t) for name, t in typing.get_type_hints(Options).items()}
SCHEMA_TEXT = ", ".join(f"{SCHEMA_TYPES[f.name]} {f.name}={f.default!r}" for f in FIELDS)


def cpp_header() -> str:
    """kernels/cpu's options.h: `HYBRID_OPTIONS(X)` applies X(C++ parameter type, name) to every option, in order."""
    rows = " \\\n".join(f"  X({_CPP_TYPES[SCHEMA_TYPES[f.name]]}, {f.name})" for f in FIELDS)
    return (
        "// Generated from hybrid_ops/options.py when the kernels build: the ops' options in schema order.\n"
        "#pragma once\n\n"
        "#include <ATen/core/Tensor.h>\n\n"
        "#include <optional>\n\n"
        f"#define HYBRID_OPTIONS(X) \\\n{rows}\n"
    )
