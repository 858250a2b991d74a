"""The Triton backend: the kernels of `hybrid_ops.kernels` (the repository's `kernels/`).

Sync-free and CUDA-graph safe: metadata stays on the device, out-of-range block ids and positions are masked
(neither read nor written). On the CPU it runs under Triton's interpreter (`TRITON_INTERPRET=1`, set before
the first use), which is how the tests run it. fp8 caches (`hybrid_ops.fp8`) are read 1 byte per element.

The state ops (`hybrid_ops.state_ops`; kernels/causal_conv1d.py, gated_delta_rule.py, selective_scan.py) run one
program per request and block of its state, over the request's new tokens, with the same guarantees: a slot outside
[0, num_slots) (padding's -1) is neither read nor written and its outputs are zeros. Trees are served in every mode:
TARGET_VERIFY keeps each token's state in intermediate_states, where its children read it; a tree in any other mode
(a draft tree's prefill) keeps them in a scratch buffer [T, *state shape] allocated per call from the shapes
alone, so that the call stays sync-free and capturable.
"""

import functools
import os

import torch

from ..check_rows import FLOAT_DTYPES
from ..settings import deterministic_enabled
from .base import STATE_OPS, Backend
from .deps import importable


@functools.cache
def _device_target(device: torch.device):
    """The launch target for tensors on `device`: the interpreter on the CPU, else the GPU's SM count."""
    from ..kernels.config import INTERPRETER, Target

    if device.type == "cpu":
        return INTERPRETER
    return Target(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)


# The head dim of a state op's Spec that its kernel holds whole: Dk of the gated delta rule, N of the scan (the
# other, Dv or P, is split over programs); the convolution has none.
_WHOLE_HEAD_DIM = {"causal_conv1d": None, "gated_delta_rule": "head_dim", "selective_scan": "v_head_dim"}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _store(k, v, k_cache, v_cache, metadata, options):
    """The new k, v into the caches. metadata: (cu_seqlens_q, seq_lens, block_table)."""
    from ..kernels import kv_store

    kv_store.store_kv(k, v, k_cache, v_cache, *metadata, options.k_scale, options.v_scale)


class TritonBackend(Backend):
    name = "triton"
    requirement = "triton (pip install 'hybrid_ops[triton]')"
    features = frozenset({"sinks", "attention_chunk", "fp8_kv", "tree_mask", *STATE_OPS})

    def __init__(self):
        self.target = None  # a kernels.config.Target that overrides the device's

    def is_available(self) -> bool:
        return importable("triton")

    def supports(self, spec) -> bool:
        # Attention: head dims below 16 are padded to 16 in the kernels (a 16-bit tl.dot needs K >= 16); the tile
        # tables hold D and Dv up to 256, and past it D = Dv + a rope part, Dv up to 512 and the rope part up to
        # 64 (MLA's latent cache, 576 = 512 + 64: `kernels.config.head_blocks`). A state op's kernel holds one head
        # dim whole in a program (its tables stop at 256) and splits the other over programs.
        from ..kernels.config import head_blocks

        on_device = spec.device.type == "cuda" or (spec.device.type == "cpu" and _interpreting())
        if not (on_device and spec.dtype in FLOAT_DTYPES):
            return False
        state_op = next((op for op in STATE_OPS if op in spec.features), None)
        if state_op is None:
            return head_blocks(spec.head_dim, spec.v_head_dim) is not None
        whole = _WHOLE_HEAD_DIM[state_op]
        return whole is None or getattr(spec, whole) <= 256

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

    def causal_conv1d(self, x, weight, bias, conv_state, step, activation):
        from ..kernels import causal_conv1d

        return causal_conv1d.causal_conv1d(x, weight, bias, conv_state, step, activation, self.launch_target(x))

    def gated_delta_rule(self, q, k, v, g, beta, state, step, scale):
        from ..kernels import gated_delta_rule

        return gated_delta_rule.gated_delta_rule(q, k, v, g, beta, state, step, scale, self.launch_target(q))

    def selective_scan(self, x, dt, A, B, C, state, step, D, z, dt_bias, dt_softplus, dt_min, dt_max):
        from ..kernels import selective_scan

        target = self.launch_target(x)
        limits = (dt_softplus, dt_min, dt_max)
        return selective_scan.selective_scan(x, dt, A, B, C, state, step, D, z, dt_bias, *limits, target)
