"""Stateful layers of transformers models (linear attention, state space, short convolutions) served from the packed
batch, with each request's state in a slot of a `StatePool`.

transformers 5.24 keeps these layers' states in its cache object, through `get_conv_state` / `update_conv_state` /
`get_recurrent_state` / `update_recurrent_state` (`LinearAttentionCacheLayerMixin`, cache_utils.py); MiniMax through
its own `get_linear_cache` / `set_linear_cache`, RecurrentGemma in module attributes. The packed forward builds no
cache. `find_mixers` finds each layer that keeps state (a cached forward, then two more on its cache with the cache's
state reads recorded: the innermost module with a `layer_idx` that reads a state is the layer). `serve_state` then
replaces the forward of each (on the instance only, so its weights and other instances are untouched), for forwards
whose step carries states:

- the families of `layers.py` (gated delta rule, Mamba2, Mamba1, short convolutions): their own served forward, whose
  recurrent core is a state op (`hybrid_ops.state_ops`) over every request at once, in our state layout; every mode,
  CUDA graphs, packages and speculative verification serve them;
- the classes of `SERVED` (MiniMax's lightning attention, RecurrentGemma's RG-LRU, Zaya's convolution): through
  `torch.ops.hybrid.mixer` (`mixer_op.py`), whose torch backend calls the layer's own forward once per request with a
  one-request cache whose states are that request's slot (`Mixer.call`), their states in transformers' shapes (read
  from that cache). It reads the metadata on the host, so those models get neither CUDA graphs, nor packages, nor the
  speculative modes.

Without a step, or with one that carries no states (the servability probe, transformers' own `generate`), every layer
runs as before. Some decoder layers do not pass the step on to their stateful layer (Jamba, Zaya, Inkling), so the
model's forward is wrapped too: it holds the step where the layers' forwards read it.

Any other class keeping state is refused.
"""

import functools
import inspect
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, LinearAttentionLayer

from ..errors import HybridInputError
from . import mixer_op
from .layers import family_of

# The classes served through `hybrid::mixer`, by class name: (how its state reaches it, whether a prefill chunk
# continues from the state of the chunks before: RecurrentGemma's convolution restarts from zero in a chunk, so its
# later chunks go token by token through its decode path).
SERVED = {
    "ZayaCCAProjection": ("cache", True),
    "MiniMaxLightningAttention": ("linear_cache", True),
    "RecurrentGemmaRecurrentBlock": ("attributes", False),
}
# Arguments of a layer's call that the op may leave out, by how its state reaches it: the cache (replaced), the
# step, positions (the op derives them from the metadata; the layers of "cache" pass them on only to kernels' torch
# paths, which drop them), RecurrentGemma's mask (which its recurrent block never reads).
_LEFT_OUT = {
    "cache": {"position_ids", "position_embeddings"},
    "linear_cache": {"position_ids", "position_embeddings"},
    "attributes": {"position_ids", "attention_mask"},
}
_ALWAYS_LEFT_OUT = {"cache", "past_key_values", "cache_params", "hybrid_step"}
_ids = itertools.count()


@dataclass
class StateSpec:
    """One state of a layer: a conv or recurrent state, its index in the layer's cache, one request's shape."""

    kind: str  # "conv" or "recurrent" (transformers' cache), "state" (a family's of layers.py)
    index: int
    shape: tuple
    dtype: torch.dtype
    kernel_size: int | None = None  # a conv state's width in the cache


