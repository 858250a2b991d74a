"""The `hybrid` ops: schemas, real implementations and fake (meta) implementations.

    torch.ops.hybrid.prefill  any ragged mix of requests (prefill, chunked prefill over a cached prefix)
    torch.ops.hybrid.decode   the same query length for every request (1 for DECODE, the draft length for verify)
    torch.ops.hybrid.attn     routes by `forward_mode` (the table is `modes.ROUTING`)
    torch.ops.hybrid.plan     the step's host-side planning for backends that plan (FlashInfer), kept out of
                              CUDA graphs (`Tag.cudagraph_unsafe`); `cuda_graph=True` plans into the fixed
                              buffers a CUDA graph replays; a no-op for the others

Options beyond plain causal attention: `scale`, `sliding_window`, `logit_cap` (soft-capping), `sinks` ([Hq] float32
logits, one per query head, that join each row's softmax denominator and attend to nothing, as gpt-oss) and
`attention_chunk` (a query at position p sees only keys at positions in [p - p % chunk, p], as Llama 4's chunked
layers); v and v_cache may have a head dim Dv other than q's and k's D (MLA-style models), and the output is then
[T, Hq, Dv]. The caches may hold fp8 (float8_e4m3fn or float8_e5m2) with `k_scale`, `v_scale` (float32 tensors,
one scale or one per kv head; 1.0 when not given): the store quantizes, attention dequantizes (`hybrid_ops.fp8`).
Backends declare which of these they serve (`options`); "auto" picks one that does.

Each op writes the new k, v into the paged cache (declared as mutated, `Tensor(a!)`, so torch.compile calls it on
the caller's cache without a copy), then attends. `Library.define` + `impl` keeps the eager dispatch cost to a few
microseconds (`torch.library.custom_op` costs about 47 us per call with grad enabled). On CPU tensors, once the cpu
backend's kernels are loaded, their C++ entry points (kernels/cpu/dispatch.cpp) take the calls they serve and hand
every other call to the implementations here (`PYTHON_IMPLEMENTATIONS`).
"""

import math

import torch

from .backends import check_backend_name, get_backend
from .fp8 import FP8_DTYPES, per_head
from .modes import check_speculative_attention_mode, select_path
from .settings import validation_enabled
from .validation import args_ok, check_args, check_decode_shape, check_metadata_values, decode_shape_ok

_ARGS = (
    "Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table"
)
_OPTIONS = (
    "float? scale=None, int sliding_window=-1, float logit_cap=0.0, Tensor? sinks=None, "
    "int attention_chunk=-1, Tensor? k_scale=None, Tensor? v_scale=None"
)

SCHEMAS = {
    "prefill": f'prefill({_ARGS}, *, {_OPTIONS}, str backend="auto") -> Tensor',
    "decode": f'decode({_ARGS}, *, {_OPTIONS}, str backend="auto") -> Tensor',
    "attn": f'attn({_ARGS}, SymInt forward_mode, *, {_OPTIONS}, str prefill_backend="auto", '
    'str decode_backend="auto", str speculative_attention_mode="prefill") -> Tensor',
    # Host-side planning for the step (FlashInfer), outside CUDA graphs: k_cache gives device, layout and head dim.
    "plan": "plan(Tensor k_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, SymInt forward_mode, "
    f'*, ScalarType q_dtype, int num_q_heads, {_OPTIONS}, str prefill_backend="auto", '
    'str decode_backend="auto", str speculative_attention_mode="prefill", bool cuda_graph=False) -> ()',
}

lib = torch.library.Library("hybrid", "DEF")
for _name, _schema in SCHEMAS.items():
    lib.define(_schema, tags=(torch.Tag.cudagraph_unsafe,) if _name == "plan" else ())
# plan returns nothing; its effect is the backend's plan state, so the compiler must keep it.
torch.fx.node.has_side_effect(torch.ops.hybrid.plan.default)
# The dispatcher passes a keyword argument only where it differs from its default: the defaults of the options scale
# through v_scale, for the implementations that take them as `**options`.
_OPTION_DEFAULTS = {a.name: a.default_value for a in torch._C.parse_schema(f"f(*, {_OPTIONS}) -> ()").arguments}


def _run(path, tensors, backend, arg, *, scale, sliding_window, logit_cap, sinks, attention_chunk, k_scale, v_scale):
    """`path` ("prefill" or "decode") on the backend named `backend` (the op's argument `arg`); tensors: the op's
    q through block_table."""
    if not args_ok(*tensors, scale, sliding_window, logit_cap, sinks, attention_chunk, k_scale, v_scale):
        check_args(*tensors, scale, sliding_window, logit_cap, sinks, attention_chunk, k_scale, v_scale)
    q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table = tensors
    if path == "decode" and not decode_shape_ok(q.shape[0], seq_lens.shape[0]):
        check_decode_shape(q, seq_lens)
    options = _extra_options(sinks, attention_chunk, k_cache, k_scale, v_scale)
    impl = get_backend(backend, q.device, q.dtype, q.shape[-1], arg, _features(options, q.shape[-1], v.shape[-1]))
    if validation_enabled() and not impl.checks_values:
        check_metadata_values(
            cu_seqlens_q, seq_lens, block_table, q.shape[0], k_cache.shape[0], k_cache.shape[1], path == "decode"
        )
    return getattr(impl, path)(*tensors, _scale(scale, q.shape[-1]), sliding_window, logit_cap, **options)


