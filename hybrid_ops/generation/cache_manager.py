"""`KVCacheManager`: what the scheduler asks of the KV cache, in pages of `PagedKVCache.page_size` tokens.

The scheduler never counts a request's resources itself: whether a request can be admitted, whether a step's new
tokens fit, the step's metadata and what a request frees are answered here, so a cache that holds more per request
than pages changes this class only. A hybrid model's requests also hold a state slot each (`StatePool`), which counts
as `state_pages` pages: taken at admission if its pages are free besides the prefill's, held while the request runs,
freed with its pages.

Prefix caching of a hybrid model: a cached page serves a later request only where a snapshot of the state after
its tokens was kept (`StatePool.save`, at the end of a step whose tokens end on a page boundary), since the state
cannot be computed from K/V. So prefill chunks end on page boundaries where they can (`chunk`), and a request
admitted on cached pages starts from the snapshot of the last of them (`StatePool.restore`).
"""

import torch

from ..cache import LayerShape, PagedKVCache
from ..metadata import ForwardBatch
from ..modes import ForwardMode
from ..state import StatePool


def paged_cache(
    layer_shapes, max_batch_size, pages_per_request, page_size, num_pages, dtype, device, scratch, for_compile=True
):
    """The generator's `PagedKVCache`: per layer (Hkv, D, Dv) of `layer_shapes`, `num_pages` pages (None: the worst
    case, `max_batch_size` requests of `pages_per_request` pages), block-table rows of `pages_per_request`, with
    `scratch` the scratch page that padding requests write, and the marks torch.compile reads if `for_compile`."""
    return PagedKVCache(
        num_pages or max_batch_size * pages_per_request,
        page_size,
        *layer_shapes[0][:2],
        layer_shapes=layer_shapes,
        max_pages_per_request=pages_per_request,
        dtype=dtype,
        device=device,
        reserve_scratch=scratch,
        for_compile=for_compile,
    )


def num_snapshots(max_batch_size: int, prefix_caching: bool) -> int:
    """State snapshots a hybrid model's pool keeps for prefix caching: two per request slot."""
    return 2 * max_batch_size if prefix_caching else 0


def state_pool(mixers, layer_shapes, max_batch_size, page_size, kv_cache_dtype, device, num_snapshots=0):
    """(a `StatePool` of `max_batch_size` slots (and `num_snapshots` snapshot slots, for prefix caching) for the
    stateful layers `mixers`, the pages a slot counts as: `slot_pages`); (None, 0) for a model without state."""
    if not mixers:
        return None, 0
    layers = [[(s.shape, s.dtype) for s in m.states] for m in mixers]
    states = StatePool(layers, max_batch_size, device, num_snapshots=num_snapshots)
    return states, slot_pages(states, layer_shapes, page_size, kv_cache_dtype)