@dataclass(eq=False)
class Mixer:
    """A stateful layer: served by its family's forward over the state ops (`family`), or else through
    `torch.ops.hybrid.mixer` (the fields after `family` are that path's)."""

    module: torch.nn.Module
    name: str
    states: list  # [StateSpec]
    family: object = None  # layers.Family, or None for the `hybrid::mixer` path
    layer: int | None = None  # its index in transformers' cache (None: state in module attributes)
    access: str = ""  # "cache", "linear_cache" (MiniMax) or "attributes" (RecurrentGemma)
    chunks_continue: bool = True
    outputs: list = field(default_factory=list)  # the trailing shape of each output along the tokens (of `dtype`)
    dtype: torch.dtype | None = None
    structure: object = None  # None: the layer returns one tensor; else, per element of its tuple, its output index
    number_of_states: int = 1
    forward: object = None  # the layer's own forward
    id: int = field(default_factory=lambda: next(_ids))
    index: int = 0  # its states' place in the step's `states`

    @property
    def features(self) -> int:
        """The op's output width: every output flattened after the tokens."""
        return sum(math.prod(shape) for shape in self.outputs)

    def split(self, out) -> list:
        """The op's output [b, L, features] -> the layer's outputs along the tokens, views [b, L, *shape] each."""
        parts = out.split([math.prod(shape) for shape in self.outputs], dim=-1)
        return [part.unflatten(-1, shape) if shape else part.squeeze(-1) for part, shape in zip(parts, self.outputs)]

    def call(self, hidden, states, has_previous: bool, positions) -> list:
        """The layer's own forward on hidden [b, L, H] of b requests whose states are `states` ([b, *shape] each,
        updated in place); positions: [b, L] int64 -> its outputs along the tokens, [b, L, ...] each."""
        if self.access == "attributes":
            out = self._call_with_attributes(hidden, states, has_previous, positions)
        elif self.access == "linear_cache":
            out = self.forward(hidden, None, None, cache=_LinearCache(states[0], has_previous))
        else:
            out = self._call_with_cache(hidden, states, has_previous)
        if self.structure is None:
            return [out]
        return [out[i] for i, index in enumerate(self.structure) if index is not None]

    def _call_with_cache(self, hidden, states, has_previous):
        layer = LinearAttentionLayer(number_of_states=self.number_of_states)
        for spec, state in zip(self.states, states):
            held = layer.conv_states if spec.kind == "conv" else layer.recurrent_states
            held[spec.index] = state
            if spec.kind == "conv":
                layer.is_conv_states_initialized[spec.index] = True
                layer.conv_kernel_size[spec.index] = spec.kernel_size
            else:
                layer.is_recurrent_states_initialized[spec.index] = True
            layer.has_previous_state[spec.index] = has_previous
        out = self.forward(hidden, cache=Cache(layers=[None] * self.layer + [layer]))
        for spec, state in zip(self.states, states):  # a state the layer replaced instead of writing in place
            held = (layer.conv_states if spec.kind == "conv" else layer.recurrent_states)[spec.index]
            if held is not state:
                state.copy_(held)
        return out

    def _call_with_attributes(self, hidden, states, has_previous, positions):
        """RecurrentGemma: states in `conv1d_state` and `rg_lru.recurrent_states`; with none, it starts from zero."""
        module, (conv, recurrent) = self.module, states
        module.conv1d_state, module.rg_lru.recurrent_states = (conv, recurrent) if has_previous else (None, None)
        try:
            out = self.forward(hidden, positions, None, use_cache=True)
            conv.copy_(module.conv1d_state)
            recurrent.copy_(module.rg_lru.recurrent_states)
        finally:
            module.conv1d_state = module.rg_lru.recurrent_states = None
        return out


class _LinearCache:
    """MiniMax's cache interface over one state: [b, H, D, D]; None until the request has one."""

    def __init__(self, state, has_previous):
        self.state, self.has_previous = state, has_previous

    def get_linear_cache(self, layer_idx):
        return self.state if self.has_previous else None

    def set_linear_cache(self, layer_idx, value):
        self.state.copy_(value)


class StepHolder:
    """The step of the model's forward running now, where its layers read it (`step_holder`)."""

    step = None


def step_holder(model) -> StepHolder:
    """The model's `StepHolder`, its forward wrapped (once) to hold each call's `hybrid_step` while it runs: some
    decoder layers do not pass the step on to their submodules (Jamba's, Zaya's), and MLA's `expand_kv` never sees
    it."""
    holder = getattr(model, "_hybrid_step_holder", None)
    if holder is None:
        holder = model._hybrid_step_holder = StepHolder()
        model.forward = _model_forward(model.forward, holder)
    return holder


