"""The Triton state kernels (kernels/causal_conv1d.py, gated_delta_rule.py, selective_scan.py) where the shared state
op tests do not reach: a GPU's tiles run by the interpreter over shapes that cross every tile boundary (value columns,
heads and channels per program, tokens per window step), slots outside [0, num_slots) with validation off, inputs as
the strided views a compiled graph passes, and the head dims `supports` bounds. Against the float64 recurrences of
tests/helpers/state_reference.py; every slot the batch does not hold is poisoned and must come back bit for bit."""

import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers.cases import launch_target
from helpers.reference import slow_except
from helpers.state_reference import (
    StateCall,
    conv_reference,
    gated_delta_reference,
    make_batch,
    selective_scan_reference,
)

import hybrid_ops
from hybrid_ops import ForwardMode
from hybrid_ops.backends import Spec
from hybrid_ops.kernels.config import INTERPRETER, Target, conv_tiles, delta_tiles, scan_tiles

GPU_TILES = Target(num_sms=132, interpret=True)  # an H200's tiles


@dataclass
class Layer:
    """A state op at one size: make(num_tokens, dtype) -> (its tensors before the state, its keywords);
    reference(batch, tensors, keywords, state) -> (out, finals, every) of tests/helpers/state_reference.py."""

    op: str
    make: object
    reference: object
    state_shape: tuple
    state_dtype: torch.dtype = None  # None: the inputs' (the convolution's)


def conv_layer(channels, width):
    def make(num_tokens, dtype):
        x = torch.randn(num_tokens, channels, dtype=dtype)
        tensors = (x, torch.randn(channels, width, dtype=dtype) / width, torch.randn(channels, dtype=dtype))
        return tensors, dict(activation="silu")

    def reference(batch, tensors, keywords, state):
        return conv_reference(batch, *tensors, state, keywords["activation"])

    return Layer("causal_conv1d", make, reference, (width - 1, channels))


def delta_layer(k_heads, v_heads, k_dim, v_dim, per_channel=False):
    def make(num_tokens, dtype):
        q, k = (F.normalize(torch.randn(num_tokens, k_heads, k_dim), dim=-1).to(dtype) for _ in range(2))
        g = -torch.rand(num_tokens, v_heads, *([k_dim] if per_channel else [])) * 0.5
        return (q, k, torch.randn(num_tokens, v_heads, v_dim, dtype=dtype), g, torch.rand(num_tokens, v_heads)), {}

    def reference(batch, tensors, keywords, state):
        return gated_delta_reference(batch, *tensors, state, k_dim**-0.5)

    return Layer("gated_delta_rule", make, reference, (v_heads, k_dim, v_dim), torch.float32)


def scan_layer(heads, head_dim, groups, state_size):
    mamba1 = head_dim == 1  # A [H, N]

    def make(num_tokens, dtype):
        rate = -torch.rand(heads, state_size) if mamba1 else -torch.rand(heads) * 2
        tensors = (
            torch.randn(num_tokens, heads, head_dim, dtype=dtype),
            torch.randn(num_tokens, heads, dtype=dtype) - 1,
            rate,
            *(torch.randn(num_tokens, groups, state_size, dtype=dtype) for _ in range(2)),
        )
        keywords = dict(
            D=torch.randn(heads),
            z=torch.randn(num_tokens, heads, head_dim, dtype=dtype),
            dt_bias=torch.randn(heads) * 0.5,
            dt_softplus=True,
            dt_min=0.001,
        )
        return tensors, keywords

    def reference(batch, tensors, keywords, state):
        options = dict(keywords, dt_max=float("inf"))
        return selective_scan_reference(batch, *tensors, state, **options)

    return Layer("selective_scan", make, reference, (heads, head_dim, state_size), torch.float32)


