"""transformers integration: `attn_implementation="hybrid"` runs a model's attention through `torch.ops.hybrid.attn`.

Importing this module registers "hybrid" with `AttentionInterface`, and with `AttentionMaskInterface` as
transformers' SDPA mask. A forward call made with a `hybrid_step=HybridStep(...)` keyword runs over the paged cache:
the batch is packed into one sequence (`input_ids: [1, T]`, `position_ids: [1, T]`) and `use_cache=False`, so
transformers builds neither a cache nor a mask (no cache keyword is passed, which also sidesteps its rename from
`past_key_values=` to `cache=`). A call without it, such as plain `model.generate()`, attends densely over the
cache and mask that transformers passes, so a model switched to "hybrid" still works everywhere.

`check_servable` refuses, before any generation, a model this forward cannot serve exactly: layers that keep state
outside attention (transformers keeps it in the cache object, which this forward does not use), and attention that
does not reach the op once per layer with the step (`probe_attention`). It also reads each layer's cache shape from
the K and V the layers actually pass, so per-layer head counts and head dims (MLA's qk vs v dims) are sized right.

A model loaded with `tp_plan="auto"` holds a slice of the attention heads on each rank: the probe sees that slice's
K and V, `kv_heads_per_rank` refuses KV heads split across ranks, and `tensor_parallel_group` names the ranks that
must take the same steps.
"""

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from ..errors import HybridInputError


@dataclass
class HybridStep:
    """What one forward step passes to every attention layer.

    k_caches, v_caches: per layer [num_pages, page_size, Hkv, D] and [num_pages, page_size, Hkv, Dv] (a
    `PagedKVCache`'s); the metadata as in the ops; k_scales, v_scales: per layer the float32 scales of fp8 caches
    (`PagedKVCache.k_scales`), None for others.
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
    if hybrid_step is None or hybrid_step.k_caches is None:
        probe = getattr(module, "hybrid_probe", None)
        if probe is not None:
            with_step, passed_sinks = hybrid_step is not None, s_aux is not None
            probe.record(module, query, key, value, attention_mask, with_step, passed_sinks, sliding_window)
        return dense_attention(query, key, value, attention_mask, scaling, sliding_window, softcap, sinks), None
    if query.shape[0] != 1:
        raise HybridInputError(
            f"a hybrid_step call packs the batch into one sequence: input_ids must be [1, T], "
            f"got batch size {query.shape[0]}"
        )
    layer = module.layer_idx
    out = torch.ops.hybrid.attn(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        hybrid_step.k_caches[layer],
        hybrid_step.v_caches[layer],
        hybrid_step.cu_seqlens_q,
        hybrid_step.seq_lens,
        hybrid_step.block_table,
        hybrid_step.forward_mode,
        scale=scaling,
        sliding_window=sliding_window or -1,
        logit_cap=softcap or 0.0,
        sinks=sinks,
        attention_chunk=attention_chunk(getattr(module, "config", None), layer),
        prefill_backend=hybrid_step.prefill_backend,
        decode_backend=hybrid_step.decode_backend,
        speculative_attention_mode=hybrid_step.speculative_attention_mode,
        k_scale=None if hybrid_step.k_scales is None else hybrid_step.k_scales[layer],
        v_scale=None if hybrid_step.v_scales is None else hybrid_step.v_scales[layer],
    )
    return out[None], None


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


# The layer types (config.layer_types) that the op serves; any other (linear attention, mamba, conv, indexed or
# compressed attention) is not plain attention over a KV cache.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Configs that name each layer's block kind under another field (hybrid models).
_BLOCK_TYPE_FIELDS = ("layers_block_type", "hybrid_override_pattern", "block_types")
# Parameter names of state-space and gated-delta mixers, whose state transformers carries only in its cache object.
_RECURRENT_PARAMETERS = ("A_log", "dt_bias", "recurrent_param")


def other_layers(config) -> str | None:
    """Why a text config's layers are not all attention over a KV cache (layers with recurrent state, state-space or
    convolution mixers, or attention other than the op's), or None."""
    layer_types = getattr(config, "layer_types", None) or ()  # a config may have no such field (Llama's)
    other_types = sorted(set(layer_types) - set(_ATTENTION_LAYER_TYPES))
    if other_types:
        return (
            f"its layer_types include {other_types}, layers with state or attention other than the op's "
            f"(full, sliding, chunked)"
        )
    for name in _BLOCK_TYPE_FIELDS:
        if getattr(config, name, None):
            return f"its config's {name} mixes attention with other blocks that keep state outside attention"
    return None


