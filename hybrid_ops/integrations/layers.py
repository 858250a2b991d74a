"""Stateful layers of transformers models served through the state ops (`hybrid_ops.state_ops`) on the packed batch.

Each family's forward is written once over the layer's own weights and submodules: its projections, norms and gates
stay plain tensor code that torch.compile traces (and Inductor fuses), and only its recurrent core runs as a state op,
one call over every request of the step, each from its slot. What differs between the classes of a family (how they
name and split their input projections, their gate and output norm) is a small function per class.

    gated delta rule   Qwen3-Next, Qwen3.5 (+ MoE), Lara, OLMo hybrid; Kimi Linear and Bailing hybrid (a decay
                       per key channel): conv over [q | k | v], then gated_delta_rule
    Mamba2             Bamba, Granite 4 (granitemoehybrid), Nemotron-H, Falcon-H1: conv over [x | B | C], then
                       selective_scan with A [H]
    Mamba1             Jamba: conv over x, then selective_scan with P = 1 and A [H, N]
    short convolution  LFM2 (+ MoE), LFM3: causal_conv1d of B * x, gated by C

A `Family` gives the states one request needs in each such layer (`states`: our layout, not transformers' cache's)
and the served forward. `family_of(module)` finds it by the module's class name, or None for a class not listed
here (stateful.py serves those through `hybrid::mixer`, or refuses them).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Family:
    name: str
    # module -> [(shape, dtype)] of one request's states, in the order the forward takes them
    states: Callable
    # forward(module, hidden [1, T, H], step, states, intermediates) -> [1, T, H]; states: the layer's state tensors
    # [num_slots, *shape]; intermediates: theirs for TARGET_VERIFY ([num_slots, Q, *shape]) or None
    forward: Callable


def _dtype(module) -> torch.dtype:
    """The dtype of the layer's activations: its input projection's."""
    return next(m.weight.dtype for m in module.modules() if isinstance(m, torch.nn.Linear))


def _metadata(step):
    return step.cu_seqlens_q, step.seq_lens, step.state_slots, step.forward_mode


def _route(step, intermediate):
    return dict(
        tree_mask=step.tree_mask,
        intermediate_states=intermediate,
        prefill_backend=step.prefill_backend,
        decode_backend=step.decode_backend,
        speculative_attention_mode=step.speculative_attention_mode,
    )


def _conv(step, x, conv, conv_state, intermediate, activation):
    """x: [T, C] through the layer's depthwise `conv` (an nn.Conv1d, weight [C, 1, K]) -> [T, C]."""
    return torch.ops.hybrid.causal_conv1d(
        x, conv.weight.squeeze(1), conv.bias, conv_state, *_metadata(step), activation=activation,
        **_route(step, intermediate),
    )  # fmt: skip


def _conv_state(channels, conv, dtype):
    return (conv.weight.shape[-1] - 1, channels), dtype


def _intermediates(intermediates, count):
    return [None] * count if intermediates is None else intermediates


def _l2norm(x):
    """FLA's and transformers' l2 norm of q and k, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


# Gated delta rule. Each class's inputs: (x [T, H]) -> (mixed [T, 2 Hk Dk + Hv Dv], beta [T, Hv], g [T, Hv] or
# [T, Hv, Dk] float32, gate [T, Hv, Dv]); its output: (module, core [T, Hv, Dv], gate) -> [T, H].


def _softplus_decay(module, a):
    """Qwen3-Next's decay: -exp(A_log) * softplus(a + dt_bias), float32 [T, Hv]."""
    return -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)


def _qwen3_5_inputs(module, x):
    gate = module.in_proj_z(x).unflatten(-1, (-1, module.head_v_dim))
    return module.in_proj_qkv(x), module.in_proj_b(x).sigmoid(), _softplus_decay(module, module.in_proj_a(x)), gate


def _qwen3_next_inputs(module, x):
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x)[None], module.in_proj_ba(x)[None])
    mixed = torch.cat([t[0].flatten(1) for t in (q, k, v)], dim=-1)
    return mixed, b[0].sigmoid(), _softplus_decay(module, a[0]), z[0]


