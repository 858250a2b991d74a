"""Argument checks of the ops.

`check_args` looks only at metadata (rank, shape, dtype, device), so the fake implementations run it too and the
same errors surface under torch.compile. `check_metadata_values` reads the metadata's values, which on CUDA is a
host sync: it runs only with validation switched on (`settings.set_validation`).
Every check runs before the KV cache is written, so a rejected call leaves the cache untouched.
"""

import torch

from .check_rows import all_hold, check, check_values, compiled, compiled_values, cpp, cpp_values
from .errors import check_input
from .options import FIELDS, check_options, in_use_condition

# The tensor checks, declared once and in order: rows (condition, message) of `check_rows`. Python runs them as
# `tensors_ok` (all at once: the ops' per-call path) and `check_tensors` (one by one, raising the first that fails); the
# native kernels run them as `tensors_ok` of checks.h, which `cpp_header` writes when they build. Shapes:
#
#   q: [T, Hq, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv]; k_cache: [num_pages, page_size, Hkv, D], v_cache:
#   [num_pages, page_size, Hkv, Dv], contiguous (v_cache: or the leading Dv values of contiguous rows,
#   `check_rows.value_rows_ok`), q's dtype or both one of FP8_DTYPES; cu_seqlens_q: [B + 1] int32; seq_lens: [B] int32;
#   block_table: [B, max_pages] int32. Dv may differ from D (MLA-style models).
RANKS = {"q": 3, "k": 3, "v": 3, "k_cache": 4, "v_cache": 4, "cu_seqlens_q": 1, "seq_lens": 1, "block_table": 2}
TENSOR_CHECKS = (
    *(
        row
        for name, rank in RANKS.items()
        for row in (
            (f"{name}.dim() == {rank}", f"{name} must have {rank} dimensions, got shape {{tuple({name}.shape)}}"),
            (f"same_device({name}, q)", f"{name} must be on q's device {{q.device}}, got {{{name}.device}}"),
        )[: 1 if name == "q" else 2]
    ),
    ("is_float(q)", "q must be float16, bfloat16 or float32, got {q.dtype}"),
    ("same_dtype(k, q)", "k must have q's dtype {q.dtype}, got {k.dtype}"),
    ("same_dtype(v, q)", "v must have q's dtype {q.dtype}, got {v.dtype}"),
    (
        "same_dtype(k_cache, q) or is_fp8(k_cache)",
        "k_cache must have q's dtype {q.dtype} or be float8_e4m3fn or float8_e5m2, got {k_cache.dtype}",
    ),
    ("same_dtype(v_cache, k_cache)", "v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}"),
    *(
        (f"is_int32({name})", f"{name} must be int32, got {{{name}.dtype}}")
        for name in ("cu_seqlens_q", "seq_lens", "block_table")
    ),
    (
        "v_cache.size(0) == k_cache.size(0) and v_cache.size(1) == k_cache.size(1) "
        "and v_cache.size(2) == k_cache.size(2)",
        "v_cache must be [num_pages, page_size, Hkv, Dv] with k_cache's first three sizes "
        "{tuple(k_cache.shape[:3])}, got {tuple(v_cache.shape)}",
    ),
    ("v_cache.size(3) > 0", "v_cache's head dim Dv must be positive, got shape {tuple(v_cache.shape)}"),
    (
        "k_cache.is_contiguous()",
        "k_cache must be a contiguous [num_pages, page_size, Hkv, D] tensor, got strides {k_cache.stride()}",
    ),
    (
        "value_rows_ok(v_cache)",
        "v_cache must be a contiguous [num_pages, page_size, Hkv, Dv] tensor or the leading Dv values of the rows of "
        "one (as k_cache[..., :Dv] of a latent cache), got strides {v_cache.stride()}",
    ),
    ("k_cache.size(3) == q.size(2)", "k_cache head dim {k_cache.size(3)} must equal q's head dim {q.size(2)}"),
    *(
        row
        for name, cache in (("k", "k_cache"), ("v", "v_cache"))
        for row in (
            (f"{name}.size(0) == q.size(0)", f"{name} must have q's {{q.size(0)}} tokens, got {{{name}.size(0)}}"),
            (
                f"{name}.size(1) == k_cache.size(2)",
                f"{name} must have k_cache's {{k_cache.size(2)}} kv heads, got shape {{tuple({name}.shape)}}",
            ),
            (
                f"{name}.size(2) == {cache}.size(3)",
                f"{name} head dim must equal its cache's {{{cache}.size(3)}}, got {{{name}.size(2)}}",
            ),
        )
    ),
    (
        "k_cache.size(2) > 0 and q.size(1) % k_cache.size(2) == 0",
        "q's {q.size(1)} heads must be a multiple of the caches' {k_cache.size(2)} kv heads (Hq % Hkv == 0)",
    ),
    (
        "cu_seqlens_q.size(0) == seq_lens.size(0) + 1",
        "cu_seqlens_q must have B + 1 = {seq_lens.size(0) + 1} entries (B = len(seq_lens)), got {cu_seqlens_q.size(0)}",
    ),
    (
        "block_table.size(0) == seq_lens.size(0)",
        "block_table must have B = {seq_lens.size(0)} rows (B = len(seq_lens)), got {block_table.size(0)}",
    ),
)
# `decode` needs the same query length for every request: T a multiple of B (T = 0 when B = 0).
DECODE_SHAPE = "(num_requests > 0 and num_tokens % num_requests == 0) or (num_requests == 0 and num_tokens == 0)"

