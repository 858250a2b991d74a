"""hybrid_ops as an sglang attention backend, named "hybrid_ops", on sglang's own pools and batches.

Installing hybrid_ops makes it available: its entry point in sglang's plugin group `sglang.srt.plugins` (`register`)
runs in every process sglang starts and adds the name to sglang's attention registry and command-line choices. Then
`--attention-backend hybrid_ops` serves every mode with the ops, and `--prefill-attention-backend hybrid_ops` or
`--decode-attention-backend hybrid_ops` make sglang build its own `HybridAttnBackend` around ours and another backend.
This module imports sglang; `import hybrid_ops` never does.

sglang's objects, served in place (no copy per step):

    pool     MHATokenToKVPool: per layer k_buffer [size + P, Hkv, D] and v_buffer [size + P, Hkv, Dv], viewed as
             the ops' caches [num_pages, P, Hkv, D] (P = --page-size). sglang gives a request's positions
             p..p + P - 1 of one page together, so slot = page * P + p % P, and page 0 is its padding page.
    batch    block_table = req_to_token[req_pool_indices, ::P] // P, [B, max_pages] int32; seq_lens the KV length
             after the step (TARGET_VERIFY's `seq_lens` counts the prefix only: the draft tokens are added);
             cu_seqlens_q from `extend_seq_lens` (1 per request in DECODE, the draft length in TARGET_VERIFY).
    writes   the ops store request i's new K/V at positions seq_lens[i] - q_len_i ..., the slots `out_cache_loc`
             names, since sglang writes a step's slots into req_to_token before the forward.
    trees    TARGET_VERIFY's `spec_info.custom_mask`: [B * Q, Q] on the CPU (sglang's QLEN_ONLY layout) is the ops'
             `tree_mask`; the GPU's FULL_MASK layout ([Q, prefix + Q] per request) is cut to its last Q columns.

The layer's options come from `RadixAttention`: `scaling`, `sliding_window_size` W (sglang's window admits W + 1 keys,
`k_pos >= q_pos - W`; the ops' `sliding_window` counts the keys, so W + 1), `logit_cap` (tanh), `v_head_dim`, `sinks=`
(a forward keyword, [Hq]), the model runner's `attention_chunk_size` on layers with `use_irope` (Llama 4), and for
fp8 pools the layer's `k_scale` / `v_scale` (the pool holds k / k_scale, as sglang's own writes do).

Modes follow sglang's predicates, as its `HybridAttnBackend._select_backend` does: `hybrid::attn` routes DECODE and
IDLE to the decode path, TARGET_VERIFY by `--speculative-attention-mode`, and EXTEND, MIXED, DRAFT_EXTEND_V2 and
SPLIT_PREFILL to prefill. PREBUILT and DLLM_EXTEND are refused by name (`modes.REFUSED_MODES`).

Graphs: sglang's CPU graph runner (`--enable-torch-compile` on the CPU) compiles the model per decode batch size with
our ops inside; the CUDA graph runner captures and replays them. For both, the step's metadata lives in static
buffers of a fixed width (the model's context in pages) that `init_forward_metadata` rewrites in place before every
replay, so a replay never changes a shape (no recompile) and a CUDA graph reads the current values. Padded requests
(req_pool_indices 0, seq_lens 1) read and write sglang's padding page only.
"""

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.eagle_utils import TreeMaskMode, default_tree_mask_mode

from ..buckets import plan_for_graph
from ..check_rows import FLOAT_DTYPES
from ..errors import HybridInputError
from ..fp8 import FP8_DTYPES
from ..metadata import ForwardBatch as Metadata
from ..modes import REFUSED_MODES, ForwardMode, select_path

NAME = "hybrid_ops"


