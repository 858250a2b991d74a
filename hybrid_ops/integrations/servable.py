"""Which transformers models the integration serves exactly: `check_servable` refuses, before any generation, a model
that `attn_implementation="hybrid"` cannot serve exactly: state that no served stateful layer holds (transformers
keeps it in the cache object, which the packed forward does not use; the stateful layers it knows are served with
state slots, `stateful.py`), and attention that does not reach the op once per layer with the step
(`probe_attention`). It also reads each layer's cache shape from the K and V the layers actually pass, so per-layer
head counts and head dims (MLA's qk vs v dims) are sized right.
"""

import inspect

import torch

from ..cache import LayerShape
from ..errors import HybridInputError
from .mla import serve_latent
from .stateful import serve_state
from .transformers import HybridStep, Probe


def _without_positions(model) -> bool:
    """Whether the model uses no positions at all (NoPE: granitemoehybrid's default): its config names no position
    embedding and no module computes one. Its logits then follow position_ids trivially."""
    config = model.config.get_text_config()
    named = {type(m).__name__ for m in model.modules()}
    return getattr(config, "position_embedding_type", "") in (None, "nope") and not any(
        "Rotary" in name or "Position" in name for name in named
    )


# The layer types (config.layer_types) that the op serves, alone or beside a stateful layer (`stateful.py`), and those
# with neither attention nor state (transformers' cache gives them no layer); any other (indexed or compressed
# attention) is not plain attention over a KV cache.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
_STATE_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
_PLAIN_LAYER_TYPES = ("mlp", "moe")
# Configs that name each layer's block kind under another field (hybrid models).
_BLOCK_TYPE_FIELDS = ("layers_block_type", "hybrid_override_pattern", "block_types")
# Parameter names of state-space and gated-delta mixers, whose state transformers carries only in its cache object.
_RECURRENT_PARAMETERS = ("A_log", "dt_bias", "recurrent_param")


def check_servable(model) -> tuple:
    """(each decoder layer's cache shape (Hkv, D, Dv), the layers that keep state as `stateful.Mixer`s) for
    `HybridGenerator`, or a HybridInputError naming the model type and why this integration cannot serve it exactly.

    Stateful layers (linear attention, state space, short convolutions) are served through their state slots
    (`stateful.serve_state`, which refuses classes it has not been verified on). Refused: state that no served layer
    holds (recurrent, state-space or convolution modules elsewhere: the generator calls the model without
    transformers' cache, so that state would not carry over between steps); attention other than plain causal
    attention (indexed, compressed); drafters that attend over the K/V of the model they draft for; attention that
    does not reach the op once per layer with the step (`probe_attention`); sinks a layer holds but does not pass.
    """
    config = model.config.get_text_config()
    model_type = getattr(model.config, "model_type", type(model).__name__)  # the one loaded, not its text part

    def refuse(reason):
        raise HybridInputError(f"{model_type} cannot be served exactly: {reason}")

    layer_types = set(getattr(config, "layer_types", None) or ())  # a config may have no such field (Llama's)
    other_types = sorted(layer_types - {*_ATTENTION_LAYER_TYPES, *_STATE_LAYER_TYPES, *_PLAIN_LAYER_TYPES})
    if other_types:
        refuse(f"its layer_types include {other_types}, attention other than the op's (full, sliding, chunked)")
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
    block_fields = [name for name in _BLOCK_TYPE_FIELDS if getattr(config, name, None)]
    mixers = []
    if stateful or block_fields or layer_types & set(_STATE_LAYER_TYPES):
        mixers = serve_state(model, refuse)
    if block_fields and not mixers:
        refuse(f"its config's {block_fields[0]} mixes attention with other blocks that keep state outside attention")
    served = [mixer.name for mixer in mixers]
    stateful = {
        name: module
        for name, module in stateful.items()
        if not any(name == s or name.startswith(s + ".") for s in served)
    }
    return probe_attention(model, refuse, stateful, served), mixers


def probe_attention(model, refuse, stateful=None, served=()) -> list:
    """Runs three eager two-token forwards (positions 0, 1 and 0, 3; one row or all rows of logits) with a step
    whose attention is dense, recording every attention call, and returns each layer's (Hkv, D, Dv) as its layer
    passed K and V ((1, 1, 1) for a layer without attention: pages it never reads or writes).

    Calls `refuse(reason)` if a module of `stateful` ({name: module}, mixers that keep recurrent or convolution
    state) is in a decoder layer or runs in these forwards, and unless every decoder layer calls the attention
    interface exactly once per forward, with the step, as causal self-attention (or never runs, or holds a stateful
    layer of `served`, the names of those served with their state, instead), and the positions
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
    if probe.shared:
        refuse(
            f"its attention modules of layer_idx {sorted(probe.shared)} serve several decoder layers (shared blocks)"
        )
    if not probe.calls and not probe.dense:
        refuse("its attention does not run through transformers' AttentionInterface")
    if logits[0].shape[1] != 1 or not torch.allclose(logits[0][:, 0], logits[2][:, 0], rtol=1e-3, atol=1e-4):
        refuse("it does not take logits_to_keep as a tensor of row indices")
    if torch.equal(logits[1][:, -1], logits[2][:, -1]) and not _without_positions(model):
        refuse(
            "its positions do not follow position_ids (it counts them from the input's length), which a packed "
            "batch of requests needs"
        )
    layers = {
        name: sorted(getattr(probe, name), key=str) for name in ("dense", "not_causal", "biased", "unpassed_sinks")
    }
    if probe.keywords:
        layer, names = sorted(probe.keywords.items(), key=str)[0]
        refuse(f"the attention of layer {layer} takes {names}, which the op has no input for")
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
    # Layers whose stateful layer stands in for attention, and those transformers gives neither (nemotron_h's MLPs).
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None) or ()
    skipped += [
        layer
        for layer in range(num_layers)
        if any(name.startswith(f"{d}.{layer}.") for d in decoders for name in served)
        or (layer < len(layer_types) and layer_types[layer] in _PLAIN_LAYER_TYPES)
    ]
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
    windowless = [
        layer
        for layer in sorted(probe.windowless, key=str)
        if not (
            isinstance(layer, int)
            and layer < len(layer_types)
            and layer_types[layer] in ("full_attention", "chunked_attention", "hybrid")
        )
    ]
    if getattr(config, "sliding_window", None) and windowless:
        refuse(
            f"its config sets sliding_window={config.sliding_window} but layers {windowless} call attention "
            f"without it (the window lives in its mask or cache only)"
        )
    # A layer without attention keeps its place in the cache's list, so indices stay the layers'. MLA layers served
    # over a latent cache store their latent row instead of their expanded K and V.
    latent = serve_latent(model, {module.layer_idx: module for module in probe.modules})
    return [latent.get(layer) or LayerShape(*probe.calls.get(layer, [(1, 1, 1)])[0]) for layer in range(num_layers)]
