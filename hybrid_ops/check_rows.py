"""Checks declared as rows, `(condition, message)`, that run in Python and are written out in C++.

A condition is Python that is also C++ once `and`, `or` and `not` are spelled `&&`, `||` and `!`: sizes through `dim()`
and `size(i)`, dtypes and devices through the helpers below (kernels/cpu/dispatch.cpp defines each of them too), `inf`,
and `|` for an "or" of sizes that may be symbolic (Python's `or` would guard on them). A message is an f-string's text
over the same names. The ops' tensor checks (`validation.TENSOR_CHECKS`) and option checks (`options.Options`) are
such rows; `validation.cpp_header` writes both into the cpu kernels' checks.h.

A row of values, `(indices, condition, message)`, holds at every point of its indices: each ranges from 0 below its
bound, a bound over the indices before it (`(("i", "num_requests"), ("p", "pages(i)"))`). Its condition reads
elements `a[i, j]` of 1-dim or 2-dim integer arrays and Python scalars. Python evaluates it over tensors at once
(`check_values`), C++ loops (`cpp_values`); the metadata's value checks (`validation`) are such rows.
"""

import ast
import math
import re

import torch

from .errors import HybridInputError, check_input
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


_OPERATORS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Mod: "%",
    ast.FloorDiv: "//",
    ast.BitOr: "|",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
}


def _spell(node, in_cpp: bool, inner: bool = False) -> str:
    """An expression of a row in C++ (`in_cpp`: `&&`, `||`, `!`; `//` as `/`, as every value divided is non-negative;
    `a[i, j]` as `a(i, j)`) or in Python over tensors (`&`, `|`, `_not`; `a[i, j]` as `_at(a, i, j)`), parenthesised
    wherever it is `inner`."""

    def spell(child):
        return _spell(child, in_cpp, inner=True)

    match node:
        case ast.BoolOp(op=op, values=values):
            joint = {(ast.And, True): " && ", (ast.Or, True): " || ", (ast.And, False): " & ", (ast.Or, False): " | "}
            text = joint[type(op), in_cpp].join(map(spell, values))
        case ast.UnaryOp(op=ast.Not(), operand=operand):
            return f"!{spell(operand)}" if in_cpp else f"_not({spell(operand)})"
        case ast.UnaryOp(op=ast.USub(), operand=operand):
            return f"-{spell(operand)}"
        case ast.BinOp(left=left, op=op, right=right):
            operator = "/" if in_cpp and isinstance(op, ast.FloorDiv) else _OPERATORS[type(op)]
            text = f"{spell(left)} {operator} {spell(right)}"
        case ast.Compare(left=left, ops=[op], comparators=[right]):
            text = f"{spell(left)} {_OPERATORS[type(op)]} {spell(right)}"
        case ast.Subscript(value=array, slice=index):
            index = ", ".join(_spell(i, in_cpp) for i in (index.elts if isinstance(index, ast.Tuple) else [index]))
            return f"{spell(array)}({index})" if in_cpp else f"_at({spell(array)}, {index})"
        case ast.Call(func=function, args=args):
            return f"{spell(function)}({', '.join(_spell(a, in_cpp) for a in args)})"
        case ast.Attribute(value=value, attr=attribute):
            return f"{spell(value)}.{attribute}"
        case ast.Name(id=name):
            return name
        case ast.Constant(value=bool() as value) if in_cpp:
            return "true" if value else "false"
        case ast.Constant(value=value):
            return repr(value)
        case _:
            raise ValueError(f"a row cannot say {ast.unparse(node)!r}")
    return f"({text})" if inner else text


def cpp(condition: str) -> str:
    """The condition in C++."""
    return _spell(ast.parse(condition, mode="eval").body, in_cpp=True)


def _tensor_code(expression: str):
    return compile(_spell(ast.parse(expression, mode="eval").body, in_cpp=False), expression, "eval")


class _Array:
    """A host tensor of a row's values, with its list for reads at Python ints (the rows' scalar reads)."""

    def __init__(self, tensor):
        self.tensor, self.list = tensor, tensor.tolist()


