"""Triton helpers shared by the kernels: segment search and the paged online-softmax loop."""

import triton
import triton.language as tl


@triton.jit
def find_segment(offsets, x, n, LOG_N: tl.constexpr):
    """The last i in [0, n) with offsets[i] <= x (offsets non-decreasing, offsets[0] <= x): which request a token
    (or a query tile) belongs to, by binary search; empty segments are skipped."""
    lo = 0
    hi = n - 1
    for _ in tl.static_range(LOG_N):
        mid = (lo + hi + 1) // 2
        go_right = tl.load(offsets + mid) <= x
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    return lo


@triton.jit
def attend_pages(
    q, q_pos, acc, l_i, m_i,  # q: [R, BLOCK_D]; q_pos: [R] position of each row's token; running state
    KCache, VCache, block_table_row, kv_head,  # block_table_row: pointer to this request's block_table row
    kv_lo, kv_hi, seq_len, num_pages, num_table_pages, scale, logit_cap, sliding_window, attention_chunk,
    stride_cp, stride_cr, stride_ch,  # cache strides: page, row, head (head dim contiguous)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, UPCAST: tl.constexpr,
):
    """Online softmax of q's rows over KV positions [kv_lo, kv_hi) of one request, read in place from its pages.

    Keys past `seq_len`, beyond the block table, in pages outside [0, num_pages), after a row's own position, or
    outside its sliding window or its chunk of positions are masked: neither loaded nor weighted.
    """
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        page_index = pos // PAGE_SIZE
        in_table = (pos < seq_len) & (page_index < num_table_pages)
        page = tl.load(block_table_row + page_index, mask=in_table, other=-1)
        ok = in_table & (page >= 0) & (page < num_pages)
        offset = page.to(tl.int64) * stride_cp + (pos % PAGE_SIZE) * stride_cr + kv_head * stride_ch
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(KCache + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(VCache + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        # fp32 inputs as three TF32 products (about fp32's precision; plain TF32 would round them to 10 bits), on
        # tensor cores: IEEE fp32 dots spill kilobytes of registers. fp16/bf16 inputs ignore it.
        s = tl.dot(q, tl.trans(k), input_precision="tf32x3") * scale  # [R, BLOCK_N], fp32
        if SOFT_CAP:
            # logit_cap * tanh(s / logit_cap), with tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf
            s = logit_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / logit_cap) + 1.0))
        visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        if HAS_CHUNK:  # a row sees its own chunk only: positions from q_pos - q_pos % attention_chunk
            visible = visible & (pos[None, :] >= (q_pos - q_pos % attention_chunk)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite, so fully masked rows stay NaN-free
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="tf32x3")
        m_i = m_new
    return acc, l_i, m_i
