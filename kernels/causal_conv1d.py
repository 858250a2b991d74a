"""The depthwise causal convolution (`torch.ops.hybrid.causal_conv1d`).

Grid: (B, cdiv(C, BLOCK_C)). Program (i, b) slides the K-wide window over request i's new tokens for channels
b * BLOCK_C + [0, BLOCK_C): x [T, C] any strides, weight [C, K], bias [C]; out [T, C] in x's dtype,

    out_j = act(bias + sum_k weight[:, k] * u_{j - K + 1 + k})    (act: silu or none)

where u_j is new token j's input and, before the first, u_{-K+1} .. u_{-1} are the K - 1 inputs of the slot's
conv_state [num_slots, K - 1, C] (x's dtype; zeros without a prefix, `common.request_slot`). The slot then keeps
the request's last K - 1 inputs.

A plain sequence (no tree) has no recurrence: each step takes BLOCK_T tokens at once, tap k their inputs
u_{j - K + 1 + k} read straight from x or the slot (`_window_inputs`). In TARGET_VERIFY (VERIFY) the K - 1 inputs
that end at token j go to intermediate_states[slot, j] and the slot is left as it was. With a tree (HAS_TREE),
token j's window is its parent's kept K - 1 inputs (intermediate_states, or outside TARGET_VERIFY the scratch of
`common.token_states`; the slot's for the prefix) and its own: one token a step, each keeping its K - 1 for its
children. A padding request (slot outside [0, num_slots)) writes zeros to its outputs and nothing else.
"""

import triton
import triton.language as tl

from .common import kernel_tree_mask, request_slot, request_tokens, token_states, tree_parent
from .config import Target, conv_tiles


@triton.jit
def _window_inputs(X, prefix_rows, index, start, n, c, c_ok, has_state, stride_xt, stride_xc, stride_sr,
                   WIDTH: tl.constexpr):  # fmt: skip
    """[len(index), BLOCK_C] float32: row r the request's input u_{index[r]}: x row start + index for a new token
    (0 <= index < n), row K - 1 + index of the slot's inputs (prefix_rows: [BLOCK_C] pointers to its row 0) before
    them, zeros past the request's tokens and without a prefix. index >= -(K - 1)."""
    new = tl.load(
        X + (start + index).to(tl.int64)[:, None] * stride_xt + c[None, :] * stride_xc,
        mask=((index >= 0) & (index < n))[:, None] & c_ok[None, :],
        other=0.0,
    )
    held = tl.load(
        prefix_rows[None, :] + (WIDTH - 1 + index)[:, None] * stride_sr,
        mask=tl.where(has_state, (index < 0)[:, None] & c_ok[None, :], False),
        other=0.0,
    )
    return new.to(tl.float32) + held.to(tl.float32)


@triton.jit
def _tree_window(parent_rows, parent_ok, x, index, c_ok, stride_sr, WIDTH: tl.constexpr):
    """[len(index), BLOCK_C] float32: rows `index` of a tree token's window, its parent's K - 1 inputs
    (parent_rows: [BLOCK_C] pointers to their row 0; zeros where not parent_ok) then its own input x [BLOCK_C];
    zeros past row K - 1."""
    held = tl.load(
        parent_rows[None, :] + index[:, None] * stride_sr,
        mask=tl.where(parent_ok, (index < WIDTH - 1)[:, None] & c_ok[None, :], False),
        other=0.0,
    )
    return tl.where((index == WIDTH - 1)[:, None], x[None, :], held.to(tl.float32))


