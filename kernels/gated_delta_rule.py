"""The gated delta rule, token by token (`torch.ops.hybrid.gated_delta_rule`).

Grid: (B, Hv, cdiv(Dv, BLOCK_V)). Program (i, h, b) holds columns b * BLOCK_V + [0, BLOCK_V) of value head h's
state S [Dk, Dv] (Dk whole, padded to BLOCK_K) of request i in registers and runs the request's new tokens through
it: q, k [T, Hk, Dk] (head h // (Hv // Hk)), v [T, Hv, Dv], g [T, Hv] or [T, Hv, Dk] float32, beta [T, Hv], any
strides; out [T, Hv, Dv] in v's dtype. Per token, in float32:

    S = exp(g) * S                          (per key channel: row d by exp(g[d]))
    S = S + k outer (beta * (v - S^T k))    (S^T k needs only the program's columns: Dk is whole)
    o = scale * S^T q

S starts from the slot's state [num_slots, Hv, Dk, Dv] float32 (`common.request_slot`: zeros without a prefix)
and ends there, except in TARGET_VERIFY (VERIFY), where the state after each token j goes to
intermediate_states[slot, j] instead. With a tree (HAS_TREE), token j continues its parent's state
(`common.tree_state`): the one in registers when the parent is token j - 1, else the parent's as kept after it
(intermediate_states, or outside TARGET_VERIFY the scratch of `common.token_states`), or the slot's for the prefix.
A padding request (slot outside [0, num_slots)) writes zeros to its outputs and nothing else.
"""

import triton
import triton.language as tl

from .common import kernel_tree_mask, request_slot, request_tokens, token_states, tree_state
from .config import Target, delta_tiles


