"""Stateful layers (linear attention, state space, short convolutions) served from the packed batch, each request's
state in a slot of a `StatePool`: every sampled row's logits against transformers' own logits for the same tokens
(one forward, no cache), through prefill chunks that cross pages, mixed steps, batched decoding and a preemption
(state dropped and computed again from the tokens), with every slot not yet written full of NaN (a slot is never read
before its request's first forward writes it). Then hybrid::mixer's contract and errors, and the generator's
features on hybrid models: CUDA-graph buckets (padding requests without a slot), prefix caching from state snapshots,
the compiled forward without recompiles, a load test.

Tiny random models hide a missing state in their greedy tokens (lfm2, lfm2_moe and falcon_h1 keep theirs without
it), so the logits are compared: without their state they differ by 2e-4 to 0.5, with it by under 1e-6.
"""

import random
import re

import pytest
import torch
from helpers.models import NEW_TOKENS as REFERENCE_TOKENS
from helpers.models import PROMPTS, SIZES, make_model, preempting_pages, reference_tokens, tiny_config
from helpers.serving import NEW_TOKENS, assert_logits_equal_transformers, serve
from torch.library import opcheck

from hybrid_ops import ForwardMode, GenerationStats, HybridGenerator, HybridInputError
from hybrid_ops.integrations.servable import check_servable

# model type -> the class of its stateful layers (each its own code in transformers).
SERVED = {
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "qwen3_5_text": "Qwen3_5GatedDeltaNet",
    "qwen3_5": "Qwen3_5GatedDeltaNet, in a composite model",
    "qwen3_5_moe_text": "Qwen3_5MoeGatedDeltaNet",
    "lara_mini": "LaraMiniGatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "kimi_linear": "KimiLinearDeltaAttention",
    "bailing_hybrid": "BailingHybridDeltaAttention",
    "bamba": "BambaMixer (Mamba2)",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer (Mamba2), NoPE attention",
    "nemotron_h": "NemotronHMamba2Mixer, MLP and MoE layers without attention",
    "falcon_h1": "FalconH1Mixer, beside attention in every layer",
    "jamba": "JambaMambaMixer (Mamba1)",
    "lfm2": "Lfm2ShortConv",
    "lfm2_moe": "Lfm2MoeShortConv",
    "lfm3": "Lfm3ShortConv",
    "zaya": "ZayaCCAProjection (hybrid::mixer): q, k, v out of a convolution with state, a step its decoder does not "
    "pass",
    "minimax": "MiniMaxLightningAttention (hybrid::mixer): its own linear cache",
    "recurrent_gemma": "RecurrentGemmaRecurrentBlock (hybrid::mixer): state in module attributes, later chunks token "
    "by token",
}


@pytest.mark.parametrize("model_type", SERVED)
def test_logits_equal_transformers(model_type):
    config = tiny_config(model_type)
    tokens, rows = serve(make_model(config, attn_implementation="hybrid"))
    assert len(rows) == len(PROMPTS) * NEW_TOKENS
    assert_logits_equal_transformers(model_type, make_model(config), rows, tokens)


@pytest.fixture(scope="module")
def lightning():
    """A tiny MiniMax's first lightning-attention layer, served through hybrid::mixer."""
    _, mixers = check_servable(make_model(tiny_config("minimax"), attn_implementation="hybrid"))
    return mixers[0]


def op_args(mixer, q_lens, seq_lens, slots, num_slots=4):
    states = [torch.randn(num_slots, *s.shape, dtype=s.dtype) for s in mixer.states]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    hidden = torch.randn(1, sum(q_lens), mixer.module.out_proj.out_features)
    return hidden, cu, torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32), states


def test_op_contract(lightning):
    """Schema, fake and real implementations agree (opcheck): a prefill, a continued chunk and a decode at once."""
    mixer = lightning
    with torch.no_grad():
        opcheck(torch.ops.hybrid.mixer.default, (*op_args(mixer, [3, 2, 1], [3, 7, 9], [2, 0, 3]), 3, mixer.id))


