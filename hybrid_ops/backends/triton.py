"""The Triton backend: the kernels of `hybrid_ops.kernels` (the repository's `kernels/`).

Sync-free and CUDA-graph safe: metadata stays on the device, out-of-range block ids and positions are masked
(neither read nor written). On the CPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before
the first use), which is how the tests run it. fp8 caches (`hybrid_ops.fp8`) are read 1 byte per element.
"""

import functools
import os

import torch

from ..errors import HybridInputError
from ..settings import deterministic_enabled
from ..validation import FLOAT_DTYPES
from .base import Backend
from .deps import importable


@functools.cache
def _device_target(device: torch.device):
    """The launch target for tensors on `device`: the interpreter on the CPU, else the GPU's SM count."""
    from ..kernels.config import INTERPRETER, Target

    if device.type == "cpu":
        return INTERPRETER
    return Target(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_v_head_dim(v_cache):
    """`supports` sees D only; the tile tables stop at 256 for Dv as for D."""
    if v_cache.shape[3] > 256:
        raise HybridInputError(f"backend='triton' supports a value head dim Dv <= 256, got {v_cache.shape[3]}")


class TritonBackend(Backend):
    name = "triton"
    requirement = "triton (pip install 'hybrid_ops[triton]')"
    checks_values = False
    options = frozenset({"sinks", "attention_chunk", "v_head_dim", "fp8_kv"})

    def __init__(self):
        self.target = None  # a kernels.config.Target that overrides the device's

    def is_available(self) -> bool:
        return importable("triton")

    def supports(self, device, dtype, head_dim) -> bool:
        # Head dims below 16 are padded to 16 in the kernels (a 16-bit tl.dot needs K >= 16).
        on_device = device.type == "cuda" or (device.type == "cpu" and _interpreting())
        return on_device and dtype in FLOAT_DTYPES and head_dim <= 256

    def launch_target(self, q):
        """Where the kernels run (`kernels.config.Target`): `self.target` when set (the tests run the GPU's tiles
        in the interpreter), else q's device."""
        return self.target if self.target is not None else _device_target(q.device)

    def prefill(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_table,
        scale,
        sliding_window,
        logit_cap,
        sinks=None,
        attention_chunk=-1,
        k_scale=None,
        v_scale=None,
    ):
        from ..kernels import kv_store, prefill

        _check_v_head_dim(v_cache)
        kv_store.store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, k_scale, v_scale)
        return prefill.prefill(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q,
            seq_lens,
            block_table,
            scale,
            sliding_window,
            logit_cap,
            self.launch_target(q),
            sinks=sinks,
            attention_chunk=attention_chunk,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def decode(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        cu_seqlens_q,
        seq_lens,
        block_table,
        scale,
        sliding_window,
        logit_cap,
        sinks=None,
        attention_chunk=-1,
        k_scale=None,
        v_scale=None,
    ):
        from ..kernels import decode, kv_store

        _check_v_head_dim(v_cache)
        kv_store.store_kv(k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, k_scale, v_scale)
        return decode.decode(
            q,
            k_cache,
            v_cache,
            seq_lens,
            block_table,
            scale,
            sliding_window,
            logit_cap,
            self.launch_target(q),
            batch_invariant=deterministic_enabled(),
            sinks=sinks,
            attention_chunk=attention_chunk,
            k_scale=k_scale,
            v_scale=v_scale,
        )
