"""Batch buckets: a step's metadata padded up to one of a few fixed sizes, for CUDA graphs.

CUDA-graph trees record one graph (with its own memory pool) per distinct set of input sizes. A serving loop's batch
changes every step, so each step is padded to the smallest bucket that fits: `batch_buckets` for the number of
requests, `token_buckets` for the number of tokens of a prefill step. The padding requests come after the real ones;
every column of their block-table rows is the cache's scratch page (`PagedKVCache(reserve_scratch=True)`), which no
request owns, so they write and read only there, however long they are:

    real:     cu_seqlens_q [0, 5, 6]        seq_lens [9, 2]        block_table [[3, 7, 0], [4, 0, 0]]
    padded:   cu_seqlens_q [0, 5, 6, 7, 8]  seq_lens [9, 2, 1, 1]  block_table [[3, 7, 0], [4, 0, 0],
                                                                                [S, S, S], [S, S, S]]   S: scratch

The model runs the padded tokens too (their q/k/v rows follow the real ones); the caller keeps the first
`T_real` rows of the outputs. A backend that plans on the host (FlashInfer) plans a graph's static metadata outside
it, before its capture and every replay (`plan_for_graph`).
"""

from itertools import accumulate

import torch

from .backends import Spec, get_backend
from .errors import HybridInputError
from .metadata import ForwardBatch
from .modes import ROUTING, ForwardMode
from .options import Options

# The modes that ROUTING may send to the decode path (under either speculative_attention_mode): `decode` needs the
# same query length for every request, so their batches have one, and padding requests copy it.
UNIFORM_MODES = tuple(mode for mode, paths in ROUTING.items() if "decode" in paths)


def _capped(sizes, maximum):
    return [s for s in sizes if s < maximum] + [maximum]


def batch_buckets(max_batch_size: int):
    """Request counts, as sglang captures them: 1, 2, 4, 8, then every 8th, up to and ending at `max_batch_size`."""
    return _capped([1, 2, 4] + list(range(8, max_batch_size, 8)), max_batch_size)


def token_buckets(max_num_tokens: int):
    """Token counts: 1, 2, 4, 8, then powers of two and their halfway points (16, 24, 32, 48, 64, 96, ...), up to
    and ending at `max_num_tokens`; a step pads by less than half its bucket."""
    sizes, size = [1, 2, 4, 8], 16
    while size < max_num_tokens:
        sizes += [size, size * 3 // 2]
        size *= 2
    return _capped(sizes, max_num_tokens)


def bucket_for(buckets, size: int) -> int:
    """The smallest bucket >= size (buckets sorted)."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    raise HybridInputError(f"size {size} is larger than the largest bucket {buckets[-1]}")


def padding_q_lens(q_lens, forward_mode, batch_sizes, token_counts, max_q_len: int):
    """The query lengths of the padding requests that bring a step to buckets.

    q_lens: the real requests' query lengths (host ints). In `UNIFORM_MODES` each padding request has the real
    query length (1 for DECODE, the draft length for TARGET_VERIFY; 0 for IDLE) and the batch pads to
    `bucket_for(batch_sizes, B)`. Otherwise the tokens pad to `bucket_for(token_counts, T)`, spread evenly over the
    padding requests of the smallest batch bucket that has room for them, at most `max_q_len` each (what the
    block table's width holds).
    """
    num_requests = len(q_lens)
    if ForwardMode(forward_mode) in UNIFORM_MODES:
        q_len = q_lens[0] if q_lens else int(forward_mode == ForwardMode.DECODE)
        return [q_len] * (bucket_for(batch_sizes, num_requests) - num_requests)
    extra = bucket_for(token_counts, sum(q_lens)) - sum(q_lens)
    for batch_size in batch_sizes:
        count = batch_size - num_requests
        if count >= 0 and (extra == 0 or (count > 0 and -(-extra // count) <= max_q_len)):
            return [extra // count + (i < extra % count) for i in range(count)]
    raise HybridInputError(
        f"{extra} padding tokens for {num_requests} requests fit no batch bucket up to "
        f"{batch_sizes[-1]} with at most {max_q_len} tokens per padding request"
    )


def pad_batch(batch: ForwardBatch, q_lens, scratch_page: int, page_size: int, seq_len_fill: int = 1) -> ForwardBatch:
    """`batch` (B requests, T tokens) followed by `len(q_lens)` padding requests over the scratch page.

    q_lens: the padding requests' query lengths (host ints, `padding_q_lens`); padding request i has
    `seq_lens = max(q_lens[i], seq_len_fill)` (`seq_len_fill`: the backend's `get_cuda_graph_seq_len_fill_value()`)
    and a block-table row of `scratch_page` only. Returns a ForwardBatch of B + len(q_lens) requests and
    T + sum(q_lens) tokens, on the batch's device, built without reading it to the host:
    cu_seqlens_q [B' + 1], seq_lens [B'], block_table [B', max_pages], int32.
    """
    if not q_lens:
        return batch
    width = batch.block_table.shape[1]
    seq_lens = [max(n, seq_len_fill) for n in q_lens]
    if max(seq_lens) > width * page_size:
        raise HybridInputError(
            f"a padding request of {max(seq_lens)} tokens exceeds block_table's capacity of "
            f"{width} pages x {page_size} tokens"
        )
    device, int32 = batch.seq_lens.device, torch.int32
    ends = torch.tensor(list(accumulate(q_lens)), dtype=int32, device=device)
    padded = ForwardBatch(
        batch.forward_mode,
        torch.cat([batch.cu_seqlens_q, batch.cu_seqlens_q[-1:] + ends]),
        torch.cat([batch.seq_lens, torch.tensor(seq_lens, dtype=int32, device=device)]),
        torch.cat([batch.block_table, torch.full((len(q_lens), width), scratch_page, dtype=int32, device=device)]),
    )
    return padded


def plan_for_graph(backend: str, path: str, k_cache, v_cache, batch: ForwardBatch, q_dtype) -> None:
    """Outside a CUDA graph, before its capture and before every replay: the backend named `backend`, as the layers'
    ops choose it for q of `q_dtype` over a layer's caches (`k_cache`, `v_cache`), plans `batch`'s static metadata
    for `path` ("prefill" or "decode", the op the graph's layers run) into the buffers that the graph reads
    (`Backend.plan_cuda_graph`: FlashInfer plans, the others need nothing)."""
    features = Options(tree_mask=batch.tree_mask).resolve(k_cache.shape[-1], k_cache).features()
    spec = Spec(k_cache.device, q_dtype, k_cache.dtype, k_cache.shape[-1], v_cache.shape[-1], features)
    get_backend(backend, spec).plan_cuda_graph(path, k_cache, *batch.metadata, tree_mask=batch.tree_mask)
