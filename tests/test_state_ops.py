"""torch.ops.hybrid.{causal_conv1d, gated_delta_rule, selective_scan} against the float64 recurrences of
tests/helpers/state_reference.py, on every backend that serves them on the CPU: ragged prefills with and without a
prefix (past chunk and tile boundaries), decode, TARGET_VERIFY of chains and trees into intermediate states,
padding requests, every slot the batch does not hold full of poison; then their contract (opcheck), their errors and
the compiled graph."""

import itertools
import random
import re
import zlib

import pytest
import torch
from helpers.reference import BACKENDS, slow_except
from helpers.state_cases import (
    BATCHES,
    STATE_BAD_INPUTS,
    STATE_VALUE_INPUTS,
    conv_inputs,
    delta_inputs,
    scan_inputs,
    state_message,
    valid_call,
)
from helpers.state_reference import (
    StateCall,
    assert_near,
    conv_reference,
    gated_delta_reference,
    make_batch,
    selective_scan_reference,
)
from torch.library import opcheck

from hybrid_ops import ForwardMode, HybridInputError

BASIC = ["prefill", "decode"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def routed(backend, mode):
    return dict(prefill_backend=backend, decode_backend=backend, speculative_attention_mode=mode)


class Call(StateCall):
    """The batch of BATCHES[name] and its op's state tensors, called on a backend."""

    def __init__(self, name, state_shape, state_dtype, seed, speculative_attention_mode="prefill"):
        self.mode, arguments = BATCHES[name]
        batch = make_batch(**arguments, rng=random.Random(seed))
        super().__init__(batch, state_shape, state_dtype, verify=self.mode == ForwardMode.TARGET_VERIFY)
        self.spec_mode = speculative_attention_mode

    def keywords(self, backend):
        return dict(
            tree_mask=self.batch.tree_mask, intermediate_states=self.intermediate, **routed(backend, self.spec_mode)
        )

    @property
    def metadata(self):
        return (*self.batch.metadata, int(self.mode))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("width, activation", [(4, "silu"), (2, "none")])
def test_causal_conv1d(backend, name, width, activation):
    check_conv1d(backend, name, width, activation, torch.float32, channels=40)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BASIC)
@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv1d_dtypes(backend, name, dtype, bias):
    check_conv1d(backend, name, 4, "silu", dtype, channels=72, bias=bias)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [1, 3, 5])
def test_causal_conv1d_widths(backend, width):
    check_conv1d(backend, "mixed", width, "silu", torch.float32, channels=20)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "none"])
def test_causal_conv1d_every_combination_of_options(backend, bias, activation):
    check_conv1d(backend, "mixed", 4, activation, torch.float32, channels=24, bias=bias)


def check_conv1d(backend, name, width, activation, dtype, channels, bias=True, spec_mode="prefill"):
    call = Call(
        name,
        (width - 1, channels),
        dtype,
        seed=zlib.crc32(f"{name}{width}".encode()),
        speculative_attention_mode=spec_mode,
    )
    x, weight, b = conv_inputs(call.batch.num_tokens, channels, width, dtype, bias)
    before = call.state.clone()
    out = torch.ops.hybrid.causal_conv1d(
        x, weight, b, call.state, *call.metadata, activation=activation, **call.keywords(backend)
    )
    call.check(out, conv_reference(call.batch, x, weight, b, before, activation), dtype, dtype)


# (Hk, Hv, Dk, Dv): grouped value heads, head dims past 64-wide tiles, dims that are no power of two.
DELTA_HEADS = {"grouped": (2, 4, 16, 16), "d128": (1, 2, 128, 64), "odd": (3, 3, 24, 40)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_gated_delta_rule(backend, name, per_channel):
    check_gated_delta_rule(backend, name, DELTA_HEADS["grouped"], torch.float32, per_channel)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BASIC + ["verify"])
