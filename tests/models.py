"""Test helpers: tiny random configs of transformers' causal LMs, and greedy tokens of `hybrid_ops.generate` against
transformers' own `generate`, one prompt at a time (no padding), written without the library's code."""

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

import hybrid_ops

PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate([11, 3, 17])]
NEW_TOKENS = 8
# Sizes every tiny config gets, under whichever of these names its config has (by name or through attribute_map).
TINY = {
    "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 96, "max_position_embeddings": 256, "n_positions": 256,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "ffn_dim": 96, "n_inner": 96,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "sliding_window": 6, "attention_chunk_size": 5, "rotary_dim": 8, "partial_rotary_factor": 0.5,
    "first_k_dense_replace": 1, "use_cache": True, "tie_word_embeddings": False,
    "decoder_layers": 3, "decoder_attention_heads": 4, "decoder_ffn_dim": 96,
    "is_decoder": True,  # encoder architectures (BERT, RoBERTa, ...) are causal LMs only as decoders
}
# Token ids that are not special, so generation never stops or gets suppressed early.
SPECIAL_TOKENS = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}


def tiny_config(model_type, **overrides):
    """`model_type`'s default config, with each of TINY's sizes it has and `overrides` (which win)."""
    default = AutoConfig.for_model(model_type)
    sizes = {name: value for name, value in TINY.items()
             if name in default.to_dict() or name in getattr(default, "attribute_map", {})}
    if "partial_rotary_factor" in sizes and "rotary_dim" in sizes:
        del sizes["partial_rotary_factor"]
    if "qk_rope_head_dim" in sizes:  # MLA: head_dim is the rope part, K/V expand from a latent to every head
        sizes.update(head_dim=sizes["qk_rope_head_dim"], num_key_value_heads=sizes["num_attention_heads"])
    try:
        return AutoConfig.for_model(model_type, **{**sizes, **SPECIAL_TOKENS, **overrides})
    except Exception:  # a config that insists on its special tokens keeps them
        return AutoConfig.for_model(model_type, **{**sizes, **overrides})


def make_model(config, attn_implementation="eager", seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def reference_tokens(model, prompts=PROMPTS, new_tokens=NEW_TOKENS):
    """transformers' plain greedy generate (no forced, suppressed or penalised tokens, no eos: the generation
    config a checkpoint would bring is replaced) on each prompt alone: the generated ids of each."""
    greedy = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 generation_config=greedy)
            out.append(ids[0, len(p):].tolist())
    return out


def hybrid_tokens(model, prompts=PROMPTS, new_tokens=NEW_TOKENS, **kwargs):
    """`hybrid_ops.generate` over all prompts at once, eager, in chunks that cross pages and a mixed step."""
    options = dict(compile=False, max_batch_size=2, page_size=4, prefill_chunk=8)
    return hybrid_ops.generate(model, prompts, new_tokens, **{**options, **kwargs})
