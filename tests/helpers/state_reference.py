"""Test helpers for the state ops: random packed batches over state slots and the float64 recurrences, one request
and one token at a time, written without the library's code; a call's states and outputs checked against them."""

import math
import random
from dataclasses import dataclass
from itertools import accumulate

import torch

from .reference import random_tree, tree_mask_for

# Fills every slot the batch does not hold; a read of it shows in the output, a write to it in the slot.
POISON = 1e4


@dataclass
class Batch:
    """B requests over a pool of slots. q_lens, prefixes (new tokens and cached ones; a prefix of 0 starts from
    zero state), slots (-1: a padding request), tree_rows: per request its [n, n] rows (`random_tree`) or None."""

    q_lens: list
    prefixes: list
    slots: list
    num_slots: int
    tree_rows: list | None = None
    tree_mask: torch.Tensor | None = None

    @property
    def metadata(self):
        cu = torch.tensor([0, *accumulate(self.q_lens)], dtype=torch.int32)
        seq_lens = torch.tensor([p + n for p, n in zip(self.prefixes, self.q_lens)], dtype=torch.int32)
        return cu, seq_lens, torch.tensor(self.slots, dtype=torch.int32)

    @property
    def num_tokens(self):
        return sum(self.q_lens)

    def parents(self, i):
        """Request i's parent of each new token: its tree's, else the token before (-1: the prefix)."""
        n = self.q_lens[i]
        if self.tree_rows is None:
            return list(range(-1, n - 1))
        rows = self.tree_rows[i]
        return [max((c for c in range(j) if rows[j, c]), default=-1) for j in range(n)]


def make_batch(q_lens, prefixes, num_slots=None, padding=0, tree=None, rng=None):
    """A batch of the requests (q_lens, prefixes) on shuffled distinct slots of a pool with spare slots, then
    `padding` padding requests (slot -1, no prefix) of the real requests' q_len where they share one (as on the
    decode path), else of one token each. tree: (depth, width) to give every real
    request a random tree of that many levels of `width` nodes instead of q_lens (its q_len is then the tree's size;
    padding requests a chain of as many)."""
    rng = rng or random.Random(random.getrandbits(32))
    q_lens, prefixes = list(q_lens), list(prefixes)
    rows = None
    if tree is not None:
        rows = [random_tree(*tree, rng, full=True)[0] for _ in q_lens]  # one size: the decode path takes them
        q_lens = [r.shape[0] for r in rows]
    num_slots = num_slots or len(q_lens) + 3
    slots = rng.sample(range(num_slots), len(q_lens))
    pad_len = q_lens[0] if len(set(q_lens)) == 1 else 1
    batch = Batch(q_lens + [pad_len] * padding, prefixes + [0] * padding, slots + [-1] * padding, num_slots)
    if rows is not None:
        batch.tree_rows = rows + [torch.ones(pad_len, pad_len, dtype=torch.bool).tril()] * padding
        batch.tree_mask = tree_mask_for(batch.tree_rows, max(batch.q_lens), rng)
    return batch


def poisoned_states(batch, shape, dtype):
    """[num_slots, *shape] random for the slots of requests with a prefix, POISON elsewhere."""
    states = torch.full((batch.num_slots, *shape), POISON, dtype=dtype)
    for slot, prefix in zip(batch.slots, batch.prefixes):
        if slot >= 0 and prefix > 0:
            states[slot] = torch.randn(shape, dtype=dtype)
    return states


def expected_states(batch, before, finals):
    """The state tensor after an op outside TARGET_VERIFY: `before` with each real request's final state (finals[i],
    float64; None for padding or no tokens) in its slot."""
    after = before.double().clone()
    for slot, final in zip(batch.slots, finals):
        if final is not None:
            after[slot] = final
    return after


def expected_intermediates(batch, before, every):
    """intermediate_states after a TARGET_VERIFY call: `before` with the state after token j of each real request
    at [slot, j] (every: `run_requests`'s)."""
    after = before.double().clone()
    for slot, states in zip(batch.slots, every):
        if slot >= 0:
            for j, state in enumerate(states):
                after[slot, j] = state
    return after


# Max abs error over the expected tensor's magnitude: the recurrences in float32, inputs rounded to the dtype.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_near(got, want, dtype, what):
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert err <= TOLERANCE[dtype] * scale, f"{what}: max abs error {err:.3g} > {TOLERANCE[dtype]:.1g} x {scale:.3g}"


def assert_states(got, before, want, written, dtype, what):
    """The entries `written` ([num_slots] or [num_slots, Q] bool) near `want`, within the tolerance of `dtype`
    scaled by their own magnitude; every other entry exactly as `before` (poison stays poison)."""
    assert torch.equal(got[~written], before[~written]), f"{what}: an entry the call must not write changed"
    assert_near(got[written], want[written], dtype, what)


