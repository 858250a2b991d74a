"""transformers integration: `attn_implementation="hybrid"` runs a model's attention through `torch.ops.hybrid.attn`.

Importing this module registers "hybrid" with `AttentionInterface`, and with `AttentionMaskInterface` as
transformers' SDPA mask. A forward call made with a `hybrid_step=HybridStep(...)` keyword runs over the paged cache:
the batch is packed into one sequence (`input_ids: [1, T]`, `position_ids: [1, T]`) and `use_cache=False`, so
transformers builds neither a cache nor a mask (no cache keyword is passed, which also sidesteps its rename from
`past_key_values=` to `cache=`). A call without it, such as plain `model.generate()`, attends densely over the
cache and mask that transformers passes, so a model switched to "hybrid" still works everywhere.

A model loaded with `tp_plan="auto"` holds a slice of the attention heads on each rank: `kv_heads_per_rank` sizes a
cache for that slice and `tensor_parallel_group` names the ranks that must take the same steps.
"""

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from ..errors import HybridInputError


@dataclass
class HybridStep:
    """What one forward step passes to every attention layer.

    k_caches, v_caches: per layer [num_pages, page_size, Hkv, D] (a `PagedKVCache`'s); the metadata as in the ops.
    """

    forward_mode: int
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_pages] int32
    k_caches: list
    v_caches: list
    prefill_backend: str = "auto"
    decode_backend: str = "auto"
    speculative_attention_mode: str = "prefill"


def hybrid_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                     softcap=None, hybrid_step: HybridStep | None = None, **kwargs):
    """query: [1, Hq, T, D], key/value: [1, Hkv, T, D] -> ([1, T, Hq, D], None)."""
    if hybrid_step is None:
        return dense_attention(query, key, value, attention_mask, scaling, sliding_window, softcap), None
    if query.shape[0] != 1:
        raise HybridInputError(f"a hybrid_step call packs the batch into one sequence: input_ids must be [1, T], "
                               f"got batch size {query.shape[0]}")
    layer = module.layer_idx
    out = torch.ops.hybrid.attn(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        hybrid_step.k_caches[layer], hybrid_step.v_caches[layer],
        hybrid_step.cu_seqlens_q, hybrid_step.seq_lens, hybrid_step.block_table, hybrid_step.forward_mode,
        scale=scaling, sliding_window=sliding_window or -1, logit_cap=softcap or 0.0,
        prefill_backend=hybrid_step.prefill_backend, decode_backend=hybrid_step.decode_backend,
        speculative_attention_mode=hybrid_step.speculative_attention_mode,
    )
    return out[None], None


def dense_attention(query, key, value, attention_mask, scaling, sliding_window, softcap):
    """Masked attention over the dense K/V transformers passes, with soft-capping (which SDPA lacks).

    attention_mask: bool [B, 1, S, L] (True = attend) from the SDPA mask, or None for a plain causal mask.
    """
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)).float() * (scaling or query.shape[-1] ** -0.5)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)[:, None]
        k_pos = torch.arange(kv_len, device=query.device)[None, :]
        attention_mask = k_pos <= q_pos
        if sliding_window:
            attention_mask &= k_pos > q_pos - sliding_window
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    probs = scores.softmax(dim=-1).nan_to_num(0.0).to(value.dtype)  # fully padded rows -> 0
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def tensor_parallel_group(model):
    """The process group a `tp_plan` model is sharded over, or None for a model on one rank."""
    if (getattr(model, "tp_size", None) or 1) == 1:
        return None
    mesh = model._device_mesh
    return mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")


def kv_heads_per_rank(model, head_dim: int) -> int:
    """The KV heads this rank's attention layers hold: all of them, or this rank's slice under a `tp_plan`.

    Read from the decoder's attention layers' `k_proj` (its local shard when sharded). transformers' colwise plan splits
    `k_proj`'s output features evenly, not its heads, so KV heads that do not divide by the tensor-parallel size would
    leave a rank with part of a head: refused with a HybridInputError, on every rank alike (transformers' own
    forward fails on such a model too).
    """
    total = model.config.get_text_config().num_key_value_heads
    tp_size = getattr(model, "tp_size", None) or 1
    if tp_size == 1:
        return total
    if total % tp_size:
        raise HybridInputError(f"num_key_value_heads ({total}) must divide by the tensor-parallel size ({tp_size}): "
                               f"each rank must hold whole KV heads")
    # The decoder's attention layers: those with a layer_idx (a vision tower's have none).
    k_proj = next((m.k_proj for m in model.modules()
                   if hasattr(m, "layer_idx") and isinstance(getattr(m, "k_proj", None), torch.nn.Linear)), None)
    if k_proj is None:
        raise HybridInputError("a tensor-parallel model needs attention layers with a k_proj to size the cache from")
    weight = k_proj.weight.to_local() if isinstance(k_proj.weight, DTensor) else k_proj.weight
    return weight.shape[0] // head_dim


AttentionInterface.register("hybrid", hybrid_attention)
AttentionMaskInterface.register("hybrid", sdpa_mask)
