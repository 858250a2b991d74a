"""`StatePool`: slots handed out and returned, the states' shapes and dtypes, the step's slot tensor, errors."""

import pytest
import torch

from hybrid_ops import HybridInputError, OutOfPagesError
from hybrid_ops.state import StatePool


def test_pool_slots():
    pool = StatePool([[((3, 4), torch.float32), ((2,), torch.bfloat16)], [((5,), torch.float16)]], 3)
    assert [[tuple(t.shape) for t in layer] for layer in pool.states] == [[(3, 3, 4), (3, 2)], [(3, 5)]]
    assert pool.bytes_per_slot == 12 * 4 + 2 * 2 + 5 * 2
    assert [pool.add(r) for r in "abc"] == [0, 1, 2] and pool.num_free_slots == 0
    with pytest.raises(OutOfPagesError, match="all 3 state slots are taken"):
        pool.add("d")
    pool.free("b")
    assert pool.add("d") == 1 and pool.slots(["d", "a", "c"]).tolist() == [1, 0, 2]
    assert pool.slots(["a"]).dtype == torch.int32 and sorted(pool.requests) == ["a", "c", "d"]
    with pytest.raises(HybridInputError, match="request_id 'a' holds a state slot already"):
        pool.add("a")
    with pytest.raises(HybridInputError, match="request_id 'b' holds no state slot"):
        pool.free("b")


def test_commit_takes_each_requests_accepted_token_state():
    pool = StatePool([[((2,), torch.float32)], [((3, 1), torch.bfloat16)]], 4, max_verify_tokens=3)
    assert [tuple(t.shape) for layer in pool.intermediate_states for t in layer] == [(4, 3, 2), (4, 3, 3, 1)]
    for r in "abc":
        pool.add(r)
    for layer in pool.intermediate_states:
        for t in layer:
            t.copy_(torch.arange(t.numel()).view(t.shape).to(t.dtype))
    before = [t.clone() for t in pool.all_states]
    pool.commit(["c", "a"], [2, 0])
    for state, old, inter in zip(pool.all_states, before, (t for layer in pool.intermediate_states for t in layer)):
        assert torch.equal(state[2], inter[2, 2]) and torch.equal(state[0], inter[0, 0])
        assert torch.equal(state[1], old[1]) and torch.equal(state[3], old[3])  # b's and the free slot untouched
    with pytest.raises(HybridInputError, match=r"tokens must give each of the 1 requests a token index in \[0, 3\)"):
        pool.commit(["a"], [3])
    with pytest.raises(HybridInputError, match="commit needs intermediate states"):
        StatePool([[((2,), torch.float32)]], 2).commit(["a"], [0])


def test_snapshots_saved_restored_and_replaced_least_recently_used_first():
    pool = StatePool([[((2,), torch.float32)]], 2, num_snapshots=2)
    state = pool.states[0][0]
    pool.add("a")
    for key, value in (("x", 1.0), ("y", 2.0)):
        state[pool.slot("a")] = value
        pool.save("a", key)
    pool.add("b")
    pool.restore("b", "x")  # x is now the most recently used
    assert state[pool.slot("b")].tolist() == [1.0, 1.0]
    state[pool.slot("a")] = 3.0
    pool.save("a", "z")  # replaces y
    assert pool.has_snapshot("x") and pool.has_snapshot("z") and not pool.has_snapshot("y")
    pool.restore("b", "z")
    assert state[pool.slot("b")].tolist() == [3.0, 3.0]
