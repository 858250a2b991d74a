"""The page ids of a paged cache on their own: `PagePool` (allocation, reference counts, what is shared) and
`PrefixCache` (keyed chains of full pages, lookup, eviction of the least recently released)."""

import random

import pytest

from hybrid_ops import OutOfPagesError, PagedKVCache
from hybrid_ops.pages import PagePool, PrefixCache


def pool_of(num_pages, page_size=2):
    return PagePool(num_pages, PrefixCache(page_size))


def test_pool_hands_out_low_ids_first_until_exhausted():
    pool = pool_of(5)
    assert pool.num_free == 5
    got = []
    for left in (4, 3, 2, 1, 0):
        got.append(pool.allocate())
        assert pool.num_free == left
    assert got == [0, 1, 2, 3, 4] and pool.refs == [1] * 5
    with pytest.raises(OutOfPagesError, match="no page is free"):
        pool.allocate()
    assert pool.refs == [1] * 5 and pool.num_free == 0


def test_pool_counts_holds_and_frees_a_page_at_its_last_release():
    pool = pool_of(4)
    a, b = pool.allocate(), pool.allocate()
    pool.hold([a, a, b])  # three more holders: a held three times, b twice
    assert pool.refs == [3, 2, 0, 0] and pool.shared(a) and pool.shared(b)
    pool.release([a, b])
    assert pool.refs == [2, 1, 0, 0] and pool.shared(a) and not pool.shared(b)
    assert pool.num_free == 2  # a page still held is never free
    pool.release([b])
    assert pool.refs == [2, 0, 0, 0] and pool.num_free == 3
    assert pool.allocate() == b  # the page released last is handed out first
    pool.release([a, a, b])
    assert pool.refs == [0] * 4 and pool.num_free == 4


def test_pool_keeps_keyed_pages_cached_until_it_needs_them():
    """A keyed page is shared even with one holder; released, it is free but stays cached (its key still matches),
    and the pool evicts it only once no unused page is left."""
    pool = pool_of(3, page_size=2)
    prefix = pool.prefix
    pages = [pool.allocate(), pool.allocate()]
    prefix.register(pages, [5, 6, 7, 8], 0, 2)
    assert pool.shared(pages[0]) and pool.refs == [1, 1, 0]
    pool.release(reversed(pages))
    assert pool.unused == [2] and list(prefix.evictable) == [1, 0] and pool.num_free == 3
    assert [e.page for e in prefix.lookup([5, 6, 7, 8])] == [0, 1]

    pool.hold([0])  # a request starting on the cached first page: no longer evictable
    assert pool.refs == [1, 0, 0] and list(prefix.evictable) == [1] and pool.num_free == 2
    assert pool.allocate() == 2  # the unused page before any cached one
    assert pool.allocate() == 1 and prefix.entry(1) is None  # then the cached one, evicted: its key is gone
    assert [e.page for e in prefix.lookup([5, 6, 7, 8])] == [0]
    with pytest.raises(OutOfPagesError):
        pool.allocate()


def test_prefix_lookup_follows_the_registered_chain():
    """Pages of 3 tokens registered as a chain: a lookup finds the longest run of full pages from the start whose
    tokens, and all before them, are the same; a page's tokens after other pages are another key."""
    prefix = PrefixCache(3)
    tokens = [random.randint(0, 9) for _ in range(9)]
    prefix.register([7, 2, 5], tokens, 0, 3)
    assert [e.page for e in prefix.lookup(tokens)] == [7, 2, 5]
    assert [e.page for e in prefix.lookup(tokens + [1, 2, 3, 4])] == [7, 2, 5]
    assert [e.page for e in prefix.lookup(tokens[:8])] == [7, 2]  # the third page is not full
    assert [e.page for e in prefix.lookup(tokens[:3] + [10, 10, 10] + tokens[6:])] == [7]
    assert prefix.lookup(tokens[3:]) == []  # the second page's tokens, not after the first's
    assert prefix.lookup(tokens[:2]) == []
    entries = prefix.lookup(tokens)
    assert [prefix.entry(page) for page in (7, 2, 5)] == entries and prefix.entry(0) is None
    assert entries[1].key == (entries[0], tuple(tokens[3:6])) and entries[0].key == (None, tuple(tokens[:3]))
    assert 7 in prefix and 0 not in prefix and not prefix.evictable  # registered pages are held until released


def test_prefix_registration_extends_a_chain_and_stops_at_a_page_keyed_twice():
    prefix = PrefixCache(2)
    prefix.register([4, 1], [1, 2, 3, 4], 0, 2)
    prefix.register([4, 1, 6], [1, 2, 3, 4, 5, 6], 2, 3)  # the same request's next page: chained to the first two
    assert [e.page for e in prefix.lookup([1, 2, 3, 4, 5, 6])] == [4, 1, 6]
    # Another row computed the same tokens: the first copy stays the cached one, the rest of that row is not keyed.
    prefix.register([0, 3, 8], [1, 2, 3, 4, 7, 7], 0, 3)
    assert [e.page for e in prefix.lookup([1, 2, 3, 4, 7, 7])] == [4, 1]
    assert all(page not in prefix for page in (0, 3, 8))
    prefix.register([9, 10], [7, 7, 8, 8], 1, 2)  # its first page has no key: nothing to chain the second to
    assert 10 not in prefix


def test_prefix_evicts_the_least_recently_released_first():
    prefix = PrefixCache(2)
    chains = {page: [page, page + 10] for page in range(4)}  # one single-page chain per page
    for page, tokens in chains.items():
        prefix.register([page], tokens, 0, 1)
    for page in (2, 0, 3, 1):
        prefix.release(page)
    prefix.hold(0)  # held again, then released last of all
    prefix.release(0)
    order = []
    for left in (3, 2, 1, 0):
        order.append(prefix.evict())
        assert len(prefix.evictable) == left
    assert order == [2, 3, 1, 0]
    assert all(prefix.lookup(tokens) == [] and page not in prefix for page, tokens in chains.items())


def test_prefix_eviction_drops_only_the_evicted_key():
    prefix = PrefixCache(2)
    prefix.register([3, 5], [1, 2, 3, 4], 0, 2)
    prefix.register([6], [9, 9], 0, 1)
    for page in (5, 6, 3):  # a request's last page first, as the cache releases them
        prefix.release(page)
    assert prefix.evict() == 5
    assert [e.page for e in prefix.lookup([1, 2, 3, 4])] == [3] and [e.page for e in prefix.lookup([9, 9])] == [6]


def test_a_partly_filled_page_is_never_cached():
    """A request's registered tokens key only the pages they fill: a page with fewer tokens than page_size has no key,
    is never matched, and returns to the unused pages when freed."""
    cache = PagedKVCache(num_pages=4, page_size=4, num_kv_heads=1, head_dim=8)
    tokens = [3, 1, 4, 1, 5, 9]
    cache.add("a")
    cache.step(["a"], [6])
    cache.register_tokens("a", tokens[:3])
    assert cache.page_key("a", 0) is None and cache.match(tokens) == []
    cache.register_tokens("a", tokens[3:])
    assert cache.page_key("a", 0) is not None and cache.page_key("a", 1) is None
    pages = cache.pages("a")
    assert cache.match(tokens) == pages[:1] and cache.match(tokens + [2, 6]) == pages[:1]
    cache.free("a")
    assert cache.num_evictable_pages == 1 and list(cache.prefix.evictable) == pages[:1]
    assert pages[1] in cache.pool.unused and cache.num_free_pages == 4
