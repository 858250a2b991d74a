"""The FlashInfer backend: paged prefill and decode through FlashInfer's wrappers, CUDA only.

Our metadata becomes FlashInfer's at this edge, on the device and without a host sync (`to_flashinfer_metadata`).
FlashInfer splits the work when it *plans* (host-side, it reads the metadata to the host): once per step for each
variant (path, dtypes, head counts, page size, scale, sliding window, soft-cap), each variant with its wrapper, so
every layer of a variant shares the step's plan (Gemma2-style alternating windows plan twice per step, not per layer).
A layer reuses the plan made for the same metadata tensors at the same version, and plans otherwise; an empty batch
(B = 0 or T = 0) returns an empty output without planning. `torch.ops.hybrid.plan` always plans: call it when
metadata made under `inference_mode` is rewritten in place (inference tensors have no version counter).

CUDA graphs. A replay reads the index buffers and the work split of the plan made before capture, and a plan cannot
run inside a capture (host copies). So a batch shape (path, B, T) that a graph replays is planned into wrappers made
with `use_cuda_graph=True`, one per variant, with index buffers allocated with the wrapper and never moved; planning
the same shape again refreshes those buffers in place and keeps the split's layout. A shape takes these wrappers once
`plan(..., cuda_graph=True)` or `plan_cuda_graph` has named it; it must be planned outside the graph before every
replay. While a graph is being captured the layers use their shape's CUDA-graph plan and never plan (the metadata
they receive may be copies: CUDA-graph trees copy inputs that are not static). Our cache layout (separate k and v
caches, [num_pages, page_size, Hkv, D]) is FlashInfer's "NHD" layout.

fp8 caches (float8_e4m3fn, float8_e5m2) run FlashInfer's fa2 kernels for an fp8 KV cache: planned with the cache's dtype
as `kv_data_type` and q's (fp16 or bf16: FlashInfer has no fp32-q kernel, so `supports` declines fp32 q and "auto" picks
another backend). The new k, v are quantized as `fp8.quantize` defines it. FlashInfer's `run` takes k_scale and v_scale
as scalars (folded into the kernel's float `sm_scale`, and a multiply of the whole output, over which an [Hkv] tensor
would broadcast along the head dim), while ours are [Hkv] tensors that may change between calls and must not be read to
the host (CUDA graphs read their current value), so they are applied on the device around the kernel: each query head's
q is multiplied by its kv head's k_scale (its scores are then those over stored * k_scale) and its output by the v_scale
(the output is linear in the values).
"""

from dataclasses import dataclass

import torch

from ..errors import HybridInputError
from ..fp8 import quantize, raw
from ..validation import decode_shape_ok
from .base import Backend
from .deps import importable

WORKSPACE_BYTES = 128 << 20


