"""The torch backend's state ops (`hybrid_ops.state_ops`): plain tensor code on any device, vectorised over requests.

The packed batch is laid out as [B, Q] (Q the longest request's new tokens, padding after each request's last); then
one loop over the Q token positions updates every request's state at once: no Python loop over requests. A padding
position leaves its request's state as it was. The recurrences are the ops' docstrings', in float32; a convolution
over a plain sequence (no tree) is one unfold instead of a loop.
"""

import torch
import torch.nn.functional as F

from ..validation import check_state_metadata_values


class Padded:
    """The step's [B, Q] layout. index: [B, Q] int64, the token row of each (request, position), T for padding
    (a zero row appended to every input); valid: [B, Q] bool; q_lens: [B] int64; parents: [B, Q] int64, each token's
    parent position (-1: the prefix) or None for plain sequences; has_state: [B] bool, whether the request continues
    its slot's state; slots: [B] int64, -1 for padding requests."""

    def __init__(self, step, num_tokens, num_slots):
        verify_len = None if step.intermediate_states is None else step.intermediate_states.shape[1]
        cu, seq_lens, _ = check_state_metadata_values(
            *step[:3], num_tokens, num_slots, step.decode, step.tree_mask, verify_len
        )
        device = step.cu_seqlens_q.device
        q_lens = [b - a for a, b in zip(cu, cu[1:])]
        self.width = max(q_lens, default=0)
        position = torch.arange(self.width, device=device)
        starts = torch.tensor(cu[:-1], device=device)
        self.q_lens = torch.tensor(q_lens, device=device)
        self.valid = position < self.q_lens[:, None]
        self.index = torch.where(self.valid, starts[:, None] + position, num_tokens)
        self.slots = step.state_slots.to(torch.int64)
        prefix = torch.tensor([n > q for n, q in zip(seq_lens, q_lens)], device=device)
        self.has_state = prefix & (self.slots >= 0)
        self.parents = None
        if step.tree_mask is not None:
            rows = step.tree_mask[self.index.clamp(max=num_tokens - 1)]  # [B, Q, Q']
            columns = torch.arange(rows.shape[-1], device=device)
            earlier = rows & (columns < position[:, None])  # what token j sees before itself
            self.parents = (earlier * (columns + 1)).amax(-1) - 1

    def gather(self, t):
        """t: [T, ...] -> [B, Q, ...], zeros at padding positions, in float32."""
        t = t.float()
        return torch.cat([t, t.new_zeros((1, *t.shape[1:]))])[self.index]

    def scatter(self, padded, num_tokens, dtype):
        """padded: [B, Q, ...] -> [T, ...] of the valid positions, in `dtype`; padding requests' rows are zeros."""
        out = padded.new_zeros((num_tokens + 1, *padded.shape[2:]))
        out[self.index[self.valid]] = padded[self.valid]
        out[:num_tokens][self._padding_rows()] = 0
        return out[:num_tokens].to(dtype)

    def _padding_rows(self):
        rows = self.index[(self.slots < 0)[:, None] & self.valid]
        return rows

    def initial(self, state):
        """Each request's state to start from, [B, ...] float32: its slot's, or zeros."""
        held = state[self.slots.clamp(min=0)].float()
        return torch.where(self.has_state.view(-1, *[1] * (held.dim() - 1)), held, 0.0)


def scan(padded: Padded, initial, update, keep_all):
    """Runs `update(state [B, ...], j) -> (state, out [B, ...])` over the Q positions, from `initial` [B, ...],
    along each token's parent with a tree. -> (outputs [B, Q, ...], the state after each position [B, Q, ...] if
    keep_all or with a tree, else None; the state after each request's last token [B, ...])."""
    tree = padded.parents is not None
    kept = [] if keep_all or tree else None
    outputs, state = [], initial
    rows = torch.arange(initial.shape[0], device=initial.device)
    for j in range(padded.width):
        if tree and j:
            before = torch.stack([initial, *kept])  # [1 + j, B, ...]: index 0 the initial state
            state = before[padded.parents[:, j] + 1, rows]
        elif tree:
            state = initial
        new, out = update(state, j)
        mask = padded.valid[:, j].view(-1, *[1] * (new.dim() - 1))
        state = torch.where(mask, new, state)
        outputs.append(out)
        if kept is not None:
            kept.append(state)
    if padded.width == 0:
        return None, None, initial
    every = torch.stack(kept, 1) if kept is not None else None
    if tree:
        last = every[rows, (padded.q_lens - 1).clamp(min=0)]
        last = torch.where((padded.q_lens > 0).view(-1, *[1] * (last.dim() - 1)), last, initial)
    else:
        last = state
    return torch.stack(outputs, 1), every, last