def slot_pages(states: StatePool, layer_shapes, page_size: int, kv_cache_dtype) -> int:
    """The pages a slot of `states` counts as in the budget of a cache of `layer_shapes` ((Hkv, D, Dv) per layer) in
    `kv_cache_dtype`: those its bytes would fill, so that the budget bounds K/V and state together."""
    values = sum(LayerShape(*shape).values_per_token for shape in layer_shapes)
    bytes_per_page = page_size * kv_cache_dtype.itemsize * values
    return -(-states.bytes_per_slot // bytes_per_page)


class KVCacheManager:
    """Requests' pages in a `PagedKVCache`, keyed by request id. With `prefix_caching`, a request starts on the
    cached pages of its tokens but its last (`admit`), and the pages its steps fill are offered to later requests
    (`computed`). With `states`, each running request also holds a slot of that pool, counted as `state_pages`
    pages."""

    def __init__(
        self, cache: PagedKVCache, prefix_caching: bool = False, states: StatePool | None = None, state_pages: int = 0
    ):
        self.cache, self.prefix_caching = cache, prefix_caching
        self.states, self.state_pages = states, state_pages

    def pages(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.cache.page_size)

    def request_pages(self, num_tokens: int) -> int:
        """Pages a request holds at its largest, `num_tokens` tokens (prompt + max_new_tokens), its state slot's
        included: more than the cache's num_pages, and it could never run."""
        return self.pages(num_tokens) + self.state_pages

    def free_pages(self) -> int:
        """Pages free for K/V: the cache's, less those the running requests' state slots count for."""
        held = 0 if self.states is None else len(self.states.requests)
        return self.cache.num_free_pages - self.state_pages * held

    def prefill_pages(self, request) -> int:
        """Pages a running request's prefill has still to take."""
        return self.pages(request.prefill_end) - self.pages(request.num_computed_tokens)

    def reusable_tokens(self, request) -> int:
        """Tokens of the request the prefix cache holds now (whole pages), short of its last token; for a hybrid
        model, up to the last page with a state snapshot."""
        return self._reusable_pages(self._prefix_tokens(request)) * self.cache.page_size

    def _reusable_pages(self, tokens) -> int:
        keys = self.cache.prefix_keys(tokens)
        if self.states is not None:
            while keys and not self.states.has_snapshot(keys[-1]):
                keys.pop()
        return len(keys)

    def chunk(self, request, num_tokens: int) -> int:
        """The tokens of the request's next prefill chunk, at most `num_tokens`: for a hybrid model with prefix
        caching, cut back to end on a page boundary (where a state snapshot is kept) unless it ends the prefill or
        would hold no full page's end."""
        end = request.num_computed_tokens + num_tokens
        if not (self.prefix_caching and self.states is not None) or end >= request.prefill_end:
            return num_tokens
        aligned = end - end % self.cache.page_size
        return aligned - request.num_computed_tokens if aligned > request.num_computed_tokens else num_tokens

    def _prefix_tokens(self, request) -> list:
        # Never the last token from the cache: the step that prefills it samples from its logits.
        return request.tokens(0, request.num_tokens - 1) if self.prefix_caching else []

    def admit(self, request, reserved_pages: int) -> bool:
        """Starts `request` in the cache, on the cached pages of its tokens with prefix caching, if the pages its
        prefill needs are free besides `reserved_pages` (those promised to running prefills); sets its
        num_computed_tokens and prefill_end. False: the cache is unchanged."""
        tokens = self._prefix_tokens(request)
        reused = self.cache.add(request.id, tokens[: self._reusable_pages(tokens) * self.cache.page_size])
        need = self.pages(request.num_tokens) - self.pages(reused) + self.state_pages
        # Taking cached pages that no request held lowered num_free_pages already.
        if need > self.free_pages() - reserved_pages:
            self.cache.free(request.id)
            return False
        if self.states is not None:
            self.states.add(request.id)
            if reused:
                last_page = self.cache.page_key(request.id, reused // self.cache.page_size - 1)
                self.states.restore(request.id, last_page)
        request.num_computed_tokens, request.prefill_end = reused, request.num_tokens
        return True

    def step_fits(self, requests, num_new_tokens) -> bool:
        """Whether the new pages of the requests' next `num_new_tokens[i]` tokens are free."""
        need = sum(
            self.pages(r.num_computed_tokens + n) - self.pages(r.num_computed_tokens)
            for r, n in zip(requests, num_new_tokens)
        )
        return need <= self.free_pages()

    def allocate(self, requests, num_new_tokens, forward_mode: ForwardMode) -> ForwardBatch:
        """Grows the requests by their new tokens (pages allocated) -> the step's metadata."""
        return self.cache.step([r.id for r in requests], num_new_tokens, forward_mode)

    def state_slots(self, requests) -> torch.Tensor | None:
        """The step's `state_slots` ([B] int32, each request's slot), None without states."""
        return None if self.states is None else self.states.slots([r.id for r in requests])

    def computed(self, request, token_ids) -> None:
        """The request's next `token_ids` have their K/V written (and its state is the one after them): with prefix
        caching, the pages they fill can serve later requests, and where a prefill chunk ends on a page boundary the
        state is kept as that page's snapshot."""
        if not self.prefix_caching:
            return
        self.cache.register_tokens(request.id, token_ids)
        end = request.num_computed_tokens + len(token_ids)
        # Prefill chunks only: a prompt's prefix is what later prompts share, and decode steps would replace its
        # snapshot with ones of generated tokens.
        prefilling = request.num_computed_tokens < request.prefill_end
        if self.states is not None and prefilling and end % self.cache.page_size == 0:
            key = self.cache.page_key(request.id, end // self.cache.page_size - 1)
            if key is not None:
                self.states.save(request.id, key)

    def free(self, request) -> None:
        """Ends the request in the cache: its pages return to the allocator (keyed ones stay cached), its state slot
        to the pool."""
        self.cache.free(request.id)
        if self.states is not None:
            self.states.free(request.id)
