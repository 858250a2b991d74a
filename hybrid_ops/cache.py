"""`PagedKVCache`: the pages of every layer, a page allocator, and the metadata of each step's batch."""

import torch

from .errors import HybridInputError, OutOfPagesError
from .metadata import ForwardBatch, build_metadata
from .modes import ForwardMode


class PagedKVCache:
    """Paged K/V caches for `num_layers` layers, sharing one page allocation per request.

    k_caches[layer]: [num_pages, page_size, num_kv_heads, head_dim], v_caches[layer]: [num_pages, page_size,
    num_kv_heads, v_head_dim] (head_dim unless given), dtype `dtype`; or, with `layer_shapes`, each layer's own
    (num_kv_heads, head_dim, v_head_dim), for models whose layers differ (it then sets num_layers too). Their
    addresses never change (`mark_static_address`), so CUDA-graph trees accept the ops' in-place writes.
    A request's pages are the same in every layer; `block_table` rows are `max_pages_per_request` wide.
    The caches' sizes and the table's width are marked static: under `dynamic=True` Dynamo would otherwise unify
    a token count that happens to equal one of them (duck sizing) and recompile when they differ.
    With `reserve_scratch=True` the caches hold one more page, `scratch_page` (id `num_pages`), which no request is
    ever given: padding requests (`hybrid_ops.buckets`) point every block-table column at it.
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, num_layers: int = 1,
                 max_pages_per_request: int | None = None, dtype=torch.float32, device="cpu",
                 reserve_scratch: bool = False, v_head_dim: int | None = None, layer_shapes=None):
        if layer_shapes is None:
            layer_shapes = [(num_kv_heads, head_dim, v_head_dim or head_dim)] * num_layers
        sizes = [("num_pages", num_pages), ("page_size", page_size), ("num_layers", len(layer_shapes))]
        for i, shape in enumerate(layer_shapes):
            sizes += zip((f"layer {i}'s num_kv_heads", f"layer {i}'s head_dim", f"layer {i}'s v_head_dim"), shape)
        for name, value in sizes:
            if not (isinstance(value, int) and value > 0):
                raise HybridInputError(f"{name} must be a positive int, got {value!r}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_pages_per_request = max_pages_per_request or num_pages
        self.scratch_page = num_pages if reserve_scratch else None
        pages = (num_pages + reserve_scratch, page_size)
        self.k_caches = [torch.zeros((*pages, heads, d), dtype=dtype, device=device) for heads, d, _ in layer_shapes]
        self.v_caches = [torch.zeros((*pages, heads, d), dtype=dtype, device=device) for heads, _, d in layer_shapes]
        for t in self.k_caches + self.v_caches:
            torch._dynamo.mark_static_address(t)
            torch._dynamo.mark_static(t)
        self.device = torch.device(device)
        # Pop from the end: low page ids first, so a fresh request gets consecutive pages.
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._pages = {}  # request id -> list of page ids
        self._lengths = {}  # request id -> tokens stored

    def layer(self, layer_id: int):
        """(k_cache, v_cache) of one layer."""
        return self.k_caches[layer_id], self.v_caches[layer_id]

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def requests(self):
        return list(self._pages)

    def seq_len(self, request_id) -> int:
        return self._lengths[self._known(request_id)]

    def _known(self, request_id):
        if request_id not in self._pages:
            raise HybridInputError(f"request_id {request_id!r} is not in the cache (never added, or freed already)")
        return request_id

    def add(self, request_id) -> None:
        """Start a request with no tokens."""
        if request_id in self._pages:
            raise HybridInputError(f"request_id {request_id!r} is in the cache already")
        self._pages[request_id] = []
        self._lengths[request_id] = 0

    def free(self, request_id) -> None:
        """End a request and return its pages."""
        self._free_pages.extend(reversed(self._pages.pop(self._known(request_id))))
        del self._lengths[request_id]

    def truncate(self, request_id, length: int) -> None:
        """Keep only the first `length` tokens of a request (rejected draft tokens), freeing pages past them."""
        if not (isinstance(length, int) and 0 <= length <= self.seq_len(request_id)):
            raise HybridInputError(f"length must be an int in [0, {self.seq_len(request_id)}], got {length!r}")
        pages = self._pages[request_id]
        keep = -(-length // self.page_size)
        self._free_pages.extend(reversed(pages[keep:]))
        del pages[keep:]
        self._lengths[request_id] = length

    def step(self, request_ids, num_new_tokens, forward_mode=ForwardMode.EXTEND) -> ForwardBatch:
        """Grow each request by its new tokens (allocating pages) and return the step's `ForwardBatch`.

        Either every request grows or, when pages or table width run out, none does and the cache is unchanged.
        """
        if len(request_ids) != len(num_new_tokens):
            raise HybridInputError(f"num_new_tokens must have one entry per request ({len(request_ids)}), "
                                   f"got {len(num_new_tokens)}")
        if len(set(request_ids)) != len(request_ids):
            raise HybridInputError(f"request_ids must be distinct, got {list(request_ids)}")
        new_lens, pages_needed = [], 0
        for rid, n in zip(request_ids, num_new_tokens):
            if not (isinstance(n, int) and n >= 0):
                raise HybridInputError(f"num_new_tokens must be non-negative ints, got {n!r} for request {rid!r}")
            length = self._lengths[self._known(rid)] + n
            num_pages = -(-length // self.page_size)
            if num_pages > self.max_pages_per_request:
                raise OutOfPagesError(f"request {rid!r} needs {num_pages} pages for {length} tokens, more than "
                                      f"max_pages_per_request = {self.max_pages_per_request}")
            pages_needed += num_pages - len(self._pages[rid])
            new_lens.append(length)
        if pages_needed > len(self._free_pages):
            raise OutOfPagesError(f"the step needs {pages_needed} new pages, only {len(self._free_pages)} are free")
        for rid, length in zip(request_ids, new_lens):
            pages = self._pages[rid]
            while len(pages) * self.page_size < length:
                pages.append(self._free_pages.pop())
            self._lengths[rid] = length
        batch = build_metadata(num_new_tokens, new_lens, [self._pages[r] for r in request_ids],
                               max_pages=self.max_pages_per_request, device=self.device, forward_mode=forward_mode)
        torch._dynamo.mark_static(batch.block_table, 1)
        return batch
