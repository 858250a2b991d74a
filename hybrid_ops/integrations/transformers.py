"""transformers integration: `attn_implementation="hybrid"` runs a model's attention through `torch.ops.hybrid.attn`.

Importing this module registers "hybrid" with `AttentionInterface`, and with `AttentionMaskInterface` as
transformers' SDPA mask. A forward call made with a `hybrid_step=HybridStep(...)` keyword runs over the paged cache:
the batch is packed into one sequence (`input_ids: [1, T]`, `position_ids: [1, T]`) and `use_cache=False`, so
transformers builds neither a cache nor a mask (no cache keyword is passed, which also sidesteps its rename from
`past_key_values=` to `cache=`). A call without it, such as plain `model.generate()`, attends densely over the
cache and mask that transformers passes, so a model switched to "hybrid" still works everywhere.

`servable.check_servable` refuses, before any generation, a model this forward cannot serve exactly; it watches a
forward through the `Probe` defined here.

A model loaded with `tp_plan="auto"` holds a slice of the attention heads on each rank: the probe sees that slice's
K and V, `kv_heads_per_rank` refuses KV heads split across ranks, and `tensor_parallel_group` names the ranks that
must take the same steps.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from ..errors import HybridInputError
from .stateful import holds_tensor


@dataclass
class HybridStep:
    """What one forward step passes to every attention layer.

    k_caches, v_caches: per layer [num_pages, page_size, Hkv, D] and [num_pages, page_size, Hkv, Dv] (a
    `PagedKVCache`'s); the metadata as in the ops; k_scales, v_scales: per layer the float32 scales of fp8 caches
    (`PagedKVCache.k_scales`), None for others; state_slots: [B] int32, each request's slot of a `StatePool`, and
    states: per stateful layer its states (`StatePool.states`), for models with layers that keep state
    (`stateful.py`), None for others; intermediate_states: per stateful layer the TARGET_VERIFY states of each
    draft token (`StatePool.intermediate_states`), or None; tree_mask: the ops' `tree_mask` ([T, Q] bool, which of
    its request's new tokens each token sees: a speculative tree), None for causal order. A step that passes a tensor
    in every mode (a causal one where there is no tree) keeps one compiled graph for trees and plain steps alike;
    position_ids then carry each token's prefix + depth.
    """

    forward_mode: int
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_pages] int32
    k_caches: list | None  # None: attend densely (`probe_attention`)
    v_caches: list | None
    prefill_backend: str = "auto"
    decode_backend: str = "auto"
    speculative_attention_mode: str = "prefill"
    k_scales: list | None = None
    v_scales: list | None = None
    state_slots: torch.Tensor | None = None
    states: list | None = None
    tree_mask: torch.Tensor | None = None
    intermediate_states: list | None = None


@dataclass(eq=False)
class Probe:
    """What the attention calls of `probe_attention`'s forwards showed: per layer index, the (Hkv, D, Dv) of each
    call with the step; the layer indices of calls without it (their decoder layer dropped the keyword); and the
    layer indices of calls that are not causal self-attention, add a bias or hold sinks they do not pass."""

    calls: dict = field(default_factory=dict)
    dense: set = field(default_factory=set)
    not_causal: set = field(default_factory=set)
    biased: set = field(default_factory=set)
    unpassed_sinks: set = field(default_factory=set)
    windowless: set = field(default_factory=set)  # layers called without a sliding_window
    shared: set = field(default_factory=set)  # layer indices that are no decoder layer's (a shared block's -1)
    keywords: dict = field(default_factory=dict)  # layer -> keywords holding tensors the op does not take
    modules: set = field(default_factory=set)  # the attention modules that called with the step

    @contextmanager
    def watching(self, model):
        """Every module of `model` holds this probe (as `hybrid_probe`) while the block runs: the attention function
        finds it through the module it is called with, also where a decoder layer does not pass the step on."""
        modules = list(model.modules())
        for module in modules:
            module.hybrid_probe = self
        try:
            yield
        finally:
            for module in modules:
                del module.hybrid_probe

    def record(self, module, query, key, value, attention_mask, with_step, passed_sinks, sliding_window):
        layer = getattr(module, "layer_idx", None)
        if not with_step or layer is None:
            self.dense.add(layer)
        elif layer < 0:
            self.shared.add(layer)
        else:
            self.calls.setdefault(layer, []).append((key.shape[1], key.shape[3], value.shape[3]))
            self.modules.add(module)
        # Bidirectional (an encoder's, or a decoder config without is_decoder) or cross-attention (keys that are not
        # the query tokens'): the op attends causally over the sequence's own tokens only. As SDPA reads them: the
        # mask when there is one (here the first of two tokens must not see the second), else the module's is_causal.
        if attention_mask is None:
            causal = getattr(module, "is_causal", True)
        else:
            visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
            causal = not bool(visible[..., 0, -1].any())
        if not causal or key.shape[2] != query.shape[2]:
            self.not_causal.add(layer)
        # A float mask with values besides 0 and -inf adds a bias (dynamic masks, ALiBi), which the op cannot apply.
        if attention_mask is not None and attention_mask.is_floating_point():
            masked = attention_mask <= torch.finfo(attention_mask.dtype).min / 2
            if not bool(((attention_mask == 0) | masked).all()):
                self.biased.add(layer)
        if not passed_sinks and isinstance(getattr(module, "sinks", None), torch.Tensor):
            self.unpassed_sinks.add(layer)
        if not sliding_window:
            self.windowless.add(layer)


# Keywords of an attention call that the op needs not: the positions (applied to q and k already), the logits rows.
_UNUSED_KEYWORDS = ("position_ids", "logits_to_keep")


def attention_chunk(config, layer: int) -> int:
    """Layer `layer`'s chunk size for the op's `attention_chunk` (Llama 4's chunked layers), -1 for none (also for
    an attention module without a config; `check_servable` refuses a config with chunks on unnamed layers)."""
    layer_types = getattr(config, "layer_types", None) or ()
    if layer < len(layer_types) and layer_types[layer] == "chunked_attention":
        return config.attention_chunk_size
    return -1


def hybrid_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    hybrid_step: HybridStep | None = None,
    s_aux=None,
    **kwargs,
):
    """query: [1, Hq, T, D], key: [1, Hkv, T, D], value: [1, Hkv, T, Dv] -> ([1, T, Hq, Dv], None).

    s_aux: [Hq] attention sinks (gpt-oss), passed to the op as float32 `sinks`."""
    sinks = None if s_aux is None else s_aux.float()
    dropped = [name for name, value in kwargs.items() if name not in _UNUSED_KEYWORDS and holds_tensor(value)]
    if hybrid_step is None or hybrid_step.k_caches is None:
        probe = getattr(module, "hybrid_probe", None)
        if probe is not None:
            with_step, passed_sinks = hybrid_step is not None, s_aux is not None
            probe.record(module, query, key, value, attention_mask, with_step, passed_sinks, sliding_window)
            if dropped:
                probe.keywords[getattr(module, "layer_idx", None)] = dropped
        return dense_attention(query, key, value, attention_mask, scaling, sliding_window, softcap, sinks), None
    if query.shape[0] != 1:
        raise HybridInputError(
            f"a hybrid_step call packs the batch into one sequence: input_ids must be [1, T], "
            f"got batch size {query.shape[0]}"
        )
    if dropped:  # a bias (inkling's position_bias) or other input the op would silently leave out
        raise HybridInputError(
            f"the attention of layer {module.layer_idx} takes {dropped}, which the op has no input for"
        )
    layer, step = module.layer_idx, hybrid_step

    def attn(q, k, v, latent_values=None):
        """The op over the layer's cache; latent_values: its values are the first that many of its keys' (MLA)."""
        k_cache = step.k_caches[layer]
        v_cache = step.v_caches[layer] if latent_values is None else k_cache[..., :latent_values]
        return torch.ops.hybrid.attn(
            q,
            k,
            v,
            k_cache,
            v_cache,
            step.cu_seqlens_q,
            step.seq_lens,
            step.block_table,
            step.forward_mode,
            scale=scaling,
            sliding_window=sliding_window or -1,
            logit_cap=softcap or 0.0,
            sinks=sinks,
            attention_chunk=attention_chunk(getattr(module, "config", None), layer),
            prefill_backend=step.prefill_backend,
            decode_backend=step.decode_backend,
            speculative_attention_mode=step.speculative_attention_mode,
            k_scale=None if step.k_scales is None else step.k_scales[layer],
            v_scale=None if step.v_scales is None else step.v_scales[layer],
            tree_mask=step.tree_mask,
        )

    latent = getattr(module, "hybrid_latent", None)  # an MLA layer over its latent cache (mla.py)
    if latent is not None:
        return latent.attend(query, key, attn), None
    return attn(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))[None], None


def dense_attention(query, key, value, attention_mask, scaling, sliding_window, softcap, sinks=None):
    """Masked attention over the dense K/V transformers passes, with soft-capping (which SDPA lacks) and sinks.

    attention_mask: bool [B, 1, S, L] (True = attend) from the SDPA mask, or None for a plain causal mask;
    sinks: [Hq] float32 or None.
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
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:  # one more logit per head in each row's softmax, attending to nothing
        sink = sinks[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    probs = probs.nan_to_num(0.0).to(value.dtype)  # fully padded rows -> 0
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
    config = model.config.get_text_config()
    total = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    tp_size = getattr(model, "tp_size", None) or 1
    if tp_size == 1:
        return total
    if total % tp_size:
        raise HybridInputError(
            f"num_key_value_heads ({total}) must divide by the tensor-parallel size ({tp_size}): "
            f"each rank must hold whole KV heads"
        )
    # The decoder's attention layers: those with a layer_idx (a vision tower's have none).
    k_proj = next(
        (
            m.k_proj
            for m in model.modules()
            if hasattr(m, "layer_idx") and isinstance(getattr(m, "k_proj", None), torch.nn.Linear)
        ),
        None,
    )
    if k_proj is None:
        raise HybridInputError("a tensor-parallel model needs attention layers with a k_proj to size the cache from")
    weight = k_proj.weight.to_local() if isinstance(k_proj.weight, DTensor) else k_proj.weight
    return weight.shape[0] // head_dim


AttentionInterface.register("hybrid", hybrid_attention)
AttentionMaskInterface.register("hybrid", sdpa_mask)
