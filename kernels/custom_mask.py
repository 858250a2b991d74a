"""FlashInfer's custom mask from a tree mask (`tree_mask`, hybrid_ops/ops.py), written on the device.

FlashInfer's mask (its MaskMode CUSTOM, `attention/variants.cuh`) replaces causal masking and covers each request's
whole KV: request i's block holds q_len_i x kv_len_i bits, row-major, bit j * kv_len_i + c saying whether its new
token j sees the key in slot c, prefix included. Packed, the block starts at byte indptr[i] (request by request, each
rounded up to whole bytes) and bit e of a block is bit e % 8 of its byte e // 8 (little-endian, as its `plan` packs a
bool mask with `segment_packbits(..., bitorder="little")`); unpacked (the bool `custom_mask` its `plan` takes), one
element per bit and indptr[i] counts elements.

A new token j at prefix P = kv_len - q_len sees the slots of the prefix, itself, and the earlier new tokens its tree
row names; with a sliding window W, only keys whose positions lie within W of its own, positions as the ops define
them for trees: P + depth, depth the number of earlier new tokens a row sees (a prefix key's position is its slot).
Entries of the tree on and above the diagonal and columns past q_len are never read.

Grid: one program per BLOCK output bytes (BLOCK * BITS bits), its requests found by binary search over indptr;
programs past indptr[B] return at once, so a CUDA graph's buffer sized for the largest step costs nothing beyond the
step's own mask. No host sync: the sizes come from the metadata on the device.
"""

import torch
import triton
import triton.language as tl

from .common import find_segment
from .kv_store import log2_ceil

BITS_PER_PROGRAM = 2048
NO_WINDOW = 1 << 30  # farther than any position


@triton.jit
def _custom_mask_kernel(
    Out,  # uint8 [capacity]
    Indptr,  # int32 [B + 1]: each request's first byte (element) in Out
    TreeMask,  # uint8 [T, Q] (bool's bytes)
    Depth,  # int32 [T]: earlier new tokens each token sees
    CuSeqlensQ,
    SeqLens,
    num_requests,
    num_tokens,
    num_columns,
    capacity,
    stride_tree_row,
    stride_tree_column,
    sliding_window,  # NO_WINDOW without one
    BITS: tl.constexpr,  # 8: packed bits; 1: one bool per element
    BLOCK: tl.constexpr,
    LOG_B: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK
    end = tl.load(Indptr + num_requests)
    if first >= end:
        return
    byte = first + tl.arange(0, BLOCK)
    request = tl.zeros([BLOCK], tl.int32) + find_segment(Indptr, byte, num_requests, LOG_B)
    q_start = tl.load(CuSeqlensQ + request)
    q_len = tl.load(CuSeqlensQ + request + 1) - q_start
    kv_len = tl.load(SeqLens + request)
    prefix = kv_len - q_len
    size = q_len.to(tl.int64) * kv_len.to(tl.int64)  # the request's bits
    element = (byte - tl.load(Indptr + request)).to(tl.int64)[:, None] * BITS + tl.arange(0, BITS)[None, :]
    valid = (element < size[:, None]) & (byte < end)[:, None]
    kv = tl.maximum(kv_len, 1).to(tl.int64)[:, None]
    j = tl.where(valid, element // kv, 0).to(tl.int32)  # [BLOCK, BITS]: the query row
    slot = tl.where(valid, element % kv, 0).to(tl.int32)  # the key's slot
    column = slot - prefix[:, None]  # the key among the new tokens, negative in the prefix
    token = q_start[:, None] + j
    valid &= (token >= 0) & (token < num_tokens)
    depth = tl.load(Depth + token, mask=valid, other=0)
    earlier = valid & (column >= 0) & (column < j) & (column < num_columns)
    tree_offset = token.to(tl.int64) * stride_tree_row + column.to(tl.int64) * stride_tree_column
    named = tl.load(TreeMask + tree_offset, mask=earlier, other=0) != 0
    key_depth = tl.load(Depth + q_start[:, None] + column, mask=earlier, other=0)
    # Positions: the query's is prefix + depth, a prefix key's its slot, a new key's prefix + its depth.
    in_window_prefix = slot > prefix[:, None] + depth - sliding_window
    in_window_new = depth - key_depth < sliding_window
    seen = ((column < 0) & in_window_prefix) | (earlier & named & in_window_new) | (column == j)
    seen &= valid
    bits = tl.sum(seen.to(tl.int32) << tl.arange(0, BITS)[None, :], axis=1)
    tl.store(Out + byte, bits.to(tl.uint8), mask=(byte < end) & (byte < capacity))


def tree_depths(tree_mask, cu_seqlens_q):
    """[T] int32: how many earlier new tokens of its request each token's row of `tree_mask` ([T, Q] bool) names;
    a token's position is its request's prefix plus this."""
    num_tokens, num_columns = tree_mask.shape
    token = torch.arange(num_tokens, dtype=torch.int32, device=tree_mask.device)
    request = torch.searchsorted(cu_seqlens_q[1:], token, right=True)
    local = token - cu_seqlens_q[request]  # token t is its request's j
    earlier = torch.arange(num_columns, device=tree_mask.device) < local[:, None]
    return (tree_mask & earlier).sum(1, dtype=torch.int32)


def custom_mask(tree_mask, cu_seqlens_q, seq_lens, sliding_window, out, indptr):
    """Writes FlashInfer's custom mask for `tree_mask` ([T, Q] bool) into `out`, and where each request's block
    starts into `indptr` ([B + 1] int32); cu_seqlens_q: [B + 1], seq_lens: [B] int32.

    out: uint8 [capacity] for the packed mask (FlashInfer's `custom_mask_buf`, indptr its `mask_indptr_buf`), or
    bool [capacity] for one element per bit (the `custom_mask` its `plan` packs). Bytes past the batch's mask or past
    `capacity` are not written: size `out` for the step (a CUDA graph's buffer: its largest step).
    """
    num_requests = seq_lens.shape[0]
    bits = 8 if out.dtype == torch.uint8 else 1
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    sizes = q_lens.to(torch.int64) * seq_lens
    indptr[0] = 0
    torch.cumsum((sizes + bits - 1) // bits, 0, dtype=torch.int32, out=indptr[1:])
    if num_requests == 0 or out.numel() == 0:
        return
    block = BITS_PER_PROGRAM // bits
    _custom_mask_kernel[(triton.cdiv(out.numel(), block),)](
        out.view(torch.uint8),
        indptr,
        tree_mask.view(torch.uint8),
        tree_depths(tree_mask, cu_seqlens_q),
        cu_seqlens_q,
        seq_lens,
        num_requests,
        tree_mask.shape[0],
        tree_mask.shape[1],
        out.numel(),
        *tree_mask.stride(),
        sliding_window if sliding_window > 0 else NO_WINDOW,
        BITS=bits,
        BLOCK=block,
        LOG_B=log2_ceil(num_requests),
    )
