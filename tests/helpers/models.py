"""Models for the tests: small named ones (`MODELS`, `small_model`), tiny random configs of any of transformers'
causal LMs (`tiny_config`), and greedy tokens of transformers' own `generate` on each prompt alone (no padding), to
compare `hybrid_ops.generate`'s (`hybrid_tokens`) with."""

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma2Config,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedConfig,
    Qwen2Config,
)

import hybrid_ops

# Token ids from 3 on: 0 pads, and 1 and 2 are the bos and eos ids of the configs that keep theirs.
PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate([5, 23, 9])]
NEW_TOKENS = 8
# 2 requests at a time over PROMPTS, chunks of 8 tokens: prompts of 1 to 3 chunks, one request decoding while another
# prefills and the third joining while another decodes, so generation takes every kind of step (EXTEND, MIXED,
# DECODE).
SIZES = dict(max_batch_size=2, max_seq_len=48, page_size=4, prefill_chunk=8)

SMALL = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)
# name -> (config, the attention transformers' reference runs with)
MODELS = {
    "llama": (lambda: LlamaConfig(**SMALL), "sdpa"),
    "qwen2": (lambda: Qwen2Config(**SMALL), "sdpa"),
    "mistral_window": (lambda: MistralConfig(**SMALL, sliding_window=6), "sdpa"),
    # Soft-capping and alternating sliding/global layers; transformers' SDPA path ignores soft-capping.
    "gemma2": (
        lambda: Gemma2Config(
            **{**SMALL, "num_hidden_layers": 3},
            head_dim=16,
            sliding_window=5,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=None,
            query_pre_attn_scalar=16,
        ),
        "eager",
    ),
}

# Sizes every tiny config gets, under whichever of these names its config has (by name or through attribute_map).
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "ffn_dim": 96,
    "n_inner": 96,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 6,
    "attention_chunk_size": 5,
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "num_layers": 3,
    "use_cache": True,
    "tie_word_embeddings": False,
    "decoder_layers": 3,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 96,
    "is_decoder": True,  # encoder architectures (BERT, RoBERTa, ...) are causal LMs only as decoders
}
# Token ids that are not special, so generation never stops or gets suppressed early; a config that insists on an int
# bos_token_id gets one in the vocabulary (generation never reads it: prompts are given).
SPECIAL_TOKENS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}
INT_BOS = {**SPECIAL_TOKENS, "bos_token_id": 1}
# Qwen4-Exp's sparse attention over compressed blocks (on its full layers); it has no default.
QSA = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
}
# Hybrid models' stateful layers as small as TINY's (their defaults: linear attention of 16 heads of 128, Mamba2 of
# 128 heads with states of 256 and chunks of 256), so that each runs in about a second.
MAMBA2 = {"mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": 8}
GATED_DELTA = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
# model type -> what its tiny config needs beyond TINY (a dict for a sub-config updates it). Without a comment: sizes
# and per-layer lists that must agree with TINY's 3 layers of width 64.
OVERRIDES = {
    # Hybrid models whose first 3 layers would have no attention layer: one in the middle.
    "bamba": {"attn_layer_indices": [1], **MAMBA2},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention", "linear_attention"], **MAMBA2},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    # Multipliers off 1, so that a layer that dropped one would differ.
    "falcon_h1": {
        **MAMBA2,
        "mamba_d_ssm": 64,
        "ssm_multipliers": [0.5, 1.5, 0.8, 1.25, 0.6],
        "ssm_in_multiplier": 0.8,
        "ssm_out_multiplier": 1.3,
    },
    # Mamba2 heads in groups that share B and C: 2 groups of 4 heads (its default: 8 groups of 16). Weights of 5x
    # the default's scale: at its own, the scan's part of the logits is under 1e-6, and a wrong B or C would not show.
    "nemotron_h": {
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "ssm_state_size": 16,
        "n_groups": 2,
        "chunk_size": 8,
        "initializer_range": 0.1,
    },
    "kimi_linear": {"linear_head_dim": 16, "linear_num_heads": 4},
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lara_mini"), GATED_DELTA),
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe"), {"text_config": GATED_DELTA}),
    # Its byte-group hash embeddings (500002 rows) and the global width its local stacks project to.
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "local_attention_window_len": 6,
        "encoder_config": {"hidden_size_global": 64},
        "decoder_config": {"hidden_size_global": 64},
    },
    # Cohere's pattern: sliding layers with RoPE, full ones without (its default config names no RoPE per kind).
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4}, "full_attention": None},
    },
    # Its attention reads rope_theta from attn_config, which the config class does not define, and clamps with
    # clip_qkv (DBRX's is 8; the default None fails); ffn_config takes d_model before hidden_size maps onto it.
    "dbrx": {
        "d_model": 64,
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 1e4},
        "ffn_config": {"ffn_hidden_size": 96},
    },
    # A layer that reuses an earlier layer's K/V (num_kv_shared_layers), as the full model's last 15 do.
    "gemma3n_text": {
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        "num_kv_shared_layers": 1,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0],
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 128,
        "laurel_rank": 8,
    },
    # A drafter, which reads the K/V of the model it drafts for on all its layers: a text config it accepts.
    "gemma4_assistant": {
        "text_config": {
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "enable_moe_block": False,
            "num_kv_shared_layers": 0,
        }
    },  # 0: all (its __post_init__)
    # Global and local (windowed) layers, as in GPT-Neo.
    "gpt_neo": {"attention_types": [[["global", "local"], 1], [["global"], 1]], "window_size": 6},
    # LFM2's checkpoints mix short convolutions with attention (their default config has attention only).
    "lfm2": {"layer_types": ["conv", "full_attention", "conv"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8, "n_groups": 1},
    # Mllama's cross-attention layers (every 5th from the 4th) are skipped without an image: one is still there.
    "mllama": {"text_config": {"cross_attention_layers": [1]}},
    "qwen4_exp": {"text_config": QSA},
    "qwen4_exp_text": QSA,
    "reformer": {
        "attn_layers": ["local", "lsh", "local"],
        "axial_pos_shape": [16, 16],
        "axial_pos_embds_dim": [16, 48],
        "attention_head_size": 16,
    },
    "xlnet": {"d_head": 16},
    # Its adapters need a language to run (its config names none by default).
    "xmod": {"default_language": "en_XX"},
    "zamba2": {"layers_block_type": ["mamba", "hybrid", "mamba"], "mamba_d_state": 16, "chunk_size": 8},
    "zaya": {"num_experts_per_tok": 1},  # the only value it supports
}


