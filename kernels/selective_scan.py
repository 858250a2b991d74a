"""The selective state-space scan, token by token (`torch.ops.hybrid.selective_scan`), for Mamba2 (A [H], heads of
P channels) and Mamba1 (A [H, N], P = 1) alike.

Grid: (B, cdiv(H, BLOCK_H), cdiv(P, BLOCK_P)). Program (i, a, b) holds the states [BLOCK_H, BLOCK_P, N] (N whole,
padded to BLOCK_N) of heads a * BLOCK_H + [0, BLOCK_H), channels b * BLOCK_P + [0, BLOCK_P) of request i in
registers and runs the request's new tokens through them: x, z [T, H, P], dt [T, H], B, C [T, G, N] (head h reads
group h // (H // G)), any strides; A [H] or [H, N] float32, D, dt_bias [H]; out [T, H, P] in x's dtype. Several
heads share a program where P is small (Mamba1's 1), so that a program still holds a tile worth its loads. Per
token and head, in float32:

    d = clamp(softplus?(dt + dt_bias), dt_min, dt_max)
    S = exp(d * A) * S + (d * x) outer B
    y = S C + D * x, then y * silu(z)

S starts from the slot's state [num_slots, H, P, N] float32 (`common.request_slot`: zeros without a prefix) and
ends there, except in TARGET_VERIFY (VERIFY), where the state after each token j goes to
intermediate_states[slot, j] instead. With a tree (HAS_TREE), token j continues its parent's state
(`common.tree_state`): the one in registers when the parent is token j - 1, else the parent's as kept after it
(intermediate_states, or outside TARGET_VERIFY the scratch of `common.token_states`), or the slot's for the prefix.
A padding request (slot outside [0, num_slots)) writes zeros to its outputs and nothing else.
"""

import triton
import triton.language as tl

from .common import kernel_tree_mask, request_slot, request_tokens, token_states, tree_state
from .config import Target, scan_tiles


@triton.jit
def softplus(x):
    """log(1 + exp(x)) as torch computes it: x itself above 20; below, log1p(e) for e = exp(x) as
    log(1 + e) * e / ((1 + e) - 1), exact to a few ulps where 1 + e rounds (Triton has no log1p)."""
    e = tl.exp(x)
    u = 1.0 + e
    return tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))


