"""The `hybrid` ops: schemas, real implementations and fake (meta) implementations.

    torch.ops.hybrid.prefill  any ragged mix of requests (prefill, chunked prefill over a cached prefix)
    torch.ops.hybrid.decode   the same query length for every request (1 for DECODE, the draft length for verify)
    torch.ops.hybrid.attn     routes by `forward_mode` (the table is `modes.ROUTING`)
    torch.ops.hybrid.plan     the step's host-side planning for backends that plan (FlashInfer), kept out of
                              CUDA graphs (`Tag.cudagraph_unsafe`); `cuda_graph=True` plans into the fixed
                              buffers a CUDA graph replays; a no-op for the others

The keyword options beyond plain causal attention are declared once, as the fields of `options.Options`: their
schema text, defaults and checks, and the backend features they need, all come from there (its docstring lists
them, with what each means). v and v_cache may have a head dim Dv other than q's and k's D (MLA-style models); the
output is then [T, Hq, Dv]. The routing keywords of `attn` and `plan` are `ROUTE_DEFAULTS`, also declared once.

Speculative trees: `tree_mask` ([T, Q] bool, Q the largest query length in the batch) replaces the causal order of
each request's new tokens by a tree's ancestry. Row t (token j of request i) says which of request i's new tokens
0..q_len_i - 1 token j sees; the cached prefix is seen in full. A token always sees itself, and only earlier new tokens
(a tree laid out parents first, as EAGLE and Medusa lay it out): entries on and above the diagonal, and columns past
q_len_i, are not read. The K/V of the new tokens still go to the linear slots seq_lens[i] - q_len_i + j; what changes
is positions: token j's is prefix + depth_j, where depth_j is the number of earlier new tokens it sees (for an
ancestry, its depth in the tree), and `sliding_window` and `attention_chunk` compare these positions, as they would in
a plain sequence holding only the token's ancestors. With validation on (and in the backends that read the metadata),
a row that does not see its own token, sees a later one, or a Q below a request's q_len is refused.

    new tokens   0 1 2 3 4        tree: 0 -> 1 -> 3, 0 -> 2 -> 4     positions: prefix + (0 1 1 2 2)
    token 3      x x . x .        sees its ancestors 0, 1 and itself
    token 4      x . x . x

It is named for what it describes rather than after FlashInfer's `custom_mask`, which is another layout (packed bits
over the whole KV, prefix included, one ragged block per request); its fixed size lets a CUDA graph read the current
tree from a static buffer. None is today's causal attention, and a causal tree gives the same output bit for bit on
the torch and cpu backends: the tree only removes keys from the same computation.

The dispatcher passes a keyword to the implementations only where it differs from its default, so they take the
options as `**keywords` and build `Options(**keywords)`: the dataclass fills in the rest. A call runs as: the checks
(`validation`: tensors, then every option in use), the route (`attn`: `modes.select_path`), the backend (the
registry, from the call's `Spec`), then `backend.prefill` or `backend.decode` with the resolved `Options`.

Each op writes the new k, v into the paged cache (declared as mutated, `Tensor(a!)`, so torch.compile calls it on
the caller's cache without a copy), then attends. `Library.define` + `impl` keeps the eager dispatch cost to a few
microseconds (`torch.library.custom_op` costs about 47 us per call with grad enabled). On CPU tensors, once the cpu
backend's kernels are loaded, their C++ entry points (kernels/cpu/dispatch.cpp) take the calls they serve and hand
every other call to the implementations here (`PYTHON_IMPLEMENTATIONS`).
"""

import torch

from .backends import Spec, check_backend_name, get_backend
from .modes import check_speculative_attention_mode, select_path
from .options import SCHEMA_TEXT, Options, check_options, options_ok
from .settings import validation_enabled
from .validation import (
    check_args,
    check_decode_shape,
    check_metadata_values,
    check_tensors,
    decode_shape_ok,
    tensors_ok,
)

ROUTE_DEFAULTS = {"prefill_backend": "auto", "decode_backend": "auto", "speculative_attention_mode": "prefill"}

_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table"
)
_ROUTE = ", ".join(f'str {name}="{value}"' for name, value in ROUTE_DEFAULTS.items())

SCHEMAS = {
    "prefill": f'prefill({_ARGS}, *, {SCHEMA_TEXT}, str backend="auto") -> Tensor',
    "decode": f'decode({_ARGS}, *, {SCHEMA_TEXT}, str backend="auto") -> Tensor',
    "attn": f"attn({_ARGS}, SymInt forward_mode, *, {SCHEMA_TEXT}, {_ROUTE}) -> Tensor",
    # Host-side planning for the step (FlashInfer), outside CUDA graphs: k_cache gives device, layout and head dim.
    "plan": "plan(Tensor k_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, SymInt forward_mode, "
    f"*, ScalarType q_dtype, int num_q_heads, {SCHEMA_TEXT}, {_ROUTE}, bool cuda_graph=False) -> ()",
}

lib = torch.library.Library("hybrid", "DEF")
for _name, _schema in SCHEMAS.items():
    lib.define(_schema, tags=(torch.Tag.cudagraph_unsafe,) if _name == "plan" else ())
