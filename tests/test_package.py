"""Packages: the generator's forward step exported with torch.export and compiled by AOTInductor into one .pt2 file
(`hybrid_ops.package`), served by `HybridGenerator.from_package` with the tokens of the eager generator, in every mode,
with prefix caching and an fp8 cache, in a new process without transformers or a compile; a package of another torch,
hybrid_ops, schema, config or cache dtype refused before its code loads; a model that cannot be packaged refused
with its reason."""

import json
import zipfile

import pytest
import torch
from expecttest import assert_expected_inline
from helpers.models import (
    NEW_TOKENS,
    PROMPTS,
    SIZES,
    hybrid_tokens,
    make_model,
    preempting_pages,
    sized_generator,
    small_model,
    tiny_config,
)
from helpers.scripts import run_script

import hybrid_ops
from hybrid_ops import ForwardMode, GenerationStats, HybridGenerator, HybridInputError


@pytest.fixture(scope="module")
def llama():
    return small_model("llama")


@pytest.fixture(scope="module")
def llama_package(llama, tmp_path_factory):
    """The Llama's step packaged at SIZES (one compile shared by the module's tests)."""
    return hybrid_ops.package(llama, tmp_path_factory.mktemp("package") / "llama.pt2", **SIZES)


def random_prompts(count, lengths, vocab_size=96):
    return [torch.randint(3, vocab_size, (int(n),)).tolist() for n in torch.randint(*lengths, (count,))]


@pytest.mark.parametrize(
    "options",
    [dict(), dict(cuda_graphs=True), dict(num_pages=9), dict(max_batch_size=1, prefill_chunk=5)],
    ids=["default", "padded_to_buckets", "preempting", "smaller_sizes"],
)
def test_served_from_the_package_as_from_the_model(llama, llama_package, options):
    """Greedy and seeded tokens from the package are the eager generator's, over the same options: every kind of
    step (prefill chunks, mixed, decode), steps padded to buckets (scratch page), a budget that preempts, sizes below
    the package's."""
    sampled = dict(do_sample=True, temperature=1.3, top_k=20, seed=5)
    eager = sized_generator(llama, **options, compile=False)
    served = HybridGenerator.from_package(llama_package, **options)
    stats = GenerationStats()
    assert served.generate(PROMPTS, NEW_TOKENS, stats=stats) == eager.generate(PROMPTS, NEW_TOKENS)
    assert served.generate(PROMPTS, NEW_TOKENS, **sampled) == eager.generate(PROMPTS, NEW_TOKENS, **sampled)
    assert served.model is None and served.cache.num_free_pages == served.cache.num_pages
    assert (stats.preemptions > 0) == ("num_pages" in options)
    if not options:
        assert set(stats.steps) == {"EXTEND", "MIXED", "DECODE"}


# Per mode, (prefix tokens written first, new tokens per request): pages of 4 crossed, requests of unequal lengths.
MODE_STEPS = {
    ForwardMode.EXTEND: ([5, 0], [3, 6]),
    ForwardMode.DECODE: ([7, 4], [1, 1]),
    ForwardMode.MIXED: ([0, 9], [5, 1]),
    ForwardMode.TARGET_VERIFY: ([6, 3], [3, 3]),
    ForwardMode.DRAFT_EXTEND_V2: ([2, 8], [2, 2]),
}


@pytest.mark.parametrize("mode", list(MODE_STEPS), ids=lambda m: m.name)
def test_every_mode_gives_the_eager_steps_logits_and_cache(llama, llama_package, mode):
    """One program serves every forward mode (a 0-d tensor input): a step of each, over K/V written by a first
    step, gives the eager forward's logits for every token and writes the same K/V."""
    eager = sized_generator(llama, compile=False)
    served = HybridGenerator.from_package(llama_package)
    prefix, new = MODE_STEPS[mode]
    tokens = [random_prompts(1, (n + m + 1, n + m + 2))[0] for n, m in zip(prefix, new)]
    results = []
    for generator in (eager, served):
        cache, runner = generator.cache, generator.runner
        for rid in range(2):
            cache.add(rid)
        steps = [(ForwardMode.EXTEND, [0] * 2, prefix), (mode, prefix, new)]
        for step_mode, start, counts in steps:
            if sum(counts):
                live = [i for i in range(2) if counts[i]] if step_mode == ForwardMode.EXTEND else [0, 1]
                ids = [t for i in live for t in tokens[i][start[i] : start[i] + counts[i]]]
                positions = [p for i in live for p in range(start[i], start[i] + counts[i])]
                batch = cache.step(live, [counts[i] for i in live], step_mode)
                logits = runner.run(batch, [counts[i] for i in live], ids, positions, list(range(len(ids))))
        results.append((logits, [c.clone() for c in cache.k_caches + cache.v_caches]))
    (want, want_caches), (got, got_caches) = results
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    for got_cache, want_cache in zip(got_caches, want_caches):
        torch.testing.assert_close(got_cache, want_cache, atol=2e-5, rtol=2e-5)