# Sizes whose GPU tiles split every axis with a partial last block (checked in test_gpu_tiles).
LAYERS = {
    "conv": conv_layer(100, 4),  # 2 channel blocks of 64; 40 tokens: 3 window steps of 16
    "delta": delta_layer(2, 4, 40, 72),  # Dk 40 padded to 64; Dv 72: 3 blocks of 32 value columns
    "delta_per_channel": delta_layer(1, 2, 24, 40, per_channel=True),
    "mamba2": scan_layer(5, 24, 1, 16),  # 2 heads x 32 channels per program: 3 head blocks, P padded
    "mamba2_wide": scan_layer(2, 40, 2, 128),  # 8 channels per program: 5 channel blocks
    "mamba1": scan_layer(100, 1, 1, 16),  # 64 heads per program: 2 head blocks
}
# name -> (forward mode, speculative_attention_mode, make_batch's arguments)
BATCHES = {
    "prefix": (ForwardMode.EXTEND, "prefill", dict(q_lens=[40, 3, 0], prefixes=[5, 0, 7], padding=1)),
    "verify": (ForwardMode.TARGET_VERIFY, "decode", dict(q_lens=[4, 4], prefixes=[3, 1], padding=1)),
    "verify_tree": (ForwardMode.TARGET_VERIFY, "decode", dict(q_lens=[0, 0], prefixes=[3, 6], tree=(3, 2))),
    "extend_tree": (ForwardMode.EXTEND, "prefill", dict(q_lens=[0, 0], prefixes=[0, 4], tree=(2, 3))),
}


def check(layer, batch_name, dtype=torch.float32, target=INTERPRETER, strided=None, out_of_range=False):
    """The op of `layer` on a batch (Triton with target's tiles) against the reference. strided(tensors) -> the same
    values as the views to call with; out_of_range: requests 0 and 1 called with slots num_slots and -5, which the
    reference takes as padding's -1."""
    mode, spec_mode, arguments = BATCHES[batch_name]
    batch = make_batch(**arguments, rng=random.Random(len(batch_name)))
    if out_of_range:
        batch.slots[0] = batch.slots[1] = -1
    cu_seqlens_q, seq_lens, state_slots = batch.metadata
    if out_of_range:
        state_slots[0], state_slots[1] = batch.num_slots, -5
    tensors, keywords = layer.make(batch.num_tokens, dtype)
    state_dtype = layer.state_dtype or dtype
    call = StateCall(batch, layer.state_shape, state_dtype, verify=mode == ForwardMode.TARGET_VERIFY)
    with launch_target(target):
        out = getattr(torch.ops.hybrid, layer.op)(
            *(strided(tensors) if strided else tensors),
            call.state,
            cu_seqlens_q,
            seq_lens,
            state_slots,
            int(mode),
            **keywords,
            tree_mask=batch.tree_mask,
            intermediate_states=call.intermediate,
            prefill_backend="triton",
            decode_backend="triton",
            speculative_attention_mode=spec_mode,
        )
    call.check(out, layer.reference(batch, tensors, keywords, call.before), dtype, state_dtype)


def test_gpu_tiles_split_every_axis():
    """The LAYERS' sizes do cross the GPU tiles' boundaries, each with a partial last block."""
    conv = conv_tiles(100, 0, GPU_TILES)
    assert 64 < 100 % conv.block_v + conv.block_v < 128 and 40 > 2 * conv.block_t
    assert conv_tiles(100, 4, GPU_TILES).block_t == 4  # the decode path's verify: one step of 4 tokens
    assert delta_tiles(40, 72, GPU_TILES).block_v == 32  # 72 = 32 + 32 + 8
    mamba2 = scan_tiles(5, 24, 16, GPU_TILES)
    assert (mamba2.block_h, mamba2.block_v) == (2, 32)  # 5 heads = 2 + 2 + 1, P 24 of 32
    assert scan_tiles(2, 40, 128, GPU_TILES).block_v == 8  # 40 = 5 x 8
    assert scan_tiles(100, 1, 16, GPU_TILES).block_h == 64  # 100 heads = 64 + 36
    assert delta_tiles(40, 72, INTERPRETER).block_v == 128  # the interpreter's: one block


