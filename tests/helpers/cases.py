"""Batches and checks that several test modules run: a batch for each forward mode and path, the fp8 conformance
cases with their check against the float64 reference, and the Triton kernels launched with another target's tiles."""

import contextlib

import torch

import hybrid_ops
from hybrid_ops import ForwardMode

from .reference import assert_close, fp8_case, reference


def mode_batch(mode, spec):
    """(q_lens, prefix_lens) of a batch `mode` may carry: none for IDLE, equal query lengths on the decode path (1 for
    DECODE, 3 for verify), ragged ones with an empty request otherwise."""
    if mode == ForwardMode.IDLE:
        return [], []
    if hybrid_ops.select_path(mode, spec) == "decode":
        return [1 if mode == ForwardMode.DECODE else 3] * 3, [4, 0, 11]
    return [5, 1, 0, 7], [0, 9, 3, 2]


def scales(kind, num_kv_heads, seed=0):
    """(k_scale, v_scale): one per kv head, one for all, or none (1.0)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "per_head":  # spread over [0.05, 4]: a backend that takes another head's scale is off by far
        return tuple(torch.exp(torch.empty(num_kv_heads).uniform_(-3, 1.4, generator=gen)) for _ in range(2))
    if kind == "one":
        return torch.tensor(0.3), torch.tensor([2.5])
    return None, None


# The conformance cases: chunked prefill over cached prefixes (page and tile boundaries), GQA with a window,
# soft-cap, decode and verify. name -> (op, make_case's arguments, the op's options, q's dtype, kind of `scales`).
FP8_CASES = {
    "prefill": ("prefill", dict(q_lens=[6, 13, 2, 0], prefix_lens=[4, 0, 11, 3]), {}, torch.bfloat16, "per_head"),
    "long_prefix": (
        "prefill",
        dict(q_lens=[70, 3], prefix_lens=[90, 140], head_dim=64, page_size=16),
        {},
        torch.float32,
        "per_head",
    ),
    "gqa_window": (
        "prefill",
        dict(q_lens=[9, 5], prefix_lens=[7, 12], num_q_heads=8),
        {"sliding_window": 5},
        torch.float16,
        "one",
    ),
    "softcap": ("prefill", dict(q_lens=[4, 8], prefix_lens=[3, 0]), {"logit_cap": 2.0}, torch.float32, "none"),
    "decode": (
        "decode",
        dict(q_lens=[1] * 4, prefix_lens=[0, 5, 17, 90], num_q_heads=8, head_dim=32),
        {},
        torch.bfloat16,
        "per_head",
    ),
    "verify": (
        "decode",
        dict(q_lens=[3] * 2, prefix_lens=[9, 20]),
        {"sliding_window": 7, "logit_cap": 3.0},
        torch.float32,
        "per_head",
    ),
}


def check_fp8_call(op, case, cache_dtype, kind, options, **kwargs):
    """`op` on `case` with caches of `cache_dtype` and scales of `kind`: the output against the float64 reference over
    the dequantized K/V, the caches byte for byte against the quantized values. kwargs: more of the op's arguments."""
    k_scale, v_scale = scales(kind, case.k.shape[1])
    fp8, read, (k_expected, v_expected) = fp8_case(
        case, cache_dtype, *(s if s is not None else torch.tensor(1.0) for s in (k_scale, v_scale))
    )
    if k_scale is not None:
        kwargs.update(k_scale=k_scale, v_scale=v_scale)
    out = op(*fp8.args, **options, **kwargs)
    assert_close(out, reference(read, **options), case.q.dtype)
    assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected), "k_cache differs from the quantized values"
    assert torch.equal(fp8.v_cache.view(torch.uint8), v_expected), "v_cache differs from the quantized values"


@contextlib.contextmanager
def launch_target(target):
    """The Triton backend launches its kernels with the tiles of `target` (a `kernels.config.Target`) inside."""
    backend = hybrid_ops.get_backend("triton")
    saved, backend.target = backend.target, target
    try:
        yield
    finally:
        backend.target = saved
