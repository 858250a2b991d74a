"""Architectures through `hybrid_ops.generate`: greedy tokens equal to transformers' own generate on each prompt
alone, or a HybridInputError naming the model type before any token for what cannot be served exactly. The sweep
over every causal LM type is scripts/model_coverage.py (bench/results/models.md)."""

import re
from types import SimpleNamespace

import pytest
import torch
from helpers.models import (
    NEW_TOKENS,
    PROMPTS,
    hybrid_tokens,
    make_model,
    preempting_pages,
    reference_tokens,
    sized_generator,
    tiny_config,
)

import hybrid_ops
from hybrid_ops import HybridGenerator, HybridInputError
from hybrid_ops.integrations import layers, stateful
from hybrid_ops.integrations.transformers import HybridStep, hybrid_attention

# model type -> what it covers; tiny configs (helpers/models.py), 3 layers.
IDENTICAL = {
    "llama": "plain GQA",
    "qwen3": "q/k norms",
    "mistral": "a sliding window on every layer",
    "gemma2": "soft-capping, alternating sliding and global layers",
    "gemma3_text": "sliding and global layers of different rope",
    "phi3": "fused qkv",
    "gpt2": "no num_key_value_heads in the config (MHA)",
    "opt": "no num_key_value_heads, learned positions",
    "gpt_neox": "no num_key_value_heads, partial rotary",
    "gpt_oss": "attention sinks (s_aux), sliding layers",
    "llama4_text": "chunked attention layers (chunks of 5 tokens, prompts up to 23)",
    "deepseek_v3": "MLA: q/k head dim 24, v head dim 16",
    "mimo_v2_flash": "per-layer KV layouts",
    "jetmoe": "K/V repeated to every head before the attention call",
    "gemma3": "a composite config (SigLIP vision tower, text config) on text prompts",
    "mllama": "cross-attention layers, skipped without an image",
    "phi4_multimodal": "an audio tower's convolutions, which never see the tokens",
    "gemma3n_text": "a layer reusing an earlier layer's K/V (num_kv_shared_layers)",
    "dbrx": "fused Wqkv clipped by clip_qkv, DBRX's experts",
}
# Hybrid models (layers that keep state, served through state slots): model type -> what it covers. Through a page
# budget that preempts; tests/test_stateful.py compares their logits.
STATEFUL = {
    "qwen3_next": "Gated DeltaNet layers",
    "qwen3_5_text": "Gated DeltaNet layers",
    "granitemoehybrid": "Mamba2 layers, NoPE attention",
    "nemotron_h": "Mamba2 layers, MLP and MoE layers without attention",
    "falcon_h1": "Mamba2 beside attention in every layer",
    "lfm2": "short convolutions",
    "jamba": "Mamba1 layers, continued token by token",
    "bamba": "Mamba2 layers",
    "kimi_linear": "Kimi delta attention",
    "minimax": "lightning attention's own linear cache",
    "recurrent_gemma": "state in module attributes",
    "zaya": "q, k, v from a convolution with state, in a decoder layer that does not pass the step",
}
# check_servable's rules, in the order it applies them, and the cases that trigger each: layer types of attention
# other than the op's (deepseek_v32), a drafter (gemma4_assistant), a chunk size without chunked layers
# (chunks_without_*), a stateful layer of a class not verified (zamba2, test_unverified_state_refused), a config field
# naming other blocks where no stateful layer is found (block_types), attention beside state that the op cannot serve
# (test_attention_beside_state_refused), no AttentionInterface (bloom),
# logits_to_keep (whisper), positions (bart), decoder layers that drop the step (nemotron, stablelm, blt), attention
# called twice per layer (diffllama), a layer that calls none (layer_without_attention), attention that is not causal
# (bidirectional), a bias (doge), sinks not passed (unpassed_sinks), a window the calls lack (phimoe).