def tiny_config(model_type, **overrides):
    """`model_type`'s default config, with each of TINY's sizes it or its sub-configs (a composite model's text,
    vision or audio config) have, SPECIAL_TOKENS, OVERRIDES[model_type] and `overrides` (which win)."""
    try:
        default = AutoConfig.for_model(model_type)
    except Exception:  # a default that fails its own validation (gemma4_assistant's)
        default = AutoConfig.for_model(model_type, **OVERRIDES[model_type])
    overrides = _merge(OVERRIDES.get(model_type, {}), overrides)
    config = _build(model_type, default, overrides)
    # The first layers of a pattern may all be of one kind (Gemma 3: 5 sliding, then a full one): layers of a kind
    # that repeats, from the last, take the kinds missing, so the tiny model has every kind the full one has.
    text = config.get_text_config(decoder=True)
    field = "layer_types" in text.to_dict()  # not one derived from other fields (Jamba's)
    layer_types = list(getattr(text, "layer_types", None) or ()) if field else []
    for kind in dict.fromkeys(getattr(default.get_text_config(decoder=True), "layer_types", None) or ()):
        repeated = [i for i, other in enumerate(layer_types) if layer_types.count(other) > 1]
        if kind not in layer_types and repeated:
            layer_types[repeated[-1]] = kind
    if field and layer_types != list(text.layer_types or ()):
        place = next((name for name in getattr(config, "sub_configs", {}) if getattr(config, name) is text), None)
        fix = {"layer_types": layer_types}
        config = _build(model_type, default, _merge({place: fix} if place else fix, overrides))
    return config


def _build(model_type, default, overrides):
    for tokens in (SPECIAL_TOKENS, INT_BOS, {}):  # {}: a config that insists on its special tokens keeps them
        try:
            return AutoConfig.for_model(model_type, **_merge(_tiny_sizes(default, tokens), overrides))
        except Exception:
            if not tokens:
                raise


def _tiny_sizes(config, tokens):
    """TINY's sizes under the names `config` has, `tokens`, and each sub-config as a dict with the same."""
    sizes = {
        name: value
        for name, value in TINY.items()
        if name in config.to_dict() or name in getattr(config, "attribute_map", {})
    }
    if "partial_rotary_factor" in sizes and "rotary_dim" in sizes:
        del sizes["partial_rotary_factor"]
    sizes.update(_structure(config, sizes))
    if "qk_rope_head_dim" in sizes:  # MLA: head_dim is the rope part, K/V expand from a latent to every head
        sizes.update(head_dim=sizes["qk_rope_head_dim"], num_key_value_heads=sizes["num_attention_heads"])
    sizes.update(tokens)
    specs = getattr(config, "sub_configs_defaults", None) or {}
    for name in getattr(config, "sub_configs", {}):
        sub = getattr(config, name, None)
        if isinstance(sub, PreTrainedConfig):
            # What the composite config would build it from, not its fields: those derived from its sizes, such as
            # layer_types, must follow the tiny ones. Before sub_configs_defaults (transformers 5.17): its non-default
            # fields, less a layer_types sized for the default's layers (Gemma 3's 26).
            spec = specs.get(name)
            if spec:
                base = {"model_type": spec.model_type, **spec.init_kwargs}
            else:
                base = sub.to_diff_dict()
                if len(base.get("layer_types") or ()) not in (0, TINY["num_hidden_layers"]):
                    del base["layer_types"]
            sizes[name] = {**base, **_tiny_sizes(sub, tokens)}
    return sizes


