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