# The metadata's values, declared once and in order: rows (indices, condition, message) of `check_rows`, over the
# names of VALUE_FIELDS (cu: cu_seqlens_q, lens: seq_lens, table: block_table, tree: tree_mask, slots: state_slots).
# Python runs them as `check_metadata_values` and `check_state_metadata_values` (raising the first failing row's
# message); the native kernels as value_checks.h's functions, which `values_header` writes when they build. Each row
# reads only what the rows before it have bounded.
VALUE_FIELDS = {
    **dict.fromkeys(("cu", "lens", "table", "slots"), "Values<int32_t>"),
    "tree": "Values<bool>",
    **dict.fromkeys(("num_requests", "num_tokens", "width", "page_size", "num_pages", "tree_width"), "int64_t"),
    **dict.fromkeys(("num_slots", "verify_len"), "int64_t"),
    **dict.fromkeys(("decode", "verify"), "bool"),
}
REQUESTS = (("i", "num_requests"),)
NEW_TOKENS = (*REQUESTS, ("j", "cu[i + 1] - cu[i]"))
LENGTH_VALUES = (
    ((), "cu[0] == 0", "cu_seqlens_q must start at 0, got {cu[0]}"),
    (REQUESTS, "cu[i + 1] >= cu[i]", "cu_seqlens_q must be non-decreasing, got {cu}"),
    (
        (),
        "cu[num_requests] == num_tokens",
        "cu_seqlens_q must end at the number of tokens T = {num_tokens}, got {cu[-1]}",
    ),
    (
        REQUESTS,
        "lens[i] >= cu[i + 1] - cu[i]",
        "seq_lens[{i}] = {lens[i]} is shorter than request {i}'s {cu[i + 1] - cu[i]} new tokens",
    ),
    (
        REQUESTS,
        "not decode or cu[i + 1] - cu[i] == cu[1] - cu[0]",
        "decode needs the same query length for every request, got {q_lens(cu)}",
    ),
)
PAGE_VALUES = (
    (
        REQUESTS,
        "lens[i] <= width * page_size",
        "seq_lens[{i}] = {lens[i]} exceeds block_table's capacity of {width} pages x {page_size} = "
        "{width * page_size} tokens",
    ),
    (
        (*REQUESTS, ("p", "(lens[i] + page_size - 1) // page_size")),
        "table[i, p] >= 0 and table[i, p] < num_pages",
        "block_table[{i}, {p}] = {table[i][p]} is not a page of the cache (0 <= id < {num_pages})",
    ),
)
# A tree_mask [T, Q]: each request's block of new tokens within Q, each row seeing itself and no later token (a tree
# laid out parents first).
TREE_VALUES = (
    (
        REQUESTS,
        "cu[i + 1] - cu[i] <= tree_width",
        "tree_mask has Q = {tree_width} columns, fewer than the longest request's {max(q_lens(cu))} new tokens",
    ),
    (NEW_TOKENS, "tree[cu[i] + j, j]", "tree_mask[{cu[i] + j}, {j}] is False: a token always sees itself"),
    (
        (*NEW_TOKENS, ("c", "cu[i + 1] - cu[i]")),
        "c <= j or not tree[cu[i] + j, c]",
        "tree_mask[{cu[i] + j}, {c}] is True: a token sees only earlier new tokens (lay the tree out parents first)",
    ),
)
_SLOTS_MESSAGE = "state_slots must be distinct slots in [0, {num_slots}) or -1 (a padding request), got {slots}"
# A state op's slots; in TARGET_VERIFY, intermediate_states [num_slots, Q, ...] with room for each request's tokens.
SLOT_VALUES = (
    (REQUESTS, "slots[i] == -1 or (slots[i] >= 0 and slots[i] < num_slots)", _SLOTS_MESSAGE),
    ((*REQUESTS, ("j", "i")), "slots[i] == -1 or slots[i] != slots[j]", _SLOTS_MESSAGE),
    (
        REQUESTS,
        "not verify or cu[i + 1] - cu[i] <= verify_len",
        "intermediate_states holds Q = {verify_len} tokens per slot, fewer than the longest request's "
        "{max(q_lens(cu))}",
    ),
)