@triton.jit
def _selective_scan_kernel(
    X, DT, A, B, C, D, Z, DtBias, State, Out, TokenStates, CuSeqlensQ, SeqLens, StateSlots, TreeMask,  # pointers
    num_tokens, num_slots, q_len, heads_per_group, num_columns, token_states_len,  # sizes (q_len: the decode path's)
    dt_min, dt_max,
    stride_xt, stride_xh, stride_xp, stride_zt, stride_zh, stride_zp, stride_dt, stride_dh,  # x, z, dt
    stride_bt, stride_bg, stride_bn, stride_ct, stride_cg, stride_cn,  # B, C
    stride_ah, stride_an, stride_d, stride_db,  # A, D, dt_bias
    stride_ss, stride_sh, stride_sp, stride_sn,  # state [num_slots, H, P, N]
    stride_ko, stride_kj,  # token states (`common.token_states`): by slot or first row, by token
    stride_tt, stride_tq, stride_ot, stride_oh,  # tree_mask [T, Q]; out [T, H, P] (P contiguous)
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, STATE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
    A_PER_CHANNEL: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr, DECODE: tl.constexpr, VERIFY: tl.constexpr, HAS_TREE: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0)
    start, n = request_tokens(CuSeqlensQ, request, q_len, num_tokens, DECODE)
    slot, held, has_state = request_slot(StateSlots, SeqLens, request, n, num_slots)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.arange(0, BLOCK_N)  # the state's channel
    h_ok = h < NUM_HEADS
    hp_ok = h_ok[:, None] & (p < HEAD_DIM)[None, :]  # [BLOCK_H, BLOCK_P]
    hn_ok = h_ok[:, None] & (c < STATE_SIZE)[None, :]  # [BLOCK_H, BLOCK_N]
    tile_ok = hp_ok[:, :, None] & (c < STATE_SIZE)[None, None, :]
    tile = h[:, None, None] * stride_sh + p[None, :, None] * stride_sp + c[None, None, :] * stride_sn
    slot_state = State + slot * stride_ss + tile
    owner = slot if VERIFY else start.to(tl.int64)
    kept = TokenStates + owner * stride_ko + tile  # + j * stride_kj: the state after token j
    s = tl.load(slot_state, mask=tl.where(has_state, tile_ok, False), other=0.0)

    # The decay rates, [BLOCK_H, BLOCK_N] or one per head [BLOCK_H, 1]; loaded once, as are D and dt_bias.
    if A_PER_CHANNEL:
        rate = tl.load(A + h[:, None] * stride_ah + c[None, :] * stride_an, mask=hn_ok, other=0.0)
    else:
        rate = tl.load(A + h * stride_ah, mask=h_ok, other=0.0)[:, None]
    if HAS_D:
        skip = tl.load(D + h * stride_d, mask=h_ok, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        dt_bias = tl.load(DtBias + h * stride_db, mask=h_ok, other=0.0).to(tl.float32)
    group = h // heads_per_group
    hp = h[:, None] * stride_oh + p[None, :]
    for j in range(0, tl.where(held, 0, n)):  # a padding request's outputs
        t = (start + j).to(tl.int64)
        tl.store(Out + t * stride_ot + hp, tl.zeros([BLOCK_H, BLOCK_P], tl.float32).to(Out.dtype.element_ty), hp_ok)
    for j in range(0, tl.where(held, n, 0)):
        t = (start + j).to(tl.int64)
        if HAS_TREE:
            s = tree_state(
                s, TreeMask, t, j, num_columns, stride_tt, stride_tq, slot_state, kept, stride_kj, has_state, tile_ok,
                BLOCK_Q,
            )  # fmt: skip
        x = tl.load(X + t * stride_xt + h[:, None] * stride_xh + p[None, :] * stride_xp, mask=hp_ok, other=0.0)
        x = x.to(tl.float32)
        d = tl.load(DT + t * stride_dt + h * stride_dh, mask=h_ok, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            d += dt_bias
        if DT_SOFTPLUS:
            d = softplus(d)
        d = tl.minimum(tl.maximum(d, dt_min), dt_max)  # [BLOCK_H]
        b_in = tl.load(B + t * stride_bt + group[:, None] * stride_bg + c[None, :] * stride_bn, mask=hn_ok, other=0.0)
        c_in = tl.load(C + t * stride_ct + group[:, None] * stride_cg + c[None, :] * stride_cn, mask=hn_ok, other=0.0)
        decay = tl.exp(d[:, None] * rate)  # [BLOCK_H, 1 or BLOCK_N]
        s = s * decay[:, None, :] + (d[:, None] * x)[:, :, None] * b_in.to(tl.float32)[:, None, :]
        y = tl.sum(s * c_in.to(tl.float32)[:, None, :], 2)  # [BLOCK_H, BLOCK_P]
        if HAS_D:
            y += skip[:, None] * x
        if HAS_Z:
            z = tl.load(Z + t * stride_zt + h[:, None] * stride_zh + p[None, :] * stride_zp, mask=hp_ok, other=0.0)
            z = z.to(tl.float32)
            y = y * z / (1.0 + tl.exp(-z))
        tl.store(Out + t * stride_ot + hp, y.to(Out.dtype.element_ty), mask=hp_ok)
        if VERIFY or HAS_TREE:
            tl.store(kept + j * stride_kj, s, mask=tl.where(j < token_states_len, tile_ok, False))
    if not VERIFY:
        if HAS_TREE:
            tl.debug_barrier()  # other threads may still read the slot's state as a parent's
        tl.store(slot_state, s, mask=tl.where(held & (n > 0), tile_ok, False))


def selective_scan(x, dt, A, B, C, state, step, D, z, dt_bias, dt_softplus, dt_min, dt_max, target: Target):
    """x: [T, H, P]; dt: [T, H]; A: [H] or [H, N] float32; B, C: [T, G, N]; D, dt_bias: [H] or None; z: [T, H, P]
    or None; state: [num_slots, H, P, N] float32; step: `state_ops.StateMetadata`; dt_max a float (inf: none).
    Returns [T, H, P] in x's dtype; updates state (or, in TARGET_VERIFY, step.intermediate_states) in place."""
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    num_requests = step.seq_lens.shape[0]
    out = x.new_empty(x.shape)
    tiles = scan_tiles(num_heads, head_dim, state_size, target)
    kept, stride_ko, stride_kj, kept_len = token_states(step, state, num_tokens)
    tree, num_columns, stride_tt, stride_tq, block_q, has_tree = kernel_tree_mask(step.tree_mask, state)
    rate_strides = (A.stride(0), A.stride(1) if A.dim() == 2 else 0)
    absent = x  # stands in for the optional tensors, never read
    grid = (num_requests, triton.cdiv(num_heads, tiles.block_h), triton.cdiv(head_dim, tiles.block_v))
    _selective_scan_kernel[grid](
        x, dt, A, B, C, absent if D is None else D, absent if z is None else z,
        absent if dt_bias is None else dt_bias, state, out, kept, step.cu_seqlens_q, step.seq_lens,
        step.state_slots, tree,
        num_tokens, state.shape[0], num_tokens // max(num_requests, 1), num_heads // num_groups, num_columns,
        kept_len, dt_min, dt_max,
        *x.stride(), *(x.stride() if z is None else z.stride()), *dt.stride(), *B.stride(), *C.stride(),
        *rate_strides, 0 if D is None else D.stride(0), 0 if dt_bias is None else dt_bias.stride(0),
        *state.stride(), stride_ko, stride_kj, stride_tt, stride_tq, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, STATE_SIZE=state_size,
        BLOCK_H=tiles.block_h, BLOCK_P=tiles.block_v, BLOCK_N=triton.next_power_of_2(state_size),
        BLOCK_Q=block_q, A_PER_CHANNEL=A.dim() == 2, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, DT_SOFTPLUS=dt_softplus, DECODE=step.decode, VERIFY=step.verify,
        HAS_TREE=has_tree, num_warps=tiles.num_warps, num_stages=1,
    )  # fmt: skip
    return out
