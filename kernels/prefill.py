"""Paged prefill / extend: ragged queries over each request's cached prefix and new tokens.

Grid: (cdiv(T, BLOCK_M) + B, Hkv * head_tiles). Program (p, kv_head * head_tiles + h) takes query tile p of the
batch: the tiles of request i are numbered from tile_cu[i] (a device cumsum of cdiv(q_len, BLOCK_M), no host sync);
programs past the last tile exit. A program holds BLOCK_M tokens x BLOCK_G of the `group` query heads that share
`kv_head` (the h-th BLOCK_G of them; one head tile, the group padded to BLOCK_G, unless the group is larger than the
tile's rows, as MLA's 128 heads over one latent kv head) as its rows, so each K/V block is loaded once for those
heads. Token j of a request with prefix P sits at position P + j and sees positions [max(0, P + j - W + 1), P + j]
(W = sliding window, else from 0), and with chunked attention none before its chunk's first position; the loop
covers the union over the tile's rows, so a tile's keys end at its last token: prefix + (tile + 1) * BLOCK_M. With
sinks, each row's online softmax starts from its head's sink logit (running max = sink, sum = 1, nothing
accumulated), which adds exp(sink) to the denominator. With a tree mask (HAS_TREE), a row also drops the new tokens
its mask row does not name (`common.attend_pages`), and the window and chunk compare positions, prefix + depth,
computed on the device by the launcher (`common.kernel_tree`); a tile's first key then comes from its rows' lowest
position, as depths need not grow with the slots. Its last key stays its last slot.
"""

import torch
import triton
import triton.language as tl

from .common import attend_pages, find_segment, kernel_kv, kernel_tree, load_q, tree_rows, values_in_keys
from .config import Target, head_blocks, prefill_tiles
from .kv_store import log2_ceil


# A line per kind of argument, here, in the launch and in the call of attend_pages (see common.attend_pages).
@triton.jit
def _prefill_kernel(
    Q, KCache, VCache, Out, CuSeqlensQ, SeqLens, BlockTable, TileCu, Sinks,  # pointers (Sinks: [Hq] fp32)
    KScale, VScale,  # [Hkv] fp32, fp8 caches only
    TreeWords, Positions,  # trees only (`common.kernel_tree`): [T, W] int32, [T] int32
    num_tokens, num_requests, group, head_tiles, num_pages, num_table_pages,  # sizes
    scale, logit_cap, sliding_window, attention_chunk,  # options
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh,  # q [T, Hq, D] any strides; out [T, Hq, Dv]
    stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh,  # caches [num_pages, page_size, Hkv, D or Dv]
    stride_bt, stride_ks, stride_vs,  # block_table rows; scales (0 when expanded from one value)
    num_words,  # W, of the tree words
    BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROPE: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, V_IN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, LOG_B: tl.constexpr,
    SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr,
    UPCAST: tl.constexpr, KV_FP8: tl.constexpr, HAS_TREE: tl.constexpr,
):  # fmt: skip
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1) // head_tiles
    head_tile = tl.program_id(1) % head_tiles
    if tile_id >= tl.load(TileCu + num_requests):
        return
    request = find_segment(TileCu, tile_id, num_requests, LOG_B)
    tile = tile_id - tl.load(TileCu + request)
    q_start = tl.load(CuSeqlensQ + request)
    q_len = tl.load(CuSeqlensQ + request + 1) - q_start
    seq_len = tl.load(SeqLens + request)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    token = tile * BLOCK_M + rows // BLOCK_G
    group_head = head_tile * BLOCK_G + rows % BLOCK_G
    head = kv_head * group + group_head
    # Rows stay inside q even when cu_seqlens_q is inconsistent (validation off).
    row_ok = (token < q_len) & (group_head < group) & (q_start + token < num_tokens) & (q_start + token >= 0)
    q_row = (q_start + token).to(tl.int64) * stride_qt + head * stride_qh
    q, q_rope = load_q(Q, q_row, row_ok, stride_qd, HEAD_DIM, BLOCK_D, BLOCK_ROPE, UPCAST)
    q_pos = prefix + token
    row_pos, tree_words = tree_rows(
        TreeWords, Positions, q_pos, q_start + token, row_ok, num_words, HAS_TREE, HAS_WINDOW or HAS_CHUNK
    )
    if KV_FP8 != "":  # k's scale joins the scores' scale; v's scales the output
        scale *= tl.load(KScale + kv_head * stride_ks)

    kv_hi = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    kv_lo = 0
    if HAS_WINDOW:
        first_pos = prefix + tile * BLOCK_M
        if HAS_TREE:  # positions need not grow with slots: the tile's lowest
            first_pos = tl.min(tl.where(row_ok, row_pos, first_pos))
        kv_lo = tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], dtype=tl.float32)
    if HAS_SINKS:  # max(sink, -1e30) keeps the running max finite even for a sink of -inf (which adds 0)
        sink = tl.load(Sinks + head, mask=row_ok, other=float("-inf"))
        m_i = tl.maximum(sink, -1e30)
        l_i = tl.exp(sink - m_i)
    else:
        l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
        m_i = tl.full([BLOCK_M * BLOCK_G], -1e30, dtype=tl.float32)
    # fmt: off
    acc, l_i, m_i = attend_pages(
        q, q_rope, q_pos, acc, l_i, m_i, KCache, VCache, BlockTable + request * stride_bt, kv_head,
        kv_lo, kv_hi, seq_len, num_pages, num_table_pages, scale, logit_cap, sliding_window, attention_chunk,
        stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh,
        row_pos, tree_words, num_words, prefix, Positions, q_start, num_tokens,
        HEAD_DIM, BLOCK_D, BLOCK_ROPE, HEAD_DIM_V, BLOCK_DV, V_IN_K, BLOCK_N, PAGE_SIZE, SOFT_CAP, HAS_WINDOW,
        HAS_CHUNK, UPCAST, KV_FP8, HAS_TREE,
    )
    # fmt: on
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8 != "":
        out *= tl.load(VScale + kv_head * stride_vs)
    dv = tl.arange(0, BLOCK_DV)
    tl.store(
        Out + (q_start + token)[:, None].to(tl.int64) * stride_ot + head[:, None] * stride_oh + dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < HEAD_DIM_V),
    )


def prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options, target: Target):
    """Attention of q: [T, Hq, D] over the paged caches k_cache: [num_pages, page_size, Hkv, D], v_cache: [...,
    Hkv, Dv] (new tokens already stored); returns [T, Hq, Dv] in q's dtype.
    options: resolved `hybrid_ops.options.Options` (scale a float; k_scale, v_scale [Hkv] float32, any stride, for
    fp8 caches, read as stored * scale)."""
    scale, sliding_window, logit_cap, sinks = options.scale, options.sliding_window, options.logit_cap, options.sinks
    attention_chunk = options.attention_chunk
    num_tokens, num_q_heads, head_dim = q.shape
    num_requests, num_kv_heads, v_head_dim = seq_lens.shape[0], k_cache.shape[2], v_cache.shape[3]
    out = q.new_empty(num_tokens, num_q_heads, v_head_dim)
    if num_tokens == 0 or num_requests == 0:
        return out
    group = num_q_heads // num_kv_heads
    k_cache, v_cache, k_scale, v_scale, kv_fp8 = kernel_kv(k_cache, v_cache, options.k_scale, options.v_scale)
    tiles = prefill_tiles(q.dtype, max(head_dim, v_head_dim), group, target, options.tree_mask is not None)
    block_m, head_tiles = tiles.block_rows, triton.cdiv(group, tiles.block_heads)
    blocks = head_blocks(head_dim, v_head_dim)
    v_in_k = values_in_keys(k_cache, v_cache, blocks)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).clamp(min=0)
    tile_cu = torch.zeros(num_requests + 1, dtype=torch.int32, device=q.device)
    torch.cumsum((q_lens + block_m - 1) // block_m, 0, out=tile_cu[1:])
    tree_words, num_words, positions, has_tree = kernel_tree(options.tree_mask, cu_seqlens_q, seq_lens, seq_lens)
    grid = (triton.cdiv(num_tokens, block_m) + num_requests, num_kv_heads * head_tiles)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, tile_cu, q if sinks is None else sinks,
        k_scale, v_scale, tree_words, positions,
        num_tokens, num_requests, group, head_tiles, k_cache.shape[0], block_table.shape[1],
        scale, logit_cap, sliding_window, attention_chunk,
        *q.stride(), out.stride(0), out.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0), k_scale.stride(0), v_scale.stride(0),
        num_words,
        BLOCK_G=tiles.block_heads, HEAD_DIM=head_dim, BLOCK_D=blocks[0], BLOCK_ROPE=blocks[1],
        HEAD_DIM_V=v_head_dim, BLOCK_DV=blocks[2], V_IN_K=v_in_k,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, PAGE_SIZE=k_cache.shape[1], LOG_B=log2_ceil(num_requests),
        SOFT_CAP=logit_cap > 0, HAS_WINDOW=sliding_window > 0, HAS_CHUNK=attention_chunk > 0,
        HAS_SINKS=sinks is not None, UPCAST=target.interpret and q.dtype == torch.bfloat16, KV_FP8=kv_fp8,
        HAS_TREE=has_tree, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out
