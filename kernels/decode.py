"""Paged split-KV decode ("flash-decoding"): q_len query tokens per request (1 for DECODE, the draft length for
TARGET_VERIFY), the KV range of each request split across num_splits programs, then reduced.
Sizes that vary with the batch (q_len, group, splits) are runtime arguments, so one compiled kernel serves them all.

Stage 1, grid (B, Hkv * row_tiles, num_splits): program (i, kv_head * row_tiles + t, s) takes the t-th tile of
BLOCK_R of the q_len x group query rows of request i that share kv_head (row r: token r // group, head
kv_head * group + r % group), and the s-th of num_splits equal BLOCK_N-aligned chunks of the request's visible KV
range [lo, seq_len) (lo > 0 with a sliding window). Row tiles bound a program's registers and shared memory
whatever the group size and draft length. It writes a normalised partial output and its log-sum-exp (-inf for
an empty chunk). Stage 2, grid (T, Hq, cdiv(BLOCK_DV, BLOCK_C)): combines the splits of a block of BLOCK_C of
Dv's columns (all of them but for wide rows over many splits, `config.reduce_columns`), weighting each by
exp(lse - max lse); a head's sink joins there, once, as one more term exp(sink - max) of the denominator with
nothing to add to the output. With
chunked attention, keys before a row's chunk are masked in stage 1. A tree mask (HAS_TREE, verify over a draft tree)
is applied in stage 1 as in prefill; the split ranges stay as they are: a request's lowest position is its first
token's, prefix, under a tree too (depth 0).
num_splits comes from static sizes only (batch, kv heads, table capacity, SM count), so it is fixed under a
CUDA graph; a batch of 1 with a 32k context still fills the GPU.
"""

import torch
import triton
import triton.language as tl

from .common import attend_pages, kernel_kv, kernel_tree, load_q, tree_rows, values_in_keys
from .config import Target, decode_tiles, head_blocks, reduce_columns


# A line per kind of argument, here, in the launch and in the call of attend_pages (see common.attend_pages).
@triton.jit
def _decode_split_kernel(
    Q, KCache, VCache, PartialOut, PartialLse, SeqLens, BlockTable, KScale, VScale,  # pointers (scales: [Hkv] fp32)
    TreeWords, Positions,  # trees only (`common.kernel_tree`): [T, W] int32, [T] int32
    q_len, group, row_tiles, num_splits, num_q_heads, num_pages, num_table_pages,  # sizes
    scale, logit_cap, sliding_window, attention_chunk,  # options
    stride_qt, stride_qh, stride_qd,  # q [T, Hq, D], any strides
    stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh,  # caches [num_pages, page_size, Hkv, D or Dv]
    stride_bt, stride_ks, stride_vs,  # block_table rows; scales (0 when expanded from one value)
    num_words,  # W, of the tree words
    BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROPE: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, V_IN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
    UPCAST: tl.constexpr, KV_FP8: tl.constexpr, HAS_TREE: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0)
    kv_head = tl.program_id(1) // row_tiles
    row_tile = tl.program_id(1) % row_tiles
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + request)
    prefix = seq_len - q_len

    rows = row_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < q_len * group
    token = request * q_len + rows // group
    head = kv_head * group + rows % group
    q_row = token.to(tl.int64) * stride_qt + head * stride_qh
    q, q_rope = load_q(Q, q_row, row_ok, stride_qd, HEAD_DIM, BLOCK_D, BLOCK_ROPE, UPCAST)
    q_pos = prefix + rows // group
    row_pos, tree_words = tree_rows(
        TreeWords, Positions, q_pos, token, row_ok, num_words, HAS_TREE, HAS_WINDOW or HAS_CHUNK
    )
    if KV_FP8 != "":  # k's scale joins the scores' scale; v's scales the output
        scale *= tl.load(KScale + kv_head * stride_ks)

    visible_lo = 0
    if HAS_WINDOW:  # the request's lowest position is its first token's, prefix (depth 0 under a tree too)
        visible_lo = tl.maximum(prefix + 1 - sliding_window, 0)
    chunk = tl.cdiv(tl.cdiv(seq_len - visible_lo, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = visible_lo + split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, seq_len)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], -1e30, dtype=tl.float32)
    # fmt: off
    acc, l_i, m_i = attend_pages(
        q, q_rope, q_pos, acc, l_i, m_i, KCache, VCache, BlockTable + request * stride_bt, kv_head,
        kv_lo, kv_hi, seq_len, num_pages, num_table_pages, scale, logit_cap, sliding_window, attention_chunk,
        stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh,
        row_pos, tree_words, num_words, prefix, Positions, request * q_len, q_len * tl.num_programs(0),
        HEAD_DIM, BLOCK_D, BLOCK_ROPE, HEAD_DIM_V, BLOCK_DV, V_IN_K, BLOCK_N, PAGE_SIZE, SOFT_CAP, HAS_WINDOW,
        HAS_CHUNK, UPCAST, KV_FP8, HAS_TREE,
    )
    # fmt: on
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8 != "":
        out *= tl.load(VScale + kv_head * stride_vs)
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    # partials: [T, Hq, num_splits, BLOCK_DV] and [T, Hq, num_splits], contiguous
    row_index = (token.to(tl.int64) * num_q_heads + head) * num_splits + split
    dv = tl.arange(0, BLOCK_DV)
    tl.store(PartialOut + row_index[:, None] * BLOCK_DV + dv[None, :], out, mask=row_ok[:, None])
    tl.store(PartialLse + row_index, lse, mask=row_ok)


