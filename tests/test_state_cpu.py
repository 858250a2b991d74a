"""The cpu backend's state kernels (kernels/cpu/state_ops.h) beyond tests/test_state_ops.py: inputs as strided views
(as a compiled graph hands them over) give the contiguous inputs' result bit for bit; parameters in other dtypes than
the inputs' match the torch backend; outputs and states do not depend on the thread count; and the kernels' own
checks of the metadata's values accept exactly what validation.check_state_metadata_values accepts, writing nothing
when they refuse."""

import random

import pytest
import torch
import torch.nn.functional as F
from helpers.state_reference import make_batch, poisoned_states
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hybrid_ops
from hybrid_ops import ForwardMode, HybridInputError
from hybrid_ops.validation import check_state_metadata_values

# name -> (forward mode, make_batch's arguments): past the kernels' threshold for using every thread, and a tree.
BATCHES = {
    "long": (ForwardMode.EXTEND, dict(q_lens=[150, 70, 1], prefixes=[130, 0, 4], padding=1)),
    "decode": (ForwardMode.DECODE, dict(q_lens=[1] * 12, prefixes=list(range(1, 13)), padding=2)),
    "verify_tree": (ForwardMode.TARGET_VERIFY, dict(q_lens=[0, 0, 0], prefixes=[5, 2, 9], tree=(3, 3))),
    "extend_tree": (ForwardMode.EXTEND, dict(q_lens=[0, 0], prefixes=[6, 0], tree=(2, 2))),
}


def native():
    return hybrid_ops.get_backend("cpu")._module


def strided(t):
    """t as a view of other strides: every stride doubled (the last one 2), the same values."""
    wide = torch.zeros(*t.shape, 2, dtype=t.dtype)
    wide[..., 0] = t
    return wide[..., 0]


def transposed(t):
    """t as a view of its first two dims' strides swapped (heads outermost; a 1-dim t strided), the same values."""
    return t.transpose(0, 1).contiguous().transpose(0, 1) if t.dim() > 1 else strided(t)


class Case:
    """A call of one op on a batch: (positional tensors, keywords), its states poisoned where the batch holds none."""

    def __init__(self, op, name, dtype=torch.float32, seed=0):
        mode, arguments = BATCHES[name]
        self.batch = make_batch(**arguments, rng=random.Random(seed))
        T, verify = self.batch.num_tokens, mode == ForwardMode.TARGET_VERIFY
        torch.manual_seed(seed)
        if op == "causal_conv1d":
            C, K = 72, 4
            shape, state_dtype = (K - 1, C), dtype
            inputs = [torch.randn(T, C, dtype=dtype), torch.randn(C, K) / K, torch.randn(C, dtype=torch.bfloat16)]
            self.keywords = dict(activation="silu")
        elif op == "gated_delta_rule":
            Hk, Hv, Dk, Dv = 2, 4, 24, 40
            shape, state_dtype = (Hv, Dk, Dv), torch.float32
            q, k = (F.normalize(torch.randn(T, Hk, Dk), dim=-1).to(dtype) for _ in range(2))
            inputs = [q, k, torch.randn(T, Hv, Dv, dtype=dtype), -torch.rand(T, Hv, Dk) * 0.5, torch.rand(T, Hv)]
            self.keywords = dict(scale=0.3)
        else:
            # Mamba1 ("selective_scan_p1": P = 1): 20 heads a group, blocks of 16 heads and the rest, N not whole
            # vectors.
            H, P, G, N = (40, 1, 2, 12) if op.endswith("_p1") else (4, 6, 2, 20)
            shape, state_dtype = (H, P, N), torch.float32
            B, C = (torch.randn(T, G, N, dtype=torch.float16) for _ in range(2))
            inputs = [torch.randn(T, H, P, dtype=dtype), torch.randn(T, H, dtype=torch.bfloat16) - 1]
            inputs += [-torch.rand(H, N), B, C]
            self.keywords = dict(D=torch.randn(H, dtype=torch.bfloat16), z=torch.randn(T, H, P), dt_bias=torch.randn(H))
            self.keywords |= dict(dt_softplus=True, dt_min=0.01, dt_max=2.0)
        self.op, self.inputs = getattr(torch.ops.hybrid, op.removesuffix("_p1")), inputs
        self.state = poisoned_states(self.batch, shape, state_dtype)
        self.intermediate = None
        if verify:
            self.intermediate = torch.full((self.batch.num_slots, max(self.batch.q_lens), *shape), 7.0).to(state_dtype)
        self.metadata = (*self.batch.metadata, int(mode))

    def run(self, backend="cpu", view=lambda t: t):
        """(output, state, intermediate states) of a call on copies of the states, every input tensor through `view`."""
        state = self.state.clone()
        intermediate = None if self.intermediate is None else self.intermediate.clone()
        inputs = [view(t) for t in self.inputs]
        keywords = {k: view(v) if isinstance(v, torch.Tensor) else v for k, v in self.keywords.items()}
        tree_mask = None if self.batch.tree_mask is None else view(self.batch.tree_mask)
        out = self.op(*inputs, state, *self.metadata, **keywords, tree_mask=tree_mask, intermediate_states=intermediate,
                      prefill_backend=backend, decode_backend=backend)  # fmt: skip
        return out, state, intermediate


