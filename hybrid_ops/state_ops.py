"""The state ops: the recurrent cores of hybrid models' stateful layers, on the packed batch, each request's state in
a slot of a `StatePool` (schemas, checks, real and fake implementations).

    torch.ops.hybrid.causal_conv1d     a depthwise causal convolution (LFM2's short convolution, and the one in front
                                       of the gated delta rule and of Mamba's scan)
    torch.ops.hybrid.gated_delta_rule  the gated delta rule (Qwen3-Next, Qwen3.5, OLMo hybrid, Lara; with a decay per
                                       key channel: Kimi Linear's and Bailing hybrid's delta attention)
    torch.ops.hybrid.selective_scan    the selective state-space scan (Mamba2: Bamba, Granite 4, Nemotron-H,
                                       Falcon-H1; Mamba1: Jamba)

Every state op takes the attention ops' vocabulary for B requests and T new tokens, packed request after request:

    cu_seqlens_q: [B + 1] int32   request i's new tokens are rows cu_seqlens_q[i] : cu_seqlens_q[i + 1]
    seq_lens:     [B] int32       request i's length after this step: it continues its slot's state when it has a
                                  prefix (seq_lens[i] > its q_len) and starts from a zero state otherwise, so a slot
                                  is never read before the request's first step has written it
    state_slots:  [B] int32       request i's slot in every state tensor ([num_slots, ...]); -1 is a padding request
                                  (CUDA-graph buckets): it reads no state, writes none, and its outputs are zeros.
                                  The other slots are distinct and below num_slots
    forward_mode: SymInt          routed as `hybrid::attn` routes (`modes.select_path` with
                                  speculative_attention_mode) to `prefill_backend` (any ragged batch) or
                                  `decode_backend` (the same q_len for every request: 1 for DECODE)
    tree_mask:    [T, Q] bool     optional, as the attention ops': token j of a request follows the last earlier new
                                  token its row sees (its parent in a speculative tree), or the prefix if none;
                                  without one, each new token follows the one before

In TARGET_VERIFY the new tokens are drafts: the state after each new token j goes to `intermediate_states[slot, j]`
([num_slots, Q, *state shape], Q >= every q_len) and the slot's own state is left as it was, so that the caller keeps
the accepted token's (`StatePool.commit`). In every other mode the state after the request's last new token (along
its tree path, with a tree) is written to its slot, and intermediate_states is not read or written.

Each state is [num_slots, *shape], contiguous: a convolution's the last K - 1 inputs in x's dtype, a recurrent one
float32. A call checks the shapes and dtypes (eagerly and in the fake implementations, so the same errors surface
under torch.compile) and the values of the metadata (`validation.check_state_metadata_values`) in the backends that
read them to the host (`checks_values`: torch, cpu) or, for the others, with validation on; all before any state is
written. The backends are the attention ops' registry's: a backend serves
an op when its `features` name it (`Backend`).
"""

import math
from typing import NamedTuple

import torch

from .backends import Spec, check_backend_name, get_backend
from .backends.base import STATE_OPS
from .check_rows import FLOAT_DTYPES
from .errors import HybridInputError, check_input
from .modes import ForwardMode, check_speculative_attention_mode, select_path
from .settings import validation_enabled
from .validation import check_decode_shape, check_state_metadata_values

ROUTE_DEFAULTS = {"prefill_backend": "auto", "decode_backend": "auto", "speculative_attention_mode": "prefill"}
_METADATA = "Tensor cu_seqlens_q, Tensor seq_lens, Tensor state_slots, SymInt forward_mode"
_TAIL = "Tensor? tree_mask=None, Tensor(b!)? intermediate_states=None, " + ", ".join(
    f'str {name}="{value}"' for name, value in ROUTE_DEFAULTS.items()
)
ACTIVATIONS = ("none", "silu")

