"""transformers models through the hybrid ops: tokens equal transformers' own generate, one graph, no recompiles."""

import pytest
import torch
from helpers.models import (
    MODELS,
    NEW_TOKENS,
    PROMPTS,
    SIZES,
    SMALL,
    hybrid_tokens,
    make_model,
    reference_tokens,
    small_model,
)
from helpers.reference import assert_close, from_fp8, to_fp8
from transformers import AttentionInterface, AttentionMaskInterface, Gemma2Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import hybrid_ops
from hybrid_ops import ForwardMode, HybridGenerator, HybridInputError
from hybrid_ops.integrations.transformers import HybridStep


def fp8_sdpa(cache_dtype, scale):
    """transformers' SDPA over K/V rounded through an fp8 cache of one scale (`reference.to_fp8`): the reference for
    `kv_cache_dtype`."""
    scale = torch.tensor(scale)

    def attention(module, query, key, value, attention_mask, **kwargs):
        key, value = (from_fp8(to_fp8(x, scale, cache_dtype), scale).to(x.dtype) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return attention


# name -> (kv_cache_dtype, the cache's scales): e4m3 at 0.3 stores every value differently from 1.0 (not a power of 2)
FP8 = {"e4m3": (torch.float8_e4m3fn, 1.0), "e5m2": (torch.float8_e5m2, 1.0), "e4m3_scaled": (torch.float8_e4m3fn, 0.3)}
for _name, (_dtype, _scale) in FP8.items():
    AttentionInterface.register(f"sdpa_{_name}", fp8_sdpa(_dtype, _scale))
    AttentionMaskInterface.register(f"sdpa_{_name}", sdpa_mask)


@pytest.mark.parametrize("name", MODELS)
def test_eager_generate_matches_transformers(name):
    assert hybrid_tokens(small_model(name)) == reference_tokens(small_model(name))


# Compiled: the window and the soft-capped, alternating layers (Llama compiled: tests/test_examples.py's demo, against
# transformers' compiled static-cache generate; Qwen2's attention is Llama's).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral_window", "gemma2"])
def test_compiled_generate_matches_and_never_recompiles(name, fresh_dynamo):
    generator = HybridGenerator(small_model(name), **SIZES)
    want = reference_tokens(small_model(name))
    stats = hybrid_ops.GenerationStats()
    assert generator.generate(PROMPTS, NEW_TOKENS, stats=stats) == want  # warm-up
    assert set(stats.steps) == {"EXTEND", "MIXED", "DECODE"}
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert generator.generate(PROMPTS[::-1], NEW_TOKENS) == want[::-1]


@pytest.mark.parametrize("name, fp8", [("llama", "e4m3"), ("llama", "e5m2"), ("mistral_window", "e4m3_scaled")])
def test_fp8_cache_generates_transformers_tokens_over_fp8_kv(name, fp8):
    """kv_cache_dtype: the tokens of transformers' generate whose attention reads K/V rounded through fp8, and
    (e5m2, 2 mantissa bits) tokens that differ from the unrounded model's, so the rounding is what is compared."""
    kv_cache_dtype, scale = FP8[fp8]
    generator = HybridGenerator(small_model(name, "sdpa"), **SIZES, compile=False, kv_cache_dtype=kv_cache_dtype)
    for t in generator.cache.k_scales + generator.cache.v_scales:
        t.fill_(scale)
    tokens = generator.generate(PROMPTS, NEW_TOKENS)
    assert tokens == reference_tokens(small_model(name, f"sdpa_{fp8}"))
    if fp8 == "e5m2":
        assert tokens != reference_tokens(small_model(name))


@pytest.mark.slow
def test_compiled_fp8_cache_generates_the_same_tokens_and_never_recompiles(fresh_dynamo):
    generator = HybridGenerator(small_model("llama", "sdpa"), **SIZES, kv_cache_dtype=torch.float8_e5m2)
    want = reference_tokens(small_model("llama", "sdpa_e5m2"))
    assert generator.generate(PROMPTS, NEW_TOKENS) == want  # warm-up
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert generator.generate(PROMPTS[::-1], NEW_TOKENS) == want[::-1]


def test_seeded_sampling_is_reproducible():
    model = small_model("llama", "sdpa")
    runs = [
        hybrid_ops.generate(model, PROMPTS, 8, compile=False, do_sample=True, temperature=0.8, top_k=20, seed=s)
        for s in (1, 1, 2)
    ]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(0 < t < 96 for tokens in runs[0] for t in tokens)


def test_left_padded_plain_generate_matches_sdpa():
    """A model switched to "hybrid" still serves transformers' own generate: the mask entry carries the padding."""
    batch = PROMPTS
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    outs = {}
    for attn in ("sdpa", "hybrid"):
        model = small_model("llama", attn)
        with torch.no_grad():
            outs[attn] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(outs["sdpa"], outs["hybrid"])


def test_eos_stops_a_request_and_frees_its_pages():
    model = small_model("llama", "sdpa")
    free = hybrid_ops.generate(model, PROMPTS[:2], NEW_TOKENS, compile=False)
    eos = free[0][3]
    generator = HybridGenerator(model, max_batch_size=2, max_seq_len=48, compile=False)
    tokens = generator.generate(PROMPTS[:2], NEW_TOKENS, eos_token_id=eos)
    assert tokens[0] == free[0][: free[0].index(eos) + 1]
    assert generator.cache.num_free_pages == generator.cache.num_pages


def test_bad_inputs():
    """A packed step's batch must be [1, T] (the generator's own input checks: test_generator.py)."""
    model = small_model("llama", "sdpa")
    generator = HybridGenerator(model, max_batch_size=2, max_seq_len=16, compile=False)
    cache = generator.cache
    cache.add("x")
    batch = cache.step(["x"], [3])
    step = HybridStep(1, *batch.metadata, cache.k_caches, cache.v_caches)
    with pytest.raises(HybridInputError, match="input_ids must be \\[1, T\\]"):
        model(torch.ones(2, 3, dtype=torch.long), use_cache=False, hybrid_step=step)


def gemma2_with_large_logits(attn, softcap=3.0):
    """Gemma2 whose scaling (query_pre_attn_scalar**-0.5 = 1/8) is half of 1/sqrt(head_dim), and whose q/k
    projections are scaled up: scaled attention logits reach about 6 in every layer, past the soft-cap of 3 (a
    random model's stay near 0.1)."""
    config = Gemma2Config(
        **{**SMALL, "num_hidden_layers": 3},
        head_dim=16,
        sliding_window=5,
        attn_logit_softcapping=softcap,
        final_logit_softcapping=None,
        query_pre_attn_scalar=64,
    )
    model = make_model(config, attn)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12.0)
            layer.self_attn.k_proj.weight.mul_(12.0)
    return model