class StateCall:
    """A batch and its op's state tensors (poisoned where the batch holds no slot; in TARGET_VERIFY, `verify`, also
    intermediate_states, all poison), called once and checked."""

    def __init__(self, batch, state_shape, state_dtype, verify):
        self.batch = batch
        self.verify = verify
        self.state = poisoned_states(batch, state_shape, state_dtype)
        self.before = self.state.clone()
        self.intermediate = None
        if verify:
            q = max(batch.q_lens) + 1
            self.intermediate = torch.full((batch.num_slots, q, *state_shape), POISON, dtype=state_dtype)

    def check(self, out, reference, dtype, state_dtype):
        """out against reference, the (out, finals, every) of the op's recurrence: out within the tolerance of dtype,
        the states written within that of state_dtype, every other entry untouched."""
        ref, finals, every = reference
        assert out.shape == ref.shape and out.dtype == dtype
        assert_near(out, ref, dtype, "output")
        if self.verify:
            assert torch.equal(self.state, self.before), "TARGET_VERIFY wrote a slot's state"
            before = torch.full_like(self.intermediate, POISON)
            want = expected_intermediates(self.batch, before, every)
            written = torch.zeros(self.intermediate.shape[:2], dtype=torch.bool)
            for slot, states in zip(self.batch.slots, every):
                if slot >= 0:  # not padding
                    written[slot, : len(states)] = True
            assert_states(self.intermediate, before, want, written, state_dtype, "intermediate states")
        else:
            want = expected_states(self.batch, self.before, finals)
            written = torch.zeros(self.state.shape[0], dtype=torch.bool)
            for slot, final in zip(self.batch.slots, finals):
                if final is not None:  # a real request with new tokens
                    written[slot] = True
            assert_states(self.state, self.before, want, written, state_dtype, "states")


def run_requests(batch, before, step, outputs_shape):
    """The float64 loop: for each request, its tokens along their parents from its slot's state in `before` (the
    slots' states before the call; zeros without a prefix), `step(state, t) -> (state, out)` with t the token's row.
    Returns (outputs [T, ...] float64, per request its final state or None, per request the state after each of its
    tokens)."""
    out = torch.zeros((batch.num_tokens, *outputs_shape), dtype=torch.float64)
    finals, every, start = [], [], 0
    for i, n in enumerate(batch.q_lens):
        slot = batch.slots[i]
        has_state = slot >= 0 and batch.prefixes[i] > 0
        state0 = before[slot].double() if has_state else torch.zeros(before.shape[1:], dtype=torch.float64)
        states = []
        for j, parent in enumerate(batch.parents(i)):
            state = state0 if parent < 0 else states[parent]
            state, out[start + j] = step(state.clone(), start + j)
            states.append(state)
        finals.append(states[-1] if n and slot >= 0 else None)
        every.append(states)
        if slot < 0:
            out[start : start + n] = 0
        start += n
    return out, finals, every


def conv_reference(batch, x, weight, bias, conv_state, activation):
    """causal_conv1d in float64: the window of K inputs along a token's path, its slot's K - 1 inputs before the
    first (zeros without a prefix)."""
    width, channels = weight.shape[1], x.shape[1]
    w, b = weight.double(), None if bias is None else bias.double()

    def step(window, t):
        full = torch.cat([window, x[t].double()[None]])  # [K, C], oldest first
        y = sum(w[:, k] * full[k] for k in range(width))
        if b is not None:
            y = y + b
        if activation == "silu":
            y = y / (1 + torch.exp(-y))
        return full[1:], y

    return run_requests(batch, conv_state, step, (channels,))


def gated_delta_reference(batch, q, k, v, g, beta, state, scale):
    """gated_delta_rule in float64, one value head at a time."""
    num_k_heads, num_v_heads = q.shape[1], v.shape[1]
    group = num_v_heads // num_k_heads

    def step(s, t):
        out = torch.zeros(num_v_heads, v.shape[2], dtype=torch.float64)
        for h in range(num_v_heads):
            qt, kt, vt = q[t, h // group].double(), k[t, h // group].double(), v[t, h].double()
            decay = torch.exp(g[t, h].double())  # a scalar, or one per key channel
            s[h] = (decay[:, None] if decay.dim() else decay) * s[h]
            s[h] = s[h] + torch.outer(kt, float(beta[t, h]) * (vt - s[h].t() @ kt))
            out[h] = scale * (s[h].t() @ qt)
        return s, out

    return run_requests(batch, state, step, (num_v_heads, v.shape[2]))


def selective_scan_reference(batch, x, dt, A, B, C, state, D, z, dt_bias, dt_softplus, dt_min, dt_max):
    """selective_scan in float64, one head at a time."""
    num_heads, head_dim = x.shape[1], x.shape[2]
    group = num_heads // B.shape[1]

    def step(s, t):
        y = torch.zeros(num_heads, head_dim, dtype=torch.float64)
        for h in range(num_heads):
            d = float(dt[t, h]) + (0.0 if dt_bias is None else float(dt_bias[h]))
            if dt_softplus:
                d = math.log1p(math.exp(d)) if d < 20 else d
            d = min(max(d, dt_min), dt_max)
            rate = A[h].double()  # [] or [N]
            bt, ct = B[t, h // group].double(), C[t, h // group].double()
            s[h] = torch.exp(d * rate) * s[h] + torch.outer(d * x[t, h].double(), bt)
            y[h] = s[h] @ ct
            if D is not None:
                y[h] = y[h] + float(D[h]) * x[t, h].double()
            if z is not None:
                gate = z[t, h].double()
                y[h] = y[h] * gate / (1 + torch.exp(-gate))
        return s, y

    return run_requests(batch, state, step, (num_heads, head_dim))
