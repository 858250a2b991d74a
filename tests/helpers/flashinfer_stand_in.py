"""FlashInfer on the CPU: its own Python code, with PyTorch code in place of what needs a GPU.

FlashInfer's kernels are compiled for CUDA and need a GPU, but the part of FlashInfer the backend depends on most is
Python: planning, the wrappers, argument binding, dtype checks, host copies and every plan/run consistency check
(query length per request, `window_left`, `qo_indptr[-1]` against q). `install` keeps all of that and replaces only
pinned host memory, the compute-capability queries (answered as an H200), cuDNN auto-routing and the compiled kernel
modules (`Kernels`).

`Kernels` checks that planning happens outside CUDA-graph capture (`cuda_graph_capture` stands in for one), records
each call, and runs attention in float64 exactly as the arguments it is handed define it (`paged_attention`), so
outputs compared with a reference check what the backend passed: index arrays, window, soft-cap, scale, causal
alignment, the cache's dtype and, for a CUDA-graph replay (`replay`), which buffers the captured call reads. An fp8
cache's stored values enter that attention as FlashInfer's fa2 kernels read them (converted exactly to q's dtype, no
scale applied: FlashInfer applies host-float scales outside its kernels), so a scale the backend drops or misplaces
shows in the output. FlashInfer's kernels themselves are checked on a GPU by scripts/gpu_check.py.
"""

import contextlib
import sys

import numpy
import torch

from hybrid_ops.backends.flashinfer import FlashInferBackend

HALF = (torch.float16, torch.bfloat16)  # q's dtypes FlashInfer's fa2 kernels take


