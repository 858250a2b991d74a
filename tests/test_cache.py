"""PagedKVCache: allocation, metadata, and several steps of ops over it against the reference; shared pages (fork,
copy on write) and the prefix cache."""

import random
import re
import sys
import zlib
from collections import Counter

import pytest
import torch
from helpers.reference import assert_close, dense_attention, from_fp8, to_fp8

from hybrid_ops import ForwardMode, HybridInputError, OutOfPagesError, PagedKVCache


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
        ((2, 8), (2, 8)),
        ((4, 16), (4, 12)),
    ]
    with pytest.raises(HybridInputError, match="layer 1's v_head_dim must be a positive int, got 0"):
        PagedKVCache(num_pages=5, page_size=2, num_kv_heads=1, head_dim=8, layer_shapes=[(2, 8, 8), (4, 16, 0)])


def test_generation_over_the_cache():
    """Requests arrive, prefill in chunks, decode, and finish, over two layers; every output against the reference
    built from the tokens each request has seen."""
    rng = random.Random(0)
    torch.manual_seed(0)
    cache = PagedKVCache(num_pages=40, page_size=3, num_kv_heads=2, head_dim=8, num_layers=2, max_pages_per_request=12)
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
    torch.ops.hybrid.attn(
        torch.randn(8, 4, 8),
        torch.randn(8, 2, 8),
        torch.randn(8, 2, 8),
        *cache.layer(0),
        *batch.metadata,
        int(ForwardMode.EXTEND),
    )

    batch = cache.step(["a"], [1], ForwardMode.DECODE)
    assert batch.block_table[0, :2].tolist() == a_pages
    q, k, v = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    out = torch.ops.hybrid.attn(q, k, v, *cache.layer(0), *batch.metadata, int(ForwardMode.DECODE))
    assert_close(out, dense_attention(q, torch.cat([keys, k]), torch.cat([values, v]), 6), torch.float32)


# Shared pages and the prefix cache.


def check_pages(cache):
    """Every page is exactly one of: held (its count = the number of block tables listing it), unused, or cached; so
    held + unused + cached pages = num_pages, and num_free_pages counts the last two."""
    held = Counter(page for rid in cache.requests for page in cache.pages(rid))
    unused, cached = list(cache.pool.unused), list(cache.prefix.evictable)
    assert sorted([*held, *unused, *cached]) == list(range(cache.num_pages))
    assert [cache.pool.refs[page] for page in range(cache.num_pages)] == [held[page] for page in range(cache.num_pages)]
    assert cache.num_free_pages == len(unused) + len(cached) == cache.num_pages - len(held)
    assert cache.num_evictable_pages == len(cached)
    return held


def write_tokens(cache, request_id, num_tokens):
    """One step of `num_tokens` new tokens for one request, written through the op in every layer -> the step's
    (k, v) per layer, each [num_tokens, Hkv, D]."""
    batch = cache.step([request_id], [num_tokens])
    written = []
    for layer in range(len(cache.k_caches)):
        q, k, v = torch.randn(num_tokens, 4, 8), torch.randn(num_tokens, 2, 8), torch.randn(num_tokens, 2, 8)
        torch.ops.hybrid.attn(q, k, v, *cache.layer(layer), *batch.metadata, int(ForwardMode.EXTEND))
        written.append((k, v))
    return written