SCHEMAS = {
    "causal_conv1d": "causal_conv1d(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_state, "
    f'{_METADATA}, *, str activation="none", {_TAIL}) -> Tensor',
    "gated_delta_rule": "gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state, "
    f"{_METADATA}, *, float? scale=None, {_TAIL}) -> Tensor",
    "selective_scan": "selective_scan(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor(a!) state, "
    f"{_METADATA}, *, Tensor? D=None, Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, "
    f"float dt_min=0.0, float? dt_max=None, {_TAIL}) -> Tensor",
}

lib = torch.library.Library("hybrid", "FRAGMENT")
for _schema in SCHEMAS.values():
    lib.define(_schema)


class StateMetadata(NamedTuple):
    """What a backend's state op receives besides the op's own tensors (checked, see the module docstring)."""

    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    state_slots: torch.Tensor  # [B] int32, -1 for padding
    decode: bool  # the decode path: every request has q_len T // B
    verify: bool  # TARGET_VERIFY: each token's state to intermediate_states, the slots' states untouched
    tree_mask: torch.Tensor | None  # [T, Q] bool
    intermediate_states: torch.Tensor | None  # [num_slots, Q, *state shape], in TARGET_VERIFY


def _check_tensor(name, t, device, rank=None, dtypes=None, shape=None):
    """t on `device`, of `rank` dims, one of `dtypes`, and of `shape` where its entries are not None."""
    if t.device != device:
        raise HybridInputError(f"{name} must be on the inputs' device {device}, got {t.device}")
    if rank is not None and t.dim() != rank:
        raise HybridInputError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = [str(d).removeprefix("torch.") for d in dtypes]
        names = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
        raise HybridInputError(f"{name} must be {names}, got {t.dtype}")
    if shape is not None:
        message = lambda: (
            f"{name} must be [{', '.join('*' if s is None else str(s) for s in shape)}], got {tuple(t.shape)}"
        )
        if len(shape) != t.dim():
            raise HybridInputError(message())
        for size, got in zip(shape, t.shape):
            if size is not None:  # check_input: no guard on a symbolic size
                check_input(got == size, message)


def _check_state(name, state, shape, dtype, device):
    """state: [num_slots, *shape] of `dtype`, contiguous (a kernel finds a slot by its index)."""
    _check_tensor(name, state, device, len(shape) + 1, (dtype,), (None, *shape))
    check_input(state.shape[0] > 0, lambda: f"{name} must have at least one slot, got shape {tuple(state.shape)}")
    if not state.is_contiguous():
        raise HybridInputError(f"{name} must be contiguous, got strides {state.stride()}")