def check_servable(model) -> list:
    """Each decoder layer's cache shape (Hkv, D, Dv) for `HybridGenerator`, or a HybridInputError naming the model
    type and why this integration cannot serve it exactly.

    Refused: layers that keep state outside attention (recurrent, state-space or convolution mixers: the generator
    calls the model without transformers' cache, so that state would not carry over between steps); drafters that
    attend over the K/V of the model they draft for; attention that does not reach the op once per layer with the step
    (`probe_attention`); sinks a layer holds but does not pass.
    """
    config = model.config.get_text_config()
    model_type = getattr(model.config, "model_type", type(model).__name__)  # the one loaded, not its text part

    def refuse(reason):
        raise HybridInputError(f"{model_type} cannot be served exactly: {reason}")

    reason = other_layers(config)
    if reason:
        refuse(reason)
    layer_types = getattr(config, "layer_types", None) or ()  # a config may have no such field (Llama's)
    if "shared_kv_states" in inspect.signature(model.forward).parameters:
        refuse("it drafts for another model, attending over that model's K/V (shared_kv_states)")
    if getattr(config, "attention_chunk_size", None) and "chunked_attention" not in layer_types:
        refuse("it sets attention_chunk_size without naming its chunked layers in layer_types")
    stateful = {
        name: module
        for name, module in model.named_modules()
        if any(hasattr(module, p) for p in _RECURRENT_PARAMETERS)
        or (isinstance(module, torch.nn.Conv1d) and module.groups == module.in_channels > 1 and module.padding[0] > 0)
    }
    return probe_attention(model, refuse, stateful)