def register() -> None:
    """The plugin: `hybrid_ops` in sglang's attention registry and command-line choices (idempotent)."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
    register_attention_backend(NAME)(HybridOpsAttnBackend)


def forward_mode_of(sglang_mode) -> ForwardMode:
    """The ops' mode of sglang's, by sglang's own predicates (the specific ones before `is_extend`, which several
    share); a clear error for a mode the ops do not serve."""
    refused = (
        (sglang_mode.is_prebuilt(), ForwardMode.PREBUILT),
        (sglang_mode.is_dllm_extend(), ForwardMode.DLLM_EXTEND),
    )
    for is_mode, mode in refused:
        if is_mode:
            raise HybridInputError(
                f"the hybrid_ops attention backend does not serve sglang's {sglang_mode.name}: {REFUSED_MODES[mode]}"
            )
    served = (
        (sglang_mode.is_idle(), ForwardMode.IDLE),
        (sglang_mode.is_decode(), ForwardMode.DECODE),
        (sglang_mode.is_target_verify(), ForwardMode.TARGET_VERIFY),
        (sglang_mode.is_draft_extend_v2(), ForwardMode.DRAFT_EXTEND_V2),
        (sglang_mode.is_mixed(), ForwardMode.MIXED),
        (sglang_mode.is_split_prefill(), ForwardMode.SPLIT_PREFILL),
        (sglang_mode.is_extend(), ForwardMode.EXTEND),
    )
    for is_mode, mode in served:
        if is_mode:
            return mode
    raise HybridInputError(f"the hybrid_ops attention backend does not serve sglang's {sglang_mode.name}")


def _check_layer(layer) -> None:
    """Refuses what the ops cannot compute exactly for a `RadixAttention` layer."""
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        raise HybridInputError(
            f"the hybrid_ops attention backend serves causal decoder attention; layer {layer.layer_id} is "
            f"{'cross attention' if layer.is_cross_attention else layer.attn_type.value}"
        )
    if layer.logit_cap > 0 and layer.logit_capping_method != "tanh":
        raise HybridInputError(
            f"layer {layer.layer_id}: logit_capping_method {layer.logit_capping_method!r} is not served (only 'tanh')"
        )
    if layer.xai_temperature_len != -1:
        raise HybridInputError(f"layer {layer.layer_id}: xai_temperature_len (Grok's logit temperature) is not served")


def _kv_scale(tensor, value, device):
    """A layer's fp8 scale as the ops take it: its tensor, or a float32 [] of its float; None for 1.0."""
    if tensor is not None:
        return tensor
    return None if value is None else torch.tensor(float(value), dtype=torch.float32, device=device)