def _olmo_inputs(module, x):
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    beta = module.b_proj(x).sigmoid()
    if module.allow_neg_eigval:
        beta = beta * 2.0
    gate = module.g_proj(x).unflatten(-1, (-1, module.head_v_dim))
    return mixed, beta, _softplus_decay(module, module.a_proj(x)), gate


def _kimi_inputs(module, x, gate):
    """Kimi Linear and Bailing hybrid: their forget gate gives a decay per key channel."""
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    g = module.forget_gate(x[None])[0]  # [T, H, Dk] float32
    return mixed, module.b_proj(x).sigmoid(), g, gate.unflatten(-1, (-1, module.head_dim))


def _norm_out(norm, proj):
    def finish(module, core, gate):
        out = getattr(module, norm)(core.flatten(0, 1), gate.flatten(0, 1))
        return getattr(module, proj)(out.view(core.shape[0], -1))

    return finish


def _kimi_out(module, core, gate):
    return module.o_proj(module.o_norm(core, gate).flatten(1))


def _delta_heads(module):
    """(Hk, Hv, Dk, Dv) of a gated delta layer, whatever its class calls them."""
    if hasattr(module, "num_k_heads"):
        return module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    return module.num_heads, module.num_heads, module.head_dim, module.head_dim


def _gated_delta(name, inputs, finish):
    def states(module):
        k_heads, v_heads, k_dim, v_dim = _delta_heads(module)
        channels = 2 * k_heads * k_dim + v_heads * v_dim
        return [_conv_state(channels, module.conv1d, _dtype(module)), ((v_heads, k_dim, v_dim), torch.float32)]

    def forward(module, hidden, step, states, intermediates):
        (conv_state, state), (conv_inter, inter) = states, _intermediates(intermediates, 2)
        k_heads, v_heads, k_dim, v_dim = _delta_heads(module)
        x = hidden[0]
        mixed, beta, g, gate = inputs(module, x)
        mixed = _conv(step, mixed, module.conv1d, conv_state, conv_inter, "silu")
        q, k, v = mixed.split([k_heads * k_dim, k_heads * k_dim, v_heads * v_dim], dim=-1)
        q, k = (_l2norm(t.unflatten(-1, (k_heads, k_dim))) for t in (q, k))
        core = torch.ops.hybrid.gated_delta_rule(
            q, k, v.unflatten(-1, (v_heads, v_dim)).float(), g, beta.float(), state, *_metadata(step),
            **_route(step, inter),
        )  # fmt: skip
        return finish(module, core.to(x.dtype), gate)[None]

    return Family(name, states, forward)


# Mamba2: in_proj -> [gate | x B C | dt], conv over x B C, the scan with A [H], the gated norm, out_proj.


def _mamba2(name):
    def states(module):
        shape = (module.num_heads, module.head_dim, module.ssm_state_size)
        return [_conv_state(module.conv_dim, module.conv1d, _dtype(module)), (shape, torch.float32)]

    def forward(module, hidden, step, states, intermediates):
        (conv_state, state), (conv_inter, inter) = states, _intermediates(intermediates, 2)
        x = hidden[0]
        if hasattr(module, "mup_vector"):  # Falcon-H1's multipliers
            x = x * module.ssm_in_multiplier
        projected = module.in_proj(x)
        if hasattr(module, "mup_vector"):
            projected = projected * module.mup_vector[0, 0]
        gate, xbc, dt = projected.split([module.intermediate_size, module.conv_dim, module.num_heads], dim=-1)
        xbc = _conv(step, xbc, module.conv1d, conv_state, conv_inter, module.activation)
        groups_state = module.n_groups * module.ssm_state_size
        xs, B, C = xbc.split([module.intermediate_size, groups_state, groups_state], dim=-1)
        dt_min, dt_max = module.time_step_limit
        y = torch.ops.hybrid.selective_scan(
            xs.unflatten(-1, (module.num_heads, module.head_dim)), dt, -torch.exp(module.A_log.float()),
            B.unflatten(-1, (module.n_groups, -1)), C.unflatten(-1, (module.n_groups, -1)), state, *_metadata(step),
            D=module.D, dt_bias=module.dt_bias, dt_softplus=True, dt_min=dt_min,
            dt_max=None if dt_max == float("inf") else dt_max, **_route(step, inter),
        ).flatten(1)  # fmt: skip
        if getattr(module, "mamba_rms_norm", True):
            y = module.norm(y[None], gate[None])[0]
        else:
            y = y * F.silu(gate)
        return module.out_proj(y.to(x.dtype))[None]

    return Family(name, states, forward)