def probe_attention(model, refuse, stateful=None) -> list:
    """Runs three eager two-token forwards (positions 0, 1 and 0, 3; one row or all rows of logits) with a step
    whose attention is dense, recording every attention call, and returns each layer's (Hkv, D, Dv) as its layer
    passed K and V.

    Calls `refuse(reason)` if a module of `stateful` ({name: module}, mixers that keep recurrent or convolution
    state) is in a decoder layer or runs in these forwards, and unless every decoder layer calls the attention
    interface exactly once per forward, with the step, as causal self-attention (or never runs), and the positions
    follow position_ids (a decoder layer that drops `**kwargs` would attend densely over one step's tokens only; two
    calls with one layer_idx would overwrite each other's cache rows; positions counted from the packed row would be
    other requests' positions)."""
    num_layers = getattr(model.config.get_text_config(), "num_hidden_layers", 0)  # none: BLT (stacks of its own)
    device = next(model.parameters()).device
    step = HybridStep(
        1,
        *(torch.zeros(n, dtype=torch.int32, device=device) for n in (2, 1)),
        torch.zeros(1, 1, dtype=torch.int32, device=device),
        None,
        None,
    )
    # The stateful modules that ran, or whose owner did (a mixer may use its convolution's weight without calling
    # it), and whether each element "list.i" of each ModuleList ran.
    stateful, ran, listed, hooks = stateful or {}, set(), {}, []
    for name, module in stateful.items():
        owner = model.get_submodule(name.rpartition(".")[0])
        hooks += [m.register_forward_pre_hook(lambda *_, name=name: ran.add(name)) for m in (module, owner)]
    for name, module in model.named_modules():
        for i, element in enumerate(module if isinstance(module, torch.nn.ModuleList) else ()):
            listed[f"{name}.{i}"] = False
            hooks.append(element.register_forward_pre_hook(lambda *_, key=f"{name}.{i}": listed.update({key: True})))
    probe = Probe()
    try:
        with probe.watching(model), torch.inference_mode():
            # The generator asks for the logits of given rows: logits_to_keep as a tensor of row indices.
            logits = [
                model(
                    input_ids=torch.tensor([[1, 2]], device=device),
                    position_ids=torch.tensor([[0, second]], device=device),
                    use_cache=False,
                    logits_to_keep=keep,
                    hybrid_step=step,
                ).logits
                for second, keep in ((1, torch.tensor([0], device=device)), (3, 0), (1, 0))
            ]
    except Exception:
        if not stateful:
            raise
        probe = None  # a model with state that fails here is refused for that state
    finally:
        for hook in hooks:
            hook.remove()
    # The decoder's layer lists: those whose elements hold the attention modules that called with the step. A
    # stateful module in them, or one that ran, keeps state; one elsewhere that never ran (an audio tower's
    # convolution) never sees the tokens.
    names = {module: name for name, module in model.named_modules()}
    decoders = {
        key.rsplit(".", 1)[0]
        for key in listed
        for module in (probe.modules if probe else ())
        if names[module].startswith(key + ".")
    }
    kept = [
        name for name in stateful if probe is None or name in ran or any(name.startswith(d + ".") for d in decoders)
    ]
    if kept:
        refuse(
            f"{kept[0]} ({type(stateful[kept[0]]).__name__}) keeps recurrent or convolution state outside "
            f"attention, which transformers carries only in its own cache"
        )
    if not probe.calls and not probe.dense:
        refuse("its attention does not run through transformers' AttentionInterface")
    if logits[0].shape[1] != 1 or not torch.allclose(logits[0][:, 0], logits[2][:, 0], rtol=1e-3, atol=1e-4):
        refuse("it does not take logits_to_keep as a tensor of row indices")
    if torch.equal(logits[1][:, -1], logits[2][:, -1]):
        refuse(
            "its positions do not follow position_ids (it counts them from the input's length), which a packed "
            "batch of requests needs"
        )
    layers = {
        name: sorted(getattr(probe, name), key=str) for name in ("dense", "not_causal", "biased", "unpassed_sinks")
    }
    if probe.dense:
        refuse(f"the decoder layers {layers['dense']} do not pass hybrid_step (their **kwargs) on to attention")
    repeated = {layer: len(calls) // 3 for layer, calls in probe.calls.items() if len(calls) > 3}  # 3 forwards
    if repeated:
        refuse(f"its layers call attention several times with one layer_idx (layer: calls {repeated})")
    num_layers = max(num_layers, max(probe.calls) + 1)  # a decoder may have more layers than num_hidden_layers
    # A decoder layer (an element of the list that holds those calling attention) that never runs on tokens alone
    # (Mllama's cross-attention layers without an image) has neither attention nor state; one that runs without
    # calling the interface may keep its own.
    skipped = [layer for layer in range(num_layers) if any(listed.get(f"{d}.{layer}") is False for d in decoders)]
    missing = [layer for layer in range(num_layers) if layer not in probe.calls and layer not in skipped]
    if missing:
        refuse(
            f"its layers {missing} do not call attention through AttentionInterface (no attention, or state of "
            f"their own)"
        )
    if probe.not_causal:
        refuse(
            f"the attention of layers {layers['not_causal']} is not causal self-attention (bidirectional or "
            f"cross-attention)"
        )
    if probe.biased:
        refuse(f"the attention of layers {layers['biased']} adds a bias of its own to the scores (through its mask)")
    if probe.unpassed_sinks:
        refuse(
            f"the attention of layers {layers['unpassed_sinks']} holds sinks that it does not pass to the "
            f"attention function as s_aux"
        )
    # A window in the config that a layer's call does not carry lives in the model's mask or cache only, where the
    # op cannot see it (unless layer_types says that layer attends fully).
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or ()
    windowless = [
        layer
        for layer in sorted(probe.windowless, key=str)
        if not (
            isinstance(layer, int)
            and layer < len(layer_types)
            and layer_types[layer] in ("full_attention", "chunked_attention")
        )
    ]
    if getattr(config, "sliding_window", None) and windowless:
        refuse(
            f"its config sets sliding_window={config.sliding_window} but layers {windowless} call attention "
            f"without it (the window lives in its mask or cache only)"
        )
    # A skipped layer gets pages it never reads or writes, shaped as the first layer's, so indices stay the layers'.
    return [probe.calls.get(layer, probe.calls[min(probe.calls)])[0] for layer in range(num_layers)]


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