def paged_attention(
    q,
    k_cache,
    v_cache,
    qo_indptr,
    kv_indptr,
    kv_indices,
    last_page_len,
    out,
    causal,
    window_left,
    logit_cap,
    scale,
    custom_mask=None,
    mask_indptr=None,
):
    """FlashInfer's paged attention as its arguments define it, in float64, into `out`.

    Request i's queries q[qo_indptr[i]:qo_indptr[i + 1]] attend its kv_len = (pages - 1) * page_size +
    last_page_len[i] positions on pages kv_indices[kv_indptr[i]:kv_indptr[i + 1]]. Query j of n sits at position
    kv_len - n + j; causal rows see positions up to their own, `window_left` w >= 0 keeps the last w + 1 of those.
    A custom mask (MaskMode CUSTOM, uint8) replaces causality, read as FlashInfer's `variants.cuh` reads it: query j
    sees key c if bit (j * kv_len + c) % 8 of byte mask_indptr[i] + (j * kv_len + c) // 8 is set.
    """
    page_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for i in range(last_page_len.shape[0]):
        q0, q1, p0, p1 = *qo_indptr[i : i + 2].tolist(), *kv_indptr[i : i + 2].tolist()
        pages = kv_indices[p0:p1].long()
        assert ((pages >= 0) & (pages < k_cache.shape[0])).all(), f"request {i} reads pages {pages.tolist()}"
        kv_len = (p1 - p0 - 1) * page_size + int(last_page_len[i]) if p1 > p0 else 0
        n = q1 - q0
        if n == 0:
            continue
        keys = k_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, 1)
        values = v_cache[pages].flatten(0, 1)[:kv_len].double().repeat_interleave(group, 1)
        s = torch.einsum("nhd,lhd->hnl", q[q0:q1].double(), keys) * scale
        if logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        position = torch.arange(kv_len - n, kv_len)[:, None]
        key = torch.arange(kv_len)[None, :]
        seen = key <= position if causal else torch.ones(n, kv_len, dtype=torch.bool)
        if custom_mask is not None:
            bit = torch.arange(n * kv_len).view(n, kv_len)
            seen = (custom_mask[int(mask_indptr[i]) + bit // 8].long() >> (bit % 8)) & 1 == 1
        if window_left >= 0:
            seen &= key >= position - window_left
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", s.masked_fill(~seen, float("-inf")).softmax(-1), values).to(out.dtype)


class Kernels:
    """FlashInfer's compiled batch-prefill module (its tensor-core decode runs it too) and its mask packing, replaced.

    `module` stands for `get_batch_prefill_module` and records the kernel variant asked for; `plan` refuses to run
    under CUDA-graph capture (its host-to-device copies) and returns its integer arguments as the plan info;
    `paged_run` records its arguments and computes `paged_attention` from them; `segment_packbits` (the
    quantization module's) packs as numpy does.
    """

    def __init__(self):
        self.modules = []  # (backend, q dtype, kv dtype, o dtype, index dtype, ...) per module asked for
        self.runs = []
        self.computing = False

    def module(self, backend, *args):
        self.modules.append((backend, *args))
        return self

    def plan(self, float_workspace, int_workspace, pinned_workspace, qo_indptr, kv_indptr, kv_lens, *plan_info):
        """plan_info: total_num_rows, batch_size, num_qo_heads, num_kv_heads, page_size, cuda_graph, head_dim_qk,
        head_dim_vo, causal, window_left, then fa2's options."""
        if capturing():
            raise RuntimeError("operation not permitted when stream is capturing")
        return list(plan_info)

    def segment_packbits(self, x, indptr, indptr_new, bitorder, y):
        """Each segment x[indptr[i]:indptr[i + 1]] (bool) packed into y[indptr_new[i]:indptr_new[i + 1]]."""
        for i in range(indptr.shape[0] - 1):
            segment = x[indptr[i] : indptr[i + 1]].numpy()
            y[indptr_new[i] : indptr_new[i + 1]] = torch.from_numpy(numpy.packbits(segment, bitorder=bitorder))

    def paged_run(
        self,
        float_workspace_buffer,
        int_workspace_buffer,
        plan_info_vec,
        q,
        paged_k_cache,
        paged_v_cache,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        o,
        maybe_lse,
        mask_mode,
        layout,
        window_left,
        enable_pdl,
        maybe_custom_mask,
        maybe_mask_indptr,
        maybe_alibi_slopes,
        maybe_prefix_len_ptr,
        maybe_token_pos_in_items_ptr,
        maybe_max_item_len_ptr,
        logits_soft_cap,
        sm_scale,
        scale_q,
        scale_k,
        scale_v,
        rope_scale,
        rope_theta,
        token_pos_in_items_len,
        workspace_size,
        *backend_options,
    ):
        from flashinfer.utils import MaskMode, TensorLayout

        assert layout == TensorLayout.NHD.value
        assert mask_mode in (MaskMode.NON_CAUSAL.value, MaskMode.CAUSAL.value, MaskMode.CUSTOM.value)
        assert (maybe_custom_mask is not None) == (mask_mode == MaskMode.CUSTOM.value)
        assert q.dtype in HALF, "FlashInfer's fa2 kernels take an fp16 or bf16 q, fp8 caches included"
        call = dict(
            q=q,
            k_cache=paged_k_cache,
            v_cache=paged_v_cache,
            qo_indptr=qo_indptr,
            kv_indptr=paged_kv_indptr,
            kv_indices=paged_kv_indices,
            last_page_len=paged_kv_last_page_len,
            out=o,
            causal=mask_mode == MaskMode.CAUSAL.value,
            window_left=window_left,
            logit_cap=logits_soft_cap,
            scale=sm_scale,
            custom_mask=maybe_custom_mask,
            mask_indptr=maybe_mask_indptr,
        )
        self.runs.append(dict(call, plan_info=list(plan_info_vec)))
        self.computing = True
        try:
            paged_attention(**call)
        finally:
            self.computing = False


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def cuda_graph_capture(monkeypatch, kernels):
    """The current stream reports a CUDA-graph capture in progress, and reading a tensor to the host (a sync, which
    a capture refuses) raises, except in the kernel stand-in (its reads are the kernel's device work)."""

    def refused(read):
        def checked(tensor, *args):
            if not kernels.computing:
                raise RuntimeError("operation not permitted when stream is capturing")
            return read(tensor, *args)

        return checked

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        for name in ("item", "tolist", "__float__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, refused(getattr(torch.Tensor, name)))
        yield


def replay(graph):
    """Re-run captured kernel calls (`Kernels.runs`) on the tensors they were captured with, as a CUDA-graph replay
    does."""
    for call in graph:
        paged_attention(**{name: value for name, value in call.items() if name != "plan_info"})


def install(monkeypatch) -> Kernels:
    """FlashInfer's Python code set to run on CPU tensors for the rest of `monkeypatch`'s scope, with a fresh
    `Kernels` in place of its compiled modules (returned), and `FlashInferBackend` taking CPU tensors."""
    import flashinfer
    import flashinfer.decode
    import flashinfer.prefill
    import flashinfer.utils

    packbits = sys.modules["flashinfer.quantization.packbits"]  # the name in flashinfer.quantization is a function
    kernels = Kernels()
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs))
    for module in (flashinfer.utils, flashinfer.decode, flashinfer.prefill):  # each holds its own reference
        monkeypatch.setattr(module, "get_compute_capability", lambda device: (9, 0))  # an H200
        monkeypatch.setattr(module, "device_support_pdl", lambda device: True)
    monkeypatch.setattr(flashinfer.utils, "is_sm90a_supported", lambda device: True)
    for module in (flashinfer.decode, flashinfer.prefill):
        monkeypatch.setattr(module, "get_batch_prefill_module", kernels.module)
    monkeypatch.setattr(packbits, "get_quantization_module", lambda: kernels)
    monkeypatch.setattr(
        flashinfer.decode.BatchDecodeWithPagedKVCacheWrapper, "_auto_prefers_cudnn", lambda self, *args, **kwargs: False
    )
    # Our backend takes CUDA tensors only; CPU tensors stand in for them here.
    monkeypatch.setattr(
        FlashInferBackend,
        "supports",
        lambda self, spec: spec.dtype in HALF and spec.head_dim == spec.v_head_dim and spec.head_dim in self.head_dims,
    )
    return kernels
