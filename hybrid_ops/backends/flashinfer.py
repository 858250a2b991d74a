"""The FlashInfer backend: paged prefill and decode through FlashInfer's wrappers, CUDA only.

Our metadata becomes FlashInfer's at this edge, on the device and without a host sync (`to_flashinfer_metadata`).
FlashInfer splits the work when it *plans*, once per step: the plan is kept while the metadata tensors are the same
objects at the same version, so the layers of one step share it. `torch.ops.hybrid.plan` always plans: call it before
the layers to plan outside a captured CUDA graph (the op is tagged `cudagraph_unsafe`, so inductor's graph
partitioning keeps it out of the captured partitions), and whenever metadata made under `inference_mode` is rewritten
in place (inference tensors have no version counter). Our cache layout (separate k and v caches,
[num_pages, page_size, Hkv, D]) is FlashInfer's "NHD" layout.
"""

from dataclasses import dataclass

import torch

from .deps import importable

WORKSPACE_BYTES = 128 << 20


def to_flashinfer_metadata(cu_seqlens_q, seq_lens, block_table, page_size):
    """(qo_indptr, kv_indptr, kv_indices, kv_last_page_len), all int32, from ours; no host sync.

    qo_indptr = cu_seqlens_q; kv_indptr: [B + 1] page offsets; kv_last_page_len: [B], 1..page_size (0 for an empty
    request). kv_indices has the static size B * max_pages + 1: request i's pages sit at
    kv_indices[kv_indptr[i]:kv_indptr[i + 1]], and everything past kv_indptr[B] is scratch.
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


@dataclass
class _Plan:
    metadata: tuple  # the metadata tensors it was made for, held so that their ids cannot be reused
    versions: tuple  # their versions then (None for inference tensors)
    sizes: tuple  # dtypes, head counts, page size and attention options
    wrapper: object

    def matches(self, metadata, sizes) -> bool:
        return (sizes == self.sizes and all(a is b for a, b in zip(metadata, self.metadata))
                and _versions(metadata) == self.versions)


def _versions(tensors):
    return tuple(None if t.is_inference() else t._version for t in tensors)


class FlashInferBackend:
    name = "flashinfer"
    requirement = "flashinfer (pip install 'hybrid_ops[flashinfer]')"
    checks_values = False
    head_dims = (64, 128, 256)

    def __init__(self):
        self._plans = {}  # (path, device) -> _Plan
        self._workspaces = {}  # device -> workspace buffer
        self.plans_made = 0

    def is_available(self) -> bool:
        return importable("flashinfer")

    def supports(self, q) -> bool:
        return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in self.head_dims

    def _new_wrapper(self, path, device):
        import flashinfer

        workspace = self._workspaces.get(device)
        if workspace is None:
            workspace = self._workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        if path == "decode":
            return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, path, q_dtype, num_q_heads, k_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window,
             logit_cap, force=True):
        """Plan `path` for this step's metadata; without `force`, keep the plan made for exactly these tensors."""
        page_size, num_kv_heads, head_dim = k_cache.shape[1:]
        metadata = (cu_seqlens_q, seq_lens, block_table)
        sizes = (q_dtype, k_cache.dtype, num_q_heads, num_kv_heads, head_dim, page_size, scale, sliding_window,
                 logit_cap)
        slot = (path, k_cache.device)
        plan = self._plans.get(slot)
        if not force and plan is not None and plan.matches(metadata, sizes):
            return plan.wrapper
        wrapper = plan.wrapper if plan is not None else self._new_wrapper(path, k_cache.device)
        qo_indptr, kv_indptr, kv_indices, last_page_len = to_flashinfer_metadata(cu_seqlens_q, seq_lens, block_table,
                                                                                 page_size)
        options = dict(window_left=sliding_window - 1 if sliding_window > 0 else -1,
                       logits_soft_cap=logit_cap or None, sm_scale=scale, q_data_type=q_dtype,
                       kv_data_type=k_cache.dtype)
        if path == "decode":
            wrapper.plan(kv_indptr, kv_indices, last_page_len, num_q_heads, num_kv_heads, head_dim, page_size,
                         **options)
        else:
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, last_page_len, num_q_heads, num_kv_heads, head_dim,
                         page_size, causal=True, **options)
        self._plans[slot] = _Plan(metadata, _versions(metadata), sizes, wrapper)
        self.plans_made += 1
        return wrapper

    def _run(self, path, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window,
             logit_cap):
        from ..kernels.kv_store import store_kv  # masked and sync-free

        store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
        wrapper = self.plan(path, q.dtype, q.shape[1], k_cache, cu_seqlens_q, seq_lens, block_table, scale,
                            sliding_window, logit_cap, force=False)
        return wrapper.run(q.contiguous(), (k_cache, v_cache))

    def prefill(self, *args):
        return self._run("prefill", *args)

    def decode(self, *args):
        return self._run("decode", *args)