# model type -> words of the refusal.
REFUSED = {
    "nemotron": "nemotron cannot be served exactly: the decoder layers [0, 1, 2] do not pass hybrid_step",
    "stablelm": "stablelm cannot be served exactly: the decoder layers [0, 1, 2] do not pass hybrid_step",
    "diffllama": "diffllama cannot be served exactly: its layers call attention several times with one layer_idx",
    "deepseek_v32": "deepseek_v32 cannot be served exactly: its layer_types include ['indexed_attention'], attention "
    "other than the op's",
    "zamba2": "zamba2 cannot be served exactly: model.layers.0.mamba (Zamba2MambaMixer) keeps state that the state op "
    "has not been verified on",
    "doge": "doge cannot be served exactly: the attention of layers [0, 1, 2] adds a bias of its own",
    "bart": "bart cannot be served exactly: its positions do not follow position_ids",
    "phimoe": "phimoe cannot be served exactly: its config sets sliding_window=6 but layers [0, 1, 2] call attention "
    "without it",
    "whisper": "whisper cannot be served exactly: it does not take logits_to_keep as a tensor of row indices",
    "blt": "blt cannot be served exactly: the decoder layers [0, 1, 2] do not pass hybrid_step",
    "gemma4_assistant": "gemma4_assistant cannot be served exactly: it drafts for another model, attending over that "
    "model's K/V (shared_kv_states)",
    "bloom": "bloom cannot be served exactly: its attention does not run through transformers' AttentionInterface",
}


class NoOpAttention(torch.nn.Module):
    """An attention block that adds nothing and calls no attention function (as Nemotron-NAS's no-op blocks)."""

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


def llama_with_no_op_attention(layer):
    model = make_model(tiny_config("llama"))
    model.model.layers[layer].self_attn = NoOpAttention()
    return model


def llama_holding_sinks():
    """A Llama whose attention modules hold sinks (a parameter, as gpt-oss's do), which its attention call does not
    pass on as s_aux."""
    model = make_model(tiny_config("llama"))
    for layer in model.model.layers:
        layer.self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    return model


def llama4_with_full_layers_only():
    config = tiny_config("llama4_text")
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    return make_model(config)


# Models changed to trigger a rule that no model type's tiny config does: name -> (model, words of the refusal).
REFUSED_VARIANTS = {
    # EmbeddingGemma's bidirectional attention.
    "bidirectional": (
        lambda: make_model(tiny_config("gemma3_text", use_bidirectional_attention=True)),
        "gemma3_text cannot be served exactly: the attention of layers [0, 1, 2] is not causal self-attention "
        "(bidirectional or cross-attention)",
    ),
    # A config naming its layers' blocks in a field of its own (RecurrentGemma's), whatever layer_types says.
    "block_types": (
        lambda: make_model(tiny_config("llama", block_types=["recurrent", "attention", "recurrent"])),
        "llama cannot be served exactly: its config's block_types mixes attention with other blocks that keep state "
        "outside attention",
    ),
    "chunks_without_chunked_layers": (
        llama4_with_full_layers_only,
        "llama4_text cannot be served exactly: it sets attention_chunk_size without naming its chunked layers in "
        "layer_types",
    ),
    # A chunk size in a config that has no layer_types at all.
    "chunks_without_layer_types": (
        lambda: make_model(tiny_config("llama", attention_chunk_size=5)),
        "llama cannot be served exactly: it sets attention_chunk_size without naming its chunked layers in layer_types",
    ),
    "layer_without_attention": (
        lambda: llama_with_no_op_attention(1),
        "llama cannot be served exactly: its layers [1] do not call attention through AttentionInterface (no "
        "attention, or state of their own)",
    ),
    "unpassed_sinks": (
        llama_holding_sinks,
        "llama cannot be served exactly: the attention of layers [0, 1, 2] holds sinks that it does not pass to the "
        "attention function as s_aux",
    ),
}


@pytest.mark.parametrize("model_type", IDENTICAL)
def test_greedy_tokens_equal_transformers(model_type):
    config = tiny_config(model_type)
    assert hybrid_tokens(make_model(config)) == reference_tokens(make_model(config))


@pytest.mark.parametrize("model_type", REFUSED)
def test_refused_before_generating(model_type):
    with pytest.raises(HybridInputError, match=re.escape(REFUSED[model_type])):
        hybrid_tokens(make_model(tiny_config(model_type)))


@pytest.mark.parametrize("name", REFUSED_VARIANTS)
def test_refused_variant(name):
    make, words = REFUSED_VARIANTS[name]
    with pytest.raises(HybridInputError, match=re.escape(words)):
        hybrid_tokens(make())


@pytest.mark.parametrize("model_type", STATEFUL)
def test_stateful_greedy_tokens_equal_transformers(model_type):
    config = tiny_config(model_type)
    model = make_model(config)
    stats = hybrid_ops.GenerationStats()
    assert hybrid_tokens(model, num_pages=preempting_pages(model), stats=stats) == reference_tokens(make_model(config))
    assert stats.preemptions > 0


