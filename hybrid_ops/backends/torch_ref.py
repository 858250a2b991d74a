"""The PyTorch backend: plain tensor code that runs on any device, and the reference for the other backends.

It reads the metadata to the host (one sync on CUDA), so it always checks the metadata's values and cannot be
captured in a CUDA graph; on CUDA, "auto" prefers the Triton or FlashInfer backend.

The layers of a step share one `StepMetadata`: the first builds it (checked host lists, the new tokens' cache rows,
gather indices, masks) and the others reuse it while the metadata holds the same values, which costs three
`torch.equal`s. Small models spend most of an attention call on exactly this work, once per layer otherwise.

Two ways through a batch, both over `attend`:
- decode batches (the same query length everywhere) whose gathered, padded K/V is small: one batched call
  (not in deterministic mode);
- otherwise one request at a time, its K/V a view of the cache when its pages are consecutive (no copy), else
  gathered into a reused buffer.
"""

import torch
import torch.nn.functional as F

from ..check_rows import FLOAT_DTYPES
from ..fp8 import quantize, raw
from ..metadata import new_token_slots
from ..settings import deterministic_enabled
from ..validation import check_metadata_values
from . import torch_state
from .base import STATE_OPS, Backend

# Decode batches whose padded K + V gather stays under this many bytes run as one batched call.
BATCHED_DECODE_BYTES = 8 << 20
# A lone request with up to this many query rows (tokens x query heads per kv head): two batched matmuls over the
# cache views beat SDPA's tiled kernel on the CPU (decode and verify). Above it, or for a padded batch, SDPA.
MATMUL_QUERY_ROWS = 32


def _matmul_branch(batch, query_rows, options, head_dims):
    """Whether `attend` takes the matmul branch: SDPA has no soft-cap and no sinks, and is not used when the value
    head dim differs (head_dims: (D, Dv))."""
    return (
        options.logit_cap > 0
        or options.sinks is not None
        or head_dims[0] != head_dims[1]
        or (batch == 1 and query_rows <= MATMUL_QUERY_ROWS)
    )