def write_states(padded: Padded, step, state, every, last):
    """The new states to their places: TARGET_VERIFY each position's to intermediate_states[slot, j], otherwise the
    last one to the slot; nothing for padding requests, or for requests without new tokens."""
    if step.verify:
        held = padded.valid & (padded.slots >= 0)[:, None]
        b, j = held.nonzero(as_tuple=True)
        step.intermediate_states[padded.slots[b], j] = every[b, j].to(state.dtype)
        return
    held = (padded.slots >= 0) & (padded.q_lens > 0)
    state[padded.slots[held]] = last[held].to(state.dtype)


def causal_conv1d(x, weight, bias, conv_state, step, activation):
    padded = Padded(step, x.shape[0], conv_state.shape[0])
    width = weight.shape[1]
    w = weight.float()
    inputs = padded.gather(x)  # [B, Q, C]
    initial = padded.initial(conv_state)  # [B, K - 1, C]

    def convolve(window):  # window: [..., K, C] -> [..., C]
        out = (window * w.t()).sum(-2)
        if bias is not None:
            out = out + bias.float()
        return F.silu(out) if activation == "silu" else out

    if padded.parents is None:  # a plain sequence: every window at once
        history = torch.cat([initial, inputs], 1)  # [B, K - 1 + Q, C]
        windows = history.unfold(1, width, 1).transpose(-1, -2)  # [B, Q, K, C]
        out = convolve(windows)
        every = windows[:, :, 1:] if step.verify else None
        ends = padded.q_lens.view(-1, 1, 1) + torch.arange(width - 1, device=x.device).view(1, -1, 1)
        last = history.gather(1, ends.expand(-1, -1, history.shape[2]))
    else:

        def update(window, j):
            full = torch.cat([window, inputs[:, j, None]], 1)
            return full[:, 1:], convolve(full)

        out, every, last = scan(padded, initial, update, step.verify)
    write_states(padded, step, conv_state, every, last)
    return padded.scatter(out, x.shape[0], x.dtype)


def gated_delta_rule(q, k, v, g, beta, state, step, scale):
    padded = Padded(step, q.shape[0], state.shape[0])
    group = v.shape[1] // q.shape[1]
    q_, k_ = (padded.gather(t).repeat_interleave(group, dim=2) for t in (q, k))  # [B, Q, Hv, Dk]
    v_, beta_ = padded.gather(v), padded.gather(beta)
    decay = padded.gather(g).exp()  # [B, Q, Hv] or [B, Q, Hv, Dk]
    if decay.dim() == 3:
        decay = decay[..., None]

    def update(s, j):  # s: [B, Hv, Dk, Dv]
        s = s * decay[:, j, :, :, None]
        kj = k_[:, j]
        u = beta_[:, j, :, None] * (v_[:, j] - torch.einsum("bhkv,bhk->bhv", s, kj))
        s = s + kj[..., None] * u[:, :, None, :]
        return s, scale * torch.einsum("bhkv,bhk->bhv", s, q_[:, j])

    out, every, last = scan(padded, padded.initial(state), update, step.verify)
    write_states(padded, step, state, every, last)
    return padded.scatter(out, q.shape[0], v.dtype)


def selective_scan(x, dt, A, B, C, state, step, D, z, dt_bias, dt_softplus, dt_min, dt_max):
    padded = Padded(step, x.shape[0], state.shape[0])
    group = x.shape[1] // B.shape[1]
    x_ = padded.gather(x)  # [B, Q, H, P]
    B_, C_ = (padded.gather(t).repeat_interleave(group, dim=2) for t in (B, C))  # [B, Q, H, N]
    d = padded.gather(dt) + (0.0 if dt_bias is None else dt_bias.float())
    d = (F.softplus(d) if dt_softplus else d).clamp(dt_min, dt_max)  # [B, Q, H]
    rate = A.float() if A.dim() == 2 else A.float()[:, None]  # [H, N] or [H, 1]

    def update(s, j):  # s: [B, H, P, N]
        dj = d[:, j, :, None]
        s = s * torch.exp(dj * rate)[:, :, None, :] + (dj * x_[:, j])[..., None] * B_[:, j, :, None, :]
        return s, (s * C_[:, j, :, None, :]).sum(-1)

    y, every, last = scan(padded, padded.initial(state), update, step.verify)
    if D is not None:
        y = y + D.float()[:, None] * x_
    if z is not None:
        y = y * F.silu(padded.gather(z))
    write_states(padded, step, state, every, last)
    return padded.scatter(y, x.shape[0], x.dtype)
