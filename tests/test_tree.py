"""Speculative trees: `tree_mask` against the float64 reference over the same mask, on random EAGLE-style trees (depths
1-6, widths 1-4) with every option, in every mode that carries new tokens; the causal tree is the chain, bit for bit;
bad masks are refused by name with the cache untouched."""

import dataclasses
import itertools
import random

import pytest
import torch
from helpers.reference import assert_close, expected_cache, fp8_case, make_case, random_tree, reference, tree_mask_for
from torch._dynamo.testing import CompileCounter

import hybrid_ops
from hybrid_ops import ForwardMode
from hybrid_ops.backends.base import ALL_FEATURES
from hybrid_ops.backends.torch_ref import TorchBackend

TREE_BACKENDS = ["torch", "cpu", "triton"]
SLOW_BACKENDS = {"triton"}  # the interpreter takes seconds a case: one case per test in the fast tier
E4M3 = torch.float8_e4m3fn

OPTIONS = {
    "plain": {},
    "window": dict(sliding_window=3),  # shorter than the trees' depths: positions, not slots, decide
    "chunk": dict(attention_chunk=4),
    "softcap_sinks": dict(logit_cap=2.0, sinks=torch.randn(8, generator=torch.Generator().manual_seed(3))),
    "scale_window_chunk": dict(scale=0.3, sliding_window=5, attention_chunk=7),
}


def with_backends(fast, *axes):
    """Parameters (backend, *values) for each backend of TREE_BACKENDS and each combination of `axes` (a tuple value
    gives several arguments); a backend of SLOW_BACKENDS on any combination but `fast` in the slow tier."""
    params = []
    for backend, combination in itertools.product(TREE_BACKENDS, itertools.product(*axes)):
        values = [x for v in combination for x in (v if isinstance(v, tuple) else (v,))]
        slow = backend in SLOW_BACKENDS and combination != fast
        params.append(pytest.param(backend, *values, marks=[pytest.mark.slow] if slow else []))
    return params


def tree_batch(num_requests, depth, width, seed, uniform=False):
    """(trees, prefix_lens): a random tree per request; with `uniform` each has 1 + depth * width nodes (`decode`
    takes the same query length for every request)."""
    rng = random.Random(seed)
    trees = [random_tree(depth, width, rng, full=uniform)[0] for _ in range(num_requests)]
    return trees, [rng.randint(0, 40) for _ in range(num_requests)]


def tree_case(trees, prefixes, width, seed, **case_kwargs):
    case = make_case([t.shape[0] for t in trees], prefixes, num_q_heads=8, num_kv_heads=2, seed=seed, **case_kwargs)
    return case, tree_mask_for(trees, width, random.Random(seed))


PREFILL_TREES = [(1, 1, 0), (3, 2, 1), (6, 4, 2), (4, 3, 3)]


@pytest.mark.parametrize(
    "backend, option, depth, width, seed", with_backends(("scale_window_chunk", (6, 4, 2)), OPTIONS, PREFILL_TREES)
)
def test_prefill_trees(backend, option, depth, width, seed):
    """Ragged trees, one request without new tokens, Q past every request's length (garbage there is ignored)."""
    trees, prefixes = tree_batch(3, depth, width, seed)
    trees.insert(1, torch.zeros(0, 0, dtype=torch.bool))
    case, tree_mask = tree_case(trees, [*prefixes[:1], 5, *prefixes[1:]], 64, seed)
    options = OPTIONS[option]
    out = torch.ops.hybrid.prefill(*case.args, tree_mask=tree_mask, backend=backend, **options)
    assert_close(out, reference(case, tree_mask=tree_mask, **options), torch.float32)
    k_ref, v_ref = expected_cache(case)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)


VERIFY_TREES = [(2, 1, 4), (3, 4, 5), (6, 2, 6)]


@pytest.mark.parametrize(
    "backend, option, depth, width, seed", with_backends(("scale_window_chunk", (6, 2, 6)), OPTIONS, VERIFY_TREES)
)
def test_verify_trees(backend, option, depth, width, seed):
    """`decode`, as TARGET_VERIFY takes it: the same tree size for every request."""
    trees, prefixes = tree_batch(3, depth, width, seed, uniform=True)
    case, tree_mask = tree_case(trees, prefixes, trees[0].shape[0] + 3, seed)
    options = OPTIONS[option]
    out = torch.ops.hybrid.decode(*case.args, tree_mask=tree_mask, backend=backend, **options)
    assert_close(out, reference(case, tree_mask=tree_mask, **options), torch.float32)


MODES = [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2]