def test_logits_match_eager_attention_with_scale_window_and_soft_cap():
    """Logits of every row of a chunked prefill and a MIXED step against transformers' eager attention: every
    layer's scale, window and soft-cap must reach the op (greedy tokens alone would hide a dropped one)."""
    prompts = [PROMPTS[1][:14], PROMPTS[2]]
    follow = 11  # the token request 1 decodes in the second step
    eager = gemma2_with_large_logits("eager")
    with torch.no_grad():
        want = [eager(torch.tensor([p])).logits[0] for p in (prompts[0], prompts[1] + [follow])]
        uncapped = gemma2_with_large_logits("eager", softcap=None)(torch.tensor([prompts[0]])).logits[0]
    # The soft-cap matters here: without it the logits move 500 times the tolerance below (a dropped cap or
    # scale in any one layer moved them about 200 times).
    assert (uncapped - want[0]).abs().max() > 0.1
    generator = HybridGenerator(
        gemma2_with_large_logits("eager"), max_batch_size=2, max_seq_len=24, page_size=4, compile=False
    )
    cache = generator.cache
    cache.add(0)
    cache.add(1)
    # Step 1 (EXTEND): 8 tokens of request 0, all 9 of request 1. Step 2 (MIXED): the rest of request 0, and
    # request 1 decodes one token over its 9 cached ones.
    steps = [
        (ForwardMode.EXTEND, [prompts[0][:8], prompts[1]], [0, 0]),
        (ForwardMode.MIXED, [prompts[0][8:], [follow]], [8, 9]),
    ]
    got = [[], []]
    for mode, chunks, starts in steps:
        batch = cache.step([0, 1], [len(c) for c in chunks], mode)
        tokens = [t for c in chunks for t in c]
        positions = [s + j for c, s in zip(chunks, starts) for j in range(len(c))]
        with torch.inference_mode():
            logits = generator.runner.forward(
                torch.tensor([tokens]), torch.tensor([positions]), torch.arange(len(tokens)), int(mode), *batch.metadata
            )
        got[0].append(logits[: len(chunks[0])])
        got[1].append(logits[len(chunks[0]) :])
    got = [torch.cat(rows) for rows in got]
    assert got[1].shape[0] == 10  # request 1's prompt from step 1 and its decoded token from step 2
    for mine, ref in zip(got, want):
        torch.testing.assert_close(mine, ref, rtol=0, atol=2e-4)
    # The same model outside a hybrid step (transformers' own forward, dense attention over its mask).
    dense = gemma2_with_large_logits("hybrid")
    with torch.no_grad():
        torch.testing.assert_close(dense(torch.tensor([prompts[0]])).logits[0], want[0], rtol=0, atol=2e-4)


