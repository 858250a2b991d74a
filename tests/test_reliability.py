"""Reliability: property-based conformance, isolation between requests, determinism, and a soak run."""

import random

import pytest
import torch
from helpers.reference import (
    BACKENDS,
    CPU_BACKENDS,
    POISON,
    assert_close,
    dense_attention,
    expected_cache,
    make_case,
    reference,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import hybrid_ops
from hybrid_ops import ROUTING, ForwardMode, PagedKVCache


@pytest.fixture
def nan_for_uninitialized():
    """torch.empty fills floats with NaN: an output element a backend never writes shows up."""
    saved = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.utils.deterministic.fill_uninitialized_memory = saved[1]


@st.composite
def batches(draw):
    mode = draw(st.sampled_from(list(ROUTING)))
    spec = draw(st.sampled_from(["prefill", "decode"]))
    num_requests = 0 if mode == ForwardMode.IDLE else draw(st.integers(1, 4))
    if hybrid_ops.select_path(mode, spec) == "decode":
        q_len = 1 if mode == ForwardMode.DECODE else draw(st.integers(1, 4))
        q_lens = [q_len] * num_requests
    else:
        q_lens = draw(st.lists(st.integers(0, 9), min_size=num_requests, max_size=num_requests))
    kv_heads = draw(st.sampled_from([1, 2]))
    return dict(
        mode=mode,
        spec=spec,
        backend=draw(st.sampled_from(CPU_BACKENDS)),
        case=dict(
            q_lens=q_lens,
            prefix_lens=draw(st.lists(st.integers(0, 20), min_size=num_requests, max_size=num_requests)),
            page_size=draw(st.sampled_from([1, 3, 4, 16])),
            num_kv_heads=kv_heads,
            num_q_heads=kv_heads * draw(st.sampled_from([1, 2, 3, 4])),
            head_dim=draw(st.sampled_from([8, 16, 24, 64])),
            dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
            strided=draw(st.booleans()),
            seed=draw(st.integers(0, 2**16)),
        ),
        options=dict(
            sliding_window=draw(st.sampled_from([-1, 1, 4, 16])), logit_cap=draw(st.sampled_from([0.0, 1.0, 30.0]))
        ),
    )


# Draws that once failed, or that sit on an edge, kept as regular regression cases.
@example(
    dict(
        mode=ForwardMode.EXTEND,
        spec="prefill",
        backend="triton",
        case=dict(
            q_lens=[0, 5],
            prefix_lens=[0, 0],
            page_size=1,
            num_kv_heads=1,
            num_q_heads=3,
            head_dim=24,
            dtype=torch.bfloat16,
            strided=True,
            seed=0,
        ),
        options=dict(sliding_window=1, logit_cap=1.0),
    )
)
@example(
    dict(
        mode=ForwardMode.TARGET_VERIFY,
        spec="decode",
        backend="triton",
        case=dict(
            q_lens=[4, 4], prefix_lens=[0, 20], page_size=16, num_q_heads=8, head_dim=64, dtype=torch.float16, seed=1
        ),
        options=dict(sliding_window=16, logit_cap=0.0),
    )
)
@given(draw=batches())
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.slow
def test_conformance(draw):
    case = make_case(**draw["case"])
    k_ref, v_ref = expected_cache(case)
    backend = draw["backend"]
    out = torch.ops.hybrid.attn(
        *case.args,
        int(draw["mode"]),
        **draw["options"],
        prefill_backend=backend,
        decode_backend=backend,
        speculative_attention_mode=draw["spec"],
    )
    assert_close(out, reference(case, **draw["options"]), case.q.dtype)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op, q_lens", [("prefill", [3, 0, 6, 1]), ("decode", [1, 1, 1, 1]), ("decode", [3] * 4)])
def test_every_output_written_and_only_own_slots(backend, op, q_lens, nan_for_uninitialized):
    case = make_case(q_lens, [5, 2, 0, 13], num_q_heads=4, num_kv_heads=2, page_size=4)
    k_ref, v_ref = expected_cache(case)
    out = getattr(torch.ops.hybrid, op)(*case.args, backend=backend)
    assert not out.isnan().any(), "an output element was never written"
    assert_close(out, reference(case), torch.float32)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref), "a slot outside the step changed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), -3e38])