def serve_state(model, refuse) -> list:
    """The layers of `model` that keep state (`find_mixers`), each served by its family's forward or through
    `torch.ops.hybrid.mixer` when a forward's step carries states. A model is set up once; `refuse(reason)` for a
    layer that cannot be served."""
    mixers = getattr(model, "_hybrid_mixers", None)
    if mixers is not None:
        return mixers
    mixers = find_mixers(model, refuse)
    for index, mixer in enumerate(mixers):
        mixer.index = index
        mixer_op.MIXERS[mixer.id] = mixer
        mixer.module.forward = _layer_forward(mixer, step_holder(model))
    model._hybrid_mixers = mixers
    return mixers


def _model_forward(forward, holder):
    @functools.wraps(forward)
    def held(*args, **kwargs):
        holder.step = kwargs.get("hybrid_step")
        try:
            return forward(*args, **kwargs)
        finally:
            holder.step = None

    return held


def _layer_forward(mixer, holder):
    names = list(inspect.signature(mixer.forward).parameters)
    left_out = _ALWAYS_LEFT_OUT | _LEFT_OUT[mixer.access or "cache"]

    def forward(*args, **kwargs):
        step = holder.step
        if step is None or getattr(step, "states", None) is None:
            return mixer.forward(*args, **kwargs)
        arguments = {**dict(zip(names, args)), **kwargs}
        hidden = arguments.pop(names[0])
        for name, value in arguments.items():
            if name not in left_out and holds_tensor(value):
                raise HybridInputError(
                    f"{mixer.name} ({type(mixer.module).__name__}) is called with {name}, which the state op does "
                    f"not carry"
                )
        if mixer.family is not None:
            intermediates = step.intermediate_states
            intermediates = None if intermediates is None else intermediates[mixer.index]
            return mixer.family.forward(mixer.module, hidden, step, step.states[mixer.index], intermediates)
        outputs = mixer.split(
            torch.ops.hybrid.mixer(
                hidden,
                step.cu_seqlens_q,
                step.seq_lens,
                step.state_slots,
                step.states[mixer.index],
                step.forward_mode,
                mixer.id,
            )
        )
        if mixer.structure is None:
            return outputs[0]
        return tuple(None if index is None else outputs[index] for index in mixer.structure)

    return forward


def holds_tensor(value) -> bool:
    """Whether `value` is a tensor or a tuple or list holding one."""
    if isinstance(value, (tuple, list)):
        return any(holds_tensor(v) for v in value)
    return isinstance(value, torch.Tensor)


def find_mixers(model, refuse) -> list:
    """The layers of `model` that keep state, as `Mixer`s in the order they run; `refuse(reason)` for one that cannot
    be served. Runs three cached forwards (3 tokens, then 1 and 2 on its cache)."""
    device = next(model.parameters()).device
    stack, reads, shapes, hooks = [], {}, {}, []

    def leave(module, args, output):
        stack.pop()
        shapes.setdefault(module, _shapes(output))

    for module in model.modules():
        hooks.append(module.register_forward_pre_hook(lambda module, args: stack.append(module)))
        hooks.append(module.register_forward_hook(leave))

    def record(cache, method, kind):
        original = getattr(cache, method)

        def read(layer_idx, *args, **kwargs):
            owner = next((m for m in reversed(stack) if hasattr(m, "layer_idx")), None)
            reads.setdefault(owner, set()).add((kind, layer_idx, kwargs.get("state_idx", args[0] if args else 0)))
            return original(layer_idx, *args, **kwargs)

        setattr(cache, method, read)

    cache_keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([[1, 2, 3]], device=device)
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            for method, kind in (("get_conv_state", "conv"), ("get_recurrent_state", "recurrent")):
                if hasattr(cache, method):
                    record(cache, method, kind)
            if hasattr(cache, "get_linear_cache"):
                record(cache, "get_linear_cache", "linear")
            by_length = []
            for length in (1, 2):
                shapes.clear()
                model(input_ids=ids[:, :length], use_cache=True, **{cache_keyword: cache})
                by_length.append(dict(shapes))
    except Exception as e:
        refuse(f"its cached forward, which finds the layers keeping state, failed ({type(e).__name__}: {e})")
    finally:
        for hook in hooks:
            hook.remove()
    names = {module: name for name, module in model.named_modules()}
    for module in model.modules():  # state in module attributes
        if SERVED.get(type(module).__name__, ("",))[0] == "attributes":
            reads[module] = {("attributes", None, 0)}
    mixers = []
    for module, states in reads.items():
        family = family_of(module)
        if family is not None:
            specs = [
                StateSpec("state", i, tuple(shape), dtype) for i, (shape, dtype) in enumerate(family.states(module))
            ]
            mixers.append(Mixer(module, names[module], specs, family, forward=module.forward))
            continue
        if module is None or type(module).__name__ not in SERVED:
            name = names.get(module, "a module without a layer_idx")
            refuse(f"{name} ({type(module).__name__}) keeps state that the state op has not been verified on")
        mixers.append(_mixer(module, names[module], states, cache, by_length, refuse))
    order = {module: i for i, module in enumerate(by_length[0])}  # the order they ran in
    return sorted(mixers, key=lambda m: order.get(m.module, len(order)))