@pytest.mark.parametrize(
    "backend, spec, mode", with_backends(("decode", ForwardMode.TARGET_VERIFY), ["prefill", "decode"], MODES)
)
def test_every_mode_with_new_tokens(backend, spec, mode):
    uniform = hybrid_ops.select_path(mode, spec) == "decode"
    trees, prefixes = tree_batch(3, 3, 2, int(mode), uniform=uniform)
    case, tree_mask = tree_case(trees, prefixes, 16, int(mode))
    out = torch.ops.hybrid.attn(
        *case.args,
        int(mode),
        tree_mask=tree_mask,
        sliding_window=4,
        prefill_backend=backend,
        decode_backend=backend,
        speculative_attention_mode=spec,
    )
    assert_close(out, reference(case, tree_mask=tree_mask, sliding_window=4), torch.float32)


@pytest.mark.parametrize("backend, dtype", with_backends((torch.bfloat16,), [torch.bfloat16, torch.float16]))
def test_trees_with_fp8_caches_and_value_head_dim(backend, dtype):
    trees, prefixes = tree_batch(2, 4, 3, 11)
    case, tree_mask = tree_case(trees, prefixes, 20, 11, dtype=dtype, v_head_dim=8, head_dim=32)
    k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor(1.5)
    fp8, read, (k_expected, v_expected) = fp8_case(case, E4M3, k_scale, v_scale)
    out = torch.ops.hybrid.prefill(
        *fp8.args, tree_mask=tree_mask, k_scale=k_scale, v_scale=v_scale, sliding_window=4, backend=backend
    )
    assert_close(out, reference(read, tree_mask=tree_mask, sliding_window=4), dtype)
    assert torch.equal(fp8.k_cache.view(torch.uint8), k_expected)


CHAIN_BATCHES = [("prefill", [5, 1, 8], [0, 9, 30]), ("decode", [4, 4], [0, 17])]


@pytest.mark.parametrize(
    "backend, op, q_lens, prefixes, option", with_backends((CHAIN_BATCHES[0], "window"), CHAIN_BATCHES, OPTIONS)
)
def test_causal_tree_is_the_chain_bit_for_bit(backend, op, q_lens, prefixes, option):
    """A tree whose rows see every earlier token gives exactly tree_mask=None's output: the same computation."""
    case = make_case(q_lens, prefixes, num_q_heads=8, num_kv_heads=2, seed=5)
    causal = [torch.ones(n, n, dtype=torch.bool).tril() for n in q_lens]
    tree_mask = tree_mask_for(causal, max(q_lens) + 2, random.Random(0))
    call = getattr(torch.ops.hybrid, op)
    chain = call(*case.args, backend=backend, **OPTIONS[option])
    tree = call(*case.args, tree_mask=tree_mask, backend=backend, **OPTIONS[option])
    assert torch.equal(chain, tree)


def test_backends_without_trees_are_passed_over_or_refused():
    """ "auto" passes over a preferred backend that does not serve trees; naming it is an error, the cache untouched."""

    class Chains(TorchBackend):
        name, features = "chains", ALL_FEATURES - {"tree_mask"}

        def prefill(self, *args):
            # Reads its requests as chains: were it given a tree, the output would not be the tree's.
            return super().prefill(*args[:-1], dataclasses.replace(args[-1], tree_mask=None))

    case, tree_mask = tree_case(*tree_batch(2, 2, 2, 7), 8, 7)
    before = case.k_cache.clone()
    with hybrid_ops.register_backend(Chains(), prefer=True):
        with pytest.raises(hybrid_ops.HybridInputError, match="backend='chains' does not support tree_mask"):
            torch.ops.hybrid.prefill(*case.args, tree_mask=tree_mask, backend="chains")
        assert torch.equal(case.k_cache, before)
        out = torch.ops.hybrid.prefill(*case.args, tree_mask=tree_mask)
    assert_close(out, reference(case, tree_mask=tree_mask), torch.float32)


def test_opcheck_with_trees():
    trees, prefixes = tree_batch(2, 3, 2, 8)
    case, tree_mask = tree_case(trees, prefixes, 12, 8)
    torch.library.opcheck(torch.ops.hybrid.prefill.default, case.args, {"tree_mask": tree_mask, "sliding_window": 3})
    trees, prefixes = tree_batch(2, 2, 3, 9, uniform=True)
    case, tree_mask = tree_case(trees, prefixes, 7, 9)
    torch.library.opcheck(torch.ops.hybrid.attn.default, (*case.args, 5), {"tree_mask": tree_mask})


def test_compiled_trees_never_recompile():
    """One graph with a tree: other trees, sizes and modes (verify through decode, draft extend through prefill)
    run through it."""
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def step(case, tree_mask, mode):
        return torch.ops.hybrid.attn(
            *case.args, mode, tree_mask=tree_mask, speculative_attention_mode="decode", decode_backend="torch"
        )

    for seed, (depth, width, mode) in enumerate([(2, 2, 5), (3, 1, 5), (2, 3, 6), (4, 2, 5), (1, 4, 6)]):
        trees, prefixes = tree_batch(3, depth, width, seed, uniform=True)
        case, tree_mask = tree_case(trees, prefixes, 16, seed)
        out = step(case, tree_mask, mode)
        assert_close(out, reference(case, tree_mask=tree_mask), torch.float32)
    assert counter.frame_count == 1
