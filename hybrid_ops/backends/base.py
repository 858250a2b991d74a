"""`Backend`: the contract every backend keeps, with defaults for the optional parts.

A backend stores a step's new k, v in the paged cache and attends; the ops (`hybrid_ops.ops`) check the arguments
(`validation.check_args`) before they call it, so a backend sees only well-formed tensors:

    q: [T, Hq, D]; k, v: [T, Hkv, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D], contiguous, q's dtype
    (or fp8, below);
    cu_seqlens_q: [B + 1], seq_lens: [B], block_table: [B, max_pages], int32 (`hybrid_ops.metadata`);
    scale: float; sliding_window: int (-1: none); logit_cap: float (0.0: none). Returns [T, Hq, Dv] in q's dtype.

v and v_cache may have a head dim Dv of their own, and `sinks=` ([Hq] float32) and `attention_chunk=` (int) come as
keywords when in use: only to a backend whose `options` names them ("v_head_dim", "sinks", "attention_chunk").
Caches of float8_e4m3fn or float8_e5m2 come with `k_scale=`, `v_scale=` ([Hkv] float32, possibly an expanded view),
to a backend whose `options` names "fp8_kv": it stores and reads them as `hybrid_ops.fp8` says.

Subclass it, then `hybrid_ops.register_backend(MyBackend())`.
"""

import torch

# Every option a backend may serve beyond plain paged attention (`Backend.options`).
ALL_OPTIONS = frozenset({"sinks", "attention_chunk", "v_head_dim", "fp8_kv"})


class Backend:
    name: str = ""
    # What `is_available` needs, for the error message when it is missing ("triton (pip install ...)").
    requirement: str = ""
    # True if the backend reads the metadata to the host and checks its values itself on every call; otherwise the
    # ops run `validation.check_metadata_values` for it when validation is switched on.
    checks_values: bool = False
    # What it serves of ALL_OPTIONS: "sinks", "attention_chunk", "v_head_dim" (Dv != D), "fp8_kv" (fp8 caches with
    # their scales).
    options: frozenset = frozenset()

    def is_available(self) -> bool:
        """Whether its requirement is installed (and, for kernels built at first use, built)."""
        return True

    def supports(self, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether it runs q of this dtype and head dim on this device; "auto" takes the first that does."""
        raise NotImplementedError

    def prefill(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window, logit_cap):
        """Any ragged batch: request i's queries are q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]."""
        raise NotImplementedError

    def decode(self, q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window, logit_cap):
        """Every request has the same query length, T // B (checked by the ops)."""
        return self.prefill(
            q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window, logit_cap
        )

    # Two lines, as compact as prefill's and decode's (fmt: skip), not one a parameter.
    def plan(self, path, q_dtype, num_q_heads, k_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window,
             logit_cap, cuda_graph=False) -> None:  # fmt: skip
        """Host-side planning of a step before its layers run (`torch.ops.hybrid.plan`); path: "prefill" or
        "decode". Backends that need none keep this no-op."""

    def plan_cuda_graph(self, path, k_cache, cu_seqlens_q, seq_lens, block_table) -> None:
        """Planning into a CUDA graph's static metadata, before its capture and before every replay
        (`PhaseBackend`'s hooks). Backends that need none keep this no-op."""
