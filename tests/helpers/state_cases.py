"""Test helpers for the state ops' cases: batches by name, random inputs of each op, a valid call of each and the
bad inputs they must refuse."""

import random

import torch
import torch.nn.functional as F

from hybrid_ops import ForwardMode, HybridInputError

from .state_reference import make_batch, poisoned_states

# name -> (forward mode, make_batch's arguments). Each shape of batch once: the product with every option is not
# needed, each option is crossed with two of them.
BATCHES = {
    "prefill": (ForwardMode.EXTEND, dict(q_lens=[5, 1, 9], prefixes=[0, 0, 0])),
    "prefix": (ForwardMode.EXTEND, dict(q_lens=[3, 6, 0], prefixes=[10, 5, 4])),
    "mixed": (ForwardMode.MIXED, dict(q_lens=[7, 1, 1, 12], prefixes=[3, 9, 1, 0], padding=2)),
    "long": (ForwardMode.EXTEND, dict(q_lens=[150, 70], prefixes=[130, 0])),
    "decode": (ForwardMode.DECODE, dict(q_lens=[1] * 5, prefixes=[4, 1, 7, 30, 2], padding=3)),
    "decode_first": (ForwardMode.DECODE, dict(q_lens=[1, 1], prefixes=[0, 3])),  # a first token, by decode
    "verify": (ForwardMode.TARGET_VERIFY, dict(q_lens=[4, 4, 4], prefixes=[3, 8, 1], padding=1)),
    "verify_tree": (ForwardMode.TARGET_VERIFY, dict(q_lens=[0, 0, 0], prefixes=[5, 2, 9], tree=(3, 3))),
    "extend_tree": (ForwardMode.EXTEND, dict(q_lens=[0, 0], prefixes=[6, 0], tree=(2, 2))),
}


def conv_inputs(num_tokens, channels, width, dtype, bias=True):
    x = torch.randn(num_tokens, channels, dtype=dtype)
    weight = torch.randn(channels, width, dtype=dtype) / width
    return x, weight, torch.randn(channels, dtype=dtype) if bias else None


def delta_inputs(num_tokens, k_heads, v_heads, k_dim, v_dim, dtype, per_channel):
    q, k = (F.normalize(torch.randn(num_tokens, k_heads, k_dim), dim=-1).to(dtype) for _ in range(2))
    v = torch.randn(num_tokens, v_heads, v_dim, dtype=dtype)
    g_shape = (num_tokens, v_heads, k_dim) if per_channel else (num_tokens, v_heads)
    g = -torch.rand(g_shape) * 0.5  # decays in (0.6, 1]: a state remembers tens of tokens
    return q, k, v, g, torch.rand(num_tokens, v_heads)


def scan_inputs(num_tokens, heads, head_dim, groups, state_size, dtype, per_channel_rate):
    x = torch.randn(num_tokens, heads, head_dim, dtype=dtype)
    dt = torch.randn(num_tokens, heads, dtype=dtype) - 1
    rate = -torch.rand(heads, state_size) if per_channel_rate else -torch.rand(heads) * 2
    B, C = (torch.randn(num_tokens, groups, state_size, dtype=dtype) for _ in range(2))
    return x, dt, rate, B, C


def valid_call(op, name="mixed", seed=0):
    """(op, positional args, keywords) of a valid call of `op` on batch `name`."""
    mode, arguments = BATCHES[name]
    batch = make_batch(**arguments, rng=random.Random(seed))
    T, metadata = batch.num_tokens, (*batch.metadata, int(mode))
    verify = mode == ForwardMode.TARGET_VERIFY

    def states(shape, dtype=torch.float32):
        state = poisoned_states(batch, shape, dtype)
        inter = torch.zeros(batch.num_slots, max(batch.q_lens), *shape, dtype=dtype) if verify else None
        return state, dict(tree_mask=batch.tree_mask, intermediate_states=inter)

    if op == "causal_conv1d":
        x, weight, bias = conv_inputs(T, 8, 4, torch.float32)
        state, extra = states((3, 8))
        return torch.ops.hybrid.causal_conv1d, (x, weight, bias, state, *metadata), dict(activation="silu", **extra)
    if op == "gated_delta_rule":
        q, k, v, g, beta = delta_inputs(T, 2, 4, 8, 4, torch.float32, per_channel=False)
        state, extra = states((4, 8, 4))
        return torch.ops.hybrid.gated_delta_rule, (q, k, v, g, beta, state, *metadata), extra
    x, dt, A, B, C = scan_inputs(T, 2, 3, 1, 4, torch.float32, per_channel_rate=False)
    state, extra = states((2, 3, 4))
    return torch.ops.hybrid.selective_scan, (x, dt, A, B, C, state, *metadata), dict(D=torch.ones(2), **extra)