BAD_CALLS = [  # (change to the arguments, the message)
    (dict(forward_mode=int(ForwardMode.TARGET_VERIFY)), "forward_mode TARGET_VERIFY is a speculative mode, but "),
    (dict(forward_mode=int(ForwardMode.DRAFT_EXTEND_V2)), "forward_mode DRAFT_EXTEND_V2 is a speculative mode, but "),
    (dict(slots=[1, 1]), "state_slots must be distinct slots in [0, 4), got [1, 1]"),
    (dict(slots=[0, 4]), "state_slots must be distinct slots in [0, 4), got [0, 4]"),
    (dict(slots=[0]), "state_slots must have one slot per request (2), got 1"),
    (dict(num_slots=None), "states of model.layers.1.self_attn must be [num_slots, *shape] of (shape, dtype)"),
]


@pytest.mark.parametrize("change, message", BAD_CALLS, ids=["-".join(m.split(" ")[:2]) for _, m in BAD_CALLS])
def test_op_refuses_bad_calls(lightning, change, message):
    """Every refusal before any state is written."""
    mixer = lightning
    hidden, cu, seq_lens, slots, states = op_args(mixer, [2, 1], [2, 5], change.get("slots", [0, 1]))
    if "num_slots" in change:
        states = [s[:, :-1] for s in states]
    before = [s.clone() for s in states]
    with pytest.raises(HybridInputError, match=re.escape(message)):
        torch.ops.hybrid.mixer(
            hidden, cu, seq_lens, slots, states, change.get("forward_mode", int(ForwardMode.MIXED)), mixer.id
        )
    assert all(torch.equal(a, b) for a, b in zip(states, before))