def _structure(config, sizes) -> dict:
    """TINY's head sizes replaced by ones that keep the ratios of `config`'s (transformers' default for the type)
    that select code paths: query heads per KV head (1 to 8: 4 of 4, 4 of 2, 8 of 2, 5 of 1, 8 of 1, ...), and the
    head dims of a config whose values' head dim is apart from the keys' (MLA's nope / rope / v, or head_dim and
    v_head_dim), each an eighth of the default's (DeepSeek-V3's 128 / 64 / 128 as 16 / 8 / 16, GLM-4.7-Flash's
    192 / 64 / 256 as 24 / 8 / 32)."""
    default, out = config.to_dict(), {}
    heads, kv_heads = default.get("num_attention_heads"), default.get("num_key_value_heads")
    if "num_key_value_heads" in sizes and isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0:
        group = heads // kv_heads if heads % kv_heads == 0 else 2
        kv = 4 if group == 1 else 2 if group <= 4 else 1
        tiny_heads = kv * min(group, 8)
        if "head_dim" in sizes or TINY["hidden_size"] % tiny_heads == 0:  # else head_dim = hidden / heads
            out.update(num_attention_heads=tiny_heads, num_key_value_heads=kv)
    dims = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "head_dim")
    dims = [name for name in dims if isinstance(default.get(name), int) and default[name] > 0]
    if "v_head_dim" in dims:
        out.update({name: max(8, default[name] // 8) for name in dims})
    return out


def _merge(*layers):
    """Dicts merged left to right, nested dicts (sub-configs) merged key by key."""
    out = {}
    for layer in layers:
        for name, value in layer.items():
            both = isinstance(value, dict) and isinstance(out.get(name), dict)
            out[name] = _merge(out[name], value) if both else value
    return out


def make_model(config, attn_implementation="eager", seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def small_model(name, attn_implementation=None):
    """MODELS[name], with the attention its reference runs with unless another is named."""
    make_config, reference_attention = MODELS[name]
    return make_model(make_config(), attn_implementation or reference_attention)


def tiny_model():
    """A one-layer Llama at half SMALL's width and positions, with 64 token ids."""
    wide = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
    halved = {name: SMALL[name] // 2 for name in wide}
    return make_model(LlamaConfig(**{**SMALL, **halved, "vocab_size": 64, "num_hidden_layers": 1}), "sdpa")


def reference_tokens(model, prompts=PROMPTS, new_tokens=NEW_TOKENS):
    """transformers' plain greedy generate (no forced, suppressed or penalised tokens, no eos: the generation
    config a checkpoint would bring is replaced) on each prompt alone: the generated ids of each."""
    greedy = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), generation_config=greedy
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def sized_generator(model, **kwargs):
    """A `HybridGenerator` of `model` at SIZES unless `kwargs` say otherwise."""
    return hybrid_ops.HybridGenerator(model, **{**SIZES, **kwargs})


def hybrid_tokens(model, prompts=PROMPTS, new_tokens=NEW_TOKENS, **kwargs):
    """`hybrid_ops.generate` over all prompts at once, eager, at SIZES unless `kwargs` say otherwise."""
    return hybrid_ops.generate(model, prompts, new_tokens, **{"compile": False, **SIZES, **kwargs})


def state_pages(model) -> int:
    """The pages that a request's state slot counts for in `hybrid_tokens`' budget; 0 for a model without state."""
    return sized_generator(model, max_seq_len=8, compile=False).state_pages


def preempting_pages(model, prompts=PROMPTS, new_tokens=NEW_TOKENS) -> int:
    """A page budget for `hybrid_tokens` that holds the longest request, with two requests' state slots (a model with
    state: their cost in pages), but not two long requests at once: requests are preempted."""
    longest = max(map(len, prompts)) + new_tokens
    return -(-longest // SIZES["page_size"]) + 2 * state_pages(model)
