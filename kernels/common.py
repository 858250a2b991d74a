"""Triton helpers shared by the kernels: segment search, fp8 conversions and the paged online-softmax loop.

fp8 caches reach the kernels as uint8 bytes (`kernel_kv`) with their format as the constexpr KV_FP8: "e4m3"
(torch.float8_e4m3fn), "e5m2" (torch.float8_e5m2), or "" for a cache in q's dtype. The conversions are integer bit
manipulation: Triton converts e4m3 only on sm_89 and later, and this way the interpreter runs the same code.
"""

import torch
import triton
import triton.language as tl

FP8_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def kernel_kv(k_cache, v_cache, k_scale, v_scale):
    """The caches and scales as the kernels take them: (k_cache, v_cache, k_scale, v_scale, KV_FP8).

    fp8 caches as uint8 views, with their [Hkv] float32 scales (required); other caches as they are, with the caches
    standing in for the scales (never read).
    """
    fp8 = FP8_FORMATS.get(k_cache.dtype, "")
    if not fp8:
        return k_cache, v_cache, k_cache, v_cache, fp8
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, fp8


def values_in_keys(k_cache, v_cache, blocks) -> bool:
    """V_IN_K of `attend_pages`: v_cache holds the leading values of k_cache's rows (MLA's latent cache,
    `k_cache[..., :Dv]`: the same storage and page, row and head strides) and V's padded width is K's first block
    (blocks: `config.head_blocks`), so that one read of the block serves the scores and the values."""
    block_d, _, block_dv = blocks
    return (
        block_d == block_dv
        and v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.stride()[:3] == k_cache.stride()[:3]
        and v_cache.shape[3] <= k_cache.shape[3]
    )


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
def fp8_to_float(code, FP8: tl.constexpr):
    """fp8 bytes (uint8, any shape) of format FP8 -> their fp32 values, exactly (NaN codes as NaN, e5m2 inf as inf).

    Through an fp16's bits, whose conversion to fp32 is exact, subnormals included (no fp32 subnormal arises, which
    a flush-to-zero multiply would lose): e5m2 is an fp16's top byte; e4m3's 4-bit exponent field lands 8 below
    an fp16's bias, undone by * 256, and its NaN code (0x7F, the only one whose magnitude + 1 carries into bit 7)
    gets the fp16 exponent's top bit too, making it an fp16 NaN: integer ops, cheaper than a select on sm_80.
    """
    code = code.to(tl.int16)
    if FP8 == "e5m2":
        return (code << 8).to(tl.float16, bitcast=True).to(tl.float32)
    magnitude = code & 0x7F
    bits = ((code & 0x80) << 8) | (magnitude << 7) | (((magnitude + 1) & 0x80) << 7)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def float_to_fp8(x, FP8: tl.constexpr):
    """fp32 (any shape) -> fp8 bytes (uint8) of format FP8, as torch's `x.clamp(-max, max).to(fp8)`: saturated to
    the largest finite value (448 e4m3, 57344 e5m2; infinities too), rounded to nearest even, sign kept (-0 too),
    NaN -> NaN (0x7F with the sign)."""
    if FP8 == "e4m3":
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MAX_BITS: tl.constexpr = 0x43E00000  # 448.0
    else:
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        MAX_BITS: tl.constexpr = 0x47600000  # 57344.0
    SHIFT: tl.constexpr = 23 - MANT  # fp32 mantissa bits dropped
    # A float whose ulp is the fp8 subnormal step, 2^(1 - BIAS - MANT): adding it rounds to that step.
    MAGIC: tl.constexpr = 2.0 ** (24 - MANT - BIAS)
    MAGIC_BITS: tl.constexpr = (151 - MANT - BIAS) << 23
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    is_nan = magnitude > 0x7F800000
    magnitude = tl.minimum(magnitude, MAX_BITS)
    # Normal: round the mantissa to nearest even (add half an fp8 ulp less one, plus the kept lowest bit); a carry
    # into the exponent is the right result. Then rebias the exponent.
    normal = ((magnitude + ((1 << (SHIFT - 1)) - 1) + ((magnitude >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    # Below the smallest normal, 2^(1 - BIAS): fp32 addition rounds to nearest even (2^(1 - BIAS) itself gives the
    # smallest normal's code).
    subnormal = (magnitude.to(tl.float32, bitcast=True) + MAGIC).to(tl.int32, bitcast=True) - MAGIC_BITS
    code = tl.where(magnitude < (128 - BIAS) << 23, subnormal, normal)
    return (tl.where(is_nan, 0x7F, code) | sign).to(tl.uint8)


def kernel_tree(tree_mask, cu_seqlens_q, seq_lens, absent):
    """The tree as the kernels take it, built on the device without a host sync: (words, W, positions, HAS_TREE).

    tree_mask: [T, Q] bool or None; cu_seqlens_q: [B + 1] int32, seq_lens: [B] int32. words: [T, W] int32,
    W = cdiv(Q, 32): bit c % 32 of word c // 32 of row t is set where token t (token j of its request) sees new token
    c < j; entries on and above the diagonal are dropped here, unread. positions: [T] int32, prefix + depth (the
    number of those bits). Bits rather than the mask's bytes: a tile then reads a few words per row instead of a byte
    per (row, key), whose addresses cost a GPU program its registers. `absent` (any tensor, never read) stands in for
    both without a tree.
    """
    if tree_mask is None:
        return absent, 0, absent, False
    (num_tokens, width), device = tree_mask.shape, tree_mask.device
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=device)
    request = torch.searchsorted(cu_seqlens_q[1:], tokens, right=True).clamp_(max=seq_lens.shape[0] - 1)
    first_token = cu_seqlens_q[request]
    prefix = seq_lens[request] - (cu_seqlens_q[request + 1] - first_token)
    num_words = triton.cdiv(width, 32)
    bits = torch.zeros(num_tokens, num_words * 32, dtype=torch.bool, device=device)
    bits[:, :width] = tree_mask & (torch.arange(width, device=device) < (tokens - first_token)[:, None])
    positions = (prefix + bits.sum(1)).to(torch.int32)
    shifts = torch.arange(32, device=device, dtype=torch.int64)
    words = (bits.view(num_tokens, num_words, 32).to(torch.int64) << shifts).sum(2).to(torch.int32)
    return words, num_words, positions, True


@triton.jit
def tree_rows(TreeWords, Positions, q_pos, token, row_ok, num_words,
              HAS_TREE: tl.constexpr, HAS_POSITIONS: tl.constexpr):  # fmt: skip
    """(row_pos, rows) of query rows for `attend_pages`: each row's position for the window and chunk (its slot q_pos,
    or under a tree Positions[token]) and a pointer to its tree words (`kernel_tree`; rows outside the batch read
    token 0's). token: [R] its token's index in q."""
    row_pos = q_pos
    rows = TreeWords
    if HAS_TREE:
        token = tl.where(row_ok, token, 0)
        rows = TreeWords + token.to(tl.int64) * num_words
        if HAS_POSITIONS:
            row_pos = tl.load(Positions + token)
    return row_pos, rows


@triton.jit
def load_q(Q, row_offset, row_ok, stride_qd,
           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROPE: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """q's rows as `attend_pages` takes them: (q [R, BLOCK_D], q_rope [R, BLOCK_ROPE]), columns [0, BLOCK_D) and
    [BLOCK_D, BLOCK_D + BLOCK_ROPE) masked at HEAD_DIM (`config.head_blocks`); without a rope block q_rope is q, unread.
    row_offset: [R] int64 offset of each row's first value from Q; rows outside row_ok read zeros."""
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + row_offset[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0
    )
    if UPCAST:
        q = q.to(tl.float32)
    q_rope = q
    if BLOCK_ROPE > 0:
        dr = BLOCK_D + tl.arange(0, BLOCK_ROPE)
        q_rope = tl.load(
            Q + row_offset[:, None] + dr[None, :] * stride_qd,
            mask=row_ok[:, None] & (dr < HEAD_DIM)[None, :],
            other=0.0,
        )
        if UPCAST:
            q_rope = q_rope.to(tl.float32)
    return q, q_rope


@triton.jit
def load_kv(Cache, offset, ok, start, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, UPCAST: tl.constexpr,
            KV_FP8: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK] of cache rows (offset: [BLOCK_N] of each row's first value, ok: [BLOCK_N] which to read),
    columns [start, start + BLOCK) masked at HEAD_DIM, in the dtype the dots take: fp8 bytes as their stored values
    in q's dtype (`dtype`), bf16 as fp32 in the interpreter (UPCAST)."""
    c = start + tl.arange(0, BLOCK)
    x = tl.load(Cache + offset[:, None] + c[None, :], mask=ok[:, None] & (c < HEAD_DIM)[None, :], other=0)
    if KV_FP8 != "":
        x = fp8_to_float(x, KV_FP8).to(dtype)
    elif UPCAST:
        x = x.to(tl.float32)
    return x


# The signatures of attend_pages, of the kernels that pass its arguments on and of their launchers, the launches and the
# calls of attend_pages keep a line per kind of argument (`fmt: skip`, `fmt: off`): one argument a line would repeat
# the same thirty lines in each kernel and hide which launch argument meets which parameter.
@triton.jit
def attend_pages(
    q, q_rope, q_pos, acc, l_i, m_i,  # q: [R, BLOCK_D], q_rope: [R, BLOCK_ROPE] (`load_q`); q_pos: [R] token slots
    KCache, VCache, block_table_row, kv_head,  # block_table_row: pointer to this request's block_table row
    kv_lo, kv_hi, seq_len, num_pages, num_table_pages, scale, logit_cap, sliding_window, attention_chunk,
    stride_kp, stride_kr, stride_kh, stride_vp, stride_vr, stride_vh,  # caches: page, row, head (head dim contiguous)
    row_pos, tree_words, num_words, prefix, Positions, key_start, num_tokens,  # trees (see below)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROPE: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr, V_IN_K: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr, UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_TREE: tl.constexpr,
):  # fmt: skip
    """Online softmax of q's rows over KV slots [kv_lo, kv_hi) of one request, read in place from its pages.

    acc: [R, BLOCK_DV] fp32. K rows have HEAD_DIM elements, read as BLOCK_D and BLOCK_ROPE columns
    (`config.head_blocks`), V rows HEAD_DIM_V (padded to BLOCK_DV). V_IN_K: V's rows are the first HEAD_DIM_V values
    of K's (a latent cache, VCache at KCache with its strides) and BLOCK_DV == BLOCK_D: K's first block, already
    read for the scores, serves as V (its columns past HEAD_DIM_V reach acc columns that no output keeps). Keys past
    `seq_len`, beyond the block table, in pages outside [0, num_pages), after a row's own slot, or outside its
    sliding window or its chunk of positions are masked: neither loaded nor weighted. fp8 K/V (bytes) are read as
    their stored values in q's dtype, which holds them exactly: the caller folds the scales in.

    row_pos: [R] each row's position for the window and chunk (q_pos without a tree). With HAS_TREE, a new key (slot
    prefix + c) is seen by a row where bit c of its tree words is set (tree_words: [R] pointers to each row's
    num_words words, `kernel_tree`), and by the row of slot prefix + c itself: the diagonal is forced. With a window
    or chunk, new key c's position is Positions[key_start + c] (prefix + its depth; read inside [0, num_tokens)), a
    prefix key's its slot. Tiles of the prefix alone read no word nor position.
    """
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        page_index = pos // PAGE_SIZE
        in_table = (pos < seq_len) & (page_index < num_table_pages)
        page = tl.load(block_table_row + page_index, mask=in_table, other=-1)
        ok = in_table & (page >= 0) & (page < num_pages)
        page = page.to(tl.int64)
        row = pos % PAGE_SIZE
        k_offset = page * stride_kp + row * stride_kr + kv_head * stride_kh
        # Both offsets before either load, as ptxas allocates fewer registers so (sm_90: 96 rather than 119 at D 128).
        v_offset = page * stride_vp + row * stride_vr + kv_head * stride_vh
        k = load_kv(KCache, k_offset, ok, 0, HEAD_DIM, BLOCK_D, UPCAST, KV_FP8, q.dtype)  # [BLOCK_N, BLOCK_D]
        if V_IN_K:
            v = k
        else:
            v = load_kv(VCache, v_offset, ok, 0, HEAD_DIM_V, BLOCK_DV, UPCAST, KV_FP8, q.dtype)  # [BLOCK_N, BLOCK_DV]
        # fp32 inputs as three TF32 products (about fp32's precision; plain TF32 would round them to 10 bits), on
        # tensor cores: IEEE fp32 dots spill kilobytes of registers. fp16/bf16 inputs ignore it.
        s = tl.dot(q, tl.trans(k), input_precision="tf32x3")  # [R, BLOCK_N], fp32
        if BLOCK_ROPE > 0:
            k_rope = load_kv(KCache, k_offset, ok, BLOCK_D, HEAD_DIM, BLOCK_ROPE, UPCAST, KV_FP8, q.dtype)
            s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision="tf32x3")
        s = s * scale
        if SOFT_CAP:
            # logit_cap * tanh(s / logit_cap), with tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf
            s = logit_cap * (1.0 - 2.0 / (tl.exp(2.0 * s / logit_cap) + 1.0))
        visible = ok[None, :] & (pos[None, :] <= q_pos[:, None])
        key_pos = pos
        if HAS_TREE:
            col = pos - prefix  # [BLOCK_N]: a new key's column, negative in the prefix
            # The tile's columns span at most (BLOCK_N + 30) // 32 + 1 words from `first`, read for tiles with new
            # keys only: `readable` of them ([R], as Triton's interpreter refuses a scalar mask for a block load).
            # Non-negative operands for // and %, which round toward zero in Triton and down in its interpreter.
            first = tl.maximum(start - prefix, 0) // 32
            readable = tl.where(start + BLOCK_N > prefix, num_words - first, 0) + tl.zeros_like(q_pos)
            word_of, bit_of = tl.maximum(col, 0) // 32, tl.maximum(col, 0) % 32
            seen = (col < 0)[None, :] | (pos[None, :] == q_pos[:, None])
            for w in tl.static_range((BLOCK_N + 30) // 32 + 1):
                word = tl.load(tree_words + first + w, mask=w < readable, other=0)  # [R]
                bit = (word[:, None] >> bit_of[None, :]) & 1
                seen = seen | ((word_of == first + w)[None, :] & (bit != 0))
            visible = visible & seen
            if HAS_WINDOW or HAS_CHUNK:
                key = key_start + col
                depth_pos = tl.load(Positions + key, mask=(col >= 0) & (key >= 0) & (key < num_tokens), other=0)
                key_pos = tl.where(col >= 0, depth_pos, pos)
        if HAS_WINDOW:
            visible = visible & (key_pos[None, :] > row_pos[:, None] - sliding_window)
        if HAS_CHUNK:  # a row sees its own chunk only: positions from row_pos - row_pos % attention_chunk
            visible = visible & (key_pos[None, :] >= (row_pos - row_pos % attention_chunk)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite, so fully masked rows stay NaN-free
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="tf32x3")
        m_i = m_new
    return acc, l_i, m_i


# The state ops' kernels (causal_conv1d.py, gated_delta_rule.py, selective_scan.py): one program per request and
# block of its state, looping over the request's new tokens.


def token_states(step, state, num_tokens):
    """Where a state kernel keeps the state after each new token: (buffer, stride by owner, stride by token, Q).
    TARGET_VERIFY: `intermediate_states` [num_slots, Q, *state shape], owned by slot. A tree outside it: scratch
    [T, *state shape], token t's in row t (a request owns the rows from its first token), where each token finds its
    parent's; its size follows the shapes, so the call stays sync-free. Otherwise `state` stands in, never touched.
    Below the token both have the state's own strides (contiguous, of the same shape)."""
    if step.verify:
        states = step.intermediate_states
        return states, states.stride(0), states.stride(1), states.shape[1]
    if step.tree_mask is not None:
        states = state.new_empty(num_tokens, *state.shape[1:])
        return states, states.stride(0), states.stride(0), num_tokens
    return state, 0, 0, 0


def kernel_tree_mask(tree_mask, absent):
    """tree_mask ([T, Q] bool or None) as the state kernels read it: (bytes, Q, row stride, column stride,
    BLOCK_Q, HAS_TREE); `absent` (any tensor, never read) stands in without a tree."""
    if tree_mask is None:
        return absent, 0, 0, 0, 1, False
    width = tree_mask.shape[1]
    return tree_mask.view(torch.uint8), width, *tree_mask.stride(), triton.next_power_of_2(width), True


@triton.jit
def request_tokens(CuSeqlensQ, request, q_len, num_tokens, DECODE: tl.constexpr):
    """(first row, number of new tokens) of `request`: q_len each on the decode path (T // B), else from
    cu_seqlens_q; kept inside rows [0, num_tokens) even where cu_seqlens_q is inconsistent (validation off)."""
    if DECODE:
        start = request * q_len
        n = q_len
    else:
        start = tl.load(CuSeqlensQ + request)
        n = tl.load(CuSeqlensQ + request + 1) - start
    start = tl.minimum(tl.maximum(start, 0), num_tokens)
    return start, tl.maximum(tl.minimum(n, num_tokens - start), 0)


@triton.jit
def request_slot(StateSlots, SeqLens, request, n, num_slots):
    """(slot, held, has_state) of `request` with n new tokens: a slot outside [0, num_slots) (padding's -1) is not
    held (read and written nowhere; slot 0 stands in for address arithmetic); has_state: held and continuing its
    prefix (seq_len > n), else its state starts from zeros."""
    slot = tl.load(StateSlots + request)
    held = (slot >= 0) & (slot < num_slots)
    has_state = held & (tl.load(SeqLens + request) > n)
    return tl.where(held, slot, 0).to(tl.int64), held, has_state


@triton.jit
def tree_parent(TreeMask, row, j, num_columns, stride_tt, stride_tq, BLOCK_Q: tl.constexpr):
    """The parent of new token j (x row `row`) of its request: the last earlier new token c < j that its tree_mask
    row sees, or -1 (the prefix)."""
    c = tl.arange(0, BLOCK_Q)
    seen = tl.load(TreeMask + row * stride_tt + c * stride_tq, mask=(c < j) & (c < num_columns), other=0)
    return tl.max(tl.where(seen != 0, c, -1), 0)


@triton.jit
def tree_state(s, TreeMask, row, j, num_columns, stride_tt, stride_tq, slot_state, kept, stride_kj, has_state,
               tile_ok, BLOCK_Q: tl.constexpr):  # fmt: skip
    """The state that new token j (x row `row`) of a tree continues: s, the one in registers, where its parent
    (`tree_parent`) is token j - 1; else its parent's as kept after it (kept + parent * stride_kj), or the slot's
    (slot_state; zeros without has_state) for the prefix. tile_ok masks the state's tile."""
    parent = tree_parent(TreeMask, row, j, num_columns, stride_tt, stride_tq, BLOCK_Q)
    if parent != j - 1:
        tl.debug_barrier()  # the parent's state was stored by this program's other threads
        from_prefix = parent < 0
        s = tl.load(
            tl.where(from_prefix, slot_state, kept + parent * stride_kj),
            mask=tl.where(has_state | ~from_prefix, tile_ok, False),
            other=0.0,
        )
    return s
