"""Batch buckets: padding requests over the scratch page never change a real request's output or pages."""

import pytest
import torch
from helpers.models import tiny_model
from helpers.reference import BACKENDS, assert_close, expected_cache, make_case, reference

import hybrid_ops
from hybrid_ops import (
    ForwardBatch,
    ForwardMode,
    GenerationStats,
    HybridGenerator,
    HybridInputError,
)
from hybrid_ops.buckets import UNIFORM_MODES, batch_buckets, bucket_for, pad_batch, padding_q_lens, token_buckets

PAGE = 4
BATCH_SIZES, NUM_TOKENS = [2, 8], [8, 32]
# Real batches per mode: uniform query lengths where the decode path may serve the mode.
Q_LENS = {
    ForwardMode.EXTEND: [5, 1, 0, 9],
    ForwardMode.MIXED: [7, 1, 1, 6],
    ForwardMode.DECODE: [1, 1, 1],
    ForwardMode.IDLE: [],
    ForwardMode.TARGET_VERIFY: [3, 3, 3],
    ForwardMode.DRAFT_EXTEND_V2: [2, 2, 2],
    ForwardMode.SPLIT_PREFILL: [4, 0, 2, 1],
}
PREFIXES = [6, 0, 9, 3]
# (mode, speculative_attention_mode): each path every mode can take.
ROUTES = [
    (ForwardMode.EXTEND, "prefill"),
    (ForwardMode.MIXED, "prefill"),
    (ForwardMode.DECODE, "decode"),
    (ForwardMode.IDLE, "decode"),
    (ForwardMode.TARGET_VERIFY, "prefill"),
    (ForwardMode.TARGET_VERIFY, "decode"),
    (ForwardMode.DRAFT_EXTEND_V2, "prefill"),
    (ForwardMode.SPLIT_PREFILL, "prefill"),
]


def test_bucket_lists():
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_buckets(35) == [1, 2, 4, 8, 16, 24, 32, 35]
    assert batch_buckets(3) == [1, 2, 3]
    assert token_buckets(200) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 200]
    assert [bucket_for([2, 8], n) for n in (0, 2, 3, 8)] == [2, 2, 8, 8]
    with pytest.raises(HybridInputError, match="size 9 is larger than the largest bucket 8"):
        bucket_for([2, 8], 9)


def test_padding_q_lens():
    # Uniform modes: the real query length, up to the batch bucket.
    assert padding_q_lens([1, 1, 1], ForwardMode.DECODE, [2, 8], [8], 4) == [1] * 5
    assert padding_q_lens([3, 3], ForwardMode.TARGET_VERIFY, [2, 8], [8], 4) == []
    assert padding_q_lens([], ForwardMode.IDLE, [2, 8], [8], 4) == [0, 0]
    # Ragged modes: tokens to their bucket, spread over the smallest batch bucket with room (<= 5 each).
    assert padding_q_lens([5, 1, 0, 9], ForwardMode.EXTEND, [2, 8], [8, 32], 48) == [5, 4, 4, 4]
    assert padding_q_lens([3, 4], ForwardMode.MIXED, [2, 3, 8], [8], 5) == [1]
    assert padding_q_lens([2, 4], ForwardMode.MIXED, [2, 3, 8], [8], 1) == [1, 1, 0, 0, 0, 0]
    assert padding_q_lens([4, 4], ForwardMode.EXTEND, [2, 3], [8], 1) == []
    with pytest.raises(HybridInputError, match="11 padding tokens for 2 requests fit no batch bucket up to 3"):
        padding_q_lens([20, 1], ForwardMode.EXTEND, [2, 3], [32], 8)
    batch = ForwardBatch(ForwardMode.EXTEND, *make_case([3], [2], page_size=PAGE).args[5:])
    with pytest.raises(
        HybridInputError, match="a padding request of 13 tokens exceeds block_table's capacity of 3 pages x 4 tokens"
    ):
        pad_batch(batch, [13], 9, PAGE)


def padded_case(mode, seed):
    """A real batch with one more page (the scratch page, random) appended to its caches."""
    q_lens = Q_LENS[mode]
    case = make_case(q_lens, PREFIXES[: len(q_lens)], page_size=PAGE, seed=seed)
    scratch = torch.randn(1, *case.k_cache.shape[1:])
    case.k_cache, case.v_cache = torch.cat([case.k_cache, scratch]), torch.cat([case.v_cache, scratch + 1])
    return case, case.k_cache.shape[0] - 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode, spec", ROUTES)