# Mamba1 (Jamba): in_proj -> [x | gate], conv over x, x_proj -> dt, B, C (normed), dt_proj, the scan with P = 1.


def _jamba_states(module):
    shape = (module.intermediate_size, 1, module.ssm_state_size)
    return [_conv_state(module.intermediate_size, module.conv1d, _dtype(module)), (shape, torch.float32)]


def _jamba_forward(module, hidden, step, states, intermediates):
    (conv_state, state), (conv_inter, inter) = states, _intermediates(intermediates, 2)
    x = hidden[0]
    xs, gate = module.in_proj(x).chunk(2, dim=-1)
    xs = _conv(step, xs, module.conv1d, conv_state, conv_inter, module.activation)
    size = module.ssm_state_size
    time_step, B, C = module.x_proj(xs).split([module.time_step_rank, size, size], dim=-1)
    dt = module.dt_layernorm(time_step) @ module.dt_proj.weight.t()
    y = torch.ops.hybrid.selective_scan(
        xs[..., None], dt, -torch.exp(module.A_log.float()), module.b_layernorm(B)[:, None],
        module.c_layernorm(C)[:, None], state, *_metadata(step), D=module.D, z=gate[..., None],
        dt_bias=module.dt_proj.bias, dt_softplus=True, **_route(step, inter),
    )  # fmt: skip
    return module.out_proj(y.flatten(1).to(x.dtype))[None]


# Short convolution (LFM2): in_proj -> [B | C | x], conv of B * x, times C, out_proj.


def _short_conv_states(module):
    return [_conv_state(module.conv.weight.shape[0], module.conv, _dtype(module))]


def _short_conv_forward(module, hidden, step, states, intermediates):
    (conv_state,), (conv_inter,) = states, _intermediates(intermediates, 1)
    B, C, x = module.in_proj(hidden[0]).chunk(3, dim=-1)
    y = _conv(step, B * x, module.conv, conv_state, conv_inter, "none")
    return module.out_proj(C * y)[None]


_QWEN3_5 = _gated_delta("gated delta rule", _qwen3_5_inputs, _norm_out("norm", "out_proj"))
FAMILIES = {
    "Qwen3NextGatedDeltaNet": _gated_delta("gated delta rule", _qwen3_next_inputs, _norm_out("norm", "out_proj")),
    "Qwen3_5GatedDeltaNet": _QWEN3_5,
    "Qwen3_5MoeGatedDeltaNet": _QWEN3_5,
    "LaraMiniGatedDeltaNet": _QWEN3_5,
    "OlmoHybridGatedDeltaNet": _gated_delta("gated delta rule", _olmo_inputs, _norm_out("o_norm", "o_proj")),
    "KimiLinearDeltaAttention": _gated_delta(
        "gated delta rule, per-channel decay",
        lambda m, x: _kimi_inputs(m, x, m.g_b_proj(m.g_a_proj(x))),
        _kimi_out,
    ),
    "BailingHybridDeltaAttention": _gated_delta(
        "gated delta rule, per-channel decay", lambda m, x: _kimi_inputs(m, x, m.g_proj(x)), _kimi_out
    ),
    **dict.fromkeys(
        ("BambaMixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "FalconH1Mixer"), _mamba2("Mamba2")
    ),
    "JambaMambaMixer": Family("Mamba1", _jamba_states, _jamba_forward),
    **dict.fromkeys(
        ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"),
        Family("short convolution", _short_conv_states, _short_conv_forward),
    ),
}


def family_of(module) -> Family | None:
    return FAMILIES.get(type(module).__name__)