# plan returns nothing; its effect is the backend's plan state, so the compiler must keep it.
torch.fx.node.has_side_effect(torch.ops.hybrid.plan.default)


def _split_route(keywords):
    """(the routing keywords with their defaults, the options) of an `attn` or `plan` call's keywords."""
    route = {name: keywords.pop(name, default) for name, default in ROUTE_DEFAULTS.items()}
    return route, Options(**keywords)


def _run(path, tensors, backend, arg, options):
    """`path` ("prefill" or "decode") on the backend named `backend` (the op's argument `arg`); tensors: the op's
    q through block_table."""
    q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table = tensors
    if not tensors_ok(*tensors):
        check_tensors(*tensors)
    if not options_ok(options, q, k_cache):
        check_options(options, q, k_cache)
    if path == "decode" and not decode_shape_ok(q.shape[0], seq_lens.shape[0]):
        check_decode_shape(q, seq_lens)
    options = options.resolve(q.shape[-1], k_cache)
    spec = Spec(q.device, q.dtype, k_cache.dtype, q.shape[-1], v.shape[-1], options.features())
    impl = get_backend(backend, spec, arg)
    if validation_enabled() and not impl.checks_values:
        sizes = (q.shape[0], k_cache.shape[0], k_cache.shape[1], path == "decode")
        check_metadata_values(cu_seqlens_q, seq_lens, block_table, *sizes, options.tree_mask)
    return getattr(impl, path)(*tensors, options)


def _route(forward_mode, route):
    """(path, backend name, its argument's name) that `forward_mode` goes to; the other name is checked too."""
    if select_path(forward_mode, route["speculative_attention_mode"]) == "decode":
        check_backend_name(route["prefill_backend"], "prefill_backend")
        return "decode", route["decode_backend"], "decode_backend"
    check_backend_name(route["decode_backend"], "decode_backend")
    return "prefill", route["prefill_backend"], "prefill_backend"


def _attn(*args, **keywords):
    """args: the op's q through block_table, then forward_mode."""
    *tensors, forward_mode = args
    route, options = _split_route(keywords)
    path, backend, arg = _route(forward_mode, route)
    return _run(path, tensors, backend, arg, options)


def _fake(path, tensors, options):
    q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table = tensors
    check_args(tensors, options)
    if path == "decode":
        check_decode_shape(q, seq_lens)
    return q.new_empty((*q.shape[:2], v.shape[2]))


def _path_op(path):
    """The real and fake implementations of `hybrid::prefill` or `hybrid::decode`; tensors: q through block_table."""

    def impl(*tensors, backend="auto", **keywords):
        return _run(path, tensors, backend, "backend", Options(**keywords))

    def fake(*tensors, backend="auto", **keywords):
        check_backend_name(backend)
        return _fake(path, tensors, Options(**keywords))

    return impl, fake


def _check_route_names(route):
    check_backend_name(route["prefill_backend"], "prefill_backend")
    check_backend_name(route["decode_backend"], "decode_backend")
    check_speculative_attention_mode(route["speculative_attention_mode"])


@torch.library.register_fake("hybrid::attn")
def _attn_fake(*args, **keywords):
    *tensors, forward_mode = args
    route, options = _split_route(keywords)
    _check_route_names(route)
    # A symbolic forward_mode is only known at run time, where the real implementation checks it.
    path = "prefill"
    if isinstance(forward_mode, int):
        path = select_path(forward_mode, route["speculative_attention_mode"])
    return _fake(path, tensors, options)


def _plan(k_cache, cu_seqlens_q, seq_lens, block_table, forward_mode, *, q_dtype, num_q_heads, cuda_graph=False,
          **keywords):  # fmt: skip
    """Plan the step for the backend that `forward_mode` routes to; a no-op for backends that do not plan.

    With `cuda_graph`, the plan goes into the CUDA-graph buffers of this batch shape (B, T), which a graph captured
    after it replays: call it before every replay, outside the graph."""
    route, options = _split_route(keywords)
    path, backend, arg = _route(forward_mode, route)
    head_dim = k_cache.shape[-1]
    options = options.resolve(head_dim, k_cache)
    # The same backend as the call it plans for: a backend without the options in use is never chosen.
    spec = Spec(k_cache.device, q_dtype, k_cache.dtype, head_dim, head_dim, options.features())
    impl = get_backend(backend, spec, arg)
    impl.plan(path, q_dtype, num_q_heads, k_cache, cu_seqlens_q, seq_lens, block_table, options, cuda_graph=cuda_graph)


@torch.library.register_fake("hybrid::plan")
def _plan_fake(*args, q_dtype, num_q_heads, cuda_graph=False, **keywords):
    _check_route_names(_split_route(keywords)[0])


# One implementation for every device: the backends choose their kernels by device.
PYTHON_IMPLEMENTATIONS = {"attn": _attn, "plan": _plan}
for _path in ("prefill", "decode"):
    PYTHON_IMPLEMENTATIONS[_path], _fake_impl = _path_op(_path)
    torch.library.register_fake(f"hybrid::{_path}", _fake_impl)
for _name, _impl in PYTHON_IMPLEMENTATIONS.items():
    lib.impl(_name, _impl, "CompositeExplicitAutograd")