def test_prefix_caching_through_the_package(llama, llama_package):
    """Prompts sharing a prefix: served from the package with prefix caching, each is prefilled only past the cached
    pages and gets the tokens of the eager generator without prefix caching."""
    common = random_prompts(1, (11, 12))[0]
    prompts = [common + tail for tail in random_prompts(3, (1, 9))] + [common[:6]]
    want = sized_generator(llama, compile=False).generate(prompts, NEW_TOKENS)
    served = HybridGenerator.from_package(llama_package, prefix_caching=True)
    stats = GenerationStats()
    assert served.generate(prompts, NEW_TOKENS, stats=stats) == want
    assert stats.prefix_cache_hit_tokens >= 2 * 8 and served.cache.num_evictable_pages > 0
    again = GenerationStats()
    assert served.generate(prompts, NEW_TOKENS, stats=again) == want
    assert again.prefix_cache_hit_tokens > stats.prefix_cache_hit_tokens


def test_a_new_process_serves_without_transformers_or_a_compile(llama, llama_package):
    """A process that imports hybrid_ops and serves from the package gets the eager tokens, and never imports
    transformers, Dynamo or Inductor."""
    script = (
        "import sys, json, hybrid_ops\n"
        f"generator = hybrid_ops.HybridGenerator.from_package({str(llama_package)!r})\n"
        f"tokens = generator.generate({PROMPTS!r}, {NEW_TOKENS})\n"
        "loaded = [m for m in ('transformers', 'torch._dynamo', 'torch._inductor') if m in sys.modules]\n"
        "print(json.dumps([tokens, loaded]))\n"
    )
    tokens, loaded = json.loads(run_script("-c", script).splitlines()[-1])
    assert loaded == [] and tokens == hybrid_tokens(llama)


def test_fp8_cache_through_the_package(tmp_path):
    """A second architecture (Qwen2: q/k/v biases) packaged with an e4m3 cache: the tokens of the eager generator
    over the same cache dtype, the scales the serving cache's."""
    model = small_model("qwen2")
    path = hybrid_ops.package(model, tmp_path / "qwen2.pt2", **SIZES, kv_cache_dtype=torch.float8_e4m3fn)
    served = HybridGenerator.from_package(path)
    assert served.cache.k_caches[0].dtype == torch.float8_e4m3fn and len(served.cache.k_scales) == 2
    want = hybrid_tokens(model, kv_cache_dtype=torch.float8_e4m3fn)
    assert want != hybrid_tokens(model)  # e4m3 changes these tokens: the test sees which cache ran
    assert served.generate(PROMPTS, NEW_TOKENS) == want
    # The scales are the serving cache's tensors, read at every step: a scale that saturates e4m3 changes the tokens.
    eager = sized_generator(model, compile=False, kv_cache_dtype=torch.float8_e4m3fn)
    for scale in eager.cache.k_scales + eager.cache.v_scales + served.cache.k_scales + served.cache.v_scales:
        scale.fill_(1 / 1024)
    scaled = eager.generate(PROMPTS, NEW_TOKENS)
    assert scaled != want and served.generate(PROMPTS, NEW_TOKENS) == scaled