@pytest.mark.parametrize("speculative_attention_mode", ["prefill", "decode"])
@pytest.mark.parametrize("name", ["llama", "mistral_window"])
def test_tree_step_gives_each_node_the_logits_of_its_path(name, speculative_attention_mode):
    """A HybridStep's tree_mask reaches the op: in one TARGET_VERIFY step over cached prefixes, each node of a tree
    gets the logits of the sequence prefix + its path from the root (transformers' SDPA, a window included), at RoPE
    position prefix + depth; a causal tree beside it is a plain chain."""
    model, reference = small_model(name, "hybrid"), small_model(name)
    cache = hybrid_ops.PagedKVCache(64, 4, 2, 16, num_layers=2, max_pages_per_request=8)
    prefixes = [torch.randint(1, 96, (n,)).tolist() for n in (5, 3)]
    trees = [[-1, 0, 0, 1, 2, 1, 3], [-1, 0, 1, 2, 3, 4, 5]]  # parents among the new tokens; the second a chain
    nodes = [torch.randint(1, 96, (len(t),)).tolist() for t in trees]
    for rid in (0, 1):
        cache.add(rid)
    with torch.inference_mode():
        for mode, chunks in ((ForwardMode.EXTEND, prefixes), (ForwardMode.TARGET_VERIFY, nodes)):
            batch = cache.step([0, 1], [len(c) for c in chunks], mode)
            tree_mask = torch.zeros(sum(map(len, chunks)), 8, dtype=torch.bool)
            positions, row, paths = [], 0, []
            for rid, chunk in enumerate(chunks):
                parents = trees[rid] if mode == ForwardMode.TARGET_VERIFY else list(range(-1, len(chunk) - 1))
                seen = []
                for j, parent in enumerate(parents):
                    seen.append((seen[parent] if parent >= 0 else []) + [j])
                    tree_mask[row + j, seen[j]] = True
                    positions.append(cache.seq_len(rid) - len(chunk) + len(seen[j]) - 1)
                paths.append(seen)
                row += len(chunk)
            step = HybridStep(
                int(mode),
                *batch.metadata,
                cache.k_caches,
                cache.v_caches,
                speculative_attention_mode=speculative_attention_mode,
                tree_mask=tree_mask,
            )
            ids = torch.tensor([sum(chunks, [])])
            logits = model(ids, position_ids=torch.tensor([positions]), use_cache=False, hybrid_step=step).logits[0]
        row = 0
        for rid, seen in enumerate(paths):
            for j, path in enumerate(seen):
                sequence = torch.tensor([prefixes[rid] + [nodes[rid][i] for i in path]])
                want = reference(sequence).logits[0, -1]
                assert_close(logits[row + j], want, torch.float32)
            row += len(seen)
