"""`torch.ops.hybrid.mixer`: one stateful layer (linear attention, state space, short convolution) over a packed
batch, each request's state in its own slot of a `StatePool`.

    hybrid::mixer(Tensor hidden, Tensor cu_seqlens_q, Tensor seq_lens, Tensor state_slots, Tensor(a!)[] states,
                  SymInt forward_mode, int mixer) -> Tensor

hidden: [1, T, H], the layer's input for the step's T new tokens, packed request after request; cu_seqlens_q [B + 1]
and seq_lens [B] int32 as in the attention ops; state_slots: [B] int32, request i's slot; states: the layer's
state tensors, [num_slots, *shape] each, read and written in place at those slots; mixer: the id that
`stateful.serve_state` gave the layer. Returns the layer's outputs that run along the tokens, [1, T, ...] each,
flattened after the tokens and concatenated: [1, T, F] (one tensor: torch cannot functionalize a mutating op that
returns a list).

Request i continues its state when it has a prefix (seq_lens[i] > its q_len) and starts from no state otherwise, so
a slot is never read before the request's first forward writes it. The speculative modes (TARGET_VERIFY,
DRAFT_EXTEND_V2) are refused: a recurrent state cannot be rolled back to drop rejected draft tokens.

Like the attention ops, the op routes each call to a backend: the first of `MIXER_BACKENDS` that supports it. The
torch backend runs the layer's own transformers code once per request (the requests that decode one token together,
as a batch), each with its own state: what transformers computes for that request alone. A ragged kernel (one
call over every request, each with its initial state and slot, as flash-linear-attention's varlen gated-delta-rule
kernels with cu_seqlens on CUDA) goes in front of it as another backend; none is registered here.
"""

import weakref

import torch

from ..errors import HybridInputError, check_input
from ..modes import ForwardMode

_REFUSED_MODES = (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)

lib = torch.library.Library("hybrid", "FRAGMENT")
lib.define(
    "mixer(Tensor hidden, Tensor cu_seqlens_q, Tensor seq_lens, Tensor state_slots, Tensor(a!)[] states, "
    "SymInt forward_mode, int mixer) -> Tensor",
    tags=(torch.Tag.cudagraph_unsafe,),  # it reads the metadata on the host
)

# mixer id -> the served layer (`stateful.Mixer`); an entry goes with its model.
MIXERS = weakref.WeakValueDictionary()


class TorchMixerBackend:
    """The layer's own transformers code, once per request (decoding requests batched), on any device."""

    name = "torch"

    def supports(self, mixer, hidden) -> bool:
        return True

    def run(self, mixer, hidden, cu_seqlens_q, seq_lens, state_slots, states):
        cu, lens, slots = cu_seqlens_q.tolist(), seq_lens.tolist(), state_slots.tolist()
        q_lens = [stop - start for start, stop in zip(cu, cu[1:])]
        out = hidden.new_empty((1, hidden.shape[1], mixer.features), dtype=mixer.dtype)
        outputs = mixer.split(out)
        decoding = [i for i, q in enumerate(q_lens) if q == 1 and lens[i] > 1]
        if decoding:  # one token each after a prefix: one call as a batch of [len(decoding), 1, H]
            rows = [cu[i] for i in decoding]
            index = torch.tensor([slots[i] for i in decoding], device=hidden.device)
            gathered = [state.index_select(0, index) for state in states]
            positions = torch.tensor([[lens[i] - 1] for i in decoding], device=hidden.device)
            parts = mixer.call(hidden[0, rows].unsqueeze(1), gathered, True, positions)
            for state, new in zip(states, gathered):
                state.index_copy_(0, index, new)
            for view, part in zip(outputs, parts):
                view[0, rows] = part[:, 0]
        decoding = set(decoding)
        for i, q in enumerate(q_lens):
            if q == 0 or i in decoding:
                continue
            start, prefix = cu[i], lens[i] - q
            views = [state[slots[i] : slots[i] + 1] for state in states]
            # A layer whose chunk path starts from zero state continues token by token, through its decode path.
            pieces = [(0, q)] if prefix == 0 or mixer.chunks_continue else [(t, t + 1) for t in range(q)]
            for a, b in pieces:
                positions = torch.arange(prefix + a, prefix + b, device=hidden.device)[None]
                parts = mixer.call(hidden[:, start + a : start + b], views, prefix + a > 0, positions)
                for view, part in zip(outputs, parts):
                    view[:, start + a : start + b] = part
        return out


MIXER_BACKENDS = [TorchMixerBackend()]


def _check(hidden, cu_seqlens_q, seq_lens, state_slots, states, mixer):
    """The checks that need no values: ranks, dtypes, the layer's state shapes (static: `StatePool` marks them)."""
    if hidden.dim() != 3 or hidden.shape[0] != 1:
        raise HybridInputError(f"hidden must be [1, T, H] (the packed batch), got {tuple(hidden.shape)}")
    for name, t, rank in (
        ("cu_seqlens_q", cu_seqlens_q, 1),
        ("seq_lens", seq_lens, 1),
        ("state_slots", state_slots, 1),
    ):
        if t.dtype != torch.int32 or t.dim() != rank:
            raise HybridInputError(f"{name} must be a 1-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    check_input(
        state_slots.shape[0] == seq_lens.shape[0],
        lambda: f"state_slots must have one slot per request ({seq_lens.shape[0]}), got {state_slots.shape[0]}",
    )
    expected = [(tuple(spec.shape), spec.dtype) for spec in mixer.states]
    got = [(tuple(t.shape[1:]), t.dtype) for t in states]
    if got != expected or any(t.shape[0] != states[0].shape[0] for t in states):
        raise HybridInputError(
            f"states of {mixer.name} must be [num_slots, *shape] of (shape, dtype) {expected}, got "
            f"{[(tuple(t.shape), t.dtype) for t in states]}"
        )


def _mixer(hidden, cu_seqlens_q, seq_lens, state_slots, states, forward_mode, mixer):
    layer = MIXERS[mixer]
    _check(hidden, cu_seqlens_q, seq_lens, state_slots, states, layer)
    if forward_mode in _REFUSED_MODES:
        raise HybridInputError(
            f"forward_mode {ForwardMode(forward_mode).name} is a speculative mode, but {layer.name} keeps a "
            f"recurrent state, which cannot be rolled back to drop rejected draft tokens"
        )
    slots = state_slots.tolist()
    num_slots = states[0].shape[0] if states else 0
    if len(set(slots)) != len(slots) or not all(0 <= s < num_slots for s in slots):
        raise HybridInputError(f"state_slots must be distinct slots in [0, {num_slots}), got {slots}")
    if cu_seqlens_q[-1].item() != hidden.shape[1]:
        raise HybridInputError(
            f"cu_seqlens_q[-1] ({cu_seqlens_q[-1].item()}) must equal hidden's token count ({hidden.shape[1]})"
        )
    backend = next(b for b in MIXER_BACKENDS if b.supports(layer, hidden))
    return backend.run(layer, hidden, cu_seqlens_q, seq_lens, state_slots, states)


@torch.library.register_fake("hybrid::mixer")
def _mixer_fake(hidden, cu_seqlens_q, seq_lens, state_slots, states, forward_mode, mixer):
    layer = MIXERS[mixer]
    _check(hidden, cu_seqlens_q, seq_lens, state_slots, states, layer)
    return hidden.new_empty((1, hidden.shape[1], layer.features), dtype=layer.dtype)


lib.impl("mixer", _mixer, "CompositeExplicitAutograd")