@pytest.mark.parametrize(
    "model_type, dropped, reason",
    [
        ("lfm2", "Lfm2ShortConv", r"model\.layers\.0\.conv \(Lfm2ShortConv\) keeps state that the state op has not"),
        # State in module attributes, which no cache call shows: refused from its config's kinds of blocks.
        (
            "recurrent_gemma",
            "RecurrentGemmaRecurrentBlock",
            "its config's layers_block_type mixes attention with other blocks that keep state outside attention",
        ),
    ],
)
def test_unverified_state_refused(monkeypatch, model_type, dropped, reason):
    """A layer keeping state of a class that neither the state ops' families nor hybrid::mixer serve is refused."""
    monkeypatch.setattr(stateful, "SERVED", {k: v for k, v in stateful.SERVED.items() if k != dropped})
    monkeypatch.setattr(layers, "FAMILIES", {k: v for k, v in layers.FAMILIES.items() if k != dropped})
    with pytest.raises(HybridInputError, match=f"{model_type} cannot be served exactly: {reason}"):
        hybrid_tokens(make_model(tiny_config(model_type)))


@pytest.mark.parametrize(
    "model_type, served, reason",
    [
        # Its shared attention block's layer_idx is -1 in every layer that runs it.
        ("zamba2", "Zamba2MambaMixer", "its attention modules of layer_idx [-1] serve several decoder layers"),
        # A dense relative bias per (query, key), passed as a keyword that the op would leave out.
        ("inkling_text", "InklingShortConvolution", "the attention of layer 0 takes ['position_bias'], which the op"),
    ],
)
def test_attention_beside_state_refused(monkeypatch, model_type, served, reason):
    """The attention of a hybrid model whose stateful layers would be served, refused for its own reasons."""
    monkeypatch.setattr(stateful, "SERVED", {**stateful.SERVED, served: ("cache", True)})
    with pytest.raises(HybridInputError, match=re.escape(f"{model_type} cannot be served exactly: {reason}")):
        hybrid_tokens(make_model(tiny_config(model_type)))


def test_attention_keyword_without_an_input_refused():
    """A tensor keyword the op has no input for (a bias) fails the call, instead of being left out."""
    cache = hybrid_ops.PagedKVCache(4, 4, 2, 16)
    cache.add(0)
    batch = cache.step([0], [3])
    step = HybridStep(int(batch.forward_mode), *batch.metadata, cache.k_caches, cache.v_caches)
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    with pytest.raises(HybridInputError, match=re.escape("the attention of layer 0 takes ['position_bias'], which")):
        hybrid_attention(SimpleNamespace(layer_idx=0), q, k, k, None, hybrid_step=step, position_bias=torch.ones(3))
    assert not cache.k_caches[0].any()


def test_cache_sized_per_layer():
    """MLA: one latent row per token (kv_lora_rank 32 + rope 8), its values a view of its first 32; gpt2: every head
    is a KV head."""
    cache = HybridGenerator(
        make_model(tiny_config("deepseek_v3")), max_batch_size=1, max_seq_len=8, compile=False
    ).cache
    assert [(k.shape[2:], v.shape[2:]) for k, v in zip(cache.k_caches, cache.v_caches)] == [((1, 40), (1, 32))] * 3
    assert all(v.data_ptr() == k.data_ptr() for k, v in zip(cache.k_caches, cache.v_caches))
    cache = HybridGenerator(make_model(tiny_config("gpt2")), max_batch_size=1, max_seq_len=8, compile=False).cache
    assert [k.shape[2:] for k in cache.k_caches] == [(4, 16)] * 3


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text", "deepseek_v3"])
def test_compiled_features_never_recompile(model_type):
    """Sinks, chunks and a separate value head dim in one compiled forward across EXTEND, MIXED and DECODE. The
    warm-up takes the prompts in reverse, whose first step prefills 8 tokens of one request alone: Dynamo gives
    gpt-oss's batches of one of more than 5 tokens a graph of their own."""
    torch._dynamo.reset()
    config = tiny_config(model_type, num_hidden_layers=2)  # still a sliding and a full layer; a dense and a MoE one
    expected = reference_tokens(make_model(config))
    generator = sized_generator(make_model(config))
    stats = hybrid_ops.GenerationStats()
    assert generator.generate(PROMPTS[::-1], NEW_TOKENS, stats=stats) == expected[::-1]
    assert set(stats.steps) == {"EXTEND", "MIXED", "DECODE"}
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert generator.generate(PROMPTS, NEW_TOKENS) == expected