def to_flashinfer_metadata(cu_seqlens_q, seq_lens, block_table, page_size):
    """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len), all int32, from ours; no host sync.

    qo_indptr = cu_seqlens_q; kv_indptr: [B + 1] page offsets; kv_last_page_len: [B], 1..page_size (0 for an empty
    request). kv_indices has the static size B * max_pages + 1: request i's pages sit at
    kv_indices[kv_indptr[i]:kv_indptr[i + 1]], and everything past kv_indptr[B] is scratch. Table entries past a
    request's ceil(seq_len / page_size) pages (-1 or stale ids) only ever land in the scratch slot.
    """
    batch, max_pages = block_table.shape
    device = block_table.device
    num_pages = ((seq_lens.clamp(min=0) + page_size - 1) // page_size).clamp(max=max_pages)
    kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    torch.cumsum(num_pages, 0, out=kv_indptr[1:])
    last = seq_lens - (num_pages - 1) * page_size
    kv_last_page_len = torch.where(num_pages > 0, last, 0).to(torch.int32)
    column = torch.arange(max_pages, device=device)
    scratch = batch * max_pages
    dest = torch.where(column < num_pages[:, None], kv_indptr[:-1, None] + column, scratch)
    kv_indices = torch.zeros(scratch + 1, dtype=torch.int32, device=device)
    kv_indices.scatter_(0, dest.flatten().to(torch.int64), block_table.flatten())
    return cu_seqlens_q, kv_indptr, kv_indices, kv_last_page_len


@dataclass(frozen=True)
class _Variant:
    """All a plan depends on besides the metadata: the layers of one variant share one wrapper and one plan."""

    path: str
    device: torch.device
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    scale: float
    sliding_window: int
    logit_cap: float

    @classmethod
    def of(cls, path, q_dtype, num_q_heads, k_cache, options):
        _, page_size, num_kv_heads, head_dim = k_cache.shape
        return cls(
            path,
            k_cache.device,
            q_dtype,
            k_cache.dtype,
            num_q_heads,
            num_kv_heads,
            head_dim,
            page_size,
            options.scale,
            options.sliding_window,
            options.logit_cap,
        )


@dataclass
class _Plan:
    wrapper: object
    metadata: tuple  # the metadata tensors it was made for, held so that their ids cannot be reused
    versions: tuple  # their versions then (None for inference tensors)

    def matches(self, metadata) -> bool:
        return all(a is b for a, b in zip(metadata, self.metadata)) and _versions(metadata) == self.versions


def _versions(tensors):
    return tuple(None if t.is_inference() else t._version for t in tensors)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (nothing may plan then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class FlashInferBackend(Backend):
    name = "flashinfer"
    requirement = "flashinfer (pip install 'hybrid_ops[flashinfer]')"
    features = frozenset({"fp8_kv"})
    head_dims = (64, 128, 256)

    def __init__(self):
        self._workspaces = {}  # device -> float workspace, shared by every wrapper there (their runs are serial)
        self._plans = {}  # _Variant -> _Plan of its wrapper
        self._graph_plans = {}  # (_Variant, B, T) -> _Plan of its CUDA-graph wrapper
        self._graph_shapes = set()  # (path, device, B, T) planned into CUDA-graph wrappers
        self.plans_made = 0

    def is_available(self) -> bool:
        return importable("flashinfer")

    def supports(self, spec) -> bool:
        return (
            spec.device.type == "cuda"
            and spec.dtype in (torch.float16, torch.bfloat16)
            and spec.head_dim == spec.v_head_dim
            and spec.head_dim in self.head_dims
        )

    def plan(self, path, q_dtype, num_q_heads, k_cache, cu_seqlens_q, seq_lens, block_table, options, cuda_graph=False):
        """Plan one variant of this step; with `cuda_graph`, this batch shape takes CUDA-graph wrappers from now on.

        k_cache: [num_pages, page_size, Hkv, D] (its dtype, fp8 included, is the plan's kv_data_type); cu_seqlens_q:
        [B + 1], seq_lens: [B], block_table: [B, max_pages], int32 (our metadata). Reads T = cu_seqlens_q[-1] to the
        host, as FlashInfer's plan reads the metadata.
        """
        variant = _Variant.of(path, q_dtype, num_q_heads, k_cache, options)
        num_tokens = int(cu_seqlens_q[-1])  # planning reads the metadata to the host anyway
        if cuda_graph:
            self._graph_shapes.add((path, variant.device, seq_lens.shape[0], num_tokens))
        self._plan(variant, (cu_seqlens_q, seq_lens, block_table), num_tokens)

    def plan_cuda_graph(self, path, k_cache, cu_seqlens_q, seq_lens, block_table):
        """Give this batch shape CUDA-graph wrappers from now on, and re-plan every variant planned for it so far.

        For the capture and replay hooks: call it outside the graph, on the static metadata, before the capture
        (variants not planned yet get their wrappers at their first, eager, layer call) and before every replay.
        """
        metadata = (cu_seqlens_q, seq_lens, block_table)
        shape = (path, k_cache.device, seq_lens.shape[0], int(cu_seqlens_q[-1]))
        self._graph_shapes.add(shape)
        for variant, batch, num_tokens in list(self._graph_plans):
            if (variant.path, variant.device, batch, num_tokens) == shape:
                self._plan(variant, metadata, num_tokens)

    def _plan(self, variant, metadata, num_tokens):
        """Plan `variant` for this metadata of `num_tokens` tokens; returns the wrapper, None for an empty batch."""
        cu_seqlens_q, seq_lens, block_table = metadata
        batch = seq_lens.shape[0]
        if batch == 0 or num_tokens == 0:
            return None  # FlashInfer cannot plan an empty batch; the layers return empty outputs
        # The ops' check of q's rows, here on T = cu_seqlens_q[-1]: a plan has no q.
        if variant.path == "decode" and not decode_shape_ok(num_tokens, batch):
            raise HybridInputError(
                f"decode needs the same query length for every request: cu_seqlens_q[-1] = "
                f"{num_tokens} tokens for {batch} requests"
            )
        graph = (variant.path, variant.device, batch, num_tokens) in self._graph_shapes
        plans, key = (self._graph_plans, (variant, batch, num_tokens)) if graph else (self._plans, variant)
        plan = plans.get(key)
        if plan is not None:
            wrapper = plan.wrapper
        else:
            wrapper = self._new_wrapper(variant, (batch, num_tokens, block_table.shape[1]) if graph else None)
        qo_indptr, kv_indptr, kv_indices, last_page_len = to_flashinfer_metadata(
            cu_seqlens_q, seq_lens, block_table, variant.page_size
        )
        sizes = (variant.num_q_heads, variant.num_kv_heads, variant.head_dim, variant.page_size)
        kernel_options = dict(
            window_left=variant.sliding_window - 1 if variant.sliding_window > 0 else -1,
            logits_soft_cap=variant.logit_cap or None,
            sm_scale=variant.scale,
            q_data_type=variant.q_dtype,
            kv_data_type=variant.kv_dtype,
        )
        if variant.path == "decode":
            q_len = num_tokens // batch
            wrapper.plan(kv_indptr, kv_indices, last_page_len, *sizes, q_len_per_req=q_len, **kernel_options)
        else:
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, *sizes, causal=True, **kernel_options)
        plans[key] = _Plan(wrapper, metadata, _versions(metadata))
        self.plans_made += 1
        return wrapper

    def _new_wrapper(self, variant, graph_shape=None):
        """A wrapper for `variant`; for a CUDA-graph shape (B, T, block-table width), with index buffers of its own
        that never move (FlashInfer's plan copies each step's metadata into them)."""
        import flashinfer

        device = variant.device
        workspace = self._workspaces.get(device)
        if workspace is None:
            workspace = self._workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # fa2 named for decode: "auto" may route a multi-token decode plan to XQA (SM90) or cuDNN (SM100) by the
        # step's KV lengths, and a CUDA-graph wrapper then refuses the next plan that routes differently.
        decode = dict(use_tensor_cores=True, backend="fa2")
        if graph_shape is None:
            if variant.path == "decode":
                return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **decode)
            return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        batch, num_tokens, max_pages = graph_shape

        def buffer(size):
            return torch.zeros(size, dtype=torch.int32, device=device)

        indptr, indices, last_page_len = buffer(batch + 1), buffer(batch * max_pages + 1), buffer(batch)
        if variant.path == "decode":
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                "NHD",
                use_cuda_graph=True,
                paged_kv_indptr_buffer=indptr,
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last_page_len,
                **decode,
            )
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=buffer(batch + 1),
            paged_kv_indptr_buf=indptr,
            paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=last_page_len,
            max_total_num_rows=num_tokens,
        )

    def _run(self, path, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options):
        """options: resolved (k_scale, v_scale [Hkv] float32 with fp8 caches, else None). Returns [T, Hq, D] in q's
        dtype."""
        k_scale, v_scale = options.k_scale, options.v_scale
        from ..kernels.kv_store import store_kv  # masked and sync-free

        if k_scale is not None:  # quantized here, then copied as bytes (Triton's fp8 types depend on the GPU)
            k, v = quantize(k, k_scale, k_cache.dtype), quantize(v, v_scale, v_cache.dtype)
        store_kv(raw(k), raw(v), raw(k_cache), raw(v_cache), cu_seqlens_q, seq_lens, block_table)
        num_tokens = q.shape[0]
        if num_tokens == 0:  # B = 0 or no new tokens: nothing to attend, nothing to plan
            return q.new_empty(q.shape)
        variant = _Variant.of(path, q.dtype, q.shape[1], k_cache, options)
        metadata = (cu_seqlens_q, seq_lens, block_table)
        graph = self._graph_plans.get((variant, seq_lens.shape[0], num_tokens))
        if _capturing():
            if graph is None:
                raise HybridInputError(
                    f"flashinfer: no CUDA-graph plan for this {path} batch ({seq_lens.shape[0]} requests, "
                    f"{num_tokens} tokens) and layer variant; plan it before the capture: "
                    "torch.ops.hybrid.plan(..., cuda_graph=True), or an eager run after the capture hook"
                )
            wrapper = graph.wrapper
        else:
            plan = next((p for p in (graph, self._plans.get(variant)) if p is not None and p.matches(metadata)), None)
            wrapper = plan.wrapper if plan is not None else self._plan(variant, metadata, num_tokens)
        if k_scale is None:
            return wrapper.run(q.contiguous(), (k_cache, v_cache))
        group = q.shape[1] // k_cache.shape[2]  # query head h reads kv head h // group
        q = (q * k_scale.repeat_interleave(group)[:, None]).to(q.dtype)
        return wrapper.run(q, (k_cache, v_cache)).mul_(v_scale.repeat_interleave(group)[:, None])

    def prefill(self, *args):
        return self._run("prefill", *args)

    def decode(self, *args):
        return self._run("decode", *args)
