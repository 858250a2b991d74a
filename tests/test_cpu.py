"""The native CPU backend on long contexts: past its key-slice boundaries (512 keys), tile boundaries (64 keys for few
rows, 256 for many), query blocks (512 rows), row chunks of its products (64 rows, padded to 16) and page boundaries,
both row paths (few rows: dot products; many: brgemm, in fp32 or in 16-bit on AMX), head dims 20, 64, 80 and 128
(read in place, or copied and padded), with -1 past each request's pages."""

import math

import pytest
import torch
from reference import expected_cache, make_case, reference

import hybrid_ops  # noqa: F401 (registers torch.ops.hybrid)

# Max abs error over the reference's largest magnitude: long contexts average many values, so outputs are small
# and an absolute bound would let a 1% error through. The bounds sit above each dtype's output rounding.
RELATIVE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 5e-3}

CASES = {  # op, make_case arguments
    # 3 slices, exactly 1, and a slice boundary at the last key; page 16.
    "decode": ("decode", dict(q_lens=[1] * 3, prefix_lens=[1100, 511, 1536], num_q_heads=8, num_kv_heads=2,
                              head_dim=128, page_size=16)),
    # 4 draft tokens x group 8 = 32 rows (the many-rows path); head dim 80 (copied rows); page 5.
    "verify": ("decode", dict(q_lens=[4] * 2, prefix_lens=[700, 1030], num_q_heads=16, num_kv_heads=2, head_dim=80,
                              page_size=5)),
    # A short chunk over a long prefix (one query block: sliced keys) beside a chunk of two query blocks (group 4:
    # 128 tokens a block; 600 rows).
    "chunk_over_prefix": ("prefill", dict(q_lens=[9, 150], prefix_lens=[1200, 100], num_q_heads=8, num_kv_heads=2,
                                          head_dim=64, page_size=16)),
    # A head dim of no whole vectors (zero-padded in every tile), a prefix that ends mid-page, pages of 3.
    "head_dim_20": ("prefill", dict(q_lens=[40, 150], prefix_lens=[37, 0], num_q_heads=4, num_kv_heads=2, head_dim=20,
                                    page_size=3)),
    # Fresh prefills, one of two query blocks (group 1: 512 tokens a block), page 1.
    "prefill": ("prefill", dict(q_lens=[600, 70], prefix_lens=[0, 0], num_q_heads=2, num_kv_heads=2, head_dim=128,
                                page_size=1)),
}
OPTIONS = {
    "default": dict(),
    "window": dict(sliding_window=200),  # the window's start moves across slices and tiles
    "softcap_scale": dict(logit_cap=5.0, scale=0.05),
    "window_softcap": dict(sliding_window=77, logit_cap=2.0),
}


def pad_table_with_minus_one(case):
    """Table entries past each request's pages become -1, as transformers' paged cache pads them."""
    page_size = case.k_cache.shape[1]
    for i, length in enumerate(case.seq_lens.tolist()):
        case.block_table[i, math.ceil(length / page_size):] = -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", CASES)
def test_long_contexts_against_float64(name, option, dtype):
    op, kwargs = CASES[name]
    case = make_case(**kwargs, dtype=dtype, seed=7)
    pad_table_with_minus_one(case)
    k_ref, v_ref = expected_cache(case)
    out = getattr(torch.ops.hybrid, op)(*case.args, **OPTIONS[option], backend="cpu")
    ref = reference(case, **OPTIONS[option])
    error = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert out.dtype == dtype and out.shape == case.q.shape
    assert error <= RELATIVE[dtype], f"relative error {error:.3g} > {RELATIVE[dtype]:.1g}"
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)


def test_thread_count_does_not_change_the_result():
    """A batch of one: its key slices run on several threads, or all on one, with the same result bit for bit."""
    case = make_case([1], [2000], num_q_heads=4, num_kv_heads=1, head_dim=128, page_size=16, seed=8)
    threads = torch.get_num_threads()
    outs = []
    for n in (max(threads, 2), 1):
        torch.set_num_threads(n)
        try:
            outs.append(torch.ops.hybrid.decode(*case.args, backend="cpu"))
        finally:
            torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])


def test_without_a_compiler(monkeypatch):
    """A failed build: one warning, "auto" takes the torch backend, and asking for "cpu" by name is an error."""
    from hybrid_ops.backends import native

    def no_compiler():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(native, "build", no_compiler)
    working = hybrid_ops.get_backend("cpu", torch.zeros(1, 1, 8))
    hybrid_ops.register_backend(native.NativeBackend())
    try:
        case = make_case([3, 2], [4, 0], seed=9)
        with pytest.warns(UserWarning, match="cpu backend's kernels could not be built .*Ninja is required") as seen:
            out = torch.ops.hybrid.prefill(*case.args)
            torch.ops.hybrid.decode(*make_case([1], [5]).args)
        assert len(seen) == 1
        assert torch.allclose(out.double(), reference(case), atol=2e-5)
        with pytest.raises(hybrid_ops.HybridInputError, match="backend='cpu' needs a C\\+\\+ compiler and ninja"):
            torch.ops.hybrid.prefill(*case.args, backend="cpu")
    finally:
        hybrid_ops.register_backend(working)