@pytest.mark.parametrize("heads", slow_except("grouped", list(DELTA_HEADS)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_delta_rule_shapes(backend, name, heads, dtype):
    check_gated_delta_rule(backend, name, DELTA_HEADS[heads], dtype, per_channel=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_gated_delta_rule_every_combination_of_options(backend, per_channel, scale):
    check_gated_delta_rule(backend, "verify", DELTA_HEADS["grouped"], torch.float32, per_channel, scale=scale)


def check_gated_delta_rule(backend, name, heads, dtype, per_channel, scale=None, spec_mode="prefill"):
    k_heads, v_heads, k_dim, v_dim = heads
    call = Call(name, (v_heads, k_dim, v_dim), torch.float32, seed=zlib.crc32(f'{name}{heads}'.encode()),
                speculative_attention_mode=spec_mode)  # fmt: skip
    q, k, v, g, beta = delta_inputs(call.batch.num_tokens, k_heads, v_heads, k_dim, v_dim, dtype, per_channel)
    before = call.state.clone()
    out = torch.ops.hybrid.gated_delta_rule(
        q, k, v, g, beta, call.state, *call.metadata, scale=scale, **call.keywords(backend)
    )
    scale = k_dim**-0.5 if scale is None else scale
    call.check(out, gated_delta_reference(call.batch, q, k, v, g, beta, before, scale), dtype, torch.float32)


# (H, P, G, N): Mamba2 heads in groups, wide heads and states, Mamba1 (P = 1, A per state channel).
SCAN_HEADS = {"mamba2": (4, 8, 2, 16), "wide": (2, 64, 1, 128), "mamba1": (24, 1, 1, 16)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("heads", ["mamba2", "mamba1"])
def test_selective_scan(backend, name, heads):
    check_selective_scan(backend, name, heads, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", BASIC)
@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_selective_scan_dtypes(backend, name, dtype):
    check_selective_scan(backend, name, "mamba2", dtype)


# Every combination of the scan's options (D, z, dt_bias, dt_softplus, dt limits): 32, each once, on a mixed batch or a
# verify, in turn.
SCAN_OPTIONS = list(itertools.product([False, True], repeat=5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "D, z, dt_bias, dt_softplus, limits",
    SCAN_OPTIONS,
    ids=[
        "-".join(n for n, on in zip(["D", "z", "bias", "softplus", "limits"], o) if on) or "bare" for o in SCAN_OPTIONS
    ],
)
def test_selective_scan_every_combination_of_options(backend, D, z, dt_bias, dt_softplus, limits):
    name = ["mixed", "verify"][SCAN_OPTIONS.index((D, z, dt_bias, dt_softplus, limits)) % 2]
    bounds = dict(dt_min=0.05, dt_max=0.7) if limits else {}
    check_selective_scan(backend, name, "mamba2", torch.float32, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                         **bounds)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_scan_wide(backend):
    check_selective_scan(backend, "long", "wide", torch.float32)


def check_selective_scan(backend, name, heads, dtype, D=True, z=True, dt_bias=True, dt_softplus=True, dt_min=0.0,
                         dt_max=None, spec_mode="prefill"):  # fmt: skip
    num_heads, head_dim, groups, state_size = SCAN_HEADS[heads]
    call = Call(name, (num_heads, head_dim, state_size), torch.float32, seed=zlib.crc32(f'{name}{heads}'.encode()),
                speculative_attention_mode=spec_mode)  # fmt: skip
    T = call.batch.num_tokens
    x, dt, A, B, C = scan_inputs(T, num_heads, head_dim, groups, state_size, dtype, heads == "mamba1")
    extra = dict(
        D=torch.randn(num_heads) if D else None,
        z=torch.randn(T, num_heads, head_dim, dtype=dtype) if z else None,
        dt_bias=torch.randn(num_heads) * 0.5 if dt_bias else None,
    )
    limits = dict(dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max)
    before = call.state.clone()
    out = torch.ops.hybrid.selective_scan(x, dt, A, B, C, call.state, *call.metadata, **extra, **limits,
                                          **call.keywords(backend))  # fmt: skip
    limits["dt_max"] = float("inf") if dt_max is None else dt_max
    reference = selective_scan_reference(call.batch, x, dt, A, B, C, before, **extra, **limits)
    call.check(out, reference, dtype, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["verify", "verify_tree"])
def test_verify_on_the_decode_path(backend, name):
    """speculative_attention_mode="decode" sends TARGET_VERIFY to the decode path (every request's draft tokens in
    one call): the same states and outputs."""
    check_conv1d(backend, name, 4, "silu", torch.float32, channels=24, spec_mode="decode")
    check_gated_delta_rule(backend, name, DELTA_HEADS["grouped"], torch.float32, True, spec_mode="decode")
    check_selective_scan(backend, name, "mamba2", torch.float32, spec_mode="decode")


# The contract: opcheck, the refusals (eager and compiled, every state untouched), the compiled graph.


STATE_OPS = ["causal_conv1d", "gated_delta_rule", "selective_scan"]


@pytest.mark.parametrize("op", STATE_OPS)
@pytest.mark.parametrize("name", ["mixed", "verify_tree"])
def test_opcheck(op, name):
    fn, args, kwargs = valid_call(op, name)
    opcheck(fn.default, args, kwargs)


@pytest.mark.parametrize("name", STATE_BAD_INPUTS)
def test_bad_inputs_refused_eager_and_compiled(name):
    """Refused with the same message eagerly and under torch.compile (where Dynamo wraps what the fake
    implementation raised; static sizes, so that the message names numbers, not symbols), before any state is
    written."""
    op, change = STATE_BAD_INPUTS[name]
    fn, args, kwargs = valid_call(op)
    args, kwargs = change(args, kwargs)
    tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in tensors]
    message = state_message(name)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a, **k: fn(*a, **k), fullgraph=True, dynamic=False, backend="aot_eager")
    with pytest.raises((HybridInputError, torch._dynamo.exc.TorchRuntimeError)) as raised:
        compiled(*args, **kwargs)
    error = raised.value
    while error is not None and not isinstance(error, HybridInputError):
        error = error.__cause__ or error.__context__
    assert str(error) == message
    assert all(torch.equal(a, b) for a, b in zip(tensors, before)), "a refused call wrote a tensor"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", STATE_VALUE_INPUTS)
def test_bad_values_refused(backend, name, validation_on):
    """Refused, every state untouched, on each backend (validation on: the backends that do not read the metadata
    are checked by the op)."""
    op, change = STATE_VALUE_INPUTS[name]
    fn, args, kwargs = valid_call(op)
    args, kwargs = change(args, kwargs)
    kwargs = {**kwargs, **routed(backend, "prefill")}
    states = [t for t in args if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() >= 3]
    before = [t.clone() for t in states]
    with pytest.raises(HybridInputError, match=re.escape(state_message(name, STATE_VALUE_INPUTS))):
        fn(*args, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(states, before))


def test_compiled_layer_calls_the_ops_on_the_pools_states():
    """A served gated delta layer (Qwen3.5's) compiled whole (fullgraph, dynamic): the generated code calls the conv
    and the delta rule on the pool's state tensors themselves (no clone, no copy), every mode runs through the same
    graphs after a warm-up (no recompile), and each gives the eager layer's output and states."""
    from helpers.models import make_model, tiny_config
    from torch._inductor.utils import run_and_get_code

    from hybrid_ops.integrations.servable import check_servable
    from hybrid_ops.integrations.transformers import HybridStep
    from hybrid_ops.state import StatePool

    model = make_model(tiny_config("qwen3_5_text"), attn_implementation="hybrid")
    mixer = check_servable(model)[1][0]
    pool = StatePool([[(s.shape, s.dtype) for s in mixer.states]], 6, max_verify_tokens=12)

    def layer(hidden, cu_seqlens_q, seq_lens, state_slots, forward_mode: int, tree_mask):
        step = HybridStep(forward_mode, cu_seqlens_q, seq_lens, None, None, None, state_slots=state_slots,
                          tree_mask=tree_mask)  # fmt: skip
        return mixer.family.forward(mixer.module, hidden, step, pool.states[0], pool.intermediate_states[0])

    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    rng = random.Random(0)
    with torch.no_grad():
        for i, name in enumerate(["prefill", "mixed", "decode", "verify", "verify_tree", "prefix"] * 2):
            mode, arguments = BATCHES[name]
            batch = make_batch(**{**arguments, "padding": 0, "prefixes": [0] * len(arguments["prefixes"])}
                               if i < 2 else arguments, num_slots=6, rng=rng)  # fmt: skip
            hidden = torch.randn(1, batch.num_tokens, model.config.hidden_size)
            args = (hidden, *batch.metadata, int(mode), batch.tree_mask)
            before = [t.clone() for t in pool.all_states]
            want = layer(*args)
            eager_states = [t.clone() for t in pool.all_states]
            for t, b in zip(pool.all_states, before):
                t.copy_(b)
            if i == 0:
                out, codes = run_and_get_code(compiled, *args)
                code = "\n".join(codes)
                assert "torch.ops.hybrid.causal_conv1d.default(" in code
                assert "torch.ops.hybrid.gated_delta_rule.default(" in code
                assert "aten.copy" not in code and ".clone(" not in code
            else:
                with torch._dynamo.config.patch(error_on_recompile=i >= 6):
                    out = compiled(*args)
            assert_near(out[0], want[0].double(), torch.float32, name)
            for got, eager in zip(pool.all_states, eager_states):  # Inductor rounds the projections its own way
                assert_near(got, eager.double(), torch.float32, f"{name}: states")