@pytest.mark.parametrize("slots, running", [(1, 1), (2, 2)])
def test_state_counts_in_the_page_budget(slots, running):
    """A running request's slot counts as `state_pages` pages: a budget of two requests' pages and one slot's admits
    one of them at a time (not both, to preempt one), with two slots' both."""
    model = make_model(tiny_config("lfm2"))
    sizes = dict(max_batch_size=2, max_seq_len=10, page_size=4, compile=False)
    state_pages = HybridGenerator(model, **sizes).state_pages
    generator = HybridGenerator(model, **sizes, num_pages=2 * 2 + slots * state_pages)
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16]):
        generator.add_request(prompt, 2)
    stats = GenerationStats()
    generator.step(stats)  # both prompts (2 pages each) prefilled, or one
    assert state_pages > 0 and len(generator.states.requests) == running and stats.preemptions == 0


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "granitemoehybrid"])
def test_compiled_never_recompiles(model_type, fresh_dynamo):
    """The generator's compiled forward (fullgraph) with the state op in its stateful layer: transformers' tokens
    through EXTEND, MIXED and DECODE steps and preemptions; a second call with other prompts compiles nothing. Two
    layers (a stateful one, an attention one): each of the warm-up's four graphs compiles the whole model."""
    config = tiny_config(model_type, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    model = make_model(config)
    others = [[(5 * i + 7 * j) % 100 + 3 for j in range(n)] for i, n in enumerate([5, 20, 9])]
    expected = [reference_tokens(make_model(config), prompts) for prompts in (PROMPTS, others)]
    generator = HybridGenerator(model, **SIZES, num_pages=preempting_pages(model))
    stats = GenerationStats()
    assert generator.generate(PROMPTS, REFERENCE_TOKENS, stats=stats) == expected[0]
    assert set(stats.steps) == {"EXTEND", "MIXED", "DECODE"} and stats.preemptions > 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert generator.generate(others, REFERENCE_TOKENS) == expected[1]
    assert generator.states.num_free_slots == generator.states.num_slots
    assert generator.cache.num_free_pages == generator.cache.num_pages


def test_load_ragged_requests_through_a_small_budget():
    """50 ragged requests on a hybrid model through a budget that preempts: added a few at a time between steps,
    some aborted, greedy and seeded sampling mixed. Every finished request has the tokens of its solo run, an aborted
    one a prefix of them, and every page and state slot is free at the end."""
    rng = random.Random(0)
    model = make_model(tiny_config("qwen3_5_text"))
    sizes = dict(max_batch_size=4, max_seq_len=40, page_size=4, prefill_chunk=12, compile=False)
    solo = HybridGenerator(model, **{**sizes, "max_batch_size": 1})
    generator = HybridGenerator(model, **sizes, num_pages=3 * (solo.state_pages + 5))
    requests = []  # (prompt, max_new_tokens, sampling options)
    for i in range(50):
        sampling = dict(do_sample=True, temperature=0.8, top_k=20, seed=i) if i % 4 == 0 else {}
        prompt = [rng.randrange(1, 128) for _ in range(rng.randint(1, 28))]
        requests.append((prompt, rng.randint(1, 12), sampling))
    got, ids, aborted, stats, queue = {}, {}, set(), GenerationStats(), list(range(50))
    while queue or generator.has_unfinished():
        for i in queue[: rng.randint(0, 3)]:
            ids[generator.add_request(requests[i][0], requests[i][1], **requests[i][2])], got[i] = i, []
            queue.remove(i)
        rid = rng.choice(list(ids)) if ids and rng.random() < 0.03 else None
        if rid is not None and generator.abort(rid):
            aborted.add(ids[rid])
        for rid, tokens, _ in generator.step(stats):
            got[ids[rid]] += tokens
        # The running requests' pages and slots within the budget, after every step.
        used = generator.cache.num_pages - generator.cache.num_free_pages
        assert used + generator.state_pages * len(generator.states.requests) <= generator.cache.num_pages
    assert stats.preemptions > 0 and aborted
    assert generator.cache.num_free_pages == generator.cache.num_pages and generator.cache.requests == []
    assert generator.states.num_free_slots == generator.states.num_slots and generator.states.requests == []
    for i, (prompt, max_new_tokens, sampling) in enumerate(requests):
        want = solo.generate([prompt], max_new_tokens, **sampling)[0]
        assert got[i] == want[: len(got[i])] and (len(got[i]) == len(want) or i in aborted), f"request {i}"


# Hybrid models whose greedy tokens show a missing or wrong state (see the module docstring), one per family.
SHOWS_STATE = ["qwen3_5_text", "bamba", "jamba", "kimi_linear"]


@pytest.mark.parametrize("model_type", SHOWS_STATE)
def test_cuda_graph_buckets(model_type):
    """cuda_graphs=True pads every step to buckets; the padding requests hold no slot (-1): transformers' tokens,
    through a budget that preempts, and every slot free at the end."""
    model = make_model(tiny_config(model_type))
    generator = HybridGenerator(model, **SIZES, num_pages=preempting_pages(model), cuda_graphs=True, compile=False)
    stats = GenerationStats()
    assert generator.generate(PROMPTS, REFERENCE_TOKENS, stats=stats) == reference_tokens(
        make_model(tiny_config(model_type))
    )
    assert stats.preemptions > 0 and generator.states.num_free_slots == generator.states.num_slots


@pytest.mark.parametrize("model_type", SHOWS_STATE + ["lfm2"])
def test_prefix_caching_from_state_snapshots(model_type):
    """Prompts sharing 21 tokens: with prefix caching a later request starts on the cached pages up to the last one
    with a state snapshot, and the tokens are those without prefix caching, on the first call and on a second one
    that finds the whole shared prefix cached."""
    model = make_model(tiny_config(model_type))
    shared = [(5 * j) % 90 + 3 for j in range(21)]
    prompts = [shared + [(7 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate([3, 9, 1, 14])]
    # Chunks of 7 end on page boundaries only when the scheduler cuts them back to one (4, 8, ...).
    sizes = dict(max_batch_size=2, max_seq_len=64, page_size=4, prefill_chunk=7, compile=False)
    plain = HybridGenerator(model, **sizes).generate(prompts, 6)
    generator = HybridGenerator(model, **sizes, prefix_caching=True)
    for _ in range(2):
        stats = GenerationStats()
        assert generator.generate(prompts, 6, stats=stats) == plain
        assert stats.prefix_cache_hit_tokens >= 20
    assert generator.states.num_free_slots == generator.states.num_slots


def test_per_request_layers_refuse_cuda_graphs_and_prefix_caching():
    model = make_model(tiny_config("minimax"))
    for option in ("cuda_graphs", "prefix_caching"):
        with pytest.raises(HybridInputError, match=rf"{option}=True is not supported .* \(hybrid::mixer\)"):
            HybridGenerator(model, **SIZES, compile=False, **{option: True})
