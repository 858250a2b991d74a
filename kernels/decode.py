"""Paged split-KV decode ("flash-decoding"): Q_LEN query tokens per request (1 for DECODE, the draft length for
TARGET_VERIFY), the KV range of each request split across NUM_SPLITS programs, then reduced.

Stage 1, grid (B, Hkv, NUM_SPLITS): program (i, kv_head, s) takes the Q_LEN x GROUP query rows of request i that
share kv_head, and the s-th of NUM_SPLITS equal BLOCK_N-aligned chunks of the request's visible KV range
[lo, seq_len) (lo > 0 with a sliding window). It writes a normalised partial output and its log-sum-exp (-inf for
an empty chunk). Stage 2, grid (T, Hq): combines the splits, weighting each by exp(lse - max lse).
NUM_SPLITS comes from static sizes only (batch, kv heads, table capacity, SM count), so it is fixed under a
CUDA graph; a batch of 1 with a 32k context still fills the GPU.
"""

import torch
import triton
import triton.language as tl

from .common import attend_pages


@triton.jit
def _decode_split_kernel(
    Q, KCache, VCache, PartialOut, PartialLse, SeqLens, BlockTable,  # pointers
    num_pages, num_table_pages, scale, logit_cap, sliding_window,  # sizes and options
    stride_qt, stride_qh, stride_qd,  # q [T, Hq, D], any strides
    stride_cp, stride_cr, stride_ch, stride_bt,  # caches [num_pages, page_size, Hkv, D]; block_table rows
    Q_LEN: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + request)
    prefix = seq_len - Q_LEN

    rows = tl.arange(0, BLOCK_R)  # row r: token r // GROUP, head kv_head * GROUP + r % GROUP
    row_ok = rows < Q_LEN * GROUP
    token = request * Q_LEN + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    q_mask = row_ok[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + token[:, None].to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + rows // GROUP

    visible_lo = 0
    if HAS_WINDOW:
        visible_lo = tl.maximum(prefix + 1 - sliding_window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - visible_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = visible_lo + split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, seq_len)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], -1e30, dtype=tl.float32)
    acc, l_i, m_i = attend_pages(
        q, q_pos, acc, l_i, m_i, KCache, VCache, BlockTable + request * stride_bt, kv_head,
        kv_lo, kv_hi, seq_len, num_pages, num_table_pages, scale, logit_cap, sliding_window,
        stride_cp, stride_cr, stride_ch,
        HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, SOFT_CAP, HAS_WINDOW, UPCAST,
    )
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    # partials: [T, Hq, NUM_SPLITS, BLOCK_D] and [T, Hq, NUM_SPLITS], contiguous
    row_index = (token.to(tl.int64) * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
    tl.store(PartialOut + row_index[:, None] * BLOCK_D + d[None, :], out, mask=row_ok[:, None])
    tl.store(PartialLse + row_index, lse, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    PartialOut, PartialLse, Out,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token.to(tl.int64) * tl.num_programs(1) + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(PartialLse + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    lse_max = tl.maximum(tl.max(lse, 0), -1e30)  # finite even when no split saw a key
    weight = tl.exp(lse - lse_max)
    partial = tl.load(PartialOut + (row * NUM_SPLITS + s)[:, None] * BLOCK_D + d[None, :],
                      mask=(s < NUM_SPLITS)[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + token * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


def num_kv_splits(batch_size: int, num_kv_heads: int, max_kv_len: int, block_n: int, num_sms: int) -> int:
    """Splits per request: enough programs to fill the GPU twice over, never more than the table has blocks.

    From static sizes only, so the value is fixed for a captured graph.
    """
    wanted = triton.cdiv(2 * num_sms, max(batch_size * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(max_kv_len, block_n), 64))


def decode(q, k_cache, v_cache, seq_lens, block_table, scale, sliding_window, logit_cap, upcast, interpret,
           num_splits=None, batch_invariant=False):
    """Attention of q: [T, Hq, D], T = B * Q_LEN, over the paged caches (new tokens already stored).

    `batch_invariant` takes the split count as for a batch of one, so a request's result never depends on its batch.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_requests, num_kv_heads, page_size = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    out = q.new_empty(q.shape)
    if num_tokens == 0:
        return out
    q_len = num_tokens // num_requests
    group = num_q_heads // num_kv_heads
    block_n = 128 if interpret else 64
    block_d = triton.next_power_of_2(head_dim)
    if num_splits is None:
        num_sms = 4 if interpret else torch.cuda.get_device_properties(q.device).multi_processor_count
        num_splits = num_kv_splits(1 if batch_invariant else num_requests, num_kv_heads,
                                   block_table.shape[1] * page_size, block_n, num_sms)
    partial_out = torch.empty(num_tokens, num_q_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_requests, num_kv_heads, num_splits)](
        q, k_cache, v_cache, partial_out, partial_lse, seq_lens, block_table,
        k_cache.shape[0], block_table.shape[1], scale, logit_cap, sliding_window,
        *q.stride(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        Q_LEN=q_len, GROUP=group, BLOCK_R=max(triton.next_power_of_2(q_len * group), 16), HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_N=block_n, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        SOFT_CAP=logit_cap > 0, HAS_WINDOW=sliding_window > 0, UPCAST=upcast,
        num_warps=4, num_stages=1 if interpret else 2,
    )
    _decode_reduce_kernel[(num_tokens, num_q_heads)](
        partial_out, partial_lse, out, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out