def test_fork_shares_full_pages_and_copies_the_partly_filled_one():
    """A child forked at 10 tokens (pages of 4) reads its parent's pages; its first new token lands in a copy of the
    partly filled third page, in every layer's k and v; afterwards each reads its own keys only."""
    cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, num_layers=2, max_pages_per_request=4)
    cache.add("parent")
    history = write_tokens(cache, "parent", 10)
    cache.fork("parent", "child")
    assert cache.pages("child") == cache.pages("parent") and cache.seq_len("child") == 10
    assert cache.num_free_pages == 8 - 3
    parent_pages = cache.pages("parent")

    batch = cache.step(["child"], [1], ForwardMode.DECODE)
    child_pages = cache.pages("child")
    assert child_pages[:2] == parent_pages[:2] and child_pages[2] not in parent_pages
    assert batch.block_table[0, :3].tolist() == child_pages and cache.num_free_pages == 8 - 4
    for layer, (k, v) in enumerate(history):
        for cached, dense in zip(cache.layer(layer), (k, v)):
            assert torch.equal(cached[child_pages[2], :2], dense[8:10])
            assert torch.equal(cached[parent_pages[2], :2], dense[8:10])
    for layer, (k, v) in enumerate(history):  # the child's token, written and read through the op
        q, k1, v1 = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
        out = torch.ops.hybrid.attn(q, k1, v1, *cache.layer(layer), *batch.metadata, int(ForwardMode.DECODE))
        assert_close(out, dense_attention(q, torch.cat([k, k1]), torch.cat([v, v1]), 10), torch.float32)
        assert torch.equal(cache.layer(layer)[0][child_pages[2], 2], k1[0])

    batch = cache.step(["parent"], [1], ForwardMode.DECODE)  # now the page's only holder: it writes in place
    assert cache.pages("parent") == parent_pages
    for layer, (k, v) in enumerate(history):
        q, k1, v1 = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
        out = torch.ops.hybrid.attn(q, k1, v1, *cache.layer(layer), *batch.metadata, int(ForwardMode.DECODE))
        assert_close(out, dense_attention(q, torch.cat([k, k1]), torch.cat([v, v1]), 10), torch.float32)
    check_pages(cache)
    cache.free("parent")
    assert cache.num_free_pages == 8 - 3  # the child still holds the two shared pages and its copy
    cache.free("child")
    assert cache.num_free_pages == 8 and check_pages(cache) == Counter()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_keeps_its_scales_and_copies_pages_bit_for_bit(dtype):
    """An fp8 cache: a scale tensor per layer and role, the ops' keywords from `scales`; the store's bytes are the
    quantized rows, a forked request's copy on write keeps them, and attention reads them back times the scale."""
    cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, num_layers=2, dtype=dtype, kv_scale=0.25)
    assert PagedKVCache(4, 4, 2, 8).scales(0) == {}
    scales = [cache.scales(layer) for layer in range(2)]
    assert all(s.dtype == torch.float32 and s.shape == () and s.item() == 0.25 for d in scales for s in d.values())
    assert len({id(s) for d in scales for s in d.values()}) == 4  # one tensor each: set one, the others keep theirs
    cache.add("parent")
    batch = cache.step(["parent"], [10])
    history = []
    for layer in range(2):
        q, k, v = torch.randn(10, 4, 8), torch.randn(10, 2, 8) * 3, torch.randn(10, 2, 8) * 3
        torch.ops.hybrid.attn(
            q,
            k,
            v,
            *cache.layer(layer),
            *batch.metadata,
            int(ForwardMode.EXTEND),
            **cache.scales(layer),
            prefill_backend="torch",
        )
        history.append((k, v))
    cache.fork("parent", "child")
    batch = cache.step(["child"], [1], ForwardMode.DECODE)
    page = cache.pages("child")[2]
    assert page not in cache.pages("parent")
    scale = torch.tensor(0.25)
    for layer, (k, v) in enumerate(history):
        for cached, rows in zip(cache.layer(layer), (k, v)):
            assert cached.dtype == dtype
            assert torch.equal(cached[page, :2].view(torch.uint8), to_fp8(rows[8:10], scale, dtype).view(torch.uint8))
        q, k1, v1 = torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8)
        out = torch.ops.hybrid.attn(
            q, k1, v1, *cache.layer(layer), *batch.metadata, int(ForwardMode.DECODE), **cache.scales(layer)
        )
        keys, values = (from_fp8(to_fp8(torch.cat(x), scale, dtype), scale) for x in ((k, k1), (v, v1)))
        assert_close(out, dense_attention(q, keys, values, 10), torch.float32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(dtype=torch.int8),
            "dtype must be a floating-point torch.dtype (float8_e4m3fn and float8_e5m2 included), got torch.int8",
        ),
        (dict(dtype="bf16"), "dtype must be a floating-point torch.dtype"),
        (dict(dtype=torch.float8_e4m3fn, kv_scale=0.0), "kv_scale must be a finite positive float, got 0.0"),
        (dict(dtype=torch.float8_e5m2, kv_scale=float("nan")), "kv_scale must be a finite positive float, got nan"),
    ],
)
def test_bad_cache_dtype_or_scale(kwargs, message):
    with pytest.raises(HybridInputError, match=re.escape(message)):
        PagedKVCache(4, 4, 2, 8, **kwargs)


