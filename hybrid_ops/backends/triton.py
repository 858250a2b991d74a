"""The Triton backend: the kernels of `hybrid_ops.kernels` (the repository's `kernels/`).

Sync-free and CUDA-graph safe: metadata stays on the device, out-of-range block ids and positions are masked
(neither read nor written). On the CPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before
the first use), which is how the tests run it. fp8 caches (`hybrid_ops.fp8`) are read 1 byte per element.
"""

import functools
import os

import torch

from ..settings import deterministic_enabled
from ..validation import FLOAT_DTYPES
from .base import ALL_FEATURES, Backend
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


def _store(k, v, k_cache, v_cache, metadata, options):
    """The new k, v into the caches. metadata: (cu_seqlens_q, seq_lens, block_table)."""
    from ..kernels import kv_store

    kv_store.store_kv(k, v, k_cache, v_cache, *metadata, options.k_scale, options.v_scale)


class TritonBackend(Backend):
    name = "triton"
    requirement = "triton (pip install 'hybrid_ops[triton]')"
    features = ALL_FEATURES

    def __init__(self):
        self.target = None  # a kernels.config.Target that overrides the device's

    def is_available(self) -> bool:
        return importable("triton")

    def supports(self, spec) -> bool:
        # Head dims below 16 are padded to 16 in the kernels (a 16-bit tl.dot needs K >= 16); the tile tables stop
        # at 256, for D and Dv alike.
        on_device = spec.device.type == "cuda" or (spec.device.type == "cpu" and _interpreting())
        return on_device and spec.dtype in FLOAT_DTYPES and max(spec.head_dim, spec.v_head_dim) <= 256

    def launch_target(self, q):
        """Where the kernels run (`kernels.config.Target`): `self.target` when set (the tests run the GPU's tiles
        in the interpreter), else q's device."""
        return self.target if self.target is not None else _device_target(q.device)

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options):
        from ..kernels import prefill

        metadata = (cu_seqlens_q, seq_lens, block_table)
        _store(k, v, k_cache, v_cache, metadata, options)
        return prefill.prefill(q, k_cache, v_cache, *metadata, options, self.launch_target(q))

    def decode(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options):
        from ..kernels import decode

        _store(k, v, k_cache, v_cache, (cu_seqlens_q, seq_lens, block_table), options)
        target, invariant = self.launch_target(q), deterministic_enabled()
        return decode.decode(q, k_cache, v_cache, seq_lens, block_table, options, target, batch_invariant=invariant)
