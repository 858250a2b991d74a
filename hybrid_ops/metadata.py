"""Batch metadata: the tensors that describe a batch of requests to the ops, and helpers over them.

For B requests and T new tokens (packed request after request):
    cu_seqlens_q: [B + 1] int32   request i's new tokens are q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]
    seq_lens:     [B] int32       request i's KV length after this step (cached prefix + new tokens)
    block_table:  [B, max_pages] int32   request i's pages in order; position p lives in page
                                         block_table[i, p // page_size], row p % page_size

Request i with prefix P = seq_lens[i] - q_len_i; new token j sits at position P + j and, causally, sees
positions 0 .. P + j (with a sliding window W > 0: the last W of those):

    positions   0 1 2 3 4 5 6
                [ prefix  ][new]      P = 4, q_len = 3
    token 0      x x x x x            sees 0..4
    token 1      x x x x x x          sees 0..5
    token 2      x x x x x x x        sees 0..6
"""

from dataclasses import dataclass
from itertools import accumulate

import torch

from .modes import ForwardMode


@dataclass
class ForwardBatch:
    """One step's batch: its mode and metadata tensors, and the tree mask of a speculative tree step."""

    forward_mode: ForwardMode
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_pages] int32
    tree_mask: torch.Tensor | None = None  # [T, Q] bool: the ops' `tree_mask`; None: causal

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def metadata(self):
        """The three metadata arguments of the ops, in order."""
        return self.cu_seqlens_q, self.seq_lens, self.block_table


def build_metadata(
    q_lens, seq_lens, page_lists, max_pages=None, device="cpu", forward_mode=ForwardMode.EXTEND
) -> ForwardBatch:
    """Metadata tensors from host lists: `q_lens[i]` new tokens, `seq_lens[i]` total tokens, `page_lists[i]` pages.

    `max_pages` fixes the block table's width (static shapes for compiled code); rows are padded with page 0,
    which is never read past a request's `seq_lens`.
    """
    width = max([len(p) for p in page_lists], default=0) if max_pages is None else max_pages
    rows = [list(pages) + [0] * (width - len(pages)) for pages in page_lists]
    table = torch.tensor(rows, dtype=torch.int32).view(len(page_lists), width)
    cu = torch.tensor(list(accumulate(q_lens, initial=0)), dtype=torch.int32)
    return ForwardBatch(
        ForwardMode(forward_mode),
        cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
        table.to(device),
    )


def new_token_slots(cu_seqlens_q, seq_lens, block_table, num_tokens, page_size):
    """Cache rows of the new tokens, computed on the device without a host sync.

    Returns `slots: [T] int64`: token t goes to row `slots[t]` of the cache viewed as
    [num_pages * page_size, Hkv, D]. Assumes checked metadata (`check_metadata_values`).
    """
    token = torch.arange(num_tokens, device=cu_seqlens_q.device, dtype=torch.int32)
    request = torch.searchsorted(cu_seqlens_q[1:], token, right=True)
    q_start = cu_seqlens_q[request]
    q_len = cu_seqlens_q[request + 1] - q_start
    position = (seq_lens[request] - q_len + token - q_start).to(torch.int64)
    page = block_table[request, position.div(page_size, rounding_mode="floor")].to(torch.int64)
    return page * page_size + position.remainder(page_size)
