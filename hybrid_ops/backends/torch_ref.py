"""The PyTorch backend: plain tensor code that runs on any device, and the reference for the other backends.

It reads the metadata to the host (one sync on CUDA), so it always checks the metadata's values and cannot be
captured in a CUDA graph; on CUDA, "auto" prefers the Triton or FlashInfer backend.

Two ways through a batch, both over `attend`:
- one request at a time, its K/V a view of the cache when its pages are consecutive (no copy), else gathered;
- decode batches (the same query length everywhere) whose gathered, padded K/V is small: one batched call,
  which saves the per-request overhead that dominates small models (not in deterministic mode).
"""

import torch
import torch.nn.functional as F

from ..metadata import new_token_slots
from ..validation import FLOAT_DTYPES, check_metadata_values, deterministic_enabled

# Decode batches whose padded K + V gather stays under this many bytes run as one batched call.
BATCHED_DECODE_BYTES = 8 << 20
# Up to this many query rows (tokens x query heads per kv head), two batched matmuls over the cache views beat
# SDPA's tiled kernel on the CPU (decode and verify); above it, SDPA.
MATMUL_QUERY_ROWS = 32


def store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table):
    """Write the new k, v: [T, Hkv, D] to their cache rows, in place."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    slots = new_token_slots(cu_seqlens_q, seq_lens, block_table, k.shape[0], page_size)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def request_kv(cache, pages, length, buffer):
    """[length, Hkv, D] of one request: a view when its pages are consecutive, else gathered into `buffer`
    (a `Workspace.get` of at least len(pages) pages).

    pages: the request's page ids as a host list.
    """
    page_size = cache.shape[1]
    first = pages[0]
    if pages[-1] - first == len(pages) - 1 and all(b - a == 1 for a, b in zip(pages, pages[1:])):
        return cache.view(-1, *cache.shape[2:])[first * page_size : first * page_size + length]
    gathered = buffer[: len(pages)]
    torch.index_select(cache, 0, torch.tensor(pages, device=cache.device), out=gathered)
    return gathered.flatten(0, 1)[:length]


class Workspace:
    """Gather buffers reused across calls, one for keys and one for values (layers run one after another; one
    thread at a time). A fresh buffer per call costs page faults: on the CPU, first-touch faults made the gathers
    of the decode benchmark take 31 ms instead of 17."""

    def __init__(self):
        self._buffers = {}

    def get(self, role, cache, num_pages):
        """A [num_pages, page_size, Hkv, D] buffer like `cache`'s pages; role: "k" or "v"."""
        key = (role, cache.dtype, cache.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < num_pages or buffer.shape[1:] != cache.shape[1:]:
            buffer = self._buffers[key] = cache.new_empty((num_pages, *cache.shape[1:]))
        return buffer[:num_pages]


def attend(q, k, v, prefix, seq_lens, scale, sliding_window, logit_cap):
    """Attention of B requests' new tokens over their K/V, computed in fp32 at least.

    q: [B, n, Hq, D]; k, v: [B, L, Hkv, D] with L = max(seq_lens) (rows past a request's length are padding);
    prefix, seq_lens: [B] int64 (token j of request b sits at position prefix[b] + j).
    Returns [B, n, Hq, D] in q's dtype.
    """
    batch, n, num_q_heads, head_dim = q.shape
    length, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    out_dtype, compute_dtype = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k_t, v_t = q.to(compute_dtype), k.to(compute_dtype).transpose(1, 2), v.to(compute_dtype).transpose(1, 2)
    padded = batch > 1 and bool((seq_lens != length).any())
    needs_mask = n > 1 or padded or 0 < sliding_window < length

    def mask(rows_per_token):
        """[B, 1, n * rows_per_token, L] bool: causal (which also hides padding) and the window."""
        query_pos = prefix[:, None] + torch.arange(n, device=q.device).repeat_interleave(rows_per_token)
        key_pos = torch.arange(length, device=q.device)
        visible = key_pos <= query_pos[:, :, None]
        if sliding_window > 0:
            visible &= key_pos > query_pos[:, :, None] - sliding_window
        return visible[:, None]

    if logit_cap > 0 or n * group <= MATMUL_QUERY_ROWS:
        # Each kv head serves its `group` query heads as extra rows: [B, Hkv, n * group, D], no K/V repeat.
        q_rows = q.view(batch, n, num_kv_heads, group, head_dim).transpose(1, 2).reshape(batch, num_kv_heads, -1,
                                                                                         head_dim)
        scores = torch.matmul(q_rows, k_t.transpose(2, 3)) * scale
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        if needs_mask:
            scores = scores.masked_fill(~mask(group), float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), v_t).view(batch, num_kv_heads, n, group, head_dim)
        out = out.transpose(1, 2).reshape(batch, n, num_q_heads, head_dim)
    else:
        # SDPA's causal kernel serves a lone request without prefix or window; the rest need a mask.
        is_causal = batch == 1 and n == length and sliding_window <= 0
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_t, v_t, scale=scale, enable_gqa=True,
                                             is_causal=is_causal,
                                             attn_mask=mask(1) if needs_mask and not is_causal else None)
        out = out.transpose(1, 2)
    return out.to(out_dtype)


class TorchBackend:
    name = "torch"
    requirement = "torch"
    checks_values = True

    def __init__(self):
        self.workspace = Workspace()

    def is_available(self) -> bool:
        return True

    def supports(self, q) -> bool:
        return q.dtype in FLOAT_DTYPES

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window,
                logit_cap, decode=False):
        num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
        cu, lens = check_metadata_values(cu_seqlens_q, seq_lens, block_table, q.shape[0], num_pages, page_size,
                                         decode)
        store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
        if not lens or q.shape[0] == 0:
            return q.new_empty(q.shape)
        options = (scale, sliding_window, logit_cap)
        max_pages = -(-max(lens) // page_size)
        gather_bytes = 2 * len(lens) * max_pages * page_size * num_kv_heads * head_dim * k_cache.element_size()
        # Padding changes a request's reduction, so the batch-invariant (deterministic) mode never batches.
        if decode and gather_bytes <= BATCHED_DECODE_BYTES and not deterministic_enabled():
            n = q.shape[0] // len(lens)
            pages = block_table[:, :max_pages].flatten()
            lengths = seq_lens.to(torch.int64)
            kv_shape = (len(lens), max_pages * page_size, num_kv_heads, head_dim)
            longest = max(lens)
            k_padded = torch.index_select(k_cache, 0, pages, out=self.workspace.get("k", k_cache, pages.shape[0]))
            v_padded = torch.index_select(v_cache, 0, pages, out=self.workspace.get("v", v_cache, pages.shape[0]))
            k_padded, v_padded = k_padded.view(kv_shape)[:, :longest], v_padded.view(kv_shape)[:, :longest]
            out = attend(q.view(len(lens), n, *q.shape[1:]), k_padded, v_padded, lengths - n, lengths, *options)
            return out.flatten(0, 1)
        out = q.new_empty(q.shape)
        tables = block_table.tolist()
        k_buffer, v_buffer = (self.workspace.get(role, k_cache, max_pages) for role in ("k", "v"))
        for i, length in enumerate(lens):
            start, end = cu[i], cu[i + 1]
            if start == end:
                continue
            pages = tables[i][: -(-length // page_size)]
            lengths = torch.tensor([length])
            out[start:end] = attend(q[None, start:end], request_kv(k_cache, pages, length, k_buffer)[None],
                                    request_kv(v_cache, pages, length, v_buffer)[None], lengths - (end - start),
                                    lengths, *options)[0]
        return out

    def decode(self, *args):
        return self.prefill(*args, decode=True)
