"""`MetadataBuilder`: a step's ForwardBatch against values written plainly here, for random request lengths across
page boundaries, on its own and through `PagedKVCache.step`; the step's argument checks."""

import random
import re

import pytest
import torch

from hybrid_ops import ForwardMode, HybridInputError, OutOfPagesError, PagedKVCache
from hybrid_ops.metadata import new_token_slots
from hybrid_ops.metadata_builder import MetadataBuilder


def plain_batch(q_lens, seq_lens, page_lists, width):
    """(cu_seqlens_q, seq_lens, block_table) as lists: running sums of q_lens, and each row's pages then zeros."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return cu, list(seq_lens), [pages + [0] * (width - len(pages)) for pages in page_lists]


def check(batch, q_lens, seq_lens, page_lists, width, mode):
    cu, lens, table = plain_batch(q_lens, seq_lens, page_lists, width)
    assert batch.forward_mode == mode
    assert [t.dtype for t in batch.metadata] == [torch.int32] * 3
    assert batch.block_table.shape == (len(q_lens), width)
    assert batch.cu_seqlens_q.tolist() == cu and batch.seq_lens.tolist() == lens and batch.block_table.tolist() == table


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_build_from_random_lengths(page_size):
    """Requests of random prefixes and new-token counts, their pages random ids: the batch holds the plain values, and
    each new token's cache row (page of its position, then its row in that page) is where the batch places it."""
    max_pages = 6
    builder = MetadataBuilder(page_size, max_pages, "cpu", for_compile=False)
    for _ in range(20):
        batch_size = random.randint(1, 5)
        seq_lens = [random.randint(0, max_pages * page_size) for _ in range(batch_size)]
        q_lens = [random.randint(0, n) for n in seq_lens]
        page_lists = [random.sample(range(50), -(-n // page_size)) for n in seq_lens]
        mode = random.choice([ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
        batch = builder.build(q_lens, seq_lens, page_lists, mode)
        check(batch, q_lens, seq_lens, page_lists, max_pages, mode)
        rows = [
            pages[p // page_size] * page_size + p % page_size
            for pages, n, q in zip(page_lists, seq_lens, q_lens)
            for p in range(n - q, n)
        ]
        assert new_token_slots(*batch.metadata, sum(q_lens), page_size).tolist() == rows


def test_build_marks_the_table_width_for_compile_only():
    marked, unmarked = (MetadataBuilder(4, 3, "cpu", flag).build([2], [2], [[5]]) for flag in (True, False))
    assert marked.block_table._dynamo_static_indices == {1}
    assert not hasattr(unmarked.block_table, "_dynamo_static_indices")


def test_new_lengths_and_their_checks():
    builder = MetadataBuilder(4, 3, "cpu")
    lengths = {"a": 5, "b": 0, "c": 12}
    assert builder.new_lengths(["a", "b", "c"], [7, 4, 0], lengths.__getitem__) == [12, 4, 12]
    assert builder.new_lengths([], [], lengths.__getitem__) == []
    for args, error, message in [
        ((["a", "b"], [1]), HybridInputError, "num_new_tokens must have one entry per request (2), got 1"),
        ((["a", "a"], [1, 1]), HybridInputError, "request_ids must be distinct, got ['a', 'a']"),
        ((["a", "b"], [1, -1]), HybridInputError, "num_new_tokens must be non-negative ints, got -1 for request 'b'"),
        ((["b"], [1.0]), HybridInputError, "num_new_tokens must be non-negative ints, got 1.0 for request 'b'"),
        (
            (["a", "c"], [7, 1]),
            OutOfPagesError,
            "request 'c' needs 4 pages for 13 tokens, more than max_pages_per_request = 3",
        ),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            builder.new_lengths(*args, lengths.__getitem__)


def test_steps_over_the_cache_from_random_lengths():
    """Requests growing by random counts, none freed: pages are handed out in order, lowest id first, request after
    request, each as its tokens cross into it; every step's batch holds the plain values."""
    page_size, width = 4, 7
    cache = PagedKVCache(num_pages=40, page_size=page_size, num_kv_heads=1, head_dim=8, max_pages_per_request=width)
    lengths, pages, next_page = {}, {}, 0
    for rid in range(5):
        cache.add(rid)
        lengths[rid], pages[rid] = 0, []
    for _ in range(12):
        ids = random.sample(list(lengths), random.randint(1, len(lengths)))
        counts = [random.randint(0, min(6, width * page_size - lengths[rid])) for rid in ids]
        mode = random.choice([ForwardMode.EXTEND, ForwardMode.MIXED])
        batch = cache.step(ids, counts, mode)
        for rid, n in zip(ids, counts):
            lengths[rid] += n
            while len(pages[rid]) * page_size < lengths[rid]:
                pages[rid].append(next_page)
                next_page += 1
        check(batch, counts, [lengths[rid] for rid in ids], [pages[rid] for rid in ids], width, mode)
    assert cache.num_free_pages == 40 - next_page and next_page > width
