"""The Triton backend: the kernels of `hybrid_ops.kernels` (the repository's `kernels/`).

Sync-free and CUDA-graph safe: metadata stays on the device, out-of-range block ids and positions are masked
(neither read nor written). On the CPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before
the first use), which is how the tests run it.
"""

import os

import torch

from ..validation import FLOAT_DTYPES, deterministic_enabled
from .deps import importable


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend:
    name = "triton"
    requirement = "triton (pip install 'hybrid_ops[triton]')"
    checks_values = False

    def is_available(self) -> bool:
        return importable("triton")

    def supports(self, q) -> bool:
        on_device = q.device.type == "cuda" or (q.device.type == "cpu" and _interpreting())
        return on_device and q.dtype in FLOAT_DTYPES and q.shape[-1] <= 256

    def _options(self, q):
        # The interpreter computes bf16 dots wrongly; there (only) the kernels upcast to fp32 first.
        interpret = q.device.type == "cpu"
        return interpret and q.dtype == torch.bfloat16, interpret

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window,
                logit_cap):
        from ..kernels import kv_store, prefill

        kv_store.store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
        return prefill.prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window,
                               logit_cap, *self._options(q))

    def decode(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window,
               logit_cap):
        from ..kernels import decode, kv_store

        kv_store.store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
        return decode.decode(q, k_cache, v_cache, seq_lens, block_table, scale, sliding_window, logit_cap,
                             *self._options(q), batch_invariant=deterministic_enabled())
