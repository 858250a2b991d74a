"""The ops under `torch.inference_mode` (as `HybridGenerator` runs them) and outside it, in either order."""

import torch
from helpers.reference import assert_close, make_case, reference

import hybrid_ops  # noqa: F401  (registers the ops)


def test_calls_inside_then_outside_inference_mode():
    """Buffers the torch backend reuses across calls, first made under inference_mode, still serve calls outside."""
    for inference in (True, False, True):
        case = make_case([3, 1], [6, 9], seed=inference)
        with torch.inference_mode(inference):
            out = torch.ops.hybrid.attn(*case.args, 1)
        assert_close(out, reference(case), torch.float32)