@triton.jit
def _decode_reduce_kernel(
    PartialOut,
    PartialLse,
    Out,
    Sinks,  # Sinks: [Hq] fp32
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,  # a partial's padded width
    BLOCK_C: tl.constexpr,  # its columns per program
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token.to(tl.int64) * tl.num_programs(1) + head
    s = tl.arange(0, BLOCK_S)
    dv = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    lse = tl.load(PartialLse + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
    lse_max = tl.maximum(tl.max(lse, 0), -1e30)  # finite even when no split saw a key
    if HAS_SINKS:
        sink = tl.load(Sinks + head)
        lse_max = tl.maximum(lse_max, sink)
    weight = tl.exp(lse - lse_max)
    partial = tl.load(
        PartialOut + (row * num_splits + s)[:, None] * BLOCK_DV + dv[None, :], mask=(s < num_splits)[:, None], other=0.0
    )
    total = tl.sum(weight, 0)
    if HAS_SINKS:
        total += tl.exp(sink - lse_max)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + token * stride_ot + head * stride_oh + dv, out.to(Out.dtype.element_ty), mask=dv < HEAD_DIM_V)


def num_kv_splits(programs_per_split: int, max_kv_len: int, block_n: int, num_sms: int) -> int:
    """Splits per request: enough programs to fill the GPU twice over, never more than the table has blocks.

    programs_per_split: requests x kv heads x row tiles. From static sizes only, so the value is fixed for a
    captured graph.
    """
    wanted = triton.cdiv(2 * num_sms, max(programs_per_split, 1))
    return max(1, min(wanted, triton.cdiv(max_kv_len, block_n), 64))


def decode(q, k_cache, v_cache, seq_lens, block_table, options, target: Target, num_splits=None, batch_invariant=False):
    """Attention of q: [T, Hq, D], T = B * q_len, over the paged caches k_cache: [num_pages, page_size, Hkv, D],
    v_cache: [..., Hkv, Dv] (new tokens already stored); returns [T, Hq, Dv] in q's dtype.
    options: resolved `hybrid_ops.options.Options` (scale a float; k_scale, v_scale [Hkv] float32, any stride, for
    fp8 caches, read as stored * scale).

    `batch_invariant` takes the split count as for a batch of one, so a request's result never depends on its batch.
    """
    scale, sliding_window, logit_cap, sinks = options.scale, options.sliding_window, options.logit_cap, options.sinks
    attention_chunk = options.attention_chunk
    num_tokens, num_q_heads, head_dim = q.shape
    num_requests, num_kv_heads, page_size = seq_lens.shape[0], k_cache.shape[2], k_cache.shape[1]
    v_head_dim = v_cache.shape[3]
    out = q.new_empty(num_tokens, num_q_heads, v_head_dim)
    if num_tokens == 0:
        return out
    q_len = num_tokens // num_requests
    group = num_q_heads // num_kv_heads
    tiles = decode_tiles(q.dtype, max(head_dim, v_head_dim), q_len * group, target)
    row_tiles = triton.cdiv(q_len * group, tiles.block_rows)
    if num_splits is None:
        programs = (1 if batch_invariant else num_requests) * num_kv_heads * row_tiles
        num_splits = num_kv_splits(programs, block_table.shape[1] * page_size, tiles.block_n, target.num_sms)
    blocks = head_blocks(head_dim, v_head_dim)
    padded_dv, columns = blocks[2], reduce_columns(num_splits, blocks[2])
    v_in_k = values_in_keys(k_cache, v_cache, blocks)
    k_cache, v_cache, k_scale, v_scale, kv_fp8 = kernel_kv(k_cache, v_cache, options.k_scale, options.v_scale)
    cu_seqlens_q = None  # as the kernel reads q: token j of request i is q[i * q_len + j]
    if options.tree_mask is not None:
        cu_seqlens_q = torch.arange(0, num_tokens + 1, q_len, dtype=torch.int32, device=q.device)
    tree_words, num_words, positions, has_tree = kernel_tree(options.tree_mask, cu_seqlens_q, seq_lens, seq_lens)
    partial_out = torch.empty(num_tokens, num_q_heads, num_splits, padded_dv, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_requests, num_kv_heads * row_tiles, num_splits)](
        q, k_cache, v_cache, partial_out, partial_lse, seq_lens, block_table, k_scale, v_scale, tree_words, positions,
        q_len, group, row_tiles, num_splits, num_q_heads, k_cache.shape[0], block_table.shape[1],
        scale, logit_cap, sliding_window, attention_chunk,
        *q.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0), k_scale.stride(0), v_scale.stride(0),
        num_words,
        BLOCK_R=tiles.block_rows, HEAD_DIM=head_dim, BLOCK_D=blocks[0], BLOCK_ROPE=blocks[1], HEAD_DIM_V=v_head_dim,
        BLOCK_DV=padded_dv, V_IN_K=v_in_k, BLOCK_N=tiles.block_n, PAGE_SIZE=page_size,
        SOFT_CAP=logit_cap > 0, HAS_WINDOW=sliding_window > 0, HAS_CHUNK=attention_chunk > 0,
        UPCAST=target.interpret and q.dtype == torch.bfloat16, KV_FP8=kv_fp8, HAS_TREE=has_tree,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    _decode_reduce_kernel[(num_tokens, num_q_heads, triton.cdiv(padded_dv, columns))](
        partial_out,
        partial_lse,
        out,
        partial_lse if sinks is None else sinks,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM_V=v_head_dim,
        BLOCK_DV=padded_dv,
        BLOCK_C=columns,
        BLOCK_S=triton.next_power_of_2(num_splits),
        HAS_SINKS=sinks is not None,
    )
    return out