def _replace(index, value):
    return lambda args, kwargs: (args[:index] + (value(args[index]),) + args[index + 1 :], kwargs)


def _keyword(name, value):
    return lambda args, kwargs: (args, {**kwargs, name: value(kwargs.get(name))})


def _metadata(op, name, value):
    """A change to one metadata argument (cu_seqlens_q, seq_lens, state_slots, forward_mode) of any op."""
    first = {"causal_conv1d": 4, "gated_delta_rule": 6, "selective_scan": 6}[op]
    index = first + ["cu_seqlens_q", "seq_lens", "state_slots", "forward_mode"].index(name)
    return _replace(index, value)


# name -> (op, change to a valid call). The whole messages are pinned in tests/test_contract.py.
STATE_BAD_INPUTS = {
    "conv_x_int": ("causal_conv1d", _replace(0, lambda x: x.int())),
    "conv_weight_channels": ("causal_conv1d", _replace(1, lambda w: w[:4])),
    "conv_state_width": ("causal_conv1d", _replace(3, lambda s: s[:, :2].contiguous())),
    "conv_state_dtype": ("causal_conv1d", _replace(3, lambda s: s.half())),
    "conv_activation": ("causal_conv1d", _keyword("activation", lambda _: "gelu")),
    "slots_int64": ("causal_conv1d", _metadata("causal_conv1d", "state_slots", lambda s: s.long())),
    "slots_count": ("gated_delta_rule", _metadata("gated_delta_rule", "state_slots", lambda s: s[:-1])),
    "cu_seqlens_count": ("selective_scan", _metadata("selective_scan", "cu_seqlens_q", lambda c: c[:-1])),
    "state_strided": ("gated_delta_rule", _replace(5, lambda s: s.transpose(2, 3).contiguous().transpose(2, 3))),
    "delta_v_heads": ("gated_delta_rule", _replace(2, lambda v: v[:, :1].expand(-1, 3, -1))),
    "delta_g_shape": ("gated_delta_rule", _replace(3, lambda g: g[:, :, None].expand(-1, -1, 5))),
    "delta_beta_dtype": ("gated_delta_rule", _replace(4, lambda b: b.double())),
    "delta_state_dtype": ("gated_delta_rule", _replace(5, lambda s: s.bfloat16())),
    "scan_A_shape": ("selective_scan", _replace(2, lambda a: a[:1])),
    "scan_groups": ("selective_scan", _replace(3, lambda b: b.expand(-1, 3, -1))),
    "scan_D_size": ("selective_scan", _keyword("D", lambda d: torch.ones(5))),
    "scan_dt_limits": ("selective_scan", _keyword("dt_max", lambda _: -1.0)),
    "verify_needs_intermediate": (
        "gated_delta_rule",
        _metadata("gated_delta_rule", "forward_mode", lambda _: int(ForwardMode.TARGET_VERIFY)),
    ),
    "unknown_backend": ("selective_scan", _keyword("prefill_backend", lambda _: "x")),
}
# name -> (op, change): refusals of values, which every backend that reads the metadata makes (validation on too).
STATE_VALUE_INPUTS = {
    "slots_repeated": ("causal_conv1d", _metadata("causal_conv1d", "state_slots", lambda s: s.clone().fill_(1))),
    "slot_too_high": ("gated_delta_rule", _metadata("gated_delta_rule", "state_slots", lambda s: s + 100)),
    "cu_seqlens_not_T": (
        "selective_scan",
        _metadata("selective_scan", "cu_seqlens_q", lambda c: torch.cat([c[:-1], c[-1:] - 1])),
    ),
    "seq_lens_short": ("gated_delta_rule", _metadata("gated_delta_rule", "seq_lens", lambda s: s * 0)),
}


def state_message(name, table=None) -> str:
    op, change = (table or STATE_BAD_INPUTS)[name]
    fn, args, kwargs = valid_call(op)
    args, kwargs = change(args, kwargs)
    try:
        fn(*args, **kwargs)
    except HybridInputError as e:
        return str(e)
    raise AssertionError(f"{name}: no error")