@pytest.mark.parametrize("op, q_lens", [("prefill", [4, 1, 6]), ("decode", [1, 1, 1]), ("decode", [2, 2, 2])])
def test_foreign_pages_do_not_matter(backend, fill, op, q_lens):
    """Whatever the pages a request does not own hold, its output is the same, bit for bit (decode batches gather
    padded K/V in the torch backend: the padding must not carry a non-finite value into the output)."""
    prefixes = [7, 12, 0]
    clean = make_case(q_lens, prefixes, page_size=4, seed=11)
    dirty = make_case(q_lens, prefixes, page_size=4, seed=11)
    dirty.k_cache[dirty.k_cache == POISON] = fill
    dirty.v_cache[dirty.v_cache == POISON] = fill
    out_clean = getattr(torch.ops.hybrid, op)(*clean.args, backend=backend)
    out_dirty = getattr(torch.ops.hybrid, op)(*dirty.args, backend=backend)
    assert torch.equal(out_clean, out_dirty)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_block_ids_are_masked_without_validation(backend):
    """Validation off: the torch and cpu backends (which read the metadata anyway) reject them; Triton never reads
    or writes outside the cache (an out-of-bounds access would abort the interpreter) and leaves other slots alone."""
    case = make_case([3, 2], [2, 5], page_size=4, seed=2)
    before_k = case.k_cache.clone()
    case.block_table[0, 0] = 10_000
    case.block_table[1, 1] = -7
    if backend in ("torch", "cpu"):
        with pytest.raises(hybrid_ops.HybridInputError, match="block_table"):
            torch.ops.hybrid.prefill(*case.args, backend=backend)
        return
    out = torch.ops.hybrid.prefill(*case.args, backend=backend)
    changed = (case.k_cache != before_k).flatten(1).any(1).nonzero().flatten().tolist()
    assert set(changed) <= {case.pages[0][1], case.pages[1][0]}  # only pages still named by the table
    assert out.shape == case.q.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_inputs_bit_identical(backend):
    runs = []
    for _ in range(2):
        case = make_case([5, 1, 9], [3, 17, 0], dtype=torch.bfloat16, seed=4)
        runs.append(torch.ops.hybrid.prefill(*case.args, backend=backend))
        case = make_case([1] * 3, [3, 17, 40], dtype=torch.bfloat16, seed=5)
        runs.append(torch.ops.hybrid.decode(*case.args, backend=backend))
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_batch_invariance_when_deterministic(backend, op, deterministic):
    """With set_deterministic(True), request 0's output is the same alone and in any batch."""
    n = 1 if op == "decode" else 5
    alone = make_case([n], [300], page_size=16, seed=6)
    crowd = make_case([n] * 7, [300] + [random.Random(i).randint(0, 500) for i in range(6)], page_size=16, seed=6)
    # Same request 0 in both: copy its prefix and new tokens over.
    for dst, src in ((crowd.prefix_k, alone.prefix_k), (crowd.prefix_v, alone.prefix_v)):
        dst[0] = src[0]
    for pos in range(300):
        page, row = crowd.pages[0][pos // 16], pos % 16
        crowd.k_cache[page, row], crowd.v_cache[page, row] = alone.prefix_k[0][pos], alone.prefix_v[0][pos]
    crowd.q[:n], crowd.k[:n], crowd.v[:n] = alone.q, alone.k, alone.v
    out_alone = getattr(torch.ops.hybrid, op)(*alone.args, backend=backend)
    out_crowd = getattr(torch.ops.hybrid, op)(*crowd.args, backend=backend)
    assert torch.equal(out_alone, out_crowd[:n])


# The Triton interpreter runs about 5 steps a second on this size.
@pytest.mark.slow
@pytest.mark.parametrize("backend, num_steps", [("torch", 2000), ("triton", 60), ("cpu", 2000)])
def test_soak(backend, num_steps):
    """Requests arrive, grow by prefill chunks, decode and verify steps, and finish, for a fixed number of steps;
    every 7th step is checked against the reference; at the end every page is free again."""
    rng = random.Random(backend)
    cache = PagedKVCache(num_pages=48, page_size=4, num_kv_heads=2, head_dim=8, max_pages_per_request=16)
    k_cache, v_cache = cache.layer(0)
    history, live, checked = {}, [], 0
    for steps in range(1, num_steps + 1):
        if len(live) < 6 and rng.random() < 0.4:
            rid = steps
            cache.add(rid)
            live.append(rid)
            history[rid] = (torch.zeros(0, 2, 8), torch.zeros(0, 2, 8))
        if not live:
            continue
        mode = rng.choice([ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY])
        uniform = mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
        draft = rng.randint(2, 4)
        new = [1 if mode == ForwardMode.DECODE else draft if uniform else rng.randint(0, 6) for _ in live]
        try:
            batch = cache.step(live, new, mode)
        except hybrid_ops.OutOfPagesError:
            victim = live.pop(0)
            cache.free(victim)
            continue
        T = sum(new)
        q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
        out = torch.ops.hybrid.attn(
            q,
            k,
            v,
            k_cache,
            v_cache,
            *batch.metadata,
            int(mode),
            sliding_window=9,
            prefill_backend=backend,
            decode_backend=backend,
            speculative_attention_mode="decode",
        )
        start = 0
        for rid, n in zip(live, new):
            keys, values = history[rid]
            history[rid] = torch.cat([keys, k[start : start + n]]), torch.cat([values, v[start : start + n]])
            if steps % 7 == 0 and n:
                keys, values = history[rid]
                ref = dense_attention(q[start : start + n], keys, values, keys.shape[0] - n, sliding_window=9)
                assert_close(out[start : start + n], ref, torch.float32)
                checked += 1
            start += n
        if mode == ForwardMode.TARGET_VERIFY:  # reject a random number of draft tokens
            for rid in live:
                keep = cache.seq_len(rid) - rng.randint(0, draft)
                cache.truncate(rid, keep)
                history[rid] = tuple(t[:keep] for t in history[rid])
        for rid in [r for r in live if cache.seq_len(r) > 50 or rng.random() < 0.03]:
            cache.free(rid)
            live.remove(rid)
    for rid in live:
        cache.free(rid)
    assert cache.num_free_pages == cache.num_pages and not cache.requests
    assert checked >= num_steps // 10, checked