class HybridOpsAttnBackend(AttentionBackend):
    """sglang's `AttentionBackend` over the ops (the module's docstring says how sglang's objects map to theirs)."""

    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if type(pool) is not MHATokenToKVPool or pool.dtype not in (*FLOAT_DTYPES, *FP8_DTYPES):
            raise HybridInputError(
                f"the hybrid_ops attention backend serves sglang's MHATokenToKVPool; this model's pool is "
                f"{type(pool).__name__} of {pool.dtype} (MLA, hybrid sliding-window and quantized pools are not served)"
            )
        self.token_to_kv_pool = pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.max_context_len = model_runner.model_config.context_len
        self.device = torch.device(model_runner.device)
        self.page_size = model_runner.page_size
        self.attention_chunk = model_runner.attention_chunk_size or -1
        self.speculative_attention_mode = get_spec().speculative_attention_mode
        self.kv_cache_dtype = pool.dtype
        # Each layer's buffers as pages, made once: a compiled step reads these tensors and writes them in place.
        self.pages = {}
        for layer_id in range(pool.start_layer, pool.start_layer + pool.layer_num):
            k, v = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
            self.pages[layer_id] = (k.unflatten(0, (-1, self.page_size)), v.unflatten(0, (-1, self.page_size)))
        # The widest block table: the context of a request row in pages.
        self.max_pages = -(-self.req_to_token_pool.req_to_token.shape[1] // self.page_size)
        self.forward_metadata = None
        self.graph_metadata = None  # static buffers (`init_cuda_graph_state`, `init_cpu_graph_state`)

    # -- metadata ---------------------------------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        """The step's metadata (`Metadata`: mode, cu_seqlens_q, seq_lens, block_table, tree_mask): in the graph
        buffers for a step a graph may replay (DECODE, TARGET_VERIFY, IDLE), of its own size otherwise."""
        mode = forward_mode_of(forward_batch.forward_mode)
        graph = self.graph_metadata is not None and forward_batch.batch_size <= self.graph_max_bs
        static = graph and mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)
        self.forward_metadata = self._metadata(mode, forward_batch, static)
        return self.forward_metadata

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Before a CUDA graph's capture and before every replay: the metadata into the static buffers, and the host
        planning of a backend that plans (FlashInfer, `buckets.plan_for_graph`)."""
        metadata = self.init_forward_metadata(forward_batch)
        layer_id = next(iter(self.pages))
        q_dtype = torch.bfloat16 if self.kv_cache_dtype in FP8_DTYPES else self.kv_cache_dtype
        path = select_path(metadata.forward_mode, self.speculative_attention_mode)
        plan_for_graph("auto", path, *self.pages[layer_id], metadata, q_dtype)

    def _metadata(self, mode, forward_batch, static):
        batch_size = forward_batch.batch_size if mode != ForwardMode.IDLE else 0
        seq_lens = forward_batch.seq_lens[:batch_size]
        q_len = 1
        if mode == ForwardMode.TARGET_VERIFY:
            q_len = forward_batch.spec_info.draft_token_num
            seq_lens = seq_lens + q_len
        if mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE):
            cu_seqlens_q = torch.arange(batch_size + 1, dtype=torch.int32, device=seq_lens.device) * q_len
        else:
            cu_seqlens_q = torch.nn.functional.pad(torch.cumsum(forward_batch.extend_seq_lens, 0), (1, 0))
        tree_mask = self._tree_mask(mode, forward_batch, seq_lens, q_len)
        if static:
            return self._static(mode, forward_batch.req_pool_indices, cu_seqlens_q, seq_lens, tree_mask)
        # The widest request in pages, from the host's copy of sglang's seq_lens where it keeps one (no device sync).
        lens = forward_batch.seq_lens if forward_batch.seq_lens_cpu is None else forward_batch.seq_lens_cpu
        max_len = (
            int(lens[:batch_size].max()) + (q_len if mode == ForwardMode.TARGET_VERIFY else 0) if batch_size else 0
        )
        block_table = self._block_table(forward_batch.req_pool_indices[:batch_size], -(-max_len // self.page_size))
        return Metadata(mode, cu_seqlens_q.to(torch.int32), seq_lens.to(torch.int32), block_table, tree_mask)

    def _block_table(self, req_pool_indices, width):
        """[B, width] int32: each request's pages, from its row of req_to_token."""
        rows = self.req_to_token_pool.req_to_token[req_pool_indices, : width * self.page_size : self.page_size]
        return rows if self.page_size == 1 else torch.div(rows, self.page_size, rounding_mode="floor")

    def _tree_mask(self, mode, forward_batch, seq_lens, q_len):
        """TARGET_VERIFY's tree, [B * Q, Q] bool; None for a chain (EAGLE's topk 1: causal) and other modes."""
        spec_info = forward_batch.spec_info
        if mode != ForwardMode.TARGET_VERIFY or spec_info.custom_mask is None or spec_info.topk == 1:
            return None
        batch_size, mask = seq_lens.shape[0], spec_info.custom_mask.bool()
        if default_tree_mask_mode() == TreeMaskMode.QLEN_ONLY:
            tree = mask[: batch_size * q_len * q_len].view(batch_size * q_len, q_len)
        else:
            # FULL_MASK: request b's rows [Q, prefix_b + Q] start at Q * (prefix sum before b + Q * b); its draft
            # columns are the last Q of each row.
            prefix = (seq_lens - q_len).to(torch.int64)
            starts = q_len * (torch.cumsum(prefix, 0) - prefix + q_len * torch.arange(batch_size, device=prefix.device))
            rows = torch.arange(q_len, device=prefix.device)
            index = starts[:, None, None] + rows[:, None] * (prefix + q_len)[:, None, None] + prefix[:, None, None]
            tree = mask[index + rows].view(batch_size * q_len, q_len)
        # A token sees itself and no later token: what an EAGLE tree's rows say already, made true of the rows of a
        # graph's padded requests too, whatever their buffer holds.
        token = (torch.arange(batch_size * q_len, device=tree.device) % q_len)[:, None]
        column = torch.arange(q_len, device=tree.device)
        return (tree & (column < token)) | (column == token)

    # -- graphs -----------------------------------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Static metadata for up to `max_bs` requests of up to `max_num_tokens` tokens."""
        int32 = dict(dtype=torch.int32, device=self.device)
        max_q_len = max(max_num_tokens // max(max_bs, 1), 1)
        self.graph_max_bs = max_bs
        self.graph_metadata = (
            torch.zeros(max_bs + 1, **int32),
            torch.ones(max_bs, **int32),
            torch.zeros(max_bs, self.max_pages, **int32),
            torch.zeros(max_num_tokens * max_q_len, dtype=torch.bool, device=self.device),
        )

    def _static(self, mode, req_pool_indices, cu_seqlens_q, seq_lens, tree_mask):
        """The metadata copied into the graph buffers, in place: views of the first B requests, every block-table row
        the full width."""
        cu_buffer, lens_buffer, table_buffer, tree_buffer = self.graph_metadata
        batch_size = seq_lens.shape[0]
        cu_buffer[: batch_size + 1].copy_(cu_seqlens_q)
        lens_buffer[:batch_size].copy_(seq_lens)
        table = table_buffer[:batch_size]
        table.copy_(self._block_table(req_pool_indices[:batch_size], self.max_pages))
        if tree_mask is not None:
            tree = tree_buffer[: tree_mask.numel()].view(tree_mask.shape)
            tree_mask = tree.copy_(tree_mask)
        return Metadata(mode, cu_buffer[: batch_size + 1], lens_buffer[:batch_size], table, tree_mask)

    def get_cuda_graph_seq_len_fill_value(self):
        # Padded requests hold one position, on sglang's padding page: nothing out of range.
        return 1

    init_cpu_graph_state = init_cuda_graph_state
    get_cpu_graph_seq_len_fill_value = get_cuda_graph_seq_len_fill_value

    def init_forward_metadata_capture_cpu_graph(
        self, bs, num_tokens, req_pool_indices, seq_lens, out_cache_loc, encoder_lens, forward_mode, spec_info
    ):
        """sglang's CPU graph runner, before compiling the step of `bs` decode requests: the static metadata."""
        cu_seqlens_q = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
        self.forward_metadata = self._static(
            forward_mode_of(forward_mode), req_pool_indices, cu_seqlens_q, seq_lens, None
        )

    # -- forward ----------------------------------------------------------------------------------------------------

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _forward(self, q, k, v, layer, forward_batch, save_kv_cache, sinks=None, **kwargs):
        """q: [T, Hq * D] or [T, Hq, D]; k: [T, Hkv, D], v: [T, Hkv, Dv] (None, or with `save_kv_cache=False`: the new
        tokens' K/V are in the pool already, written by a fused kernel or the layer whose KV this one shares, and the
        op writes them again, unchanged). Returns [T, Hq * Dv] in q's dtype."""
        if kwargs:
            raise HybridInputError(f"the hybrid_ops attention backend does not serve the keywords {sorted(kwargs)}")
        _check_layer(layer)
        metadata = self.forward_metadata
        k_cache, v_cache = self.pages[layer.layer_id]
        if k is None or not save_kv_cache:
            k, v = self._stored(layer, k_cache, v_cache, forward_batch.out_cache_loc, q.dtype)
        fp8 = k_cache.dtype in FP8_DTYPES
        out = torch.ops.hybrid.attn(
            q.unflatten(-1, (layer.tp_q_head_num, layer.qk_head_dim)) if q.dim() == 2 else q,
            k,
            v,
            k_cache,
            v_cache,
            metadata.cu_seqlens_q,
            metadata.seq_lens,
            metadata.block_table,
            int(metadata.forward_mode),
            scale=layer.scaling,
            sliding_window=layer.sliding_window_size + 1 if layer.sliding_window_size >= 0 else -1,
            logit_cap=layer.logit_cap,
            sinks=None if sinks is None else sinks.float(),
            attention_chunk=self.attention_chunk if layer.use_irope else -1,
            k_scale=_kv_scale(layer.k_scale, layer.k_scale_float, q.device) if fp8 else None,
            v_scale=_kv_scale(layer.v_scale, layer.v_scale_float, q.device) if fp8 else None,
            tree_mask=metadata.tree_mask,
            speculative_attention_mode=self.speculative_attention_mode,
        )
        return out.flatten(1)

    def _stored(self, layer, k_cache, v_cache, out_cache_loc, dtype):
        """The new tokens' K/V as the pool holds them at `out_cache_loc`, in q's dtype (fp8: times the scales)."""
        k = k_cache.flatten(0, 1)[out_cache_loc]
        v = v_cache.flatten(0, 1)[out_cache_loc]
        if k_cache.dtype in FP8_DTYPES:
            k_scale = _kv_scale(layer.k_scale, layer.k_scale_float, k.device)
            v_scale = _kv_scale(layer.v_scale, layer.v_scale_float, v.device)
            k = k.float() * (1.0 if k_scale is None else k_scale)
            v = v.float() * (1.0 if v_scale is None else v_scale)
        return k.to(dtype), v.to(dtype)