OPS = ["causal_conv1d", "gated_delta_rule", "selective_scan", "selective_scan_p1"]


def assert_same(got, want):
    for a, b in zip(got, want):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["long", "verify_tree"])
@pytest.mark.parametrize("view", [strided, transposed])
def test_strided_inputs(op, name, view):
    """Every input (the tree mask and the parameters too) as a strided view: the contiguous inputs' result."""
    case = Case(op, name, torch.bfloat16)
    assert_same(case.run(view=view), case.run())


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_dtypes_against_torch(op, name, dtype):
    """Parameters in other float dtypes than the inputs' (the scan's B, C float16, dt and D bfloat16; the
    convolution's weight float32 and bias bfloat16), with its tree or padding: the torch backend's result."""
    case = Case(op, name, dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 4e-3
    for got, want in zip(case.run(), case.run("torch")):
        if want is not None:
            scale = max(1.0, want.abs().max().item())
            assert (got.double() - want.double()).abs().max().item() <= tolerance * scale


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("name", ["long", "decode"])
def test_thread_count_independent(op, name):
    """Each (request, head), (request, head block) or (request, channel block) task runs on one thread in a fixed
    order: the same bits on 1, 2 or 3 threads."""
    case = Case(op, name)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(case.run())
    finally:
        torch.set_num_threads(threads)
    assert_same(results[1], results[0])
    assert_same(results[2], results[0])


def accepts(*args) -> bool:
    try:
        check_state_metadata_values(*args)
    except HybridInputError:
        return False
    return True


@st.composite
def metadata(draw):
    """A random step's metadata (decode or not, verify or not, a tree or not), then a few of its values changed."""
    decode, verify, tree = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    num_requests = draw(st.integers(1, 4))
    q_len = draw(st.integers(1, 3))
    q_lens = [q_len] * num_requests if decode else draw(st.lists(st.integers(0, 4), min_size=num_requests,
                                                                  max_size=num_requests))  # fmt: skip
    num_slots = num_requests + 2
    slots = draw(st.permutations(list(range(num_slots))))[:num_requests]
    slots = [s if draw(st.booleans()) else -1 for s in slots]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n + draw(st.integers(0, 3)) for n in q_lens], dtype=torch.int32)
    T, longest = int(cu[-1]), max(q_lens)
    tree_mask = None
    if tree:
        width = max(1, longest + draw(st.integers(0, 2)))
        tree_mask = torch.rand(T, width, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) < 0.5
        for i, n in enumerate(q_lens):
            block = tree_mask[cu[i] : cu[i + 1], :n]
            block.copy_(block.tril() | torch.eye(n, dtype=torch.bool))
    tensors = [cu, seq_lens, torch.tensor(slots, dtype=torch.int32)]
    for _ in range(draw(st.integers(0, 2))):
        which = draw(st.sampled_from([0, 1, 2, 3] if tree and T else [0, 1, 2]))
        if which == 3:
            tree_mask[draw(st.integers(0, T - 1)), draw(st.integers(0, tree_mask.shape[1] - 1))] ^= True
        else:
            values = tensors[which].tolist()  # another entry's value: repeated slots, a request's length moved
            value = draw(st.one_of(st.integers(-2, T + 3), st.sampled_from(values)))
            tensors[which][draw(st.integers(0, len(values) - 1))] = value
    verify_len = max(1, longest + draw(st.integers(-1, 1))) if verify else None
    return (*tensors, T, num_slots, decode, tree_mask, verify_len)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(md=metadata())
def test_value_checks_agree_with_validation(md):
    """The kernels refuse (None) exactly the metadata that validation refuses, and then write nothing: neither the
    states nor, in verify, the intermediate states."""
    cu, seq_lens, slots, T, num_slots, decode, tree_mask, verify_len = md
    verify = verify_len is not None
    x, weight, bias = torch.randn(T, 16), torch.randn(16, 3), torch.randn(16)
    state = torch.randn(num_slots, 2, 16)
    intermediate = torch.randn(num_slots, verify_len, 2, 16) if verify else None
    before = (state.clone(), None if intermediate is None else intermediate.clone())
    out = native().causal_conv1d(x, weight, bias, state, cu, seq_lens, slots, decode, verify, tree_mask, intermediate,
                                 "silu")  # fmt: skip
    accepted = accepts(cu, seq_lens, slots, T, num_slots, decode, tree_mask, verify_len)
    event(f"accepted: {accepted}")
    assert (out is not None) == accepted
    if out is None:
        assert_same((state, intermediate), before)


@pytest.mark.parametrize("op", OPS)
def test_refusal_names_the_value(op):
    """A refused call raises validation's error, which names the value, having written no state."""
    case = Case(op, "long")
    case.metadata = (case.metadata[0], case.metadata[1], case.metadata[2].clone().fill_(0), case.metadata[3])
    before = case.state.clone()
    with pytest.raises(HybridInputError, match="state_slots must be distinct slots"):
        case.op(*case.inputs, case.state, *case.metadata, **case.keywords, prefill_backend="cpu")
    assert torch.equal(case.state, before)