ARCHITECTURES = {
    "gemma2": lambda: small_model("gemma2"),
    "gemma3_text": lambda: make_model(tiny_config("gemma3_text")),
    "gpt_oss": lambda: make_model(tiny_config("gpt_oss")),
    "deepseek_v3": lambda: make_model(tiny_config("deepseek_v3")),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architectures_round_trip(name, tmp_path):
    """Sliding windows, soft-caps, q/k norms, attention sinks with MoE, MLA (K and V of other head dims): packaged
    and served, the eager generator's tokens."""
    model = ARCHITECTURES[name]()
    path = hybrid_ops.package(model, tmp_path / f"{name}.pt2", **SIZES)
    assert HybridGenerator.from_package(path).generate(PROMPTS, NEW_TOKENS) == hybrid_tokens(model)


HYBRIDS = ["qwen3_5_text", pytest.param("bamba", marks=pytest.mark.slow), pytest.param("lfm2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrid_models_served_from_the_package(model_type, tmp_path):
    """A hybrid model's step packaged with its state ops, its states the serving process's `StatePool`: the eager
    generator's tokens, also with steps padded to buckets (padding requests without a slot), through a budget that
    preempts and with prefix caching from state snapshots."""
    model = make_model(tiny_config(model_type))
    path = hybrid_ops.package(model, tmp_path / f"{model_type}.pt2", **SIZES)
    want = hybrid_tokens(model)
    for options in (dict(), dict(cuda_graphs=True), dict(num_pages=preempting_pages(model)), dict(prefix_caching=True)):
        served = HybridGenerator.from_package(path, **options)
        assert served.states is not None and served.state_pages > 0
        assert served.generate(PROMPTS, NEW_TOKENS) == want, options
        assert served.states.num_free_slots == served.states.num_slots


# Refusals.


def rewritten(path, tmp_path, **fields):
    """A copy of the package at `path` with `fields` of its recorded `PackageInfo` replaced."""
    copy = tmp_path / "rewritten.pt2"
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(copy, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.endswith("/extra/hybrid_ops.json"):
                data = json.dumps({**json.loads(data), **fields}).encode()
            target.writestr(item, data)
    return copy


def refusal(path, **options) -> str:
    with pytest.raises(HybridInputError) as error:
        HybridGenerator.from_package(path, **options)
    return str(error.value).replace(torch.__version__, "<torch>")


def test_a_package_of_another_torch_library_or_schema_is_refused(llama_package, tmp_path):
    assert_expected_inline(
        refusal(rewritten(llama_package, tmp_path, torch="2.9.1+cu128")),
        """path: the package was built with torch 2.9.1+cu128, this process has torch <torch>: package the model again with this one""",
    )
    assert_expected_inline(
        refusal(rewritten(llama_package, tmp_path, hybrid_ops="0.0.9")),
        """path: the package was built with hybrid_ops 0.0.9, this process has hybrid_ops 0.1.0: package the model again with this one""",
    )
    schemas = json.loads(json.dumps(hybrid_ops.generation.packaged.SCHEMAS))
    schemas["attn"] = schemas["attn"].replace("SymInt forward_mode", "int forward_mode")
    assert_expected_inline(
        refusal(rewritten(llama_package, tmp_path, schemas=schemas)),
        """path: the package calls the ops ['attn'] with other schemas than this hybrid_ops defines: package the model again""",
    )
    assert_expected_inline(
        refusal(rewritten(llama_package, tmp_path, format=0)),
        """path: the package is of format 0, this hybrid_ops reads format 2: package the model again""",
    )


def test_a_package_of_another_config_cache_or_sizes_is_refused(llama, llama_package, tmp_path):
    other = llama.config.to_dict() | {"hidden_size": 128, "sliding_window": 64}
    assert_expected_inline(
        refusal(llama_package, config=other),
        """config: the package was built for another config (hidden_size: 64 in the package, 128 given; sliding_window: absent in the package, 64 given)""",
    )
    assert_expected_inline(
        refusal(llama_package, kv_cache_dtype=torch.float8_e5m2),
        """kv_cache_dtype: the package's KV cache is float32, got torch.float8_e5m2: package the model with kv_cache_dtype=torch.float8_e5m2""",
    )
    assert_expected_inline(
        refusal(llama_package, max_seq_len=49),
        """max_seq_len (49) exceeds the package's 48: package with a larger one""",
    )
    assert_expected_inline(
        refusal(tmp_path / "none.pt2").replace(str(tmp_path), "TMP"),
        """path: cannot read a package at TMP/none.pt2 (No such file or directory)""",
    )
    assert HybridGenerator.from_package(llama_package, config=llama.config).generate([[5, 6]], 2)


class DataDependentEmbedding(torch.nn.Embedding):
    """An embedding whose output depends on the values of its input through Python control flow."""

    def forward(self, input_ids):
        out = super().forward(input_ids)
        return out * 2 if input_ids.max() > 50 else out


def packaging_refusal(model, tmp_path, **options) -> str:
    with pytest.raises(HybridInputError) as error:
        hybrid_ops.package(model, tmp_path / "model.pt2", **SIZES, **options)
    assert not (tmp_path / "model.pt2").exists()
    return str(error.value)


def test_a_model_that_cannot_be_packaged_is_refused_with_its_reason(tmp_path):
    model = small_model("llama")
    model.model.embed_tokens.__class__ = DataDependentEmbedding
    message = packaging_refusal(model, tmp_path)
    assert_expected_inline(
        message.split(" (")[0],
        """llama cannot be packaged: torch.export cannot trace its forward step""",
    )
    assert "DataDependent" in message and message.endswith("; serve it with HybridGenerator(model)")
    assert_expected_inline(
        packaging_refusal(small_model("llama"), tmp_path, decode_backend="flashinfer"),
        """llama cannot be packaged: the flashinfer backend plans each step on the host, which has no AOT path: package with triton; serve it with HybridGenerator(model)""",
    )
    assert_expected_inline(
        packaging_refusal(make_model(tiny_config("minimax")), tmp_path),
        """minimax cannot be packaged: its layer model.layers.1.self_attn keeps state through hybrid::mixer, which reads the metadata on the host; serve it with HybridGenerator(model)""",
    )