_TENSOR_ROWS = compiled(TENSOR_CHECKS)
# True when `check_tensors` would pass, in a few microseconds; the fake implementations call `check_tensors`.
tensors_ok = all_hold("tensors_ok", RANKS, [c for c, _ in TENSOR_CHECKS], tensors=RANKS)
decode_shape_ok = all_hold("decode_shape_ok", ("num_tokens", "num_requests"), [DECODE_SHAPE])
_LENGTH_ROWS, _PAGE_ROWS, _TREE_ROWS, _SLOT_ROWS = map(
    compiled_values, (LENGTH_VALUES, PAGE_VALUES, TREE_VALUES, SLOT_VALUES)
)


def check_args(tensors, options) -> None:
    """`check_tensors` of the op's tensors (q through block_table), then `options.check_options`."""
    check_tensors(*tensors)
    check_options(options, tensors[0], tensors[3])


def check_tensors(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table):
    """The rows of TENSOR_CHECKS in order, on sizes that may be symbolic; raises `HybridInputError` with the first
    failing row's message, which names the argument."""
    check(_TENSOR_ROWS, dict(zip(RANKS, (q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table))))


def cpp_header() -> str:
    """kernels/cpu's checks.h: TENSOR_CHECKS as `tensors_ok`, each option's rows as `options_ok` (over an `Options` of
    the includer's, whose fields are the options) and DECODE_SHAPE as `decode_shape_ok`, in C++; the includer defines
    the helpers of `check_rows`."""
    parameters = ", ".join(f"const at::Tensor& {name}" for name in RANKS)
    rows = " &&\n         ".join(f"({cpp(c)})" for c, _ in TENSOR_CHECKS)
    options = "".join(
        f"  if ({cpp(in_use_condition(f))}) {{\n"
        f"    const auto& value = {'*' if f.default is None else ''}options.{f.name};\n"
        f"    if (!({' && '.join(f'({cpp(c)})' for c, _ in f.metadata['checks'])})) return false;\n"
        "  }\n"
        for f in FIELDS
    )
    return (
        "// Generated from hybrid_ops/validation.py and options.py when the kernels build: their rows of checks.\n"
        "#pragma once\n\n"
        f"inline bool tensors_ok({parameters}) {{\n  return {rows};\n}}\n\n"
        "inline bool options_ok(const at::Tensor& q, const at::Tensor& k_cache, const Options& options) {\n"
        f"{options}  return true;\n}}\n\n"
        "inline bool decode_shape_ok(int64_t num_tokens, int64_t num_requests) {\n"
        f"  return {cpp(DECODE_SHAPE)};\n}}\n"
    )


def check_decode_shape(q, seq_lens):
    """Raises unless `decode_shape_ok`; T // B is then each request's query length."""
    num_tokens, num_requests = q.shape[0], seq_lens.shape[0]
    check_input(
        decode_shape_ok(num_tokens, num_requests),
        lambda: (
            f"decode needs the same number of query tokens per request: T = {num_tokens} "
            f"is not a multiple of B = {num_requests}"
        ),
    )


