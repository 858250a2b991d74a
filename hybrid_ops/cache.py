"""`PagedKVCache`: the pages of every layer and the requests' rows of them, over a page pool and a prefix cache
(`pages.py`) and a metadata builder (`metadata_builder.py`)."""

from typing import NamedTuple

import torch

from .errors import HybridInputError, OutOfPagesError
from .fp8 import FP8_DTYPES, raw
from .metadata import ForwardBatch
from .metadata_builder import MetadataBuilder
from .modes import ForwardMode
from .pages import PagePool, PrefixCache


class LayerShape(NamedTuple):
    """One layer's cache: `num_kv_heads` heads of keys of `head_dim` and values of `v_head_dim`. latent: the values
    are the first v_head_dim values of the keys' rows, stored once (MLA's latent cache: [normalised latent, roped key
    part], the latent read as the values): v_caches[layer] is then a view of k_caches[layer]."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    latent: bool = False

    @property
    def values_per_token(self) -> int:
        """Values one token stores in this layer."""
        return self.num_kv_heads * (self.head_dim + (0 if self.latent else self.v_head_dim))


class PagedKVCache:
    """Paged K/V caches for `num_layers` layers, sharing one page allocation per request.

    k_caches[layer]: [num_pages, page_size, num_kv_heads, head_dim], v_caches[layer]: [num_pages, page_size,
    num_kv_heads, v_head_dim] (head_dim unless given), dtype `dtype`; or, with `layer_shapes`, each layer's own
    (num_kv_heads, head_dim, v_head_dim[, latent]) (`LayerShape`), for models whose layers differ (it then sets
    num_layers too). A latent layer (MLA) stores its keys only: its v_cache is `k_cache[..., :v_head_dim]`. Their
    addresses never change (`mark_static_address`), so CUDA-graph trees accept the ops' in-place writes.
    An fp8 `dtype` (float8_e4m3fn, float8_e5m2) stores k / k_scale and v / v_scale: `k_scales[layer]`,
    `v_scales[layer]` are float32 [] tensors, `kv_scale` (1.0 unless given) at first; `scales(layer)` gives the ops'
    keywords. They are tensors, so setting a new value (before the layer's first write) never recompiles.
    A request's pages are the same in every layer; `block_table` rows are `max_pages_per_request` wide.
    The caches' sizes and the table's width are marked static: under `dynamic=True` Dynamo would otherwise unify
    a token count that happens to equal one of them (duck sizing) and recompile when they differ.
    `for_compile=False` leaves these marks out (`mark_static_address`, `mark_static`, `mark_table`): a packaged step
    reads none, and importing Dynamo for them would cost a new process seconds.
    With `reserve_scratch=True` the caches hold one more page, `scratch_page` (id `num_pages`), which no request is
    ever given: padding requests (`hybrid_ops.buckets`) point every block-table column at it.

    Shared pages. Pages are reference counted (`pool`, a `PagePool`): `fork(parent, child)` starts `child` on
    `parent`'s pages (the same page ids), and a page returns to the allocator when no request holds it. A request's
    new tokens are written only into pages that it alone holds and that no prefix-cache key describes: `step` first
    gives the request a copy of any other page they land in, in every layer's k and v cache (copy on write). So a
    forked request's partly filled last page is copied at the first new token written into it (by either request),
    and a request truncated into a shared page copies it before writing.

    Prefix cache (`prefix`, a `PrefixCache`). `register_tokens(request_id, token_ids)` tells the cache the token ids
    whose K/V a forward has written. Each page they fill gets a key: its token ids chained to the key of the page
    before it (exact tuples, never a hash: equal keys mean equal tokens from the first position on, so equal K/V).
    `add(request_id, token_ids)` starts a request on the cached pages of the longest run of full pages of
    `token_ids`. A keyed page that no request holds stays cached until the allocator needs it (the least recently
    released first) and counts in `num_free_pages`.

    `step` grows requests by their new tokens and returns the step's `ForwardBatch`, built by `metadata_builder` (a
    `MetadataBuilder`).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int = 1,
        max_pages_per_request: int | None = None,
        dtype=torch.float32,
        device="cpu",
        reserve_scratch: bool = False,
        v_head_dim: int | None = None,
        layer_shapes=None,
        kv_scale: float = 1.0,
        for_compile: bool = True,
    ):
        if layer_shapes is None:
            layer_shapes = [(num_kv_heads, head_dim, v_head_dim or head_dim)] * num_layers
        layer_shapes = [LayerShape(*shape) for shape in layer_shapes]
        sizes = [("num_pages", num_pages), ("page_size", page_size), ("num_layers", len(layer_shapes))]
        for i, shape in enumerate(layer_shapes):
            sizes += zip((f"layer {i}'s num_kv_heads", f"layer {i}'s head_dim", f"layer {i}'s v_head_dim"), shape[:3])
        for name, value in sizes:
            if not (isinstance(value, int) and value > 0):
                raise HybridInputError(f"{name} must be a positive int, got {value!r}")
        for i, shape in enumerate(layer_shapes):
            if shape.latent and not shape.v_head_dim < shape.head_dim:
                raise HybridInputError(
                    f"layer {i} is latent: its values are the first v_head_dim of its keys' head_dim values, so "
                    f"v_head_dim must be below head_dim, got {shape.v_head_dim} and {shape.head_dim}"
                )
        if not (
            isinstance(dtype, torch.dtype) and (dtype.is_floating_point and dtype.itemsize > 1 or dtype in FP8_DTYPES)
        ):
            raise HybridInputError(
                f"dtype must be a floating-point torch.dtype (float8_e4m3fn and float8_e5m2 included), got {dtype!r}"
            )
        if not (isinstance(kv_scale, (int, float)) and 0 < kv_scale < float("inf")):
            raise HybridInputError(f"kv_scale must be a finite positive float, got {kv_scale!r}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.for_compile = for_compile
        self.max_pages_per_request = max_pages_per_request or num_pages
        self.scratch_page = num_pages if reserve_scratch else None
        pages = (num_pages + reserve_scratch, page_size)
        self.layer_shapes = layer_shapes
        self.k_caches = [
            torch.zeros((*pages, s.num_kv_heads, s.head_dim), dtype=dtype, device=device) for s in layer_shapes
        ]
        self.v_caches = [
            k[..., : s.v_head_dim]
            if s.latent
            else torch.zeros((*pages, s.num_kv_heads, s.v_head_dim), dtype=dtype, device=device)
            for k, s in zip(self.k_caches, layer_shapes)
        ]
        for t in self.stored_caches if for_compile else ():
            torch._dynamo.mark_static_address(t)
            torch._dynamo.mark_static(t)
        self.k_scales = self.v_scales = None
        if dtype in FP8_DTYPES:
            # A latent layer's values are its keys' bytes: one scale serves both (v_scales[layer] is k_scales[layer]).
            self.k_scales = [torch.full((), float(kv_scale), device=device) for _ in layer_shapes]
            self.v_scales = [
                k if s.latent else torch.full((), float(kv_scale), device=device)
                for k, s in zip(self.k_scales, layer_shapes)
            ]
            for t in self.k_scales + self.v_scales if for_compile else ():
                torch._dynamo.mark_static_address(t)
        self.device = torch.device(device)
        self.prefix = PrefixCache(page_size)
        self.pool = PagePool(num_pages, self.prefix)
        self.metadata_builder = MetadataBuilder(page_size, self.max_pages_per_request, self.device, for_compile)
        self._pages = {}  # request id -> list of page ids
        self._lengths = {}  # request id -> tokens stored
        self._tokens = {}  # request id -> ids of its first tokens, those registered (at most its length)

    @property
    def stored_caches(self) -> list:
        """Every cache tensor that holds memory of its own: the k caches and the v caches but latent layers' views."""
        values = [v for v, shape in zip(self.v_caches, self.layer_shapes) if not shape.latent]
        return self.k_caches + values

    def layer(self, layer_id: int):
        """(k_cache, v_cache) of one layer."""
        return self.k_caches[layer_id], self.v_caches[layer_id]

    def scales(self, layer_id: int) -> dict:
        """The ops' `k_scale=`, `v_scale=` keywords for one layer: empty unless the cache is fp8."""
        if self.k_scales is None:
            return {}
        return {"k_scale": self.k_scales[layer_id], "v_scale": self.v_scales[layer_id]}

    @property
    def num_free_pages(self) -> int:
        """Pages the allocator can hand out: unused ones and the cached pages no request holds."""
        return self.pool.num_free

    @property
    def num_evictable_pages(self) -> int:
        """Of `num_free_pages`, those keeping a cached prefix until the allocator needs them."""
        return len(self.prefix.evictable)

    @property
    def requests(self):
        return list(self._pages)

    def pages(self, request_id) -> list:
        """The request's page ids in order: its block-table row."""
        return list(self._pages[self._known(request_id)])

    def seq_len(self, request_id) -> int:
        return self._lengths[self._known(request_id)]

    def _known(self, request_id, name="request_id"):
        if request_id not in self._pages:
            raise HybridInputError(f"{name} {request_id!r} is not in the cache (never added, or freed already)")
        return request_id

    def _start(self, request_id, pages, tokens, length, name="request_id"):
        """A new request holding `pages` (out of the eviction order, if cached) with `tokens` of `length` registered."""
        if request_id in self._pages:
            raise HybridInputError(f"{name} {request_id!r} is in the cache already")
        self.pool.hold(pages)
        self._pages[request_id], self._tokens[request_id], self._lengths[request_id] = list(pages), tokens, length

    def add(self, request_id, token_ids=()) -> int:
        """Start a request; returns the number of tokens it starts with.

        token_ids: its first token ids (a prompt), or none. The request starts on the cached pages of the longest
        run of full pages of `token_ids` from its start (`match`): it holds them and their tokens, a multiple of
        page_size and at most len(token_ids). Pass a prompt without its last token to have that one computed.
        """
        pages = self.match(token_ids)
        length = len(pages) * self.page_size
        self._start(request_id, pages, list(token_ids[:length]), length)
        return length

    def fork(self, parent, child) -> None:
        """Start request `child` as a copy of request `parent`: the same tokens on the same pages, shared (see the
        class docstring: the first write into a shared page copies it)."""
        self._start(
            child,
            self._pages[self._known(parent, "parent")],
            list(self._tokens[parent]),
            self._lengths[parent],
            "child",
        )

    def match(self, token_ids) -> list:
        """The page ids of the cached pages that hold the longest run of full pages of `token_ids` from its start."""
        return [entry.page for entry in self.prefix_keys(token_ids)]

    def prefix_keys(self, token_ids) -> list:
        """The keys of the cached pages `match` finds, in order: opaque objects, each naming its page's tokens and all
        before them for as long as the page stays cached (a state kept at a page boundary is filed under one)."""
        return self.prefix.lookup(token_ids)

    def page_key(self, request_id, index: int):
        """The key of the request's page `index` (its place in the block-table row) if that page is cached, else
        None (as `prefix_keys` gives them)."""
        return self.prefix.entry(self._pages[self._known(request_id)][index])

    def register_tokens(self, request_id, token_ids) -> None:
        """Record the ids of a request's next tokens after those registered so far (from its first token on, at most
        up to its length), once a forward has written their K/V. Each page they fill becomes a cached prefix page."""
        tokens = self._tokens[self._known(request_id)]
        if len(tokens) + len(token_ids) > self._lengths[request_id]:
            raise HybridInputError(
                f"token_ids: {len(token_ids)} ids after the {len(tokens)} registered exceed the "
                f"{self._lengths[request_id]} tokens of request {request_id!r}"
            )
        full = len(tokens) // self.page_size
        tokens += token_ids
        self.prefix.register(self._pages[request_id], tokens, full, len(tokens) // self.page_size)

    def free(self, request_id) -> None:
        """End a request and drop its hold on its pages."""
        self.pool.release(reversed(self._pages.pop(self._known(request_id))))
        del self._lengths[request_id], self._tokens[request_id]

    def truncate(self, request_id, length: int) -> None:
        """Keep only the first `length` tokens of a request (rejected draft tokens), dropping its pages past them."""
        if not (isinstance(length, int) and 0 <= length <= self.seq_len(request_id)):
            raise HybridInputError(f"length must be an int in [0, {self.seq_len(request_id)}], got {length!r}")
        pages = self._pages[request_id]
        keep = -(-length // self.page_size)
        self.pool.release(reversed(pages[keep:]))
        del pages[keep:], self._tokens[request_id][length:]
        self._lengths[request_id] = length

    def keep(self, request_id, num_new_tokens: int, indices) -> None:
        """Keep, of the request's last `num_new_tokens` tokens, those at `indices` (increasing): their K/V move to the
        slots right after the tokens before them, in every layer, and the others are dropped (a speculative tree's
        accepted path: the tokens the target's verify step wrote at linear slots, a path such as 0, 2, 5 of them).

        One gather and one scatter per cache tensor, whatever the number of tokens; pages that another request or the
        prefix cache holds are copied before they are written (copy on write). The request's registered token ids
        (`register_tokens`) stop before the last new tokens: register the kept ones again. Nothing changes on a bad
        argument."""
        length = self.seq_len(request_id)
        if not (isinstance(num_new_tokens, int) and 0 <= num_new_tokens <= length):
            raise HybridInputError(f"num_new_tokens must be an int in [0, {length}], got {num_new_tokens!r}")
        indices = list(indices)
        if not all(isinstance(i, int) and 0 <= i < num_new_tokens for i in indices) or any(
            b <= a for a, b in zip(indices, indices[1:])
        ):
            raise HybridInputError(
                f"indices must be increasing ints in [0, {num_new_tokens}) (of the last new tokens), got {indices}"
            )
        start = length - num_new_tokens
        moves = [(start + i, start + k) for k, i in enumerate(indices) if i != k]
        if moves:
            written = sorted({dst // self.page_size for _, dst in moves})
            shared = [p for p in written if self.pool.shared(self._pages[request_id][p])]
            if len(shared) > self.num_free_pages:
                raise OutOfPagesError(
                    f"keeping these tokens copies {len(shared)} shared pages, only {self.num_free_pages} are free"
                )
            for index in shared:
                self._copy_page(request_id, index)
            pages = torch.tensor(self._pages[request_id], device=self.device)
            src, dst = (torch.tensor(positions, device=self.device) for positions in zip(*moves))
            src, dst = (pages[p // self.page_size] * self.page_size + p % self.page_size for p in (src, dst))
            for cache in self.stored_caches:
                rows = raw(cache).view(-1, *cache.shape[2:])
                rows.index_copy_(0, dst, rows.index_select(0, src))
        del self._tokens[request_id][start:]
        self.truncate(request_id, start + len(indices))

    def _shared_write(self, request_id, num_new_tokens) -> bool:
        """Whether the request's new tokens start inside a page that another request or the prefix cache holds."""
        length = self._lengths[request_id]
        if num_new_tokens == 0 or length % self.page_size == 0:
            return False
        return self.pool.shared(self._pages[request_id][length // self.page_size])

    def _copy_page(self, request_id, index):
        """Gives the request its own copy of its page `index` (in its page list), in every layer."""
        pages = self._pages[request_id]
        page = self.pool.allocate()
        for cache in self.stored_caches:
            cache[page] = cache[pages[index]]
        self.pool.release([pages[index]])
        pages[index] = page

    def step(self, request_ids, num_new_tokens, forward_mode=ForwardMode.EXTEND) -> ForwardBatch:
        """Grow each request by its new tokens (allocating pages, copying shared ones written into) and return the
        step's `ForwardBatch`, which carries `forward_mode` to what runs the step (the runner's buckets and the ops'
        routing read it there).

        Either every request grows or, when pages or table width run out, none does and the cache is unchanged.
        """
        new_lens = self.metadata_builder.new_lengths(request_ids, num_new_tokens, self.seq_len)
        pages_needed = sum(
            self.metadata_builder.num_pages(length) - len(self._pages[rid]) + self._shared_write(rid, n)
            for rid, n, length in zip(request_ids, num_new_tokens, new_lens)
        )
        if pages_needed > self.num_free_pages:
            raise OutOfPagesError(f"the step needs {pages_needed} new pages, only {self.num_free_pages} are free")
        for rid, n, length in zip(request_ids, num_new_tokens, new_lens):
            if self._shared_write(rid, n):  # asked again: a request that copied a page first left it to this one
                self._copy_page(rid, self._lengths[rid] // self.page_size)
            pages = self._pages[rid]
            while len(pages) * self.page_size < length:
                pages.append(self.pool.allocate())
            self._lengths[rid] = length
        return self.metadata_builder.build(
            num_new_tokens, new_lens, [self._pages[r] for r in request_ids], forward_mode
        )

    def mark_table(self, batch: ForwardBatch) -> None:
        """Marks the width of `batch`'s block table static for torch.compile (`for_compile`)."""
        self.metadata_builder.mark_table(batch)