@triton.jit
def _causal_conv1d_kernel(
    X, Weight, Bias, ConvState, Out, TokenStates, CuSeqlensQ, SeqLens, StateSlots, TreeMask,  # pointers
    num_tokens, num_slots, q_len, num_columns, token_states_len,  # sizes (q_len: the decode path's)
    stride_xt, stride_xc, stride_wc, stride_wk, stride_b,  # x [T, C], weight [C, K], bias [C]
    stride_ss, stride_sr, stride_sc,  # conv_state [num_slots, K - 1, C]
    stride_ko, stride_kj,  # token states (`common.token_states`): by slot or first row, by token
    stride_tt, stride_tq, stride_ot,  # tree_mask [T, Q]; out [T, C] (C contiguous)
    CHANNELS: tl.constexpr, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, DECODE: tl.constexpr, VERIFY: tl.constexpr, HAS_TREE: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0)
    start, n = request_tokens(CuSeqlensQ, request, q_len, num_tokens, DECODE)
    slot, held, has_state = request_slot(StateSlots, SeqLens, request, n, num_slots)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < CHANNELS
    prefix_rows = ConvState + slot * stride_ss + c * stride_sc
    owner = slot if VERIFY else start.to(tl.int64)
    kept = TokenStates + owner * stride_ko + c * stride_sc  # + j * stride_kj: the K - 1 inputs ending at token j
    rows = tl.arange(0, BLOCK_S)  # of a state: K - 1 inputs, oldest first
    rows_ok = (rows < WIDTH - 1)[:, None] & c_ok[None, :]
    if HAS_BIAS:
        bias = tl.load(Bias + c * stride_b, mask=c_ok, other=0.0).to(tl.float32)
    tokens = tl.arange(0, BLOCK_T)
    for first in range(0, tl.where(held, 0, n), BLOCK_T):  # a padding request's outputs
        t = (start + first + tokens).to(tl.int64)
        zeros = tl.zeros([BLOCK_T, BLOCK_C], tl.float32).to(Out.dtype.element_ty)
        tl.store(Out + t[:, None] * stride_ot + c[None, :], zeros, mask=(first + tokens < n)[:, None] & c_ok[None, :])

    if HAS_TREE:
        taps = tl.arange(0, BLOCK_W)
        weight = tl.load(
            Weight + c[None, :] * stride_wc + taps[:, None] * stride_wk,
            mask=(taps < WIDTH)[:, None] & c_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_W, BLOCK_C]
        state = tl.zeros([BLOCK_S, BLOCK_C], tl.float32)
        for j in range(0, tl.where(held, n, 0)):
            t = (start + j).to(tl.int64)
            parent = tree_parent(TreeMask, t, j, num_columns, stride_tt, stride_tq, BLOCK_Q)
            tl.debug_barrier()  # the parent's inputs were stored by this program's other threads
            from_prefix = parent < 0
            parent_rows = tl.where(from_prefix, prefix_rows, kept + parent * stride_kj)
            parent_ok = has_state | ~from_prefix
            x = tl.load(X + t * stride_xt + c * stride_xc, mask=c_ok, other=0.0).to(tl.float32)
            y = tl.sum(weight * _tree_window(parent_rows, parent_ok, x, taps, c_ok, stride_sr, WIDTH), 0)
            if HAS_BIAS:
                y += bias
            if SILU:
                y = y / (1.0 + tl.exp(-y))
            tl.store(Out + t * stride_ot + c, y.to(Out.dtype.element_ty), mask=c_ok)
            state = _tree_window(parent_rows, parent_ok, x, rows + 1, c_ok, stride_sr, WIDTH)
            tl.store(
                kept[None, :] + j * stride_kj + rows[:, None] * stride_sr,
                state.to(TokenStates.dtype.element_ty),
                mask=tl.where(j < token_states_len, rows_ok, False),
            )
    else:
        for first in range(0, tl.where(held, n, 0), BLOCK_T):
            j = first + tokens
            acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
            for k in tl.static_range(WIDTH):
                u = _window_inputs(
                    X, prefix_rows, j - (WIDTH - 1) + k, start, n, c, c_ok, has_state, stride_xt, stride_xc,
                    stride_sr, WIDTH,
                )  # fmt: skip
                w = tl.load(Weight + c * stride_wc + k * stride_wk, mask=c_ok, other=0.0).to(tl.float32)
                acc += u * w[None, :]
                if VERIFY and k > 0:  # tap k is row k - 1 of the inputs that end at token j
                    tl.store(
                        kept[None, :] + j[:, None] * stride_kj + (k - 1) * stride_sr,
                        u.to(TokenStates.dtype.element_ty),
                        mask=((j < n) & (j < token_states_len))[:, None] & c_ok[None, :],
                    )
            if HAS_BIAS:
                acc += bias[None, :]
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            t = (start + j).to(tl.int64)
            tl.store(Out + t[:, None] * stride_ot + c[None, :], acc.to(Out.dtype.element_ty),
                     mask=(j < n)[:, None] & c_ok[None, :])  # fmt: skip
        if not VERIFY:
            state = _window_inputs(
                X, prefix_rows, n - (WIDTH - 1) + rows, start, n, c, c_ok, has_state, stride_xt, stride_xc,
                stride_sr, WIDTH,
            )  # fmt: skip
    if not VERIFY:
        tl.debug_barrier()  # other threads may still read the slot's inputs
        tl.store(
            prefix_rows[None, :] + rows[:, None] * stride_sr,
            state.to(ConvState.dtype.element_ty),
            mask=tl.where(held & (n > 0), rows_ok, False),
        )


def causal_conv1d(x, weight, bias, conv_state, step, activation, target: Target):
    """x: [T, C]; weight: [C, K]; bias: [C] or None; conv_state: [num_slots, K - 1, C] in x's dtype; step:
    `state_ops.StateMetadata`; activation "silu" or "none". Returns [T, C] in x's dtype; updates conv_state (or, in
    TARGET_VERIFY, step.intermediate_states) in place."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    num_requests = step.seq_lens.shape[0]
    q_len = num_tokens // max(num_requests, 1)
    out = x.new_empty(x.shape)
    tiles = conv_tiles(channels, q_len if step.decode else 0, target)
    kept, stride_ko, stride_kj, kept_len = token_states(step, conv_state, num_tokens)
    tree, num_columns, stride_tt, stride_tq, block_q, has_tree = kernel_tree_mask(step.tree_mask, conv_state)
    grid = (num_requests, triton.cdiv(channels, tiles.block_v))
    _causal_conv1d_kernel[grid](
        x, weight, x if bias is None else bias, conv_state, out, kept, step.cu_seqlens_q, step.seq_lens,
        step.state_slots, tree,
        num_tokens, conv_state.shape[0], q_len, num_columns, kept_len,
        *x.stride(), *weight.stride(), 0 if bias is None else bias.stride(0),
        *conv_state.stride(), stride_ko, stride_kj, stride_tt, stride_tq, out.stride(0),
        CHANNELS=channels, WIDTH=width, BLOCK_C=tiles.block_v, BLOCK_T=tiles.block_t,
        BLOCK_W=triton.next_power_of_2(width), BLOCK_S=triton.next_power_of_2(max(width - 1, 1)), BLOCK_Q=block_q,
        HAS_BIAS=bias is not None, SILU=activation == "silu", DECODE=step.decode, VERIFY=step.verify,
        HAS_TREE=has_tree, num_warps=tiles.num_warps, num_stages=1,
    )  # fmt: skip
    return out