def _at(array, *index):
    """array[index], each index clamped into range: a row is evaluated on a grid wider than its points (a 2-dim read
    through `take` of one row-major index, several times faster than indexing by two tensors)."""
    values = array.tensor
    if all(isinstance(i, int) for i in index):
        element = array.list
        for i, size in zip(index, values.shape):
            element = element[min(max(i, 0), size - 1)]
        return element
    if values.numel() == 0:
        return torch.zeros(torch.broadcast_shapes(*(torch.as_tensor(i).shape for i in index)), dtype=values.dtype)
    flat = 0
    for i, size in zip(index, values.shape):
        flat = flat * size + (min(max(i, 0), size - 1) if isinstance(i, int) else i.clamp(0, size - 1))
    return values.take(flat)


def _at_domain(array, *index):
    """array[index] on a grid of the row's points only, which the row reads within bounds (as C++ must)."""
    if all(isinstance(i, int) for i in index):
        element = array.list
        for i in index:
            element = element[i]
        return element
    return array.tensor[index]


def _not(condition):
    return not condition if isinstance(condition, bool) else torch.logical_not(condition)


def compiled_values(rows) -> list:
    """Rows of values with their bounds, conditions and messages compiled, for `check_values`."""
    return [
        (
            [(name, _tensor_code(bound)) for name, bound in indices],
            _tensor_code(condition),
            compile(f"f{m!r}", m, "eval"),
        )
        for indices, condition, m in rows
    ]


def check_values(rows, values: dict) -> None:
    """Each of the `compiled_values` rows in order over `values` (names of host tensors, Python scalars and, for the
    messages, functions): raises `HybridInputError` with the message of the first row that fails, at its first point
    that fails in the order of C++'s loops; the message reads the tensors as lists."""
    arrays = {k: _Array(v) for k, v in values.items() if isinstance(v, torch.Tensor)}
    scope = {"_not": _not, **values, **arrays}
    grids = {}
    for indices, condition, message in rows:
        point, where = {}, True  # where: the grid's points in the row's domain, True while it is all of them
        for n, (name, bound) in enumerate(indices):
            scope["_at"] = _at_domain if where is True else _at
            bound = eval(bound, scope, point)
            if isinstance(bound, int):
                extent = bound
            else:
                bound_in_domain = bound if where is True else torch.where(where, bound, 0)
                extent = int(bound_in_domain.max()) if bound_in_domain.numel() else 0
            shape = tuple(-1 if m == n else 1 for m in range(len(indices)))
            if (extent, shape) not in grids:
                grids[extent, shape] = torch.arange(max(extent, 0)).view(shape)
            point[name] = grids[extent, shape]
            if not isinstance(bound, int):
                where = where & (point[name] < bound)
        if any(grid.numel() == 0 for grid in point.values()):
            continue  # no points: C++ reads nothing either
        scope["_at"] = _at_domain if where is True else _at
        failed = _not(eval(condition, scope, point))
        failed = failed if where is True else where & failed
        if failed is True or (failed is not False and bool(failed.any())):
            at = dict(zip(point, (int(i) for i in torch.as_tensor(failed).nonzero()[0])))
            lists = {k: a.list for k, a in arrays.items()}
            raise HybridInputError(eval(message, {**values, **lists}, at))


def _names(expression: str) -> set:
    return {node.id for node in ast.walk(ast.parse(expression, mode="eval")) if isinstance(node, ast.Name)}


def cpp_values(name: str, rows, struct: str, fields) -> str:
    """The rows as the C++ function `bool name(const struct& m)`, over the fields of `struct` that they name (in the
    order of `fields`)."""
    used = set().union(*(_names(e) for indices, c, _ in rows for e in (c, *(b for _, b in indices))))
    lines = [f"inline bool {name}(const {struct}& m) {{"]
    lines += [f"  const auto& {field} = m.{field};" for field in fields if field in used]
    for indices, condition, _ in rows:
        indent = "  "
        for index, bound in indices:
            lines.append(f"{indent}for (int64_t {index} = 0; {index} < {cpp(bound)}; ++{index}) {{")
            indent += "  "
        lines.append(f"{indent}if (!({cpp(condition)})) return false;")
        lines += [f"{'  ' * depth}}}" for depth in range(len(indices), 0, -1)]
    return "\n".join([*lines, "  return true;", "}"]) + "\n"