def test_truncating_into_a_shared_or_cached_page_copies_it_before_writing():
    cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, max_pages_per_request=4)
    tokens = list(range(1, 13))
    cache.add("a")
    ((k, v),) = write_tokens(cache, "a", 12)
    cache.register_tokens("a", tokens)
    pages = cache.pages("a")
    k_cache, v_cache = cache.layer(0)
    cache.fork("a", "b")
    cache.truncate("b", 6)  # into the second page, which "a" holds too
    assert cache.pages("b") == pages[:2]
    ((k_b, _),) = write_tokens(cache, "b", 1)
    assert cache.pages("b")[0] == pages[0] and cache.pages("b")[1] not in pages
    assert torch.equal(k_cache[cache.pages("b")[1], :3], torch.cat([k[4:6], k_b]))
    assert torch.equal(k_cache[pages[1]], k[4:8]) and cache.pages("a") == pages
    cache.free("b")

    cache.truncate("a", 6)  # "a" alone, but its second page is a cached prefix page: it stays as it is
    assert cache.num_evictable_pages == 1  # the third page, no longer held
    write_tokens(cache, "a", 1)
    assert cache.pages("a")[1] not in pages and cache.num_evictable_pages == 2
    assert cache.match(tokens) == pages
    assert torch.equal(k_cache[pages[1]], k[4:8]) and torch.equal(v_cache[pages[2]], v[8:12])
    check_pages(cache)


def run_and_free(cache, request_id, tokens):
    """A request that writes `tokens`, registers them and finishes -> the pages it held."""
    cache.add(request_id)
    write_tokens(cache, request_id, len(tokens))
    cache.register_tokens(request_id, tokens)
    pages = cache.pages(request_id)
    cache.free(request_id)
    return pages


def test_a_finished_requests_pages_serve_a_later_prefix_until_evicted():
    """Its full pages stay cached (counted as free) and a later request with the same first tokens starts on them;
    when the allocator runs out of unused pages it evicts the least recently released, which never match again."""
    cache = PagedKVCache(num_pages=6, page_size=4, num_kv_heads=2, head_dim=8)
    prompt = list(range(1, 12))  # two full pages and 3 tokens
    pages = run_and_free(cache, "a", prompt)
    k = cache.layer(0)[0][pages[:2]].clone()
    assert cache.num_free_pages == 6 and cache.num_evictable_pages == 2
    assert cache.add("b", prompt + [20, 21]) == 8 and cache.pages("b") == pages[:2]
    assert cache.num_free_pages == 4 and cache.num_evictable_pages == 0 and cache.seq_len("b") == 8
    write_tokens(cache, "b", 3)
    assert cache.pages("b")[:2] == pages[:2]
    assert torch.equal(cache.layer(0)[0][pages[:2]], k)
    cache.free("b")  # b registered nothing past the 8 tokens it started with: only those two pages are cached
    assert cache.add("c", prompt) == 8
    cache.free("c")

    cache.add("d")
    write_tokens(cache, "d", 17)  # 5 pages: the 4 unused ones, then the second cached page (released first)
    assert cache.match(prompt) == pages[:1] and cache.num_evictable_pages == 1
    write_tokens(cache, "d", 4)
    assert cache.match(prompt) == [] and cache.num_evictable_pages == 0 and cache.num_free_pages == 0
    with pytest.raises(OutOfPagesError):
        write_tokens(cache, "d", 4)
    cache.free("d")
    assert cache.add("e", prompt) == 0 and cache.num_free_pages == 6
    check_pages(cache)