def _extra_options(sinks, attention_chunk, k_cache, k_scale, v_scale):
    """The options in use that not every backend serves, as keywords for the backend's call: a backend that does
    not declare them is never passed them. An fp8 cache comes with both scales, [Hkv] each (`fp8.per_head`)."""
    options = {}
    if sinks is not None:
        options["sinks"] = sinks
    if attention_chunk != -1:
        options["attention_chunk"] = attention_chunk
    if k_cache.dtype in FP8_DTYPES:
        num_kv_heads, device = k_cache.shape[2], k_cache.device
        options["k_scale"], options["v_scale"] = (per_head(s, num_kv_heads, device) for s in (k_scale, v_scale))
    return options


def _features(options, head_dim, v_head_dim):
    """What a backend must serve (`Backend.options`): the extra options in use ("fp8_kv" for the scales of an fp8
    cache), and "v_head_dim" when Dv != D."""
    names = {"k_scale": "fp8_kv", "v_scale": "fp8_kv"}
    return frozenset((*(names.get(n, n) for n in options), *(("v_head_dim",) if v_head_dim != head_dim else ())))


def _scale(scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def _route(forward_mode, speculative_attention_mode, prefill_backend, decode_backend):
    """(path, backend name, its argument's name) that `forward_mode` goes to; the other name is checked too."""
    if select_path(forward_mode, speculative_attention_mode) == "decode":
        check_backend_name(prefill_backend, "prefill_backend")
        return "decode", decode_backend, "decode_backend"
    check_backend_name(decode_backend, "decode_backend")
    return "prefill", prefill_backend, "prefill_backend"


def _attn(*args, prefill_backend="auto", decode_backend="auto", speculative_attention_mode="prefill", **options):
    """args: the op's q through block_table, then forward_mode."""
    *tensors, forward_mode = args
    path, backend, arg = _route(forward_mode, speculative_attention_mode, prefill_backend, decode_backend)
    return _run(path, tensors, backend, arg, **_OPTION_DEFAULTS | options)


def _fake(path, tensors, options):
    check_args(*tensors, **_OPTION_DEFAULTS | options)
    q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table = tensors
    if path == "decode":
        check_decode_shape(q, seq_lens)
    return q.new_empty((*q.shape[:2], v.shape[2]))


def _path_op(path):
    """The real and fake implementations of `hybrid::prefill` or `hybrid::decode`; tensors: q through block_table."""

    def impl(*tensors, backend="auto", **options):
        return _run(path, tensors, backend, "backend", **_OPTION_DEFAULTS | options)

    def fake(*tensors, backend="auto", **options):
        check_backend_name(backend)
        return _fake(path, tensors, options)

    return impl, fake


def _check_route_names(prefill_backend, decode_backend, speculative_attention_mode):
    check_backend_name(prefill_backend, "prefill_backend")
    check_backend_name(decode_backend, "decode_backend")
    check_speculative_attention_mode(speculative_attention_mode)


@torch.library.register_fake("hybrid::attn")
def _attn_fake(*args, prefill_backend="auto", decode_backend="auto", speculative_attention_mode="prefill", **options):
    _check_route_names(prefill_backend, decode_backend, speculative_attention_mode)
    *tensors, forward_mode = args
    # A symbolic forward_mode is only known at run time, where the real implementation checks it.
    path = "prefill"
    if isinstance(forward_mode, int):
        path = select_path(forward_mode, speculative_attention_mode)
    return _fake(path, tensors, options)


def _plan(
    k_cache,
    cu_seqlens_q,
    seq_lens,
    block_table,
    forward_mode,
    *,
    q_dtype,
    num_q_heads,
    scale=None,
    sliding_window=-1,
    logit_cap=0.0,
    sinks=None,
    attention_chunk=-1,
    k_scale=None,
    v_scale=None,
    prefill_backend="auto",
    decode_backend="auto",
    speculative_attention_mode="prefill",
    cuda_graph=False,
):
    """Plan the step for the backend that `forward_mode` routes to; a no-op for backends that do not plan.

    With `cuda_graph`, the plan goes into the CUDA-graph buffers of this batch shape (B, T), which a graph captured
    after it replays: call it before every replay, outside the graph."""
    path, backend, arg = _route(forward_mode, speculative_attention_mode, prefill_backend, decode_backend)
    head_dim = k_cache.shape[-1]
    # The same backend as the call it plans for: a backend without the options in use is never chosen.
    features = _features(_extra_options(sinks, attention_chunk, k_cache, k_scale, v_scale), head_dim, head_dim)
    impl = get_backend(backend, k_cache.device, q_dtype, head_dim, arg, features)
    metadata, scalars = (cu_seqlens_q, seq_lens, block_table), (_scale(scale, head_dim), sliding_window, logit_cap)
    impl.plan(path, q_dtype, num_q_heads, k_cache, *metadata, *scalars, cuda_graph=cuda_graph)


@torch.library.register_fake("hybrid::plan")
def _plan_fake(*args, prefill_backend="auto", decode_backend="auto", speculative_attention_mode="prefill", **options):
    _check_route_names(prefill_backend, decode_backend, speculative_attention_mode)


# One implementation for every device: the backends choose their kernels by device.
PYTHON_IMPLEMENTATIONS = {"attn": _attn, "plan": _plan}
for _path in ("prefill", "decode"):
    PYTHON_IMPLEMENTATIONS[_path], _fake_impl = _path_op(_path)
    torch.library.register_fake(f"hybrid::{_path}", _fake_impl)
for _name, _impl in PYTHON_IMPLEMENTATIONS.items():
    lib.impl(_name, _impl, "CompositeExplicitAutograd")