def _mixer(module, name, reads, cache, by_length, refuse) -> Mixer:
    access, chunks_continue = SERVED[type(module).__name__]
    layers = {layer for _, layer, _ in reads}
    if len(layers) != 1:
        refuse(f"{name} reads the states of several layers {sorted(layers, key=str)}")
    layer = layers.pop()
    number_of_states = 1
    if access == "attributes":
        states = [
            StateSpec("conv", 0, tuple(module.conv1d_state.shape[1:]), module.conv1d_state.dtype),
            StateSpec("recurrent", 0, tuple(module.rg_lru.recurrent_states.shape[1:]), torch.float32),
        ]
        module.conv1d_state = module.rg_lru.recurrent_states = None
    elif access == "linear_cache":
        state = cache.linear_cache[layer]
        states = [StateSpec("recurrent", 0, tuple(state.shape[1:]), state.dtype)]
    else:
        held = cache.layers[layer]
        number_of_states = held.number_of_states
        states = []
        for kind, _, index in sorted(reads):
            initialized = held.is_conv_states_initialized if kind == "conv" else held.is_recurrent_states_initialized
            if initialized[index]:
                state = (held.conv_states if kind == "conv" else held.recurrent_states)[index]
                width = held.conv_kernel_size[index] if kind == "conv" else None
                states.append(StateSpec(kind, index, tuple(state.shape[1:]), state.dtype, width))
    outputs, structure = _along_tokens(name, [shapes.get(module) for shapes in by_length], refuse)
    dtypes = {dtype for _, dtype in outputs}
    if len(dtypes) != 1:
        refuse(f"{name} returns outputs of several dtypes {sorted(map(str, dtypes))}")
    return Mixer(
        module,
        name,
        states,
        layer=layer,
        access=access,
        chunks_continue=chunks_continue,
        outputs=[shape for shape, _ in outputs],
        dtype=dtypes.pop(),
        structure=structure,
        number_of_states=number_of_states,
        forward=module.forward,
    )


class _Tensor(NamedTuple):
    shape: tuple
    dtype: torch.dtype


def _shapes(output):
    """A module's output as the `_Tensor` of each tensor (a tuple for a tuple of them; None for others)."""
    if isinstance(output, torch.Tensor):
        return _Tensor(tuple(output.shape), output.dtype)
    if isinstance(output, (tuple, list)):
        return tuple(_shapes(o) for o in output)
    return None


def _along_tokens(name, by_length, refuse):
    """(outputs, structure) of a layer from its outputs' shapes on 1 and 2 tokens: an output along the tokens is
    [1, 1, ...] and [1, 2, ...]; others (MiniMax's returned state) are given as None."""

    def along(one, two):
        return (
            isinstance(one, _Tensor)
            and isinstance(two, _Tensor)
            and one.shape[:2] == (1, 1)
            and two.shape[:2] == (1, 2)
            and one.shape[2:] == two.shape[2:]
        )

    one, two = by_length
    if along(one, two):
        return [(one.shape[2:], one.dtype)], None
    if not (
        isinstance(one, tuple) and not isinstance(one, _Tensor) and isinstance(two, tuple) and len(one) == len(two)
    ):
        refuse(f"{name} returns {one}, not its tokens' outputs")
    outputs, structure = [], []
    for a, b in zip(one, two):
        structure.append(len(outputs) if along(a, b) else None)
        if along(a, b):
            outputs.append((a.shape[2:], a.dtype))
    if not outputs:
        refuse(f"{name} returns no output along its tokens")
    return outputs, tuple(structure)
