"""PagedKVCache: allocation, metadata, and several steps of ops over it against the reference."""

import random

import pytest
import torch
from reference import assert_close, dense_attention

from hybrid_ops import ForwardMode, HybridInputError, PagedKVCache


def test_metadata_from_steps():
    cache = PagedKVCache(num_pages=10, page_size=4, num_kv_heads=1, head_dim=8, max_pages_per_request=5)
    for rid in "abc":
        cache.add(rid)
    batch = cache.step(["a", "b", "c"], [5, 0, 4])
    assert batch.cu_seqlens_q.tolist() == [0, 5, 5, 9]
    assert batch.seq_lens.tolist() == [5, 0, 4]
    assert batch.block_table.shape == (3, 5) and batch.block_table.dtype == torch.int32
    assert batch.block_table[0, :2].tolist() == [0, 1] and batch.block_table[2, 0].item() == 2
    batch = cache.step(["a", "c"], [1, 1], ForwardMode.DECODE)
    assert batch.forward_mode == ForwardMode.DECODE and batch.seq_lens.tolist() == [6, 5]
    assert batch.block_table[1, :2].tolist() == [2, 3]
    assert cache.num_free_pages == 10 - 4
    cache.truncate("a", 4)
    assert cache.seq_len("a") == 4 and cache.num_free_pages == 7
    cache.free("a")
    cache.free("c")
    assert cache.num_free_pages == 10 and cache.requests == ["b"]


def test_static_addresses():
    cache = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=8, num_layers=3)
    for t in cache.k_caches + cache.v_caches:
        assert getattr(t, "_dynamo_static_input_type", None) is not None
    assert cache.layer(2)[0] is cache.k_caches[2]


def test_per_layer_shapes():
    """Layers of their own KV heads and head dims, V's apart from K's (MLA); one page allocation for all."""
    cache = PagedKVCache(num_pages=5, page_size=2, num_kv_heads=1, head_dim=8, v_head_dim=4, num_layers=2)
    assert [(k.shape, v.shape) for k, v in zip(cache.k_caches, cache.v_caches)] == [((5, 2, 1, 8), (5, 2, 1, 4))] * 2
    cache = PagedKVCache(num_pages=5, page_size=2, num_kv_heads=1, head_dim=8, layer_shapes=[(2, 8, 8), (4, 16, 12)])
    assert [(k.shape[2:], v.shape[2:]) for k, v in zip(cache.k_caches, cache.v_caches)] == [
        ((2, 8), (2, 8)), ((4, 16), (4, 12))]
    with pytest.raises(HybridInputError, match="layer 1's v_head_dim must be a positive int, got 0"):
        PagedKVCache(num_pages=5, page_size=2, num_kv_heads=1, head_dim=8, layer_shapes=[(2, 8, 8), (4, 16, 0)])


def test_generation_over_the_cache():
    """Requests arrive, prefill in chunks, decode, and finish, over two layers; every output against the reference
    built from the tokens each request has seen."""
    rng = random.Random(0)
    torch.manual_seed(0)
    cache = PagedKVCache(num_pages=40, page_size=3, num_kv_heads=2, head_dim=8, num_layers=2,
                         max_pages_per_request=12)
    history = {}  # (layer, request) -> (keys, values) so far
    live = []
    for step in range(30):
        if len(live) < 4 and rng.random() < 0.5:
            rid = step
            cache.add(rid)
            live.append(rid)
            for layer in range(2):
                history[layer, rid] = (torch.zeros(0, 2, 8), torch.zeros(0, 2, 8))
        if not live:
            continue
        decode = rng.random() < 0.5
        new = [1 if decode else rng.randint(1, 5) for _ in live]
        mode = ForwardMode.DECODE if decode else ForwardMode.EXTEND
        batch = cache.step(live, new, mode)
        T = sum(new)
        for layer in range(2):
            q, k, v = torch.randn(T, 4, 8), torch.randn(T, 2, 8), torch.randn(T, 2, 8)
            out = torch.ops.hybrid.attn(q, k, v, *cache.layer(layer), *batch.metadata, int(mode))
            start = 0
            for rid, n in zip(live, new):
                keys, values = history[layer, rid]
                keys, values = torch.cat([keys, k[start : start + n]]), torch.cat([values, v[start : start + n]])
                history[layer, rid] = keys, values
                ref = dense_attention(q[start : start + n], keys, values, keys.shape[0] - n)
                assert_close(out[start : start + n], ref, torch.float32)
                start += n
        done = [rid for rid in live if cache.seq_len(rid) > 20]
        for rid in done:
            cache.free(rid)
            live.remove(rid)
    for rid in live:
        cache.free(rid)
    assert cache.num_free_pages == 40


def test_truncate_off_a_page_boundary_keeps_the_partly_filled_page():
    """Rejected draft tokens cut a request mid-page: that page stays the request's (a request added next gets
    other pages), its kept rows are still read, and the next token lands in it."""
    cache = PagedKVCache(num_pages=6, page_size=4, num_kv_heads=2, head_dim=8, max_pages_per_request=4)
    keys, values = torch.zeros(0, 2, 8), torch.zeros(0, 2, 8)
    cache.add("a")
    for n, mode in ((7, ForwardMode.EXTEND), (3, ForwardMode.TARGET_VERIFY)):
        batch = cache.step(["a"], [n], mode)
        q, k, v = torch.randn(n, 4, 8), torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        torch.ops.hybrid.attn(q, k, v, *cache.layer(0), *batch.metadata, int(mode))
        keys, values = torch.cat([keys, k]), torch.cat([values, v])
    cache.truncate("a", 6)  # page 0 full, page 1 holds 2 of its 4 rows, page 2 freed
    keys, values = keys[:6], values[:6]
    assert cache.seq_len("a") == 6 and cache.num_free_pages == 6 - 2
    a_pages = batch.block_table[0, :2].tolist()

    cache.add("b")
    batch = cache.step(["b"], [8])
    assert not set(batch.block_table[0, :2].tolist()) & set(a_pages)
    torch.ops.hybrid.attn(torch.randn(8, 4, 8), torch.randn(8, 2, 8), torch.randn(8, 2, 8), *cache.layer(0),
                          *batch.metadata, int(ForwardMode.EXTEND))

    batch = cache.step(["a"], [1], ForwardMode.DECODE)
    assert batch.block_table[0, :2].tolist() == a_pages
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    out = torch.ops.hybrid.attn(q, k, v, *cache.layer(0), *batch.metadata, int(ForwardMode.DECODE))
    assert_close(out, dense_attention(q, torch.cat([keys, k]), torch.cat([values, v]), 6), torch.float32)