def _check_metadata(x, state, cu_seqlens_q, seq_lens, state_slots, tree_mask, intermediate_states):
    """The metadata's ranks, dtypes and sizes against x (the op's first tensor, [T, ...]) and its state."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("state_slots", state_slots)):
        _check_tensor(name, t, x.device, 1, (torch.int32,))
    num_requests = seq_lens.shape[0]
    check_input(
        cu_seqlens_q.shape[0] == num_requests + 1,
        lambda: (
            f"cu_seqlens_q must have B + 1 = {num_requests + 1} entries (B = len(seq_lens)), "
            f"got {cu_seqlens_q.shape[0]}"
        ),
    )
    check_input(
        state_slots.shape[0] == num_requests,
        lambda: f"state_slots must have one slot per request ({num_requests}), got {state_slots.shape[0]}",
    )
    if tree_mask is not None:
        _check_tensor("tree_mask", tree_mask, x.device, 2, (torch.bool,))
        check_input(
            tree_mask.shape[0] == x.shape[0],
            lambda: f"tree_mask must have a row per token ({x.shape[0]}), got {tree_mask.shape[0]}",
        )
        check_input(tree_mask.shape[1] > 0, lambda: f"tree_mask must have Q >= 1 columns, got {tuple(tree_mask.shape)}")
    if intermediate_states is not None:
        shape = (state.shape[0], None, *state.shape[1:])
        _check_tensor("intermediate_states", intermediate_states, x.device, len(shape), (state.dtype,), shape)
        if not intermediate_states.is_contiguous():
            raise HybridInputError(
                f"intermediate_states must be contiguous, got strides {intermediate_states.stride()}"
            )


def _prepare(op, x, state, metadata, route, tree_mask, intermediate_states, head_dims):
    """Checks the metadata, routes the call -> (the backend, `StateMetadata`)."""
    cu_seqlens_q, seq_lens, state_slots, forward_mode = metadata
    _check_metadata(x, state, cu_seqlens_q, seq_lens, state_slots, tree_mask, intermediate_states)
    path, backend, arg = _route(forward_mode, route)
    verify = forward_mode == ForwardMode.TARGET_VERIFY
    if verify and intermediate_states is None:
        raise HybridInputError(
            f"forward_mode TARGET_VERIFY needs intermediate_states ([num_slots, Q, *state shape]): {op} keeps each "
            "draft token's state there and leaves the slots' states to the accepted one"
        )
    decode = path == "decode"
    if decode:
        check_decode_shape(x, seq_lens)
    features = frozenset({op} | ({"tree_mask"} if tree_mask is not None else set()))
    spec = Spec(x.device, x.dtype, state.dtype, *head_dims, features)
    impl = get_backend(backend, spec, arg)
    if validation_enabled() and not impl.checks_values:
        verify_len = intermediate_states.shape[1] if verify else None
        check_state_metadata_values(
            cu_seqlens_q, seq_lens, state_slots, x.shape[0], state.shape[0], decode, tree_mask, verify_len
        )
    step = StateMetadata(
        cu_seqlens_q, seq_lens, state_slots, decode, verify, tree_mask, intermediate_states if verify else None
    )
    return impl, step


def _route(forward_mode, route):
    """(path, backend name, its argument's name) for `forward_mode`; every routing keyword is checked."""
    check_speculative_attention_mode(route["speculative_attention_mode"])
    path = select_path(forward_mode, route["speculative_attention_mode"])
    other = "decode" if path == "prefill" else "prefill"
    check_backend_name(route[f"{other}_backend"], f"{other}_backend")
    return path, route[f"{path}_backend"], f"{path}_backend"


def _check_route_names(route):
    check_speculative_attention_mode(route["speculative_attention_mode"])
    for name in ("prefill_backend", "decode_backend"):
        check_backend_name(route[name], name)


def _split(keywords):
    """(the routing keywords with their defaults, tree_mask, intermediate_states, the op's own keywords)."""
    route = {name: keywords.pop(name, default) for name, default in ROUTE_DEFAULTS.items()}
    return route, keywords.pop("tree_mask", None), keywords.pop("intermediate_states", None), keywords


# causal_conv1d


def check_conv1d(x, weight, bias, conv_state, activation):
    """x: [T, C] float; weight: [C, K]; bias: [C] or None; conv_state: [num_slots, K - 1, C] in x's dtype."""
    _check_tensor("x", x, x.device, 2, FLOAT_DTYPES)
    channels = x.shape[1]
    _check_tensor("weight", weight, x.device, 2, FLOAT_DTYPES, (channels, None))
    check_input(weight.shape[1] >= 1, lambda: f"weight must have a kernel width K >= 1, got {tuple(weight.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, x.device, 1, FLOAT_DTYPES, (channels,))
    _check_state("conv_state", conv_state, (weight.shape[1] - 1, channels), x.dtype, x.device)
    if activation not in ACTIVATIONS:
        raise HybridInputError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _causal_conv1d(x, weight, bias, conv_state, *metadata, activation="none", **keywords):
    """x: [T, C]; weight: [C, K]; bias: [C] or None; conv_state: [num_slots, K - 1, C] -> [T, C] in x's dtype.

    Token j of a request, whose inputs along its path are ..., u_{j-1}, u_j (before its first new token: the K - 1
    inputs its slot holds, or zeros without a prefix): out_j = act(bias + sum_k weight[:, k] * u_{j - K + 1 + k}),
    act silu or none. The slot keeps the last K - 1 inputs."""
    route, tree_mask, intermediate_states, _ = _split(keywords)
    check_conv1d(x, weight, bias, conv_state, activation)
    impl, step = _prepare("causal_conv1d", x, conv_state, metadata, route, tree_mask, intermediate_states, (0, 0))
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    return impl.causal_conv1d(x, weight, bias, conv_state, step, activation)


def _causal_conv1d_fake(x, weight, bias, conv_state, *metadata, activation="none", **keywords):
    route, tree_mask, intermediate_states, _ = _split(keywords)
    _check_route_names(route)
    check_conv1d(x, weight, bias, conv_state, activation)
    _check_metadata(x, conv_state, *metadata[:3], tree_mask, intermediate_states)
    return x.new_empty(x.shape)


# gated_delta_rule


def check_gated_delta_rule(q, k, v, g, beta, state):
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (Hv % Hk == 0), one float dtype; g: [T, Hv] or [T, Hv, Dk] float32;
    beta: [T, Hv] float32 or v's dtype; state: [num_slots, Hv, Dk, Dv] float32."""
    _check_tensor("q", q, q.device, 3, FLOAT_DTYPES)
    num_tokens, num_k_heads, k_head_dim = q.shape
    _check_tensor("k", k, q.device, 3, (q.dtype,), tuple(q.shape))
    _check_tensor("v", v, q.device, 3, (q.dtype,), (num_tokens, None, None))
    num_v_heads = v.shape[1]
    check_input(
        num_k_heads > 0 and num_v_heads % num_k_heads == 0,
        lambda: f"v's {num_v_heads} heads must be a multiple of q's and k's {num_k_heads} heads (Hv % Hk == 0)",
    )
    # [T, Hv]: a decay per head; [T, Hv, Dk]: per key channel.
    g_shape = (num_tokens, num_v_heads) if g.dim() == 2 else (num_tokens, num_v_heads, k_head_dim)
    _check_tensor("g", g, q.device, None, (torch.float32,), g_shape)
    beta_dtypes = (torch.float32,) if q.dtype == torch.float32 else (torch.float32, q.dtype)
    _check_tensor("beta", beta, q.device, 2, beta_dtypes, (num_tokens, num_v_heads))
    _check_state("state", state, (num_v_heads, k_head_dim, v.shape[2]), torch.float32, q.device)


def _gated_delta_rule(q, k, v, g, beta, state, *metadata, scale=None, **keywords):
    """-> [T, Hv, Dv] in v's dtype. Value head h reads key head h // (Hv // Hk); per head, S [Dk, Dv] (the slot's,
    or zeros without a prefix), for each token along its path:

        S = exp(g_t) * S  (g_t a scalar, or per key channel: row i by exp(g_t[i]))
        S = S + k_t outer (beta_t * (v_t - S^T k_t))
        o_t = scale * S^T q_t    (scale: 1 / sqrt(Dk) by default)

    q and k come as the layer makes them (l2-normalised, where the model does so)."""
    route, tree_mask, intermediate_states, _ = _split(keywords)
    check_gated_delta_rule(q, k, v, g, beta, state)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else scale
    check_input(math.isfinite(scale), lambda: f"scale must be a finite float or None, got {scale}")
    head_dims = (q.shape[2], v.shape[2])
    impl, step = _prepare("gated_delta_rule", v, state, metadata, route, tree_mask, intermediate_states, head_dims)
    if q.shape[0] == 0:
        return v.new_empty(v.shape)
    return impl.gated_delta_rule(q, k, v, g, beta, state, step, scale)


def _gated_delta_rule_fake(q, k, v, g, beta, state, *metadata, scale=None, **keywords):
    route, tree_mask, intermediate_states, _ = _split(keywords)
    _check_route_names(route)
    check_gated_delta_rule(q, k, v, g, beta, state)
    _check_metadata(v, state, *metadata[:3], tree_mask, intermediate_states)
    return v.new_empty(v.shape)


# selective_scan


def check_selective_scan(x, dt, A, B, C, state, D, z, dt_bias):
    """x: [T, H, P]; dt: [T, H]; A: [H] or [H, N] float32; B, C: [T, G, N] (H % G == 0); D, dt_bias: [H];
    z: [T, H, P]; state: [num_slots, H, P, N] float32."""
    _check_tensor("x", x, x.device, 3, FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = x.shape
    _check_tensor("dt", dt, x.device, 2, FLOAT_DTYPES, (num_tokens, num_heads))
    _check_tensor("B", B, x.device, 3, FLOAT_DTYPES, (num_tokens, None, None))
    num_groups, state_size = B.shape[1], B.shape[2]
    check_input(
        num_groups > 0 and num_heads % num_groups == 0,
        lambda: f"x's {num_heads} heads must be a multiple of B's {num_groups} groups (H % G == 0)",
    )
    _check_tensor("C", C, x.device, 3, (B.dtype,), tuple(B.shape))
    # [H]: a decay rate per head (Mamba2); [H, N]: per state channel too (Mamba1).
    _check_tensor("A", A, x.device, None, (torch.float32,), (num_heads,) if A.dim() == 1 else (num_heads, state_size))
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _check_tensor(name, t, x.device, 1, FLOAT_DTYPES, (num_heads,))
    if z is not None:
        _check_tensor("z", z, x.device, 3, FLOAT_DTYPES, tuple(x.shape))
    _check_state("state", state, (num_heads, head_dim, state_size), torch.float32, x.device)


def _selective_scan(x, dt, A, B, C, state, *metadata, D=None, z=None, dt_bias=None, dt_softplus=False, dt_min=0.0,
                    dt_max=None, **keywords):  # fmt: skip
    """-> [T, H, P] in x's dtype. Head h reads group h // (H // G); per head, S [P, N] (the slot's, or zeros without
    a prefix), for each token along its path:

        d = clamp(softplus?(dt_t + dt_bias), dt_min, dt_max)         a scalar per head
        S = exp(d * A) * S + (d * x_t) outer B_t                    (A [H, N]: per state channel)
        y_t = S C_t + D * x_t, then y_t * silu(z_t) with a gate z

    Mamba2 has A [H] and heads of P channels; Mamba1 (Jamba) is H = its channels, P = 1, A [H, N], G = 1."""
    route, tree_mask, intermediate_states, _ = _split(keywords)
    check_selective_scan(x, dt, A, B, C, state, D, z, dt_bias)
    if not (math.isfinite(dt_min) and (dt_max is None or dt_max >= dt_min)):
        raise HybridInputError(
            f"dt_min, dt_max must be a finite float and None or a float >= it, got {dt_min}, {dt_max}"
        )
    head_dims = (x.shape[2], B.shape[2])
    impl, step = _prepare("selective_scan", x, state, metadata, route, tree_mask, intermediate_states, head_dims)
    if x.shape[0] == 0:
        return x.new_empty(x.shape)
    dt_max = math.inf if dt_max is None else dt_max
    return impl.selective_scan(x, dt, A, B, C, state, step, D, z, dt_bias, dt_softplus, dt_min, dt_max)


def _selective_scan_fake(x, dt, A, B, C, state, *metadata, D=None, z=None, dt_bias=None, dt_softplus=False,
                         dt_min=0.0, dt_max=None, **keywords):  # fmt: skip
    route, tree_mask, intermediate_states, _ = _split(keywords)
    _check_route_names(route)
    check_selective_scan(x, dt, A, B, C, state, D, z, dt_bias)
    _check_metadata(x, state, *metadata[:3], tree_mask, intermediate_states)
    return x.new_empty(x.shape)


IMPLEMENTATIONS = {
    "causal_conv1d": (_causal_conv1d, _causal_conv1d_fake),
    "gated_delta_rule": (_gated_delta_rule, _gated_delta_rule_fake),
    "selective_scan": (_selective_scan, _selective_scan_fake),
}
assert tuple(IMPLEMENTATIONS) == STATE_OPS
for _name, (_impl, _fake) in IMPLEMENTATIONS.items():
    lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"hybrid::{_name}", _fake)
