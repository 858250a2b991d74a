"""KV store: write the step's new k, v into their paged cache slots.

Grid: (T,), one program per new token, writing all its kv heads. Token t of request i (found by binary search over
cu_seqlens_q) sits at position seq_lens[i] - q_len_i + (t - cu_seqlens_q[i]); its slot is row position % page_size
of page block_table[i, position // page_size]. Tokens whose position falls outside the block table or whose page
id is outside the cache are not written. An fp8 cache gets k / k_scale[head] (v / v_scale[head]): a correctly rounded
fp32 division (`/` is approximate on a GPU), then `float_to_fp8`, byte for byte as `hybrid_ops.fp8.quantize`.
"""

import triton
import triton.language as tl

from .common import find_segment, float_to_fp8, kernel_kv


@triton.jit
def _store_kv_kernel(
    # pointers (scales: [Hkv] fp32)
    K,
    V,
    KCache,
    VCache,
    CuSeqlensQ,
    SeqLens,
    BlockTable,
    KScale,
    VScale,
    # sizes
    num_requests,
    num_pages,
    num_table_pages,
    # new k: [T, Hkv, D], v: [T, Hkv, Dv]
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    # caches: page, row, head
    stride_kcp,
    stride_kcr,
    stride_kch,
    stride_vcp,
    stride_vcr,
    stride_vch,
    # block_table rows; scales (0 when expanded from one value)
    stride_bt,
    stride_ks,
    stride_vs,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    LOG_B: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    token = tl.program_id(0)
    request = find_segment(CuSeqlensQ, token, num_requests, LOG_B)
    q_start = tl.load(CuSeqlensQ + request)
    q_len = tl.load(CuSeqlensQ + request + 1) - q_start
    seq_len = tl.load(SeqLens + request)
    pos = seq_len - q_len + token - q_start
    page_index = pos // PAGE_SIZE
    # Table entries past a request's length may name other requests' pages: never write there.
    in_table = (pos >= 0) & (pos < seq_len) & (page_index < num_table_pages)
    page = tl.load(BlockTable + request * stride_bt + page_index, mask=in_table, other=-1)
    ok = in_table & (page >= 0) & (page < num_pages)

    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dv = tl.arange(0, BLOCK_DV)[None, :]
    # `ok` enters through the head bound: the interpreter rejects a block mask & a scalar bool.
    h_ok = h < NUM_KV_HEADS * ok.to(tl.int32)
    k_mask = h_ok & (d < HEAD_DIM)
    v_mask = h_ok & (dv < HEAD_DIM_V)
    k = tl.load(K + token * stride_kt + h * stride_kh + d * stride_kd, mask=k_mask)
    v = tl.load(V + token * stride_vt + h * stride_vh + dv * stride_vd, mask=v_mask)
    if KV_FP8 != "":
        k_scale = tl.load(KScale + h * stride_ks, mask=h < NUM_KV_HEADS, other=1.0)
        v_scale = tl.load(VScale + h * stride_vs, mask=h < NUM_KV_HEADS, other=1.0)
        k = float_to_fp8(tl.div_rn(k.to(tl.float32), k_scale), KV_FP8)
        v = float_to_fp8(tl.div_rn(v.to(tl.float32), v_scale), KV_FP8)
    page = page.to(tl.int64)
    row = pos % PAGE_SIZE
    tl.store(KCache + page * stride_kcp + row * stride_kcr + h * stride_kch + d, k, mask=k_mask)
    tl.store(VCache + page * stride_vcp + row * stride_vcr + h * stride_vch + dv, v, mask=v_mask)


def store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, k_scale=None, v_scale=None):
    """Writes k: [T, Hkv, D], v: [T, Hkv, Dv] into k_cache: [num_pages, page_size, Hkv, D], v_cache:
    [num_pages, page_size, Hkv, Dv] of k's dtype, or fp8 with k_scale, v_scale: [Hkv] float32 (any stride; needed
    for fp8 caches only)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    num_requests = seq_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return
    k_cache, v_cache, k_scale, v_scale, kv_fp8 = kernel_kv(k_cache, v_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_table,
        k_scale,
        v_scale,
        num_requests,
        k_cache.shape[0],
        block_table.shape[1],
        *k.stride(),
        *v.stride(),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_table.stride(0),
        k_scale.stride(0),
        v_scale.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=v.shape[2],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v.shape[2]),
        PAGE_SIZE=k_cache.shape[1],
        LOG_B=log2_ceil(num_requests),
        KV_FP8=kv_fp8,
    )


def log2_ceil(n: int) -> int:
    """Binary-search steps for n segments."""
    return max(n - 1, 0).bit_length()
