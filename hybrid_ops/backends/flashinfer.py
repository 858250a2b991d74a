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

Speculative trees (`tree_mask`). Of FlashInfer's kernels only the fa2 prefill wrapper takes a mask, so a tree variant
(keyed apart from the causal one) runs `BatchPrefillWithPagedKVCacheWrapper` on either path, the decode path's
verify steps included. Its custom mask replaces causal masking and spans each request's whole KV, so it holds the
prefix (all seen), the tree, and the sliding window: FlashInfer's window counts slots, while a tree's positions are
prefix + depth (`ops`), so the window goes into the mask and the plan has none (`window_left=-1`). Soft-cap, scale and
fp8 caches pass through as for causal variants. `kernels.custom_mask` writes the mask on the device from our [T, Q]
tree mask and the metadata. An eager plan hands it to `plan` as the bool `custom_mask`, which FlashInfer packs (a
`.item()` each, one for its size and one in its packing, beside the plan's own host reads); a CUDA-graph wrapper of a
tree variant has mask buffers of its own (`custom_mask_buf`, `mask_indptr_buf`, ceil(T x max_pages x page_size / 8) +
B bytes), which such a wrapper always reads (it runs in custom-mask mode whatever it was planned with): each plan
packs the step's mask into them on the device after FlashInfer's `plan`, never through its `packed_custom_mask`
argument (0.7.4 leaves that path's `mask_indptr` in bits where its kernel reads bytes, wrong for B > 1). The tree
mask is planning input like the metadata: a layer reuses a plan made for the same tree mask tensor at the same
version, `hybrid::plan` and the CUDA-graph hooks pass it, and a capture reads the mask packed before it.
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
    tree: bool  # a tree mask in use: FlashInfer's custom mask, its own wrappers

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
            options.tree_mask is not None,
        )


def _metadata(cu_seqlens_q, seq_lens, block_table, tree_mask):
    """What a plan is made from: the metadata, and the tree mask when there is one."""
    return (cu_seqlens_q, seq_lens, block_table) + (() if tree_mask is None else (tree_mask,))


@dataclass
class _Plan:
    wrapper: object
    # A tree variant's CUDA-graph mask buffers: packed mask uint8 [capacity], byte offsets int32 [B + 1].
    mask_buffers: tuple | None = None
    metadata: tuple = ()  # the tensors of the last plan (`_metadata`), held so that their ids cannot be reused
    versions: tuple = ()  # their versions then (None for inference tensors)

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
    features = frozenset({"fp8_kv", "tree_mask"})
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
        [B + 1], seq_lens: [B], block_table: [B, max_pages], int32 (our metadata); options.tree_mask: [T, Q] bool or
        None. Reads T = cu_seqlens_q[-1] to the host, as FlashInfer's plan reads the metadata.
        """
        variant = _Variant.of(path, q_dtype, num_q_heads, k_cache, options)
        num_tokens = int(cu_seqlens_q[-1])  # planning reads the metadata to the host anyway
        if cuda_graph:
            self._graph_shapes.add((path, variant.device, seq_lens.shape[0], num_tokens))
        self._plan(variant, _metadata(cu_seqlens_q, seq_lens, block_table, options.tree_mask), num_tokens)

    def plan_cuda_graph(self, path, k_cache, cu_seqlens_q, seq_lens, block_table, tree_mask=None):
        """Give this batch shape CUDA-graph wrappers from now on, and re-plan every variant planned for it so far
        (the tree variants with `tree_mask`; without one, a replay of this shape runs none of them).

        For the capture and replay hooks: call it outside the graph, on the static metadata, before the capture
        (variants not planned yet get their wrappers at their first, eager, layer call) and before every replay.
        """
        shape = (path, k_cache.device, seq_lens.shape[0], int(cu_seqlens_q[-1]))
        self._graph_shapes.add(shape)
        for variant, batch, num_tokens in list(self._graph_plans):
            if (variant.path, variant.device, batch, num_tokens) != shape or (variant.tree and tree_mask is None):
                continue
            tree = tree_mask if variant.tree else None
            self._plan(variant, _metadata(cu_seqlens_q, seq_lens, block_table, tree), num_tokens)

    def _plan(self, variant, metadata, num_tokens):
        """Plan `variant` for `metadata` (`_metadata`) of `num_tokens` tokens; returns the wrapper, None for an empty
        batch."""
        cu_seqlens_q, seq_lens, block_table = metadata[:3]
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
        plan = plans.get(key) or self._new_plan(variant, (batch, num_tokens, block_table.shape[1]) if graph else None)
        qo_indptr, kv_indptr, kv_indices, last_page_len = to_flashinfer_metadata(
            cu_seqlens_q, seq_lens, block_table, variant.page_size
        )
        sizes = (variant.num_q_heads, variant.num_kv_heads, variant.head_dim, variant.page_size)
        kernel_options = dict(
            window_left=variant.sliding_window - 1 if variant.sliding_window > 0 and not variant.tree else -1,
            logits_soft_cap=variant.logit_cap or None,
            sm_scale=variant.scale,
            q_data_type=variant.q_dtype,
            kv_data_type=variant.kv_dtype,
        )
        paged = (kv_indptr, kv_indices, last_page_len, *sizes)
        if variant.tree:
            self._plan_tree(plan, variant, metadata, qo_indptr, paged, kernel_options)
        elif variant.path == "decode":
            plan.wrapper.plan(*paged, q_len_per_req=num_tokens // batch, **kernel_options)
        else:
            plan.wrapper.plan(qo_indptr, *paged, causal=True, **kernel_options)
        plan.metadata, plan.versions = metadata, _versions(metadata)
        plans[key] = plan
        self.plans_made += 1
        return plan.wrapper

    def _plan_tree(self, plan, variant, metadata, qo_indptr, paged, kernel_options):
        """A tree variant's plan: FlashInfer's custom mask, written on the device (`kernels.custom_mask`), with the
        sliding window in it. Eager: the bool mask, which `plan` packs; CUDA graphs: packed into the wrapper's mask
        buffers after `plan` (which leaves them alone when given no mask)."""
        from ..kernels.custom_mask import custom_mask

        cu_seqlens_q, seq_lens, _, tree_mask = metadata
        if plan.mask_buffers is None:
            size = int(((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64) * seq_lens).sum())
            mask = torch.empty(size, dtype=torch.bool, device=variant.device)
            custom_mask(
                tree_mask, cu_seqlens_q, seq_lens, variant.sliding_window, mask, seq_lens.new_empty(len(qo_indptr))
            )
            plan.wrapper.plan(qo_indptr, *paged, causal=False, custom_mask=mask, **kernel_options)
        else:
            plan.wrapper.plan(qo_indptr, *paged, causal=False, **kernel_options)
            custom_mask(tree_mask, cu_seqlens_q, seq_lens, variant.sliding_window, *plan.mask_buffers)

    def _new_plan(self, variant, graph_shape=None):
        """A wrapper for `variant`, not planned yet; for a CUDA-graph shape (B, T, block-table width), with index
        buffers of its own that never move (FlashInfer's plan copies each step's metadata into them), and for a tree
        variant mask buffers too (`_plan_tree` fills them)."""
        import flashinfer

        device = variant.device
        workspace = self._workspaces.get(device)
        if workspace is None:
            workspace = self._workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        decode = variant.path == "decode" and not variant.tree  # a tree takes the prefill wrapper on either path
        buffers, mask_buffers = {}, None
        if graph_shape is not None:
            batch, num_tokens, max_pages = graph_shape

            def buffer(size, dtype=torch.int32):
                return torch.zeros(size, dtype=dtype, device=device)

            suffix = "buffer" if decode else "buf"
            names = (f"paged_kv_indptr_{suffix}", f"paged_kv_indices_{suffix}", f"paged_kv_last_page_len_{suffix}")
            sizes = (batch + 1, batch * max_pages + 1, batch)
            buffers = dict(zip(names, map(buffer, sizes)), use_cuda_graph=True)
            if not decode:
                buffers.update(qo_indptr_buf=buffer(batch + 1), max_total_num_rows=num_tokens)
            if variant.tree:  # the largest mask of B requests of T tokens in all, each rounded up to whole bytes
                capacity = -(-num_tokens * max_pages * variant.page_size // 8) + batch
                mask_buffers = (buffer(capacity, torch.uint8), buffer(batch + 1))
                buffers.update(custom_mask_buf=mask_buffers[0], mask_indptr_buf=mask_buffers[1])
        if decode:
            # fa2 named: "auto" may route a multi-token decode plan to XQA (SM90) or cuDNN (SM100) by the step's KV
            # lengths, and a CUDA-graph wrapper then refuses the next plan that routes differently.
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=True, backend="fa2", **buffers
            )
        else:  # only fa2 takes a mask
            backend = "fa2" if variant.tree else "auto"
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend, **buffers)
        return _Plan(wrapper, mask_buffers)

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
        metadata = _metadata(cu_seqlens_q, seq_lens, block_table, options.tree_mask)
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