def test_padding_changes_no_real_output_or_page(backend, mode, spec):
    """The padded batch's real rows match the float64 reference, and with `set_deterministic(True)` equal the unpadded
    call's bit for bit (only then is a request's output promised to be batch-invariant: without it the torch
    backend's batched decode blocks its products by the batch's shape); every page but the scratch page ends as the
    unpadded call leaves it; the padding did write the scratch page."""
    case, scratch = padded_case(mode, seed=int(mode))
    real = ForwardBatch(mode, case.cu_seqlens_q, case.seq_lens, case.block_table)
    capacity = case.block_table.shape[1] * PAGE
    pad = padding_q_lens(case.q_lens, mode, BATCH_SIZES, NUM_TOKENS, capacity)
    padded = pad_batch(real, pad, scratch, PAGE)
    assert padded.batch_size in BATCH_SIZES
    num_real, extra = sum(case.q_lens), sum(pad)
    if mode in UNIFORM_MODES:
        assert pad == [(case.q_lens or [0])[0]] * (padded.batch_size - len(case.q_lens))
    else:
        assert num_real + extra in NUM_TOKENS
    options = dict(prefill_backend=backend, decode_backend=backend, speculative_attention_mode=spec, sliding_window=7)
    caches, outs = {}, {}
    padding_rows = {
        name: tuple(torch.randn(rows, *t.shape[1:]) for t in (case.q, case.k, case.v))
        for name, rows in (("real", 0), ("padded", extra))
    }
    for deterministic in (False, True):
        with hybrid_ops.set_deterministic(deterministic):
            for name, batch in (("real", real), ("padded", padded)):
                k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
                q, k, v = (torch.cat([t, rows]) for t, rows in zip((case.q, case.k, case.v), padding_rows[name]))
                outs[name, deterministic] = torch.ops.hybrid.attn(
                    q, k, v, k_cache, v_cache, *batch.metadata, int(mode), **options
                )
                caches[name] = k_cache, v_cache
    want = reference(case, sliding_window=7)
    for name in ("real", "padded"):
        for deterministic in (False, True):
            assert outs[name, deterministic].shape[0] == num_real + (extra if name == "padded" else 0)
            assert_close(outs[name, deterministic][:num_real], want, torch.float32)
    assert torch.equal(outs["padded", True][:num_real], outs["real", True])
    for want, real_cache, padded_cache, before in zip(
        expected_cache(case), caches["real"], caches["padded"], (case.k_cache, case.v_cache)
    ):
        assert torch.equal(real_cache, want)
        assert torch.equal(padded_cache[:scratch], want[:scratch])
        assert torch.equal(padded_cache[scratch], before[scratch]) == (extra == 0)


def count_shapes(generator):
    """Wraps the generator's forward to collect the input shapes of every call; returns the list."""
    shapes, forward = [], generator.runner.forward

    def forward_counting(*args):
        shapes.append(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        return forward(*args)

    generator.runner.forward = forward_counting
    return shapes


@pytest.mark.slow
def test_generator_pads_every_step_to_a_bucket(fresh_dynamo):
    """A long ragged run (requests joining and finishing, chunked prefills, MIXED steps): the padded, compiled
    forward meets only bucket shapes, and the tokens are the unpadded run's."""
    model = tiny_model()
    prompts = [
        [(5 * i + 3 * j) % 60 + 1 for j in range(n)] for i, n in enumerate([3, 17, 1, 9, 26, 6, 12, 2, 30, 5, 14, 7])
    ]
    options = dict(max_batch_size=4, max_seq_len=40, page_size=PAGE, prefill_chunk=10)
    plain = HybridGenerator(model, compile=False, **options)
    plain_shapes = count_shapes(plain)
    want = plain.generate(prompts, 8)
    padded = HybridGenerator(model, cuda_graphs=True, **options)
    assert padded.runner.token_counts == [1, 2, 4, 8, 14] and padded.runner.batch_sizes == [1, 2, 4, 5]
    shapes, stats = count_shapes(padded), GenerationStats()
    assert padded.generate(prompts, 8, stats=stats) == want
    assert set(stats.steps) == {"EXTEND", "MIXED", "DECODE"}
    used = set()
    for ids, positions, rows, cu_seqlens_q, seq_lens, block_table in shapes:
        num_tokens, bs = ids[1], seq_lens[0]
        assert positions == ids and rows == seq_lens and cu_seqlens_q == (bs + 1,) and block_table == (bs, 10)
        assert bs in padded.runner.batch_sizes and (num_tokens in padded.runner.token_counts or num_tokens == bs)
        used.add((num_tokens, bs))
    assert len(set(shapes)) == len(used) < len(set(plain_shapes))
    assert padded.cache.num_free_pages == padded.cache.num_pages
    sampled = dict(do_sample=True, temperature=0.8, seed=3)
    eager_padded = HybridGenerator(model, compile=False, cuda_graphs=True, **options)
    assert eager_padded.generate(prompts, 8, **sampled) == plain.generate(prompts, 8, **sampled)


def test_runner_refuses_to_pad_a_tree_step():
    """Padding requests would need rows of their own in the tree mask: a tree step is refused before it runs, and
    the runner serves the next step."""
    from hybrid_ops.generation.runner import ModelRunner

    model = tiny_model()
    num_kv_heads = model.config.num_key_value_heads
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    cache = hybrid_ops.PagedKVCache(16, 4, num_kv_heads, head_dim, num_layers=model.config.num_hidden_layers,
                                    max_pages_per_request=4, reserve_scratch=True)  # fmt: skip
    runner = ModelRunner(model, cache, 4, 16, 8, compile=False, cuda_graphs=True)
    cache.add("a")
    batch = cache.step(["a"], [3], ForwardMode.TARGET_VERIFY)
    batch.tree_mask = torch.ones(3, 3, dtype=torch.bool).tril()
    with pytest.raises(HybridInputError, match=r"a step with a tree_mask cannot be padded to buckets"):
        runner.run(batch, [3], [1, 2, 3], [0, 1, 2], [2])
    batch.tree_mask = None
    with torch.inference_mode():
        assert runner.run(batch, [3], [1, 2, 3], [0, 1, 2], [2]).shape == (1, model.config.vocab_size)