def test_keys_are_exact_token_chains():
    """A page is matched only after the same pages before it, by its exact token ids: prompts sharing their first page
    share only that one, and ids whose Python hashes collide are told apart."""
    cache = PagedKVCache(num_pages=8, page_size=2, num_kv_heads=2, head_dim=8)
    first = run_and_free(cache, "a", [1, 2, 3, 4])
    assert cache.match([1, 2, 5, 6]) == first[:1]
    assert cache.match([5, 6, 3, 4]) == []  # the second page's ids after another first page: another key
    assert cache.match([1, 2, 3]) == first[:1]  # only full pages
    collision = 1 + sys.hash_info.modulus
    assert hash((collision, 2)) == hash((1, 2)) and cache.match([collision, 2, 3, 4]) == []

    # The same tokens computed twice at once: the first registered copy is the cached one, the other is just freed.
    cache.add("b")
    cache.add("c")
    for rid in "bc":
        write_tokens(cache, rid, 4)
        cache.register_tokens(rid, [7, 8, 9, 10])
    b_pages = cache.pages("b")
    cache.free("b")
    cache.free("c")
    assert cache.match([7, 8, 9, 10]) == b_pages and cache.num_evictable_pages == 4
    check_pages(cache)


def test_bad_fork_and_registration_leave_the_cache_unchanged():
    cache = PagedKVCache(num_pages=4, page_size=4, num_kv_heads=2, head_dim=8)
    cache.add("a")
    write_tokens(cache, "a", 5)
    cache.add("b")

    def state():
        return [(rid, cache.pages(rid), cache.seq_len(rid)) for rid in cache.requests], cache.num_free_pages

    before = state()
    for call, message in [
        (lambda: cache.fork("x", "c"), "parent 'x' is not in the cache (never added, or freed already)"),
        (lambda: cache.fork("a", "b"), "child 'b' is in the cache already"),
        (lambda: cache.fork("a", "a"), "child 'a' is in the cache already"),
        (lambda: cache.add("a", [1, 2, 3, 4]), "request_id 'a' is in the cache already"),
        (
            lambda: cache.register_tokens("a", [1] * 6),
            "token_ids: 6 ids after the 0 registered exceed the 5 tokens of request 'a'",
        ),
        (lambda: cache.register_tokens("x", [1]), "request_id 'x' is not in the cache (never added, or freed already)"),
    ]:
        with pytest.raises(HybridInputError) as error:
            call()
        assert str(error.value) == message
        assert state() == before
    check_pages(cache)


def kv_row(tokens) -> float:
    """What a model writes at the last of `tokens`: it depends on every token before it, as K/V do."""
    return float(zlib.crc32(bytes(tokens)) % 1_000_003)