@triton.jit
def _gated_delta_rule_kernel(
    Q, K, V, G, Beta, State, Out, TokenStates, CuSeqlensQ, SeqLens, StateSlots, TreeMask,  # pointers
    num_tokens, num_slots, q_len, group, num_columns, token_states_len,  # sizes (q_len: the decode path's)
    scale,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,  # q, k, v
    stride_gt, stride_gh, stride_gd, stride_bt, stride_bh,  # g (stride_gd 0 for one decay per head), beta
    stride_ss, stride_sh, stride_sk, stride_sv,  # state [num_slots, Hv, Dk, Dv]
    stride_xo, stride_xj,  # token states (`common.token_states`): by slot or first row, by token
    stride_tt, stride_tq, stride_ot, stride_oh,  # tree_mask [T, Q]; out [T, Hv, Dv] (Dv contiguous)
    HEAD_DIM_K: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_Q: tl.constexpr, G_PER_CHANNEL: tl.constexpr, DECODE: tl.constexpr, VERIFY: tl.constexpr,
    HAS_TREE: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0)
    head = tl.program_id(1)
    start, n = request_tokens(CuSeqlensQ, request, q_len, num_tokens, DECODE)
    slot, held, has_state = request_slot(StateSlots, SeqLens, request, n, num_slots)
    k_head = head // group
    dk = tl.arange(0, BLOCK_K)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = dk < HEAD_DIM_K
    v_ok = dv < HEAD_DIM_V
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = head * stride_sh + dk[:, None] * stride_sk + dv[None, :] * stride_sv  # [BLOCK_K, BLOCK_V] offsets
    slot_state = State + slot * stride_ss + tile
    owner = slot if VERIFY else start.to(tl.int64)
    kept = TokenStates + owner * stride_xo + tile  # + j * stride_xj: the state after token j
    s = tl.load(slot_state, mask=tl.where(has_state, tile_ok, False), other=0.0)
    out = Out + head * stride_oh + dv
    zeros = tl.zeros([BLOCK_V], tl.float32).to(Out.dtype.element_ty)
    for j in range(0, tl.where(held, 0, n)):  # a padding request's outputs
        tl.store(out + (start + j).to(tl.int64) * stride_ot, zeros, mask=v_ok)
    for j in range(0, tl.where(held, n, 0)):
        t = (start + j).to(tl.int64)
        if HAS_TREE:
            s = tree_state(
                s, TreeMask, t, j, num_columns, stride_tt, stride_tq, slot_state, kept, stride_xj, has_state, tile_ok,
                BLOCK_Q,
            )  # fmt: skip
        q = tl.load(Q + t * stride_qt + k_head * stride_qh + dk * stride_qd, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(K + t * stride_kt + k_head * stride_kh + dk * stride_kd, mask=k_ok, other=0.0).to(tl.float32)
        v = tl.load(V + t * stride_vt + head * stride_vh + dv * stride_vd, mask=v_ok, other=0.0).to(tl.float32)
        beta = tl.load(Beta + t * stride_bt + head * stride_bh).to(tl.float32)
        if G_PER_CHANNEL:
            g = tl.load(G + t * stride_gt + head * stride_gh + dk * stride_gd, mask=k_ok, other=0.0)
            s = s * tl.exp(g)[:, None]
        else:
            s = s * tl.exp(tl.load(G + t * stride_gt + head * stride_gh))
        u = beta * (v - tl.sum(s * k[:, None], 0))
        s = s + k[:, None] * u[None, :]
        o = scale * tl.sum(s * q[:, None], 0)
        tl.store(out + t * stride_ot, o.to(Out.dtype.element_ty), mask=v_ok)
        if VERIFY or HAS_TREE:
            tl.store(kept + j * stride_xj, s, mask=tl.where(j < token_states_len, tile_ok, False))
    if not VERIFY:
        if HAS_TREE:
            tl.debug_barrier()  # other threads may still read the slot's state as a parent's
        tl.store(slot_state, s, mask=tl.where(held & (n > 0), tile_ok, False))


def gated_delta_rule(q, k, v, g, beta, state, step, scale, target: Target):
    """q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g: [T, Hv] or [T, Hv, Dk] float32; beta: [T, Hv]; state: [num_slots, Hv,
    Dk, Dv] float32; step: `state_ops.StateMetadata`. Returns [T, Hv, Dv] in v's dtype; updates state (or, in
    TARGET_VERIFY, step.intermediate_states) in place."""
    num_tokens, _, k_head_dim = q.shape
    num_v_heads, v_head_dim = v.shape[1], v.shape[2]
    num_requests = step.seq_lens.shape[0]
    out = v.new_empty(num_tokens, num_v_heads, v_head_dim)
    tiles = delta_tiles(k_head_dim, v_head_dim, target)
    kept, stride_xo, stride_xj, kept_len = token_states(step, state, num_tokens)
    tree, num_columns, stride_tt, stride_tq, block_q, has_tree = kernel_tree_mask(step.tree_mask, state)
    per_channel = g.dim() == 3
    grid = (num_requests, num_v_heads, triton.cdiv(v_head_dim, tiles.block_v))
    _gated_delta_rule_kernel[grid](
        q, k, v, g, beta, state, out, kept, step.cu_seqlens_q, step.seq_lens, step.state_slots, tree,
        num_tokens, state.shape[0], num_tokens // max(num_requests, 1), num_v_heads // q.shape[1], num_columns,
        kept_len, scale,
        *q.stride(), *k.stride(), *v.stride(),
        g.stride(0), g.stride(1), g.stride(2) if per_channel else 0, *beta.stride(),
        *state.stride(), stride_xo, stride_xj, stride_tt, stride_tq, out.stride(0), out.stride(1),
        HEAD_DIM_K=k_head_dim, BLOCK_K=triton.next_power_of_2(k_head_dim), HEAD_DIM_V=v_head_dim,
        BLOCK_V=tiles.block_v, BLOCK_Q=block_q, G_PER_CHANNEL=per_channel, DECODE=step.decode, VERIFY=step.verify,
        HAS_TREE=has_tree, num_warps=tiles.num_warps, num_stages=1,
    )  # fmt: skip
    return out
