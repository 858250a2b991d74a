"""`StatePool`: the per-request state slots of a model's stateful layers, beside the paged K/V cache.

Linear-attention, state-space and short-convolution layers keep, per request, a state of fixed size instead of K/V
rows: a conv state (a causal convolution's last inputs) and a recurrent state (an SSM or linear-attention state).
The pool holds, for each stateful layer, one tensor per state, `[num_slots, *shape]` in the dtype the model keeps it
in, and a request holds one slot (the same index in every layer) from its admission until it finishes, is preempted
or is dropped. The step's `state_slots: [B] int32` tensor names each request's slot, so compiled code reads the
current ones at run time.

Slots are not zeroed when reused: a request's first forward has no previous state, and every stateful layer then
computes its states from zero and writes them, whatever its slot held (tests/test_stateful.py fills free slots with
NaN to check it).

Prefix caching: with `num_snapshots=N`, each state also has N snapshot slots, where `save` files a request's state
under a key (the prefix cache's key of the page its tokens end at) and `restore` starts another request from it; the
least recently used snapshot makes room for a new one.

Speculative decoding: with `max_verify_tokens=Q`, each state also has `intermediate_states` [num_slots, Q, *shape],
where a TARGET_VERIFY step's state ops leave the state after each of a request's draft tokens (`state_ops`); once the
verifier knows how many it accepts, `commit` copies the state after the last accepted token into the slot.
"""

import math
from collections import OrderedDict

import torch

from .errors import HybridInputError, OutOfPagesError


class StatePool:
    """Slots of state for `num_slots` requests.

    layer_states: per stateful layer, the (shape, dtype) of each of its states, one request's (no batch dim).
    states[i][j]: layer i's state j, [num_slots, *shape]; its address never changes (`mark_static_address`).
    max_verify_tokens: Q > 0 gives every state its `intermediate_states[i][j]`, [num_slots, Q, *shape] (TARGET_VERIFY
    steps of up to Q tokens per request); 0 gives none (`intermediate_states` is None).
    num_snapshots: N > 0 gives every state N snapshot slots (`save`, `restore`), allocated beside the slots.
    """

    def __init__(self, layer_states, num_slots: int, device="cpu", max_verify_tokens: int = 0, num_snapshots: int = 0):
        if not (isinstance(num_slots, int) and num_slots > 0):
            raise HybridInputError(f"num_slots must be a positive int, got {num_slots!r}")
        if not (isinstance(max_verify_tokens, int) and max_verify_tokens >= 0):
            raise HybridInputError(f"max_verify_tokens must be an int >= 0, got {max_verify_tokens!r}")
        self.states = [
            [torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in layer]
            for layer in layer_states
        ]
        self.intermediate_states = None
        if max_verify_tokens:
            self.intermediate_states = [
                [t.new_zeros((num_slots, max_verify_tokens, *t.shape[1:])) for t in layer] for layer in self.states
            ]
        self.max_verify_tokens = max_verify_tokens
        if not (isinstance(num_snapshots, int) and num_snapshots >= 0):
            raise HybridInputError(f"num_snapshots must be an int >= 0, got {num_snapshots!r}")
        self.snapshots = [t.new_zeros((num_snapshots, *t.shape[1:])) for t in self.all_states] if num_snapshots else []
        self._snapshot_of = OrderedDict()  # key -> snapshot index, least recently used first
        self._free_snapshots = list(range(num_snapshots - 1, -1, -1))
        every = self.all_states + [t for layer in self.intermediate_states or [] for t in layer]
        for t in every:  # static sizes too: Dynamo would otherwise unify a token count equal to one
            torch._dynamo.mark_static_address(t)
            torch._dynamo.mark_static(t)
        self.num_slots = num_slots
        self.device = torch.device(device)
        self._free = list(range(num_slots - 1, -1, -1))  # pop from the end: low slots first
        self._slots = {}  # request id -> slot

    @property
    def all_states(self) -> list:
        """Every state tensor of every layer, in order."""
        return [t for layer in self.states for t in layer]

    @property
    def bytes_per_slot(self) -> int:
        """One request's state in bytes, over every layer."""
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.all_states)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def requests(self) -> list:
        return list(self._slots)

    def add(self, request_id) -> int:
        """Gives a request a slot; returns it. Its state is whatever the slot held until its first forward."""
        if request_id in self._slots:
            raise HybridInputError(f"request_id {request_id!r} holds a state slot already")
        if not self._free:
            raise OutOfPagesError(f"all {self.num_slots} state slots are taken")
        self._slots[request_id] = slot = self._free.pop()
        return slot

    def free(self, request_id) -> None:
        """Returns a request's slot to the pool."""
        self._free.append(self.slot(request_id))
        del self._slots[request_id]

    def slot(self, request_id) -> int:
        if request_id not in self._slots:
            raise HybridInputError(f"request_id {request_id!r} holds no state slot (never added, or freed already)")
        return self._slots[request_id]

    def slots(self, request_ids) -> torch.Tensor:
        """The step's `state_slots`: [len(request_ids)] int32, each request's slot."""
        return torch.tensor([self.slot(r) for r in request_ids], dtype=torch.int32, device=self.device)

    def has_snapshot(self, key) -> bool:
        return key in self._snapshot_of

    def save(self, request_id, key) -> None:
        """Files the request's state, in every layer, as the snapshot of `key` (nothing without snapshot slots)."""
        if not self.snapshots or key in self._snapshot_of:
            return
        if self._free_snapshots:
            index = self._free_snapshots.pop()
        else:
            _, index = self._snapshot_of.popitem(last=False)
        self._snapshot_of[key] = index
        slot = self.slot(request_id)
        for state, snapshot in zip(self.all_states, self.snapshots):
            snapshot[index] = state[slot]

    def restore(self, request_id, key) -> None:
        """Gives the request, in every layer, the state saved as the snapshot of `key`."""
        index = self._snapshot_of[key]
        self._snapshot_of.move_to_end(key)
        slot = self.slot(request_id)
        for state, snapshot in zip(self.all_states, self.snapshots):
            state[slot] = snapshot[index]

    def commit(self, request_ids, tokens) -> None:
        """After a TARGET_VERIFY step: each request's state becomes the one after its draft token `tokens[i]` (its
        index among the step's new tokens for that request), in every layer."""
        if self.intermediate_states is None:
            raise HybridInputError("commit needs intermediate states: make the pool with max_verify_tokens > 0")
        tokens = list(tokens)
        if len(tokens) != len(request_ids) or not all(0 <= t < self.max_verify_tokens for t in tokens):
            raise HybridInputError(
                f"tokens must give each of the {len(request_ids)} requests a token index in "
                f"[0, {self.max_verify_tokens}), got {tokens}"
            )
        slots = self.slots(request_ids).long()
        index = torch.tensor(tokens, device=self.device)
        for layer, intermediates in zip(self.states, self.intermediate_states):
            for state, intermediate in zip(layer, intermediates):
                state[slots] = intermediate[slots, index]