def test_random_requests_share_pages_and_never_write_what_another_reads():
    """400 random operations over a small cache: add (prompts sharing prefixes, so some start on cached pages), fork,
    step (then register the tokens), truncate and free. After each: pages are conserved (`check_pages`) and every
    request reads, in every layer's k and v, the rows of its own tokens; at each step the new tokens land only in
    pages their request alone holds and no key describes."""
    size, vocab = 3, (1, 3)
    cache = PagedKVCache(
        num_pages=20, page_size=size, num_kv_heads=1, head_dim=1, num_layers=2, max_pages_per_request=8
    )
    capacity = 8 * size
    stem = [random.randint(*vocab) for _ in range(12)]
    tokens = {}  # request id -> its tokens in the cache
    seen = Counter()
    for op in range(400):
        live = list(tokens)
        action = random.choice(["add", "fork", "step", "step", "step", "truncate", "free"]) if live else "add"
        if action in ("add", "fork") and len(live) >= 6:
            action = "free"
        if action == "add":
            prompt = stem[: random.randint(0, 12)] + [random.randint(*vocab) for _ in range(random.randint(0, 6))]
            start = cache.add(op, prompt)
            assert start % size == 0 and start <= len(prompt)
            tokens[op] = prompt[:start]
            seen["started on cached pages"] += start > 0
        elif action == "fork":
            parent = random.choice(live)
            cache.fork(parent, op)
            tokens[op] = list(tokens[parent])
        elif action == "step":
            ids = random.sample(live, random.randint(1, len(live)))
            new = {
                rid: [random.randint(*vocab) for _ in range(random.randint(0, min(4, capacity - len(tokens[rid]))))]
                for rid in ids
            }
            before = {rid: (cache.pages(rid), cache.seq_len(rid)) for rid in live}
            cached = cache.num_evictable_pages
            try:
                batch = cache.step(ids, [len(new[rid]) for rid in ids])
            except OutOfPagesError:
                assert {rid: (cache.pages(rid), cache.seq_len(rid)) for rid in live} == before
                seen["refused"] += 1
                continue
            seen["evicted"] += cache.num_evictable_pages < cached
            held = check_pages(cache)
            for i, rid in enumerate(ids):
                table = batch.block_table[i].tolist()
                assert table[: len(cache.pages(rid))] == cache.pages(rid)
                seen["copied"] += cache.pages(rid)[: len(before[rid][0])] != before[rid][0]
                for token in new[rid]:
                    position = len(tokens[rid])
                    page = table[position // size]
                    assert held[page] == 1 and page not in cache.prefix
                    tokens[rid].append(token)
                    for layer, (k_cache, v_cache) in enumerate(zip(cache.k_caches, cache.v_caches)):
                        k_cache[page, position % size] = kv_row(tokens[rid]) + layer
                        v_cache[page, position % size] = -kv_row(tokens[rid]) - layer
                cache.register_tokens(rid, new[rid])
        elif action == "truncate":
            rid = random.choice(live)
            keep = random.randint(0, len(tokens[rid]))
            cache.truncate(rid, keep)
            del tokens[rid][keep:]
        else:
            rid = random.choice(live)
            cache.free(rid)
            del tokens[rid]
        check_pages(cache)
        for rid, ids in tokens.items():
            assert cache.seq_len(rid) == len(ids)
            positions = torch.arange(len(ids))
            pages = torch.tensor(cache.pages(rid), dtype=torch.long)[positions // size]
            rows = torch.tensor([kv_row(ids[: p + 1]) for p in range(len(ids))])
            for layer, (k_cache, v_cache) in enumerate(zip(cache.k_caches, cache.v_caches)):
                assert torch.equal(k_cache[pages, positions % size, 0, 0], rows + layer)
                assert torch.equal(v_cache[pages, positions % size, 0, 0], -rows - layer)
    assert min(seen[k] for k in ("started on cached pages", "refused", "evicted", "copied")) > 0, seen
    for rid in tokens:
        cache.free(rid)
    assert cache.num_free_pages == cache.num_pages and check_pages(cache) == Counter()


# Speculative trees: the accepted path's K/V kept in place of the tree's.


def filled_cache(dtype, num_pages=24):
    """A cache of three layers of different shapes, its pages filled with random rows (fp8: random bytes)."""
    cache = PagedKVCache(
        num_pages=num_pages,
        page_size=4,
        num_kv_heads=2,
        head_dim=8,
        layer_shapes=[(2, 8, 8), (1, 16, 4), (2, 8, 8)],
        max_pages_per_request=8,
        dtype=dtype,
    )
    for t in cache.k_caches + cache.v_caches:
        t.view(torch.uint8).copy_(torch.randint(0, 120, t.view(torch.uint8).shape, dtype=torch.uint8))
    return cache


def rows_of(cache, request_id):
    """Per cache tensor, the request's rows in position order: [seq_len, Hkv, D] as bytes."""
    pages = torch.tensor(cache.pages(request_id), dtype=torch.long)
    positions = torch.arange(cache.seq_len(request_id))
    return [
        t.view(torch.uint8)[pages[positions // cache.page_size], positions % cache.page_size]
        for t in cache.k_caches + cache.v_caches
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("prefix, num_new, indices", [(6, 9, [0, 2, 5]), (8, 5, [0, 1, 2, 3, 4]), (3, 12, [0, 4, 11]),
                                                      (5, 7, [0]), (0, 6, [0, 1, 3])])  # fmt: skip
def test_keep_matches_a_cache_of_the_accepted_tokens_only(dtype, prefix, num_new, indices):
    """The path's rows end at consecutive slots after the prefix, in every layer, as in a cache where only they were
    written; the pages past them return to the allocator; a request forked before the step (sharing the prefix's
    pages) and one forked after it (sharing the tree's) read what they read before."""
    cache = filled_cache(dtype)
    cache.add("a")
    cache.step(["a"], [prefix])
    cache.fork("a", "before")
    cache.step(["a"], [num_new])  # the verify step: its tokens' rows are the random ones written above
    cache.fork("a", "after")
    rows, others = rows_of(cache, "a"), {rid: rows_of(cache, rid) for rid in ("before", "after")}
    cache.keep("a", num_new, indices)

    kept = list(range(prefix)) + [prefix + i for i in indices]
    assert cache.seq_len("a") == prefix + len(indices)
    for got, before in zip(rows_of(cache, "a"), rows):
        assert torch.equal(got, before[kept])
    for rid, before in others.items():
        assert all(torch.equal(got, old) for got, old in zip(rows_of(cache, rid), before)), rid
    held = check_pages(cache)
    assert len(cache.pages("a")) == -(-(prefix + len(indices)) // 4)
    for rid in ("a", "before", "after"):
        cache.free(rid)
    assert cache.num_free_pages == cache.num_pages and check_pages(cache) == Counter() and held


def test_keep_then_register_serves_the_path_as_a_prefix():
    """After `keep`, the kept tokens are registered again; a later request with that prompt starts on the pages
    holding the path's rows, and the pages keyed before (the tree's) are never written."""
    cache = filled_cache(torch.float32)
    cache.add("a")
    cache.step(["a"], [4])
    cache.register_tokens("a", [1, 2, 3, 4])
    cache.step(["a"], [8])
    cache.register_tokens("a", [5, 6, 7, 8, 9, 10, 11, 12])  # the tree's tokens, keyed as a chain: pages 2 and 3
    tree_pages = cache.pages("a")[1:]
    keyed = {page: [t[page].clone() for t in cache.k_caches + cache.v_caches] for page in tree_pages}
    rows = rows_of(cache, "a")
    cache.keep("a", 8, [0, 3, 4, 6])  # tokens 5, 8, 9, 11
    cache.register_tokens("a", [5, 8, 9, 11])
    for page, before in keyed.items():
        assert all(torch.equal(t[page], old) for t, old in zip(cache.k_caches + cache.v_caches, before))
    assert cache.add("b", [1, 2, 3, 4, 5, 8, 9, 11, 0]) == 8
    for got, old in zip(rows_of(cache, "b"), rows):
        assert torch.equal(got, old[[0, 1, 2, 3, 4, 7, 8, 10]])
    check_pages(cache)


@pytest.mark.parametrize(
    "num_new, indices, message",
    [
        (9, [0, 2, 5], r"num_new_tokens must be an int in \[0, 8\], got 9"),
        (4, [0, 2, 2], r"indices must be increasing ints in \[0, 4\) \(of the last new tokens\), got \[0, 2, 2\]"),
        (4, [0, 4], r"indices must be increasing ints in \[0, 4\)"),
        (4, [1, 0], r"indices must be increasing ints"),
        (4, [0, 1.0], r"indices must be increasing ints"),
    ],
)
def test_bad_keep_changes_nothing(num_new, indices, message):
    cache = filled_cache(torch.float32)
    cache.add("a")
    cache.step(["a"], [8])
    rows, pages = rows_of(cache, "a"), cache.pages("a")
    with pytest.raises(HybridInputError, match=message):
        cache.keep("a", num_new, indices)
    assert cache.pages("a") == pages and all(torch.equal(a, b) for a, b in zip(rows_of(cache, "a"), rows))
