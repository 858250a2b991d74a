"""`HybridAttnBackend`: a prefill and a decode backend behind sglang's attention-backend interface.

Engines that drive attention through per-step objects (metadata set up once per step, CUDA-graph buffers, capture
and replay) use this; models that only call `torch.ops.hybrid.attn` need none of it. The routing is the ops' own
table (`modes.ROUTING`), so the object and the op never disagree.
"""

from dataclasses import dataclass

import torch

from ..backends import Spec, check_backend_name, get_backend
from ..buckets import pad_batch
from ..errors import HybridInputError
from ..fp8 import FP8_DTYPES
from ..metadata import ForwardBatch
from ..modes import ForwardMode, check_speculative_attention_mode, select_path
from ..options import Options


@dataclass
class AttentionLayer:
    """What an attention layer tells its backend (sglang's `RadixAttention` fields)."""

    layer_id: int
    scale: float | None = None
    sliding_window: int = -1
    logit_cap: float = 0.0


class PhaseBackend:
    """One phase's backend: the name of a registered backend, the step's metadata and its CUDA-graph buffers.

    `forward_extend` calls `torch.ops.hybrid.prefill`, `forward_decode` calls `torch.ops.hybrid.decode`.
    """

    def __init__(self, kv_cache, backend: str = "auto"):
        check_backend_name(backend)
        self.kv_cache = kv_cache
        self.backend = backend
        self.forward_batch = None
        self.graph_buffers = None  # (cu_seqlens_q [max_bs + 1], seq_lens [max_bs], block_table [max_bs, max_pages])
        self.captured_num_tokens = {}  # bs -> num_tokens of its capture

    def init_forward_metadata(self, forward_batch):
        self.forward_batch = forward_batch

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        device, max_pages = self.kv_cache.device, self.kv_cache.max_pages_per_request
        self.graph_buffers = (
            torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            torch.full((max_bs,), self.get_cuda_graph_seq_len_fill_value(), dtype=torch.int32, device=device),
            torch.zeros(max_bs, max_pages, dtype=torch.int32, device=device),
        )
        for t in self.graph_buffers:
            torch._dynamo.mark_static_address(t)

    def _graph_batch(self, bs, forward_mode):
        cu, lens, table = self.graph_buffers
        return ForwardBatch(ForwardMode(forward_mode), cu[: bs + 1], lens[:bs], table[:bs])

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, forward_mode):
        """Point the metadata at the static buffers for a capture of `bs` requests with `num_tokens` tokens."""
        batch = self._graph_batch(bs, forward_mode)
        q_len = num_tokens // max(bs, 1)
        batch.cu_seqlens_q.copy_(torch.arange(bs + 1, dtype=torch.int32) * q_len)
        # Each request holds at least its own tokens (FlashInfer's multi-token decode plan checks it), over the
        # scratch page when there is one, so the warm-up run before a capture writes no request's page.
        batch.seq_lens.fill_(max(self.get_cuda_graph_seq_len_fill_value(), q_len))
        if self.kv_cache.scratch_page is not None:
            batch.block_table.fill_(self.kv_cache.scratch_page)
        self.captured_num_tokens[bs] = num_tokens
        self.forward_batch = batch
        self._plan_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, forward_batch):
        """Copy a real batch's metadata into the static buffers, in place, before replaying the graph.

        A batch of B < bs requests is padded to bs (`buckets.pad_batch`) with requests of the captured query length
        (num_tokens // bs) over the cache's scratch page: the graph's q/k/v have bs * that many rows, of which the
        first T (the real tokens) are the outputs to keep.
        """
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
        q_len = self.captured_num_tokens.get(bs, 0) // max(bs, 1)
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
        self.forward_batch = batch
        self._plan_cuda_graph(batch)

    def _plan_cuda_graph(self, batch):
        """Outside the graph, before capture and replay: a backend that plans (FlashInfer) plans the static metadata
        into the buffers the graph reads (`plan_cuda_graph`); the others need nothing."""
        k_cache, v_cache = self.kv_cache.layer(0)
        # The backend the layers' ops take. An fp8 cache does not tell q's dtype: bf16 stands for it (fp16 is
        # served alike, and the backend that plans, FlashInfer, has no fp32-q kernel).
        q_dtype = torch.bfloat16 if k_cache.dtype in FP8_DTYPES else k_cache.dtype
        features = Options().resolve(k_cache.shape[-1], k_cache).features()
        spec = Spec(k_cache.device, q_dtype, k_cache.dtype, k_cache.shape[-1], v_cache.shape[-1], features)
        impl = get_backend(self.backend, spec)
        # The path of the op the layers call: forward_decode for DECODE (and IDLE), forward_extend otherwise.
        path = "decode" if batch.forward_mode.is_decode_or_idle() else "prefill"
        impl.plan_cuda_graph(path, k_cache, *batch.metadata)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        # Capture runs with every request at length 1: one valid position, nothing out of range.
        return 1

    def get_indexer_metadata(self, layer_id: int, forward_batch):
        return None  # no sparse-attention indexer

    def _forward(self, op, q, k, v, layer):
        k_cache, v_cache = self.kv_cache.layer(layer.layer_id)
        return op(
            q,
            k,
            v,
            k_cache,
            v_cache,
            *self.forward_batch.metadata,
            scale=layer.scale,
            sliding_window=layer.sliding_window,
            logit_cap=layer.logit_cap,
            backend=self.backend,
            **self.kv_cache.scales(layer.layer_id),
        )

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

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, forward_mode):
        self._select_backend(forward_mode).init_forward_metadata_capture_cuda_graph(bs, num_tokens, forward_mode)

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