GPU_CASES = [(layer, batch) for layer in LAYERS for batch in BATCHES]


@pytest.mark.parametrize("layer, batch_name", slow_except(("delta", "verify_tree"), GPU_CASES))
def test_gpu_tiles(layer, batch_name):
    """A GPU's tiles (several programs per request and head, window steps) over prefixes, verify, trees."""
    check(LAYERS[layer], batch_name, target=GPU_TILES)


@pytest.mark.parametrize("layer", slow_except("mamba2", ["conv", "delta", "mamba2", "mamba1"]))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_tiles_16_bit(layer, dtype):
    """16-bit inputs through a GPU's tiles: loads converted to float32 (the interpreter's bf16 arithmetic is wrong
    otherwise), outputs rounded back."""
    check(LAYERS[layer], "prefix", dtype, target=GPU_TILES)


@pytest.mark.parametrize("layer", ["conv", "delta", "mamba2", "mamba1"])
@pytest.mark.parametrize("batch_name", ["prefix", "verify"])
def test_slots_out_of_range(layer, batch_name):
    """With validation off, slots past num_slots or below -1 read and write nothing, and their outputs are zeros,
    as padding's -1: the other requests' results are unchanged."""
    with hybrid_ops.set_validation(False):
        check(LAYERS[layer], batch_name, out_of_range=True)


def strided_conv(tensors):
    """x as the columns of a wider projection, weight column-major."""
    x, weight, bias = tensors
    wide = torch.cat([x, torch.zeros_like(x)], 1)[:, : x.shape[1]]
    return wide, weight.t().contiguous().t(), bias


def strided_delta(tensors):
    """q, k, v split from one fused projection, g transposed in memory, beta every other column."""
    q, k, v, g, beta = tensors
    num_tokens = q.shape[0]
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
    q_size, v_size = q[0].numel(), v[0].numel()
    views = [fused[:, a:b].unflatten(1, t.shape[1:]) for t, a, b in ((q, 0, q_size), (k, q_size, 2 * q_size),
                                                                    (v, 2 * q_size, 2 * q_size + v_size))]  # fmt: skip
    beta_wide = torch.stack([beta, torch.zeros_like(beta)], 2).flatten(1)[:, ::2]
    assert not views[0].is_contiguous() and num_tokens
    return (*views, g.t().contiguous().t(), beta_wide)


def strided_scan(tensors):
    """x transposed in memory, dt every other column, B and C halves of one tensor."""
    x, dt, rate, B, C = tensors
    fused = torch.stack([B, C], 2)  # [T, G, 2, N]
    dt_wide = torch.stack([dt, dt], 2).flatten(1)[:, ::2]
    return x.transpose(0, 2).contiguous().transpose(0, 2), dt_wide, rate, fused[:, :, 0], fused[:, :, 1]


@pytest.mark.parametrize(
    "layer, strided",
    [("conv", strided_conv), ("delta", strided_delta), ("mamba2", strided_scan), ("mamba1", strided_scan)],
    ids=["conv", "delta", "mamba2", "mamba1"],
)
def test_strided_inputs(layer, strided):
    """Inputs as non-contiguous views (as torch.compile passes them) give the contiguous inputs' results."""
    check(LAYERS[layer], "prefix", strided=strided)


def test_supports_bounds_the_whole_head_dim():
    """A state kernel holds Dk (gated delta rule) or N (scan) whole in a program, up to 256; Dv and P are split."""
    backend = hybrid_ops.get_backend("triton")

    def spec(op, head_dim, v_head_dim):
        return Spec(torch.device("cpu"), torch.bfloat16, torch.float32, head_dim, v_head_dim, frozenset({op}))

    assert backend.supports(spec("gated_delta_rule", 256, 1024))
    assert not backend.supports(spec("gated_delta_rule", 512, 64))
    assert backend.supports(spec("selective_scan", 1024, 256))
    assert not backend.supports(spec("selective_scan", 64, 512))
    assert backend.supports(spec("causal_conv1d", 0, 0))