def check_metadata_values(
    cu_seqlens_q, seq_lens, block_table, num_tokens, num_pages, page_size, decode, tree_mask=None
):
    """Value checks of the metadata (and of a tree mask): LENGTH_VALUES, PAGE_VALUES and TREE_VALUES. Reads the values
    to the host (a sync on CUDA). Returns `(cu_seqlens_q, seq_lens)` as Python lists, for callers that loop over
    requests."""
    values = _values(cu_seqlens_q, seq_lens, num_tokens, decode, tree_mask)
    values.update(table=block_table.to("cpu", torch.int64), width=block_table.shape[1], num_pages=num_pages)
    values.update(page_size=page_size)
    check_values(_LENGTH_ROWS + _PAGE_ROWS + (_TREE_ROWS if tree_mask is not None else []), values)
    return values["cu"].tolist(), values["lens"].tolist()


def check_state_metadata_values(
    cu_seqlens_q, seq_lens, state_slots, num_tokens, num_slots, decode, tree_mask, verify_len
):
    """Value checks of a state op's metadata (`state_ops`; and of a tree mask): LENGTH_VALUES, SLOT_VALUES and
    TREE_VALUES. Reads it to the host (a sync on CUDA). verify_len: Q of intermediate_states in TARGET_VERIFY, else
    None. Returns (cu_seqlens_q, seq_lens, state_slots) as lists."""
    values = _values(cu_seqlens_q, seq_lens, num_tokens, decode, tree_mask)
    values.update(slots=state_slots.to("cpu", torch.int64), num_slots=num_slots)
    values.update(verify=verify_len is not None, verify_len=verify_len or 0)
    check_values(_LENGTH_ROWS + _SLOT_ROWS + (_TREE_ROWS if tree_mask is not None else []), values)
    return values["cu"].tolist(), values["lens"].tolist(), values["slots"].tolist()


def _values(cu_seqlens_q, seq_lens, num_tokens, decode, tree_mask) -> dict:
    """The names of VALUE_FIELDS that the metadata and the tree give, for `check_values`."""
    values = dict(cu=cu_seqlens_q.to("cpu", torch.int64), lens=seq_lens.to("cpu", torch.int64), q_lens=q_lens)
    values.update(num_requests=seq_lens.shape[0], num_tokens=num_tokens, decode=decode)
    if tree_mask is not None:
        values.update(tree=tree_mask.cpu(), tree_width=tree_mask.shape[1])
    return values


def q_lens(cu: list) -> list:
    """Each request's number of new tokens, from cu_seqlens_q as a list (for messages)."""
    return [b - a for a, b in zip(cu, cu[1:])]


def values_header() -> str:
    """kernels/cpu's value_checks.h: the struct MetadataValues of VALUE_FIELDS and the rows of each kind of value
    (`length_values_ok`, `page_values_ok`, `tree_values_ok`, `slot_values_ok`) as C++ functions of it."""
    fields = "".join(f"  {kind} {name};\n" for name, kind in VALUE_FIELDS.items())
    functions = "\n".join(
        cpp_values(f"{kind}_values_ok", rows, "MetadataValues", VALUE_FIELDS)
        for kind, rows in (
            ("length", LENGTH_VALUES),
            ("page", PAGE_VALUES),
            ("tree", TREE_VALUES),
            ("slot", SLOT_VALUES),
        )
    )
    return (
        "// Generated from hybrid_ops/validation.py when the kernels build: its rows of the metadata's values.\n"
        "#pragma once\n\n#include <cstdint>\n\nnamespace hybrid_ops::cpu {\n\n"
        "// A contiguous int32 or bool tensor's values, rows `stride` apart.\n"
        "template <typename T>\nstruct Values {\n  const T* data = nullptr;\n  int64_t stride = 0;\n"
        "  int64_t operator()(int64_t i) const { return data[i]; }\n"
        "  int64_t operator()(int64_t i, int64_t j) const { return data[i * stride + j]; }\n};\n\n"
        f"struct MetadataValues {{\n{fields}}};\n\n{functions}\n}}  // namespace hybrid_ops::cpu\n"
    )
