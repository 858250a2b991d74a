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
from .base import ALL_OPTIONS, Backend
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
    """The new k, v into the caches, after the check of Dv: `supports` sees D only, and the tile tables stop at 256
    for Dv as for D. metadata: (cu_seqlens_q, seq_lens, block_table)."""
    from ..kernels import kv_store

    if v_cache.shape[3] > 256:
        raise HybridInputError(f"backend='triton' supports a value head dim Dv <= 256, got {v_cache.shape[3]}")
    kv_store.store_kv(k, v, k_cache, v_cache, *metadata, options.get("k_scale"), options.get("v_scale"))


class TritonBackend(Backend):
    name = "triton"
    requirement = "triton (pip install 'hybrid_ops[triton]')"
    options = ALL_OPTIONS

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

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *scalars, **options):
        """scalars: scale, sliding_window, logit_cap; options: those of sinks, attention_chunk, k_scale, v_scale in use
        (`Backend`), which the kernels take as keywords."""
        from ..kernels import prefill

        metadata = (cu_seqlens_q, seq_lens, block_table)
        _store(k, v, k_cache, v_cache, metadata, options)
        return prefill.prefill(q, k_cache, v_cache, *metadata, *scalars, self.launch_target(q), **options)

    def decode(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *scalars, **options):
        from ..kernels import decode

        _store(k, v, k_cache, v_cache, (cu_seqlens_q, seq_lens, block_table), options)
        target, invariant = self.launch_target(q), deterministic_enabled()
        return decode.decode(
            q, k_cache, v_cache, seq_lens, block_table, *scalars, target, batch_invariant=invariant, **options
        )