class StepMetadata:
    """What every layer of a step derives from the metadata (and the tree mask, if any) alone.

    key: what else it depends on (T, the caches' shape, dtype and device, decode, determinism).
    """

    def __init__(self, key, metadata, num_tokens, k_cache, v_cache, decode):
        """metadata: (cu_seqlens_q, seq_lens, block_table, tree_mask or None)."""
        num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
        cu_seqlens_q, seq_lens, block_table, tree_mask = metadata
        self.key = key
        self.metadata = tuple(None if t is None else t.clone() for t in metadata)
        self.cu, self.lens = check_metadata_values(
            cu_seqlens_q, seq_lens, block_table, num_tokens, num_pages, page_size, decode, tree_mask
        )
        self.slots = new_token_slots(cu_seqlens_q, seq_lens, block_table, num_tokens, page_size)  # [T] int64
        self.page_size = page_size
        self.max_pages = -(-max(self.lens, default=0) // page_size)
        row_bytes = num_kv_heads * (head_dim + v_cache.shape[3]) * k_cache.element_size()  # one K and one V row
        gather_bytes = len(self.lens) * self.max_pages * page_size * row_bytes
        # Padding changes a request's reduction, so the batch-invariant (deterministic) mode never batches.
        self.batched = decode and gather_bytes <= BATCHED_DECODE_BYTES and not deterministic_enabled()
        self.device = block_table.device
        self._masks, self._requests, self._tables, self._gather_index, self._padding_rows = {}, {}, None, None, None

    def matches(self, key, metadata) -> bool:
        return key == self.key and all(
            a is b is None or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(metadata, self.metadata)
        )

    def gather_index(self):
        """[B * max_pages] page ids: every request's pages, padded to the longest (batched decode) with page 0.

        Table entries past a request's pages may hold anything (-1 is a common padding): they are replaced on the
        device, no host sync; the rows they stand for are masked (`mask`).
        """
        if self._gather_index is None:
            table, seq_lens = self.metadata[2][:, : self.max_pages], self.metadata[1]
            unused = (
                torch.arange(self.max_pages, device=self.device)
                >= (seq_lens[:, None] + self.page_size - 1) // self.page_size
            )
            self._gather_index = table.masked_fill(unused, 0).flatten()
        return self._gather_index

    def padding_rows(self):
        """[R] int64: the rows of the batched gather (flattened to [B * max_pages * page_size]) past each request's
        length, up to the longest. They hold other requests' pages or unwritten slots: zeroed after the gather, since
        a masked score times a non-finite value there would still be NaN."""
        if self._padding_rows is None:
            width, longest = self.max_pages * self.page_size, max(self.lens)
            position = torch.arange(longest, device=self.device)
            lens = torch.tensor(self.lens, device=self.device)
            rows = torch.arange(len(self.lens), device=self.device)[:, None] * width + position
            self._padding_rows = rows[position >= lens[:, None]]
        return self._padding_rows

    def request(self, i):
        """(first page if request i's pages are consecutive else None, its page ids [num_pages] on the device)."""
        if i not in self._requests:
            if self._tables is None:
                self._tables = self.metadata[2].tolist()
            pages = self._tables[i][: -(-self.lens[i] // self.page_size)]
            consecutive = all(b - a == 1 for a, b in zip(pages, pages[1:]))
            self._requests[i] = (pages[0], None) if consecutive else (None, torch.tensor(pages, device=self.device))
        return self._requests[i]

    def tree(self, request, num_queries):
        """[B, n, n] bool: which new tokens each new token sees (itself and the earlier ones its tree row names), for
        request `request` or for the whole batch (request None, n new tokens each); None for causal rows."""
        tree_mask, n = self.metadata[3], num_queries
        if tree_mask is None:
            return None
        start, stop = (0, len(self.lens) * n) if request is None else (self.cu[request], self.cu[request] + n)
        rows = tree_mask[start:stop, :n].view(-1, n, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        rows = (rows & causal) | torch.eye(n, dtype=torch.bool, device=self.device)
        return None if torch.equal(rows, causal.expand_as(rows)) else rows

    def mask(self, request, num_queries, options, matmul):
        """(bias, is_causal) for request `request`'s queries, or for the whole batch when `request` is None.

        bias: [B, 1, n, L] float32 (0 where a query sees a key, -inf elsewhere; L the longest sequence), or None
        when every query sees every key, or when `is_causal` (the queries are the whole sequence, SDPA's plain
        causal case, which needs no mask unless `matmul`). A query at position p sees keys at positions
        max(p - sliding_window, p - p % attention_chunk) < ... <= p when those options are on; a tree's token
        sees only the new tokens its row names, and positions count only those (`ops`: prefix + depth). A causal
        tree takes the same way as none, so its output is the same bit for bit.
        """
        sliding_window, attention_chunk = options.sliding_window, options.attention_chunk
        key = (request, num_queries, sliding_window, attention_chunk, matmul)
        if key not in self._masks:
            lens = self.lens if request is None else [self.lens[request]]
            length = max(lens)
            windowed = 0 < sliding_window < length or 0 < attention_chunk < length
            tree = self.tree(request, num_queries)
            plain = tree is None and not windowed
            is_causal = plain and len(lens) == 1 and num_queries == length and not matmul
            if is_causal or (plain and num_queries == 1 and min(lens) == length):
                self._masks[key] = None, is_causal
            else:
                visible = self._visible(lens, num_queries, tree, sliding_window, attention_chunk)
                bias = torch.zeros(visible.shape, device=self.device).masked_fill_(~visible, float("-inf"))
                self._masks[key] = bias[:, None], False
        return self._masks[key]

    def _visible(self, lens, n, tree, sliding_window, attention_chunk):
        """[B, n, L] bool: which of the L keys each of the n queries of each request sees."""
        device = self.device
        prefix = torch.tensor(lens, device=device)[:, None] - n  # [B, 1]
        slot = torch.arange(max(lens), device=device)
        column = slot - prefix  # [B, L]: a new key's index among the new tokens, negative in the prefix
        visible = column[:, None, :] <= torch.arange(n, device=device)[:, None]  # causal; hides shorter requests' pads
        depth = torch.arange(n, device=device).expand(len(lens), n)
        key_pos = slot.expand(len(lens), -1)
        if tree is not None:
            new = column >= 0
            index = column.clamp(0, n - 1)
            visible &= ~new[:, None, :] | tree.gather(2, index[:, None, :].expand(-1, n, -1))
            depth = tree.sum(-1) - 1
            key_pos = torch.where(new, prefix + depth.gather(1, index), slot)
        query_pos = prefix + depth  # [B, n]
        if sliding_window > 0:
            visible &= key_pos[:, None, :] > query_pos[:, :, None] - sliding_window
        if attention_chunk > 0:
            visible &= key_pos[:, None, :] >= (query_pos - query_pos % attention_chunk)[:, :, None]
        return visible


class Workspace:
    """Gather buffers reused across calls, one for keys and one for values (layers run one after another; one
    thread at a time). A fresh buffer per call costs page faults: on the CPU, first-touch faults made the gathers
    of the decode benchmark take 31 ms instead of 17."""

    def __init__(self):
        self._buffers = {}

    def get(self, role, cache, num_pages):
        """A [num_pages, page_size, Hkv, D or Dv] buffer like `cache`'s pages; role: "k" or "v"."""
        key = (role, cache.dtype, cache.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < num_pages or buffer.shape[1:] != cache.shape[1:]:
            # A normal tensor even when made under inference_mode: an inference tensor cannot be written outside it.
            with torch.inference_mode(False):
                buffer = self._buffers[key] = cache.new_empty((num_pages, *cache.shape[1:]))
        return buffer[:num_pages]

    def gather(self, role, cache, index):
        """cache[index]: [len(index), page_size, Hkv, D or Dv], into the reused buffer."""
        return torch.index_select(cache, 0, index, out=self.get(role, cache, index.shape[0]))


def attend(q, k, v, bias, is_causal, options):
    """Attention of B requests' new tokens over their K/V, computed in fp32 at least.

    q: [B, n, Hq, D]; k: [B, L, Hkv, D]; v: [B, L, Hkv, Dv] (rows a query must not see are masked by `bias`);
    bias: [B, 1, n, L] float32 added to the scores, or None; is_causal: SDPA's plain causal mask instead (n == L;
    the matmul branch takes its causal mask as a bias, see `StepMetadata.mask`); options: resolved `Options` (its
    scale, logit_cap, sinks, and the k_scale, v_scale that fp8 k and v are read with). Returns [B, n, Hq, Dv] in q's
    dtype.
    """
    scale, logit_cap, sinks = options.scale, options.logit_cap, options.sinks
    batch, n, num_q_heads, head_dim = q.shape
    num_kv_heads, v_head_dim = v.shape[2:]
    group = num_q_heads // num_kv_heads
    out_dtype, compute_dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    k, v = (
        x.to(compute_dtype) if kv_scale is None else x.to(compute_dtype).mul_(kv_scale[:, None])
        for x, kv_scale in ((k, options.k_scale), (v, options.v_scale))
    )
    q, k_t, v_t = q.to(compute_dtype), k.transpose(1, 2), v.transpose(1, 2)
    if _matmul_branch(batch, n * group, options, (head_dim, v_head_dim)):
        # Each kv head serves its `group` query heads as extra rows: [B, Hkv, n * group, D], no K/V repeat.
        q_rows = (
            q.view(batch, n, num_kv_heads, group, head_dim).transpose(1, 2).reshape(batch, num_kv_heads, -1, head_dim)
        )
        scores = torch.matmul(q_rows, k_t.transpose(2, 3)).mul_(scale)
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        if bias is not None:  # [B, 1, n, L] against the scores' [B, Hkv, n, group, L]
            scores.view(batch, num_kv_heads, n, group, -1).add_(bias[:, :, :, None])
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:  # each head's sink joins its rows' softmax as one more logit, whose value row is zero
            sink = sinks.to(compute_dtype).view(1, num_kv_heads, 1, group, 1).expand(batch, -1, n, -1, -1)
            probs = torch.cat([scores, sink.reshape(batch, num_kv_heads, n * group, 1)], -1).softmax(-1)[..., :-1]
        out = torch.matmul(probs, v_t).view(batch, num_kv_heads, n, group, v_head_dim)
        out = out.transpose(1, 2).reshape(batch, n, num_q_heads, v_head_dim)
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_t, v_t, attn_mask=bias, is_causal=is_causal, scale=scale, enable_gqa=True
        ).transpose(1, 2)
    return out.to(out_dtype)


class TorchBackend(Backend):
    name = "torch"  # always available: nothing to require
    checks_values = True
    features = frozenset({"sinks", "attention_chunk", "fp8_kv", "tree_mask", *STATE_OPS})
    causal_conv1d = staticmethod(torch_state.causal_conv1d)
    gated_delta_rule = staticmethod(torch_state.gated_delta_rule)
    selective_scan = staticmethod(torch_state.selective_scan)

    def __init__(self):
        self.workspace = Workspace()
        self._step = None
        self.steps_derived = 0  # StepMetadata built: once per step, not per layer

    def supports(self, spec) -> bool:
        return spec.dtype in FLOAT_DTYPES

    def step_metadata(self, metadata, num_tokens, k_cache, v_cache, decode) -> StepMetadata:
        """The step's derived metadata: the kept one when the values of `metadata` (cu_seqlens_q, seq_lens,
        block_table, tree_mask or None) are the same, else a new one (which checks them, raising `HybridInputError`
        before anything is written)."""
        key = (
            num_tokens,
            k_cache.shape,
            v_cache.shape[3],
            k_cache.dtype,
            k_cache.device,
            decode,
            deterministic_enabled(),
        )
        step = self._step
        if step is None or not step.matches(key, metadata):
            step = StepMetadata(key, metadata, num_tokens, k_cache, v_cache, decode)
            self._step = step
            self.steps_derived += 1
        return step

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options, decode=False):
        _, page_size, num_kv_heads, head_dim = k_cache.shape
        head_dims = (head_dim, v_cache.shape[3])
        metadata = (cu_seqlens_q, seq_lens, block_table, options.tree_mask)
        step = self.step_metadata(metadata, q.shape[0], k_cache, v_cache, decode)
        for cache, new, kv_scale in ((k_cache, k, options.k_scale), (v_cache, v, options.v_scale)):
            if kv_scale is not None:
                new = quantize(new, kv_scale, cache.dtype)
            raw(cache).view(-1, num_kv_heads, cache.shape[3]).index_copy_(0, step.slots, raw(new))
        lens = step.lens
        out_shape = (*q.shape[:2], head_dims[1])
        if not lens or q.shape[0] == 0:
            return q.new_empty(out_shape)
        group = q.shape[1] // num_kv_heads
        if step.batched:
            n = q.shape[0] // len(lens)
            index, longest = step.gather_index(), max(lens)
            k_padded, v_padded = (
                self.workspace.gather(role, raw(cache), index)
                .view(-1, num_kv_heads, cache.shape[3])
                .index_fill_(0, step.padding_rows(), 0)
                .view(cache.dtype)
                .view(len(lens), step.max_pages * page_size, num_kv_heads, -1)[:, :longest]
                for role, cache in (("k", k_cache), ("v", v_cache))
            )
            matmul = _matmul_branch(len(lens), n * group, options, head_dims)
            bias, is_causal = step.mask(None, n, options, matmul)
            q_batched = q.view(len(lens), n, *q.shape[1:])
            return attend(q_batched, k_padded, v_padded, bias, is_causal, options).flatten(0, 1)
        out = q.new_empty(out_shape)
        for i, length in enumerate(lens):
            start, end = step.cu[i], step.cu[i + 1]
            if start == end:
                continue
            first, index = step.request(i)
            kv = []
            for role, cache in (("k", k_cache), ("v", v_cache)):
                if first is not None:  # consecutive pages: a view of the cache
                    rows = cache.view(-1, num_kv_heads, cache.shape[3])[first * page_size : first * page_size + length]
                else:
                    rows = self.workspace.gather(role, raw(cache), index).view(cache.dtype).flatten(0, 1)[:length]
                kv.append(rows[None])
            matmul = _matmul_branch(1, (end - start) * group, options, head_dims)
            bias, is_causal = step.mask(i, end - start, options, matmul)
            out[start:end] = attend(q[None, start:end], *kv, bias, is_causal, options)[0]
        return out

    def decode(self, *args):
        return self.prefill(*args, decode=True)
