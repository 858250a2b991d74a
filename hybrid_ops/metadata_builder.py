"""`MetadataBuilder`: a step's `ForwardBatch` from its requests' new-token counts and block-table rows, the step's
arguments checked against the table's width."""

import torch

from .errors import HybridInputError, OutOfPagesError
from .metadata import ForwardBatch, build_metadata
from .modes import ForwardMode


class MetadataBuilder:
    """Steps' metadata over pages of `page_size` tokens, in block tables of `max_pages` columns on `device`.
    `for_compile` marks the tables' width static for torch.compile (`mark_table`)."""

    def __init__(self, page_size: int, max_pages: int, device, for_compile: bool = True):
        self.page_size, self.max_pages = page_size, max_pages
        self.device, self.for_compile = torch.device(device), for_compile

    def new_lengths(self, request_ids, num_new_tokens, seq_len) -> list:
        """Each request's length after its `num_new_tokens`, `seq_len(request_id)` its length now (raising for an
        unknown request). Raises HybridInputError on bad arguments and OutOfPagesError for a request that would need
        more than `max_pages` pages."""
        if len(request_ids) != len(num_new_tokens):
            raise HybridInputError(
                f"num_new_tokens must have one entry per request ({len(request_ids)}), got {len(num_new_tokens)}"
            )
        if len(set(request_ids)) != len(request_ids):
            raise HybridInputError(f"request_ids must be distinct, got {list(request_ids)}")
        new_lens = []
        for rid, n in zip(request_ids, num_new_tokens):
            if not (isinstance(n, int) and n >= 0):
                raise HybridInputError(f"num_new_tokens must be non-negative ints, got {n!r} for request {rid!r}")
            length = seq_len(rid) + n
            num_pages = self.num_pages(length)
            if num_pages > self.max_pages:
                raise OutOfPagesError(
                    f"request {rid!r} needs {num_pages} pages for {length} tokens, more than "
                    f"max_pages_per_request = {self.max_pages}"
                )
            new_lens.append(length)
        return new_lens

    def num_pages(self, num_tokens: int) -> int:
        """Pages that hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def build(self, num_new_tokens, seq_lens, page_lists, forward_mode=ForwardMode.EXTEND) -> ForwardBatch:
        """The step's batch for B requests: `num_new_tokens[i]` new tokens of request i, `seq_lens[i]` its length after
        them, `page_lists[i]` its pages in order. cu_seqlens_q: [B + 1] int32, seq_lens: [B] int32, block_table:
        [B, max_pages] int32 (each row its pages, then page 0), on `device`."""
        batch = build_metadata(
            num_new_tokens,
            seq_lens,
            page_lists,
            max_pages=self.max_pages,
            device=self.device,
            forward_mode=forward_mode,
        )
        self.mark_table(batch)
        return batch

    def mark_table(self, batch: ForwardBatch) -> None:
        """Marks the width of `batch`'s block table static for torch.compile (`for_compile`)."""
        if self.for_compile:
            torch._dynamo.mark_static(batch.block_table, 1)
