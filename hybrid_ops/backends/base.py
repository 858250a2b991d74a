"""`Backend`: the contract every backend keeps, with defaults for the optional parts.

A backend stores a step's new k, v in the paged cache and attends; the ops (`hybrid_ops.ops`) check the arguments
(`validation.check_args`) before they call it, so a backend sees only well-formed tensors:

    q: [T, Hq, D]; k: [T, Hkv, D], v: [T, Hkv, Dv]; k_cache: [num_pages, page_size, Hkv, D], v_cache:
    [num_pages, page_size, Hkv, Dv], contiguous, q's dtype (or fp8, below);
    cu_seqlens_q: [B + 1], seq_lens: [B], block_table: [B, max_pages], int32 (`hybrid_ops.metadata`);
    options: `hybrid_ops.options.Options`, resolved: `scale` a float, and for caches of float8_e4m3fn or
    float8_e5m2 `k_scale`, `v_scale` [Hkv] float32 (possibly an expanded view), stored and read as `hybrid_ops.fp8`
    says. Returns [T, Hq, Dv] in q's dtype.

A backend is only given options whose features (`Options.features`) it declares in `features`, and calls whose
`Spec` its `supports` accepts. Subclass it, then `hybrid_ops.register_backend(MyBackend())`.

The state ops (`hybrid_ops.state_ops`) are features too, one per op (`STATE_OPS`): a backend that names one in
`features` implements the method of that name, `causal_conv1d(x, weight, bias, conv_state, step, activation)`,
`gated_delta_rule(q, k, v, g, beta, state, step, scale)` or `selective_scan(x, dt, A, B, C, state, step, D, z,
dt_bias, dt_softplus, dt_min, dt_max)`, with the op's checked tensors, `step` a `state_ops.StateMetadata` and the
op's keywords resolved (scale a float, dt_max a float); its `Spec` has the op's input dtype, the state's dtype as
cache_dtype, and as head dims (Dk, Dv) for the gated delta rule, (P, N) for the scan, (0, 0) for the convolution.
"""

from typing import NamedTuple

import torch

from ..options import ALL_FEATURES, Options

# The state ops, each a feature of the backends that serve it.
STATE_OPS = ("causal_conv1d", "gated_delta_rule", "selective_scan")


class Spec(NamedTuple):
    """What a backend must serve to run a call: "auto" takes the first backend that supports it."""

    device: torch.device
    dtype: torch.dtype  # q's, k's and v's
    cache_dtype: torch.dtype  # the caches': q's, or an fp8 dtype
    head_dim: int  # D, of q and k
    v_head_dim: int  # Dv, of v
    features: frozenset  # of the options in use (`Options.features`)


class Backend:
    name: str = ""
    # What `is_available` needs, for the error message when it is missing ("triton (pip install ...)").
    requirement: str = ""
    # True if the backend reads the metadata to the host and checks its values itself on every call; otherwise the
    # ops run `validation.check_metadata_values` for it when validation is switched on.
    checks_values: bool = False
    # What it serves of options.ALL_FEATURES, each by name ("sinks", "attention_chunk", "fp8_kv", "tree_mask"): an
    # option's feature is claimed by no backend until one lists it (tests/test_backend_options.py runs each).
    features: frozenset = frozenset()

    def is_available(self) -> bool:
        """Whether its requirement is installed (and, for kernels built at first use, built)."""
        return True

    def supports(self, spec: Spec) -> bool:
        """Whether it runs calls of this device, dtypes and head dims (the features are compared by the registry)."""
        raise NotImplementedError

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options: Options):
        """Any ragged batch: request i's queries are q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]."""
        raise NotImplementedError

    def decode(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options: Options):
        """Every request has the same query length, T // B (checked by the ops)."""
        return self.prefill(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, options)

    @property
    def plans_on_host(self) -> bool:
        """Whether a step calls its `plan` before the layers (it overrides `plan`): a step captured whole in a CUDA
        graph cannot, so "auto" passes over it there (`Registry.for_captured_steps`)."""
        return type(self).plan is not Backend.plan

    def plan(self, path, q_dtype, num_q_heads, k_cache, cu_seqlens_q, seq_lens, block_table, options, cuda_graph=False):
        """Host-side planning of a step before its layers run (`torch.ops.hybrid.plan`); path: "prefill" or
        "decode". Backends that need none keep this no-op."""

    def plan_cuda_graph(self, path, k_cache, cu_seqlens_q, seq_lens, block_table, tree_mask=None) -> None:
        """Planning into a CUDA graph's static metadata (and static tree mask, [T, Q] bool, for a graph of tree
        steps), before its capture and before every replay (`PhaseBackend`'s hooks). Backends that need none keep
        this no-op."""


__all__ = ["ALL_FEATURES", "Backend", "Spec", "STATE_OPS"]
