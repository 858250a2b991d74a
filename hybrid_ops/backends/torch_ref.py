"""The PyTorch backend: plain tensor code that runs on any device, and the reference for the other backends.

It reads the metadata to the host (one sync on CUDA), so it always checks the metadata's values and cannot be
captured in a CUDA graph; on CUDA, "auto" prefers the Triton or FlashInfer backend.
"""

import torch
import torch.nn.functional as F

from ..metadata import new_token_slots
from ..validation import FLOAT_DTYPES, check_metadata_values


def store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table):
    """Write the new k, v: [T, Hkv, D] to their cache rows, in place."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    slots = new_token_slots(cu_seqlens_q, seq_lens, block_table, k.shape[0], page_size)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def request_kv(cache, pages, length):
    """[length, Hkv, D] of one request: a view when its pages are consecutive, else a gathered copy."""
    page_size = cache.shape[1]
    first = int(pages[0])
    if int(pages[-1]) - first == pages.shape[0] - 1 and bool((pages.diff() == 1).all()):
        return cache.view(-1, *cache.shape[2:])[first * page_size : first * page_size + length]
    return cache[pages].flatten(0, 1)[:length]


def attend(q, k, v, prefix, scale, sliding_window, logit_cap):
    """Attention of one request's new tokens over its whole KV, computed in fp32 at least.

    q: [n, Hq, D]; k, v: [L, Hkv, D] with L = prefix + n; returns [n, Hq, D] in q's dtype.
    """
    n, num_q_heads, head_dim = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    # Each kv head serves its `group` query heads as extra rows: [Hkv, n * group, D], no K/V repeat.
    q_rows = q.to(compute_dtype).view(n, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
    k_t = k.to(compute_dtype).transpose(0, 1)
    v_t = v.to(compute_dtype).transpose(0, 1)

    mask = None
    if n > 1 or (0 < sliding_window < length):
        query_pos = torch.arange(prefix, prefix + n, device=q.device).repeat_interleave(group)[:, None]
        key_pos = torch.arange(length, device=q.device)[None, :]
        mask = key_pos <= query_pos
        if sliding_window > 0:
            mask &= key_pos > query_pos - sliding_window
    if logit_cap > 0:
        scores = torch.matmul(q_rows, k_t.transpose(1, 2)) * scale
        scores = logit_cap * torch.tanh(scores / logit_cap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), v_t)
    else:
        out = F.scaled_dot_product_attention(q_rows, k_t, v_t, attn_mask=mask, scale=scale)
    return out.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, num_q_heads, head_dim).to(q.dtype)


class TorchBackend:
    name = "torch"
    requirement = "torch"
    checks_values = True

    def is_available(self) -> bool:
        return True

    def supports(self, q) -> bool:
        return q.dtype in FLOAT_DTYPES

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window,
                logit_cap, decode=False):
        num_pages, page_size = k_cache.shape[:2]
        cu, lens = check_metadata_values(cu_seqlens_q, seq_lens, block_table, q.shape[0], num_pages, page_size,
                                         decode)
        store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
        out = q.new_empty(q.shape)
        for i, length in enumerate(lens):
            start, end = cu[i], cu[i + 1]
            if start == end:
                continue
            pages = block_table[i, : (length + page_size - 1) // page_size]
            out[start:end] = attend(q[start:end], request_kv(k_cache, pages, length), request_kv(v_cache, pages, length),
                                    length - (end - start), scale, sliding_window, logit_cap)
        return out

    def decode(self, *args):
        return self.prefill(*args, decode=True)
