"""`HybridAttnBackend`: a prefill and a decode backend behind sglang's attention-backend interface.

Engines that drive attention through per-step objects (metadata set up once per step, CUDA-graph buffers, capture
and replay) use this; models that only call `torch.ops.hybrid.attn` need none of it. The routing is the ops' own
table (`modes.ROUTING`), so the object and the op never disagree.
"""

from dataclasses import dataclass, fields

import torch

from ..backends import check_backend_name
from ..buckets import pad_batch, plan_for_graph
from ..errors import HybridInputError
from ..fp8 import FP8_DTYPES
from ..metadata import ForwardBatch
from ..modes import ForwardMode, check_speculative_attention_mode, select_path


@dataclass
class AttentionLayer:
    """What an attention layer tells its backend (sglang's `RadixAttention` fields): its id and its options of the ops
    (`options.Options`), at the ops' defaults unless given.

    scale: the logit scale, None for 1 / sqrt(D); sliding_window: -1 or the window W; logit_cap: 0.0 or the soft-cap;
    sinks: None or [Hq] float32 on q's device, one logit per query head (gpt-oss); attention_chunk: -1 or the chunk
    length (Llama 4's chunked layers). The other options are not the layer's: the fp8 scales are the cache's
    (`PagedKVCache.scales`), the tree mask the batch's. Nor are head counts and dims: the layer's caches and q tell
    them (`PhaseBackend`).
    """

    layer_id: int
    scale: float | None = None
    sliding_window: int = -1
    logit_cap: float = 0.0
    sinks: torch.Tensor | None = None
    attention_chunk: int = -1

    def keywords(self) -> dict:
        """The layer's options as keywords of the ops: every field but its id."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "layer_id"}


def _heads(x, head_dim):
    """x [T, H, head_dim], or [T, H * head_dim] viewed as that."""
    # Unflattened by the last dim rather than viewed as [T, -1, head_dim]: an empty step (IDLE) has T = 0, which
    # leaves -1 undetermined.
    return x.unflatten(-1, (-1, head_dim)) if x.dim() == 2 else x


def _fill_chains(tree_mask):
    """Fills a graph's tree mask, [bs * q_len, q_len] bool, with chains: each token sees its request's earlier ones."""
    num_tokens, q_len = tree_mask.shape
    if tree_mask.numel():
        local = torch.arange(num_tokens, device=tree_mask.device) % q_len  # token t is its request's j
        tree_mask.copy_(torch.arange(q_len, device=tree_mask.device) <= local[:, None])


class PhaseBackend:
    """One phase's backend: the name of a registered backend, the step's metadata and its CUDA-graph buffers.

    `forward_extend` calls `torch.ops.hybrid.prefill`, `forward_decode` calls `torch.ops.hybrid.decode`, with the
    layer's options (`AttentionLayer.keywords`), on q [T, Hq, D], k [T, Hkv, D] and v [T, Hkv, Dv], or each flattened
    ([T, Hq * D] and the like, as sglang's layers hand them over): float16, bfloat16 or float32, the cache's dtype
    unless it is fp8; D and Dv are the layer's caches'. They return [T, Hq, Dv] in q's dtype, flattened to
    [T, Hq * Dv] when q is (what sglang's backends return).

    Speculative trees: a batch's `tree_mask` ([T, Q] bool, the ops' option) goes to the ops. sglang carries a tree
    in `forward_batch.spec_info.custom_mask`, EAGLE's full mask: request after request, request i's N rows of
    prefix_i + N bools, the prefix's all True; our tree_mask[cu_seqlens_q[i] + j, c] is its row j's entry
    prefix_i + c. A CUDA graph of tree steps is captured with `tree=True` (sglang: a capture whose spec_info has a
    custom_mask); its tree mask is a static buffer that each replay fills, as the metadata's: with the batch's tree
    (chains when it has none, and for the padding requests).
    """

    def __init__(self, kv_cache, backend: str = "auto"):
        check_backend_name(backend)
        self.kv_cache = kv_cache
        self.backend = backend
        self.forward_batch = None
        self.graph_buffers = None  # (cu_seqlens_q [max_bs + 1], seq_lens [max_bs], block_table [max_bs, max_pages])
        self.tree_buffer = None  # bool: the tree mask of a graph of tree steps, in its first num_tokens * q_len
        self.captured_num_tokens = {}  # bs -> num_tokens of its capture
        self.tree_graphs = set()  # bs captured with a tree mask

    def init_forward_metadata(self, forward_batch):
        self.forward_batch = forward_batch

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        device, max_pages = self.kv_cache.device, self.kv_cache.max_pages_per_request
        self.graph_buffers = (
            torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            torch.full((max_bs,), self.get_cuda_graph_seq_len_fill_value(), dtype=torch.int32, device=device),
            torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device),
        )
        # Up to max_num_tokens // max_bs tokens per request (sglang's num_tokens_per_bs) for graphs of tree steps.
        max_q_len = max(max_num_tokens // max(max_bs, 1), 1)
        self.tree_buffer = torch.zeros(max_num_tokens * max_q_len, dtype=torch.bool, device=device)
        for t in (*self.graph_buffers, self.tree_buffer):
            torch._dynamo.mark_static_address(t)

    def _captured(self, bs):
        """(num_tokens, tokens per request) of the capture of `bs` requests; (0, 0) before it."""
        num_tokens = self.captured_num_tokens.get(bs, 0)
        return num_tokens, num_tokens // max(bs, 1)

    def _graph_batch(self, bs, forward_mode):
        cu, lens, table = self.graph_buffers
        tree_mask = None
        if bs in self.tree_graphs:
            num_tokens, q_len = self._captured(bs)
            tree_mask = self.tree_buffer[: num_tokens * q_len].view(num_tokens, q_len)
        return ForwardBatch(ForwardMode(forward_mode), cu[: bs + 1], lens[:bs], table[:bs], tree_mask)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, forward_mode, tree: bool = False):
        """Point the metadata at the static buffers for a capture of `bs` requests with `num_tokens` tokens; with
        `tree`, a tree mask too (chains at capture), which each replay fills."""
        q_len = num_tokens // max(bs, 1)
        if tree and num_tokens * q_len > self.tree_buffer.numel():
            raise HybridInputError(
                f"a tree graph of {bs} requests of {q_len} tokens needs a {num_tokens} x {q_len} tree mask, more than "
                f"the tree buffer's {self.tree_buffer.numel()} entries (init_cuda_graph_state's max_num_tokens x "
                "max_num_tokens // max_bs)"
            )
        self.captured_num_tokens[bs] = num_tokens
        (self.tree_graphs.add if tree else self.tree_graphs.discard)(bs)
        batch = self._graph_batch(bs, forward_mode)
        batch.cu_seqlens_q.copy_(torch.arange(bs + 1, dtype=torch.int32) * q_len)
        # Each request holds at least its own tokens (FlashInfer's multi-token decode plan checks it), over the
        # scratch page when there is one, so the warm-up run before a capture writes no request's page.
        batch.seq_lens.fill_(max(self.get_cuda_graph_seq_len_fill_value(), q_len))
        if self.kv_cache.scratch_page is not None:
            batch.block_table.fill_(self.kv_cache.scratch_page)
        if tree:
            _fill_chains(batch.tree_mask)
        self.forward_batch = batch
        self._plan_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch):
        """Copy a real batch's metadata into the static buffers, in place, before replaying the graph.

        A batch of B < bs requests is padded to bs (`buckets.pad_batch`) with requests of the captured query length
        (num_tokens // bs) over the cache's scratch page: the graph's q/k/v have bs * that many rows, of which the
        first T (the real tokens) are the outputs to keep. A graph captured with `tree` reads the batch's tree mask
        (chains for a batch without one, and for the padding requests).
        """
        self._check_tree(bs, forward_batch.tree_mask)
        padding = bs - forward_batch.batch_size
        if padding < 0:
            raise HybridInputError(
                f"forward_batch has {forward_batch.batch_size} requests, more than the graph's bs = {bs}"
            )
        if padding and (self.kv_cache.scratch_page is None or bs not in self.captured_num_tokens):
            raise HybridInputError(
                f"forward_batch has {forward_batch.batch_size} requests and the graph bs = {bs}: "
                "padding it needs PagedKVCache(reserve_scratch=True) and a capture of that bs"
            )
        q_len = self._captured(bs)[1]
        padded = pad_batch(
            forward_batch,
            [q_len] * padding,
            self.kv_cache.scratch_page,
            self.kv_cache.page_size,
            self.get_cuda_graph_seq_len_fill_value(),
        )
        batch = self._graph_batch(bs, forward_batch.forward_mode)
        batch.cu_seqlens_q.copy_(padded.cu_seqlens_q)
        batch.seq_lens.copy_(padded.seq_lens)
        batch.block_table[:, : padded.block_table.shape[1]].copy_(padded.block_table)
        if batch.tree_mask is not None:
            _fill_chains(batch.tree_mask)
            if forward_batch.tree_mask is not None:
                real = forward_batch.tree_mask
                batch.tree_mask[: real.shape[0]].copy_(real[:, : batch.tree_mask.shape[1]])
        self.forward_batch = batch
        self._plan_cuda_graph(batch)

    def _check_tree(self, bs, tree_mask):
        """A replay's tree mask against the graph of `bs` requests: one only for a graph captured with `tree`, and
        with rows and columns for the graph's requests."""
        if bs not in self.tree_graphs:
            if tree_mask is not None:
                raise HybridInputError(
                    f"forward_batch has a tree_mask, but the graph of bs = {bs} was captured without one "
                    "(init_forward_metadata_capture_cuda_graph(..., tree=True))"
                )
            return
        num_tokens, q_len = self._captured(bs)
        if tree_mask is not None and (tree_mask.shape[0] > num_tokens or tree_mask.shape[1] < q_len):
            raise HybridInputError(
                f"forward_batch.tree_mask of shape {tuple(tree_mask.shape)} does not fit the graph of bs = {bs}: at "
                f"most {num_tokens} rows and at least its {q_len} tokens per request as columns"
            )

    def _plan_cuda_graph(self, batch):
        """Outside the graph, before capture and replay (`buckets.plan_for_graph`)."""
        # An fp8 cache does not tell q's dtype: bf16 stands for it (fp16 is served alike, and the backend that plans,
        # FlashInfer, has no fp32-q kernel).
        k_cache = self.kv_cache.k_caches[0]
        q_dtype = torch.bfloat16 if k_cache.dtype in FP8_DTYPES else k_cache.dtype
        # sglang calls forward_decode (hybrid::decode) in DECODE and IDLE, forward_extend (hybrid::prefill) otherwise.
        path = "decode" if batch.forward_mode.is_decode_or_idle() else "prefill"
        plan_for_graph(self.backend, path, self.kv_cache, batch, q_dtype)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # Capture runs with every request at length 1: one valid position, nothing out of range.
        return 1

    def get_indexer_metadata(self, layer_id: int, forward_batch):
        return None  # no sparse-attention indexer

    def _forward(self, op, q, k, v, layer):
        k_cache, v_cache = self.kv_cache.layer(layer.layer_id)
        head_dim, v_head_dim = k_cache.shape[-1], v_cache.shape[-1]
        out = op(
            _heads(q, head_dim),
            _heads(k, head_dim),
            _heads(v, v_head_dim),
            k_cache,
            v_cache,
            *self.forward_batch.metadata,
            tree_mask=self.forward_batch.tree_mask,
            backend=self.backend,
            **layer.keywords(),
            **self.kv_cache.scales(layer.layer_id),
        )
        return out.flatten(1) if q.dim() == 2 else out

    def forward_extend(self, q, k, v, layer, forward_batch=None):
        return self._forward(torch.ops.hybrid.prefill, q, k, v, layer)

    def forward_decode(self, q, k, v, layer, forward_batch=None):
        return self._forward(torch.ops.hybrid.decode, q, k, v, layer)


class HybridAttnBackend:
    """Routes every per-step call to the prefill or the decode backend, by forward mode (see `modes.ROUTING`).

    `prefill_backend` and `decode_backend` are backend objects with sglang's interface (`PhaseBackend` or your
    own). CUDA-graph state is set up for the decode backend always, and for the prefill backend too when
    speculative decoding runs its verify/draft-extend steps there (`speculative_attention_mode == "prefill"`).
    """

    def __init__(
        self, prefill_backend, decode_backend, speculative_attention_mode: str = "prefill", speculative: bool = False
    ):
        check_speculative_attention_mode(speculative_attention_mode)
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.speculative_attention_mode = speculative_attention_mode
        self.speculative = speculative

    def _select_backend(self, forward_mode):
        path = select_path(int(forward_mode), self.speculative_attention_mode)
        return self.decode_backend if path == "decode" else self.prefill_backend

    def init_forward_metadata(self, forward_batch):
        self._select_backend(forward_batch.forward_mode).init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.decode_backend.init_cuda_graph_state(max_bs, max_num_tokens)
        if self.speculative and self.speculative_attention_mode == "prefill":
            self.prefill_backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, forward_mode, tree: bool = False):
        """tree: the graph's steps carry a tree mask (sglang: its capture's spec_info has a custom_mask)."""
        self._select_backend(forward_mode).init_forward_metadata_capture_cuda_graph(bs, num_tokens, forward_mode, tree)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch):
        self._select_backend(forward_batch.forward_mode).init_forward_metadata_replay_cuda_graph(bs, forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()

    def forward_decode(self, q, k, v, layer, forward_batch):
        return self.decode_backend.forward_decode(q, k, v, layer, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch):
        return self._select_backend(forward_batch.forward_mode).forward_extend(q, k, v, layer, forward_batch)

    def get_indexer_metadata(self, layer_id: int, forward_batch):
        return self._select_backend(forward_batch.forward_mode).get_indexer_metadata(layer_id, forward_batch)
