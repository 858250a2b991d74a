"""HybridGenerator as a serving engine: checked input, nothing left behind by an error, eos and per-request sampling,
the step API and streaming, a page budget with preemption, and a load test over all of it.

The reference for every request's tokens is the same request run alone on an unconstrained generator (itself checked
against transformers' generate in test_transformers.py); tiny fp32 models give the same argmax either way.
"""

import random
import re
import threading

import numpy as np
import pytest
import torch
from helpers.models import tiny_model
from helpers.scripts import EXAMPLES, run_script

import hybrid_ops
from hybrid_ops import GenerationStats, HybridGenerator, HybridInputError, HybridOpsError
from hybrid_ops.generation.runner import mkl_is_native

SIZES = dict(max_batch_size=4, max_seq_len=40, page_size=4, prefill_chunk=10)
VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def random_prompts(n, lengths=(1, 30)):
    return [torch.randint(1, VOCAB, (random.randint(*lengths),)).tolist() for _ in range(n)]


def solo(model, prompt, max_new_tokens, **options):
    """A request's tokens run alone, on a generator of its own."""
    return HybridGenerator(model, **{**SIZES, "max_seq_len": 48}, compile=False).generate(
        [prompt], max_new_tokens, **options
    )[0]


def assert_empty(generator):
    assert not generator.has_unfinished()
    assert generator.cache.requests == [] and generator.cache.num_free_pages == generator.cache.num_pages


# Input checks.

BAD_CALLS = [  # (prompts, max_new_tokens, options) -> the whole message
    ([[1, 2], [1, 64]], 4, {}, "prompts[1][1] must be a token id in [0, 64), got 64"),
    ([[1, -1]], 4, {}, "prompts[0][1] must be a token id in [0, 64), got -1"),
    ([[3], [1.0, 2]], 4, {}, "prompts[1][0] must be a token id in [0, 64), got 1.0"),
    ([[1, True]], 4, {}, "prompts[0][1] must be a token id in [0, 64), got True"),
    ([[1, 2], "ab"], 4, {}, "prompts[1] must be a list of token ids, got str"),
    ([[1], [[1, 2]]], 4, {}, "prompts[1][0] must be a token id in [0, 64), got [1, 2]"),
    ([torch.tensor([[1, 2]])], 4, {}, "prompts[0][0] must be a token id in [0, 64), got [1, 2]"),
    ([torch.tensor(3)], 4, {}, "prompts[0] must be a list of token ids, got int"),
    ([np.array([1.5, 2.0])], 4, {}, "prompts[0][0] must be a token id in [0, 64), got 1.5"),
    ([np.array([1, "a"], dtype=object)], 4, {}, "prompts[0][1] must be a token id in [0, 64), got 'a'"),
    ([[1], []], 4, {}, "prompts[1] is empty: a prompt needs at least one token"),
    ([[1]], 0, {}, "max_new_tokens must be a positive int, got 0 (for prompts[0])"),
    ([[1]], 2.5, {}, "max_new_tokens must be a positive int, got 2.5 (for prompts[0])"),
    ([[1]], True, {}, "max_new_tokens must be a positive int, got True (for prompts[0])"),
    ([[1], list(range(1, 38))], 4, {}, "prompts[1]: 37 prompt tokens + max_new_tokens = 4 exceed max_seq_len = 40"),
    ([[1]], 4, dict(do_sample=1), "do_sample must be a bool, got 1"),
    (
        [[1]],
        4,
        dict(do_sample=True, temperature=0.0),
        "temperature must be a finite number > 0 when do_sample=True, got 0.0",
    ),
    (
        [[1]],
        4,
        dict(do_sample=True, temperature=-1.0),
        "temperature must be a finite number > 0 when do_sample=True, got -1.0",
    ),
    (
        [[1]],
        4,
        dict(do_sample=True, temperature=float("nan")),
        "temperature must be a finite number > 0 when do_sample=True, got nan",
    ),
    ([[1]], 4, dict(do_sample=True, top_k=-1), "top_k must be a non-negative int (0: no limit), got -1"),
    ([[1]], 4, dict(do_sample=True, top_k=2.0), "top_k must be a non-negative int (0: no limit), got 2.0"),
    ([[1]], 4, dict(do_sample=True, top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    ([[1]], 4, dict(do_sample=True, top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    ([[1]], 4, dict(do_sample=True, min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
    ([[1]], 4, dict(do_sample=True, min_p=2), "min_p must be in [0, 1], got 2"),
    ([[1]], 4, dict(eos_token_id="2"), "eos_token_id must be None, a non-negative int or a list of them, got '2'"),
    (
        [[1]],
        4,
        dict(eos_token_id=[2, -1]),
        "eos_token_id must be None, a non-negative int or a list of them, got [2, -1]",
    ),
    ([[1]], 4, dict(seed=-1), "seed must be None or a non-negative int, got -1"),
    ([[1]], 4, dict(seed="7"), "seed must be None or a non-negative int, got '7'"),
]


@pytest.mark.parametrize("prompts, max_new_tokens, options, message", BAD_CALLS)
def test_bad_input_is_refused_before_anything_is_registered(model, prompts, max_new_tokens, options, message):
    generator = HybridGenerator(model, **SIZES, compile=False)
    good = random_prompts(2)
    want = [solo(model, p, 5) for p in good]
    for call in (
        lambda: generator.generate(prompts, max_new_tokens, **options),
        lambda: next(generator.stream(prompts, max_new_tokens, **options)),
    ):
        with pytest.raises(HybridInputError) as error:
            call()
        assert str(error.value) == message
        assert_empty(generator)
    if len(prompts) == 1:  # the same check through add_request names "prompt"
        with pytest.raises(HybridInputError) as error:
            generator.add_request(prompts[0], max_new_tokens, **options)
        assert str(error.value) == message.replace("prompts[0]", "prompt")
        assert_empty(generator)
    assert generator.generate(good, 5) == want


@pytest.mark.parametrize(
    "prompts, message",
    [(5, "prompts must be a list of prompts, got int"), ("abc", "prompts must be a list of prompts, got str")],
)
def test_prompts_must_be_a_list(model, prompts, message):
    generator = HybridGenerator(model, **SIZES, compile=False)
    for call in (lambda: generator.generate(prompts, 4), lambda: next(generator.stream(prompts, 4))):
        with pytest.raises(HybridInputError) as error:
            call()
        assert str(error.value) == message


def test_prompts_of_every_accepted_type_give_the_same_tokens(model):
    prompt = random_prompts(1)[0]
    want = solo(model, prompt, 6)
    generator = HybridGenerator(model, **SIZES, compile=False)
    forms = [
        tuple(prompt),
        torch.tensor(prompt),
        torch.tensor(prompt, dtype=torch.int32),
        np.array(prompt),
        [np.int64(t) for t in prompt],
    ]
    assert generator.generate(forms, 6) == [want] * len(forms)
    assert generator.generate((forms[0] for _ in range(2)), 6) == [want] * 2  # any iterable of prompts


def test_a_request_larger_than_the_page_budget_is_refused(model):
    generator = HybridGenerator(model, **SIZES, num_pages=3, compile=False)
    with pytest.raises(HybridInputError) as error:
        generator.add_request(list(range(1, 10)), 4)
    assert str(error.value) == "prompt: 9 prompt tokens + max_new_tokens = 4 need 4 pages, more than num_pages = 3"
    assert_empty(generator)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(page_size=0), "page_size must be a positive int, got 0"),
        (dict(prefill_chunk=-1), "prefill_chunk must be a positive int, got -1"),
        (dict(max_batch_size=2.5), "max_batch_size must be a positive int, got 2.5"),
        (dict(num_pages=0), "num_pages must be a positive int, got 0"),
        (dict(max_seq_len=True), "max_seq_len must be a positive int, got True"),
        (dict(prefix_caching=1), "prefix_caching must be a bool, got 1"),
        (dict(cuda_graphs="yes"), "cuda_graphs must be a bool, got 'yes'"),
        (dict(compile=None), "compile must be a bool, got None"),
        (
            dict(compile_options="max-autotune"),
            "compile_options must be a dict of Inductor's options or None, got 'max-autotune'",
        ),
        (dict(compile_options={"freezin": True}), "compile_options: torch._inductor.config.freezin does not exist"),
        (
            dict(kv_cache_dtype=torch.bfloat16),
            "kv_cache_dtype must be None (the model's torch.float32), "
            "torch.float8_e4m3fn or torch.float8_e5m2, got torch.bfloat16",
        ),
        (
            dict(kv_cache_dtype="fp8"),
            "kv_cache_dtype must be None (the model's torch.float32), torch.float8_e4m3fn or "
            "torch.float8_e5m2, got 'fp8'",
        ),
        (
            dict(max_seq_len=129),
            "max_seq_len (129) exceeds the model's max_position_embeddings (128); raise "
            "model.config.max_position_embeddings to go past it",
        ),
    ],
)
def test_bad_constructor_options(model, options, message):
    with pytest.raises(HybridInputError) as error:
        HybridGenerator(model, **{"compile": False, **options})
    assert str(error.value) == message


def test_sizes_default_to_the_worst_case_within_max_position_embeddings(model):
    generator = HybridGenerator(model, max_batch_size=3, page_size=16, compile=False)
    assert generator.max_seq_len == 128 and generator.cache.num_pages == 3 * 8
    with pytest.raises(
        HybridInputError,
        match=r"prompts\[0\]: 2 prompt tokens \+ max_new_tokens = 1000000 exceed "
        r"max_seq_len = 128",
    ):
        hybrid_ops.generate(model, [[1, 2]], 10**6, compile=False)


# Failure leaves nothing behind.


class Injected(Exception):
    pass


@pytest.mark.parametrize(
    "where, error, at_step",
    [
        ("forward", Injected, 0),
        ("forward", KeyboardInterrupt, 5),
        ("sampling", KeyboardInterrupt, 0),
        ("sampling", Injected, 9),
        ("consumer", KeyboardInterrupt, 2),
        ("consumer", Injected, 9),
    ],
)
def test_a_failing_step_frees_every_request_of_the_call(model, monkeypatch, where, error, at_step):
    """An error in the model's forward, in sampling or in the code consuming the stream, at the first step, in the
    prefills or among the decodes: nothing stays registered, and the next call gives a fresh generator's tokens."""
    prompts = random_prompts(6)
    want = HybridGenerator(model, **SIZES, compile=False).generate(prompts, 8)
    generator = HybridGenerator(model, **SIZES, compile=False)
    steps = 0

    def fail_at_step(function):
        def wrapper(*args):
            nonlocal steps
            steps += 1
            if steps == at_step + 1:
                raise error("injected")
            return function(*args)

        return wrapper

    if where == "forward":
        monkeypatch.setattr(generator.runner, "forward", fail_at_step(generator.runner.forward))
    elif where == "sampling":
        api = hybrid_ops.generation.api
        monkeypatch.setattr(api, "next_tokens", fail_at_step(api.next_tokens))
    with pytest.raises(error, match="injected"):
        for _event in generator.stream(prompts, 8, do_sample=True, top_k=3, seed=1):
            if where == "consumer":
                fail_at_step(lambda: None)()
    assert_empty(generator)
    monkeypatch.undo()
    assert generator.generate(prompts, 8) == want
    assert_empty(generator)


def test_a_failing_step_drops_its_requests_and_keeps_the_rest(model, monkeypatch):
    """Through the step API: the failed step's requests are dropped, a waiting one stays and finishes."""
    prompts = random_prompts(3, lengths=(1, 5))  # two fit one step's prefill budget
    generator = HybridGenerator(model, **{**SIZES, "max_batch_size": 2}, compile=False)
    ids = [generator.add_request(p, 5) for p in prompts]
    monkeypatch.setattr(generator.runner, "forward", lambda *args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        generator.step()
    monkeypatch.undo()
    assert [generator.abort(i) for i in ids[:2]] == [False, False]
    tokens = []
    while generator.has_unfinished():
        tokens += [t for rid, new, _ in generator.step() if rid == ids[2] for t in new]
    assert tokens == solo(model, prompts[2], 5)
    assert_empty(generator)


def test_closing_a_stream_early_frees_its_requests(model):
    generator = HybridGenerator(model, **SIZES, compile=False)
    prompts = random_prompts(5)
    stream = generator.stream(prompts, 8)
    next(stream)
    stream.close()
    assert_empty(generator)


def test_concurrent_use_from_two_threads_is_refused(model, monkeypatch):
    generator = HybridGenerator(model, **SIZES, compile=False)
    inside, release, forward = threading.Event(), threading.Event(), generator.runner.forward

    def blocking_forward(*args):
        inside.set()
        release.wait(30)
        return forward(*args)

    monkeypatch.setattr(generator.runner, "forward", blocking_forward)
    prompt = random_prompts(1)[0]
    results = []
    worker = threading.Thread(target=lambda: results.append(generator.generate([prompt], 3)))
    worker.start()
    assert inside.wait(30)
    for call in (lambda: generator.add_request([1], 2), generator.step, lambda: generator.generate([[1]], 2)):
        with pytest.raises(HybridOpsError, match="running a call in another thread: one generator serves one thread"):
            call()
    release.set()
    worker.join(30)
    assert results == [[solo(model, prompt, 3)]]
    assert_empty(generator)


# eos and sampling as transformers does them.


def test_eos_lists_and_the_generation_config_default(model):
    prompts = random_prompts(3)
    free = [solo(model, p, 12) for p in prompts]
    eos = [free[0][4], free[1][6]]

    def cut(tokens):
        stop = next((i for i, t in enumerate(tokens) if t in eos), len(tokens) - 1)
        return tokens[: stop + 1]

    generator = HybridGenerator(model, **SIZES, compile=False)
    assert generator.generate(prompts, 12, eos_token_id=eos) == [cut(t) for t in free]
    assert generator.generate(prompts, 12, eos_token_id=eos[0]) == [free[0][: free[0].index(eos[0]) + 1]] + [
        t[: t.index(eos[0]) + 1] if eos[0] in t else t for t in free[1:]
    ]
    try:
        model.generation_config.eos_token_id = eos
        with_default = HybridGenerator(model, **SIZES, compile=False)
        assert with_default.generate(prompts, 12) == [cut(t) for t in free]
        assert with_default.generate(prompts, 12, eos_token_id=[]) == free
    finally:
        model.generation_config.eos_token_id = None
    assert_empty(generator)


def test_unseeded_sampling_draws_from_torchs_default_generator(model):
    prompts = random_prompts(3)
    generator = HybridGenerator(model, **SIZES, compile=False)
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(generator.generate(prompts, 10, do_sample=True, temperature=1.5))
    assert runs[0] == runs[1] != runs[2]


def test_a_seeded_requests_samples_do_not_depend_on_its_batch(model):
    """A request's samples alone equal its samples among others (greedy, seeded and unseeded ones, joining at
    different steps), and a different seed gives different samples."""
    prompt = random_prompts(1)[0]
    options = dict(do_sample=True, temperature=1.5, top_p=0.95, min_p=0.02, seed=5)
    alone = solo(model, prompt, 12, **options)
    assert alone != solo(model, prompt, 12, **{**options, "seed": 6})
    generator = HybridGenerator(model, **SIZES, compile=False)
    for p in random_prompts(2):
        generator.add_request(p, 12, do_sample=True)
    generator.step()
    generator.add_request(random_prompts(1)[0], 3)
    rid = generator.add_request(prompt, 12, **options)
    tokens = []
    while generator.has_unfinished():
        tokens += [t for i, new, _ in generator.step() if i == rid for t in new]
    assert tokens == alone


def test_greedy_when_top_k_is_one_or_top_p_tiny(model):
    prompts = random_prompts(3)
    greedy = [solo(model, p, 8) for p in prompts]
    generator = HybridGenerator(model, **SIZES, compile=False)
    assert generator.generate(prompts, 8, do_sample=True, top_k=1, seed=3) == greedy
    assert generator.generate(prompts, 8, do_sample=True, top_p=1e-6, seed=3) == greedy
    assert generator.generate(prompts, 8, do_sample=True, min_p=1.0, seed=3) == greedy


# The step API and streaming.


def test_step_api_requests_come_and_go(model):
    """Requests with their own max_new_tokens join at different steps; one is aborted mid-way; every finished one
    has its solo tokens, reported one step at a time with `finished` on the last."""
    prompts = random_prompts(6)
    lengths = [3, 9, 1, 6, 12, 5]
    generator = HybridGenerator(model, **SIZES, compile=False)
    ids, got, finished = {}, {}, {}
    for step in range(200):
        if step < len(prompts):
            rid = generator.add_request(prompts[step], lengths[step])
            ids[rid], got[rid] = step, []
        if step == 4:
            assert generator.abort(1) and not generator.abort(1)
        for rid, tokens, done in generator.step():
            assert len(tokens) == 1 and rid not in finished
            got[rid] += tokens
            if done:
                finished[rid] = step
        if not generator.has_unfinished():
            break
    assert sorted(finished) == [0, 2, 3, 4, 5]
    for rid, i in ids.items():
        want = solo(model, prompts[i], lengths[i])
        if rid == 1:  # aborted: a prefix of its solo tokens
            assert got[rid] == want[: len(got[rid])] and len(got[rid]) < lengths[1]
        else:
            assert got[rid] == want
    assert_empty(generator)
    assert generator.step() == []


def test_stream_yields_each_token_as_its_step_makes_it(model):
    prompts = random_prompts(5)
    generator = HybridGenerator(model, **SIZES, compile=False)
    want = generator.generate(prompts, 7)
    other = generator.add_request(prompts[0], 4)  # a step-API request, advanced by the stream's steps
    got = [[] for _ in prompts]
    for index, tokens, finished in generator.stream(prompts, 7):
        got[index] += tokens
        assert finished == (len(got[index]) == 7)
    assert got == want
    events = generator.step()
    assert [t for rid, new, _ in events if rid == other for t in new] == want[0][:4] and events[-1][2]
    assert_empty(generator)


# The page budget.


def test_a_small_page_budget_preempts_and_gives_unconstrained_tokens(model):
    prompts = random_prompts(10, lengths=(5, 30))
    want = [solo(model, p, 10) for p in prompts]
    worst = HybridGenerator(model, **SIZES, compile=False)
    assert worst.cache.num_pages == 4 * 10
    stats = GenerationStats()
    assert worst.generate(prompts, 10, stats=stats) == want and stats.preemptions == 0
    tight = HybridGenerator(model, **SIZES, num_pages=11, compile=False)
    stats = GenerationStats()
    sampled = dict(do_sample=True, temperature=1.2, seed=4)
    assert tight.generate(prompts, 10, stats=stats) == want
    assert stats.preemptions > 0
    assert tight.generate(prompts, 10, **sampled) == worst.generate(prompts, 10, **sampled)
    assert_empty(tight)


# Prefix caching.


def shared_prefix_prompts():
    """Prompts sharing a prefix of 14 tokens (3.5 pages of 4) with ragged tails: one an exact prefix of another, one
    inside the shared part, one given twice."""
    common = random_prompts(1, (14, 14))[0]
    prompts = [common + tail for tail in random_prompts(4, (1, 12))]
    return prompts + [prompts[1][:17], common[:9], prompts[2]]


def reusable_tokens(prompts):
    """Per prompt, the tokens it can take from the cache: its longest common prefix with an earlier prompt, short of
    its last token, in whole pages (SIZES' page_size)."""

    def common(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    page = SIZES["page_size"]
    return [
        min(max((common(p, q) for q in prompts[:i]), default=0), len(p) - 1) // page * page
        for i, p in enumerate(prompts)
    ]


def test_prefix_caching_prefills_a_shared_prefix_once_and_keeps_every_token(model):
    """Requests admitted together wait for the pages another's prefill computes, then start on them: every prompt
    prefills only what no earlier prompt shares (at least its last token), and the tokens are those of the requests
    run alone. A second call finds every prompt's pages cached from the first."""
    prompts = shared_prefix_prompts()
    want = [solo(model, p, 8) for p in prompts]
    plain = GenerationStats()
    assert HybridGenerator(model, **SIZES, compile=False).generate(prompts, 8, stats=plain) == want
    assert plain.prompt_tokens == sum(map(len, prompts)) and plain.prefix_cache_hit_tokens == 0
    generator = HybridGenerator(model, **SIZES, compile=False, prefix_caching=True)
    stats = GenerationStats()
    assert generator.generate(prompts, 8, stats=stats) == want
    assert stats.prefix_cache_hit_tokens == sum(reusable_tokens(prompts)) > 0
    assert stats.prompt_tokens == plain.prompt_tokens - stats.prefix_cache_hit_tokens
    assert_empty(generator)
    assert generator.cache.num_evictable_pages > 0

    again = GenerationStats()
    assert generator.generate(prompts, 8, stats=again) == want
    assert again.prefix_cache_hit_tokens == sum((len(p) - 1) // 4 * 4 for p in prompts)
    assert_empty(generator)


@pytest.mark.parametrize("options", [dict(num_pages=11), dict(cuda_graphs=True)])
def test_prefix_caching_keeps_tokens_through_preemption_and_padding(model, options):
    """Through a tight page budget (preempted requests start again on their own cached pages) and the padded path of
    cuda_graphs, greedy and seeded tokens with prefix caching are those without; every page is free at the end."""
    prompts = shared_prefix_prompts()
    sampled = dict(do_sample=True, temperature=1.3, seed=9)
    off = HybridGenerator(model, **SIZES, **options, compile=False)
    on = HybridGenerator(model, **SIZES, **options, compile=False, prefix_caching=True)
    stats = GenerationStats()
    assert on.generate(prompts, 8, stats=stats) == off.generate(prompts, 8)
    assert on.generate(prompts, 8, **sampled) == off.generate(prompts, 8, **sampled)
    assert stats.prefix_cache_hit_tokens > 0 and (stats.preemptions > 0) == ("num_pages" in options)
    assert_empty(on)


def test_prefix_caching_changes_no_step_for_prompts_sharing_no_page(model):
    """Nothing to share: no request waits for another's prefill (a chunk takes several prompts at once)."""
    prompts, runs = random_prompts(8), []
    for prefix_caching in (False, True):
        stats = GenerationStats()
        generator = HybridGenerator(
            model, **{**SIZES, "prefill_chunk": 64}, compile=False, prefix_caching=prefix_caching
        )
        runs.append((generator.generate(prompts, 6, stats=stats), stats.steps, stats.prompt_tokens))
    assert runs[0] == runs[1]


def test_generate_forwards_prefix_caching(model):
    prompts = shared_prefix_prompts()
    stats = GenerationStats()
    tokens = hybrid_ops.generate(model, prompts, 5, compile=False, page_size=4, prefix_caching=True, stats=stats)
    assert tokens == hybrid_ops.generate(model, prompts, 5, compile=False, page_size=4)
    assert stats.prefix_cache_hit_tokens > 0


def test_generate_forwards_kv_cache_dtype(model, monkeypatch):
    caches = []
    monkeypatch.setattr(HybridGenerator, "generate", lambda self, *args, **kwargs: caches.append(self.cache))
    hybrid_ops.generate(model, [[1, 2]], 3, compile=False, kv_cache_dtype=torch.float8_e5m2)
    assert caches[0].k_caches[0].dtype == torch.float8_e5m2 and caches[0].k_scales[0].item() == 1.0


# Compiled: one graph set, warmed up on the first step.


@pytest.mark.slow
def test_compiled_generator_warms_up_once_and_never_recompiles(model, tmp_path):
    """The first call compiles every graph, a batch of one's included; later ones of any shape compile none. The
    compiled artifacts land in the compile cache file, which torch can load back."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    generator = HybridGenerator(model, **SIZES, compile_cache=str(tmp_path / "compiled.bin"))
    prompts = random_prompts(6)
    want = [solo(model, p, 6) for p in prompts]
    assert generator.generate(prompts[:2], 6) == want[:2]  # compiles, the one-request graphs included
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert generator.generate(prompts, 6) == want
        for prompt in ([5], [5, 6]):  # one request of one and two tokens, alone and with another
            assert generator.generate([prompt], 3) == [solo(model, prompt, 3)]
            assert generator.generate([prompt, prompts[0]], 3)[0] == solo(model, prompt, 3)
        with pytest.raises(HybridInputError, match=r"prompts\[0\]\[2\] must be a token id in \[0, 64\), got 300"):
            generator.generate([[1, 2, 300]], 2)
    assert counters["stats"]["unique_graphs"] == graphs
    assert_empty(generator)
    info = torch.compiler.load_cache_artifacts((tmp_path / "compiled.bin").read_bytes())
    assert len(info.inductor_artifacts) > 0


@pytest.mark.slow
def test_compiled_steps_on_the_cpu_multiply_by_weights_packed_at_compile_time(model):
    """The default options freeze the weights: every linear layer of the compiled steps is a product over a weight
    packed when the graph compiled (o_proj's with the residual add; q/k/v and gate/up one product each), none a plain
    matrix product. A graph of dynamic sizes packs them for oneDNN; one of a static row count for MKL: a step of one
    token's (its own graph where the runner does not pad it, `mkl_is_native`), and a head over one logits row (an
    EXTEND step's). The tokens are eager's, for one prompt alone too."""
    from torch._inductor.utils import run_and_get_code

    prompts = random_prompts(3)
    want = [solo(model, p, 5) for p in prompts]
    generator = HybridGenerator(model, **{**SIZES, "max_seq_len": 36})  # sizes of its own: its graphs compile here
    assert generator.runner.pad_one_token != mkl_is_native()
    tokens, codes = run_and_get_code(generator.generate, prompts, 5)  # the warm-up's graphs included
    assert tokens == want
    layers, mkl_graphs = model.config.num_hidden_layers, 0
    for code in codes:  # one per graph: per layer q/k/v, o, gate/up and down, then the head
        onednn = len(re.findall(r"= torch\.ops\.mkldnn\._linear_pointwise\.\w+\(", code))
        mkl = len(re.findall(r"= torch\.ops\.mkl\._mkl_linear\.\w+\(", code))
        assert onednn + mkl == 4 * layers + 1 and mkl in (0, 1, 4 * layers + 1)
        assert "extern_kernels.mm(" not in code and "extern_kernels.addmm(" not in code
        mkl_graphs += mkl == 4 * layers + 1
    assert mkl_graphs == (0 if generator.runner.pad_one_token else 1)
    scratch = generator.cache.k_caches[0][generator.cache.scratch_page]
    for pad in (not generator.runner.pad_one_token, generator.runner.pad_one_token):  # the default last
        generator.runner.pad_one_token = pad
        scratch.fill_(float("nan"))
        assert generator.generate(prompts[:1], 5) == want[:1]  # steps of one token
        assert bool(scratch.isnan().all()) != pad  # the padding request wrote its key
    assert generator.cache.num_free_pages == generator.cache.num_pages


def test_mkl_is_native_on_intel_cpus_alone(monkeypatch):
    """The runner pads steps of one token on CPUs other than Intel's: /proc/cpuinfo's vendor decides."""
    from hybrid_ops.generation import runner

    for vendor, native in (("GenuineIntel", True), ("AuthenticAMD", False), ("", False)):
        monkeypatch.setattr(runner, "cpuinfo_field", lambda name, vendor=vendor: vendor if name == "vendor_id" else "")
        assert runner.mkl_is_native() is native


@pytest.mark.slow
def test_generators_of_other_sizes_never_reach_the_recompile_limit(model):
    """Dynamo counts graphs against its recompile limit per code object, and fullgraph fails past it. Generators of
    other sizes in one process each compile their own graphs, within a limit of one generator's graphs here (before,
    they shared the limit: the second one failed); one of an earlier generator's sizes compiles none."""
    from torch._dynamo.utils import counters

    prompts = random_prompts(2)
    want = [solo(model, p, 4) for p in prompts]
    graphs = counters["stats"]["unique_graphs"]
    assert HybridGenerator(model, **{**SIZES, "max_seq_len": 44}).generate(prompts, 4) == want
    per_generator = counters["stats"]["unique_graphs"] - graphs
    assert per_generator > 0
    with torch._dynamo.config.patch(recompile_limit=per_generator):
        for sizes in (dict(max_seq_len=52), dict(max_seq_len=44, num_pages=30), dict(max_seq_len=44)):
            graphs = counters["stats"]["unique_graphs"]
            assert HybridGenerator(model, **{**SIZES, **sizes}).generate(prompts, 4) == want
    assert counters["stats"]["unique_graphs"] == graphs  # the last one: the first one's sizes and graphs


def test_warm_up_fits_any_budget(model):
    """The warm-up's steps (run eagerly here) skip shapes that the sizes rule out, and leave every page free."""
    for sizes in (
        dict(max_batch_size=1, max_seq_len=2, page_size=1, num_pages=2, prefill_chunk=1),
        dict(SIZES, num_pages=1),
    ):
        generator = HybridGenerator(model, **sizes, compile=False)
        generator.runner.warmed_up = False
        assert generator.generate([[7]], 1) == [solo(model, [7], 1)]
        assert generator.runner.warmed_up
        assert_empty(generator)


def test_compiles_are_said_as_compiles_and_not_counted_as_generating(model, capsys, caplog, monkeypatch):
    """The first run's warm-up (which compiles the forward; here eager, made to take a second) is said on the progress
    bar and in the log with each step's shapes, and counted apart: the bar's rate and the run's seconds and first
    tokens start after it."""
    import logging
    import time

    generator = HybridGenerator(model, **SIZES, compile=False)
    generator.runner.warmed_up = False
    warm_up = generator.runner.warm_up
    monkeypatch.setattr(generator.runner, "warm_up", lambda announce: (time.sleep(1), warm_up(announce)))
    stats = GenerationStats()
    with caplog.at_level(logging.INFO, logger="hybrid_ops.generation"):
        assert generator.generate([[7], [8, 9]], 2, progress=True, stats=stats) == [
            solo(model, p, 2) for p in ([7], [8, 9])
        ]
    bar = capsys.readouterr().err
    shapes = [m.removeprefix("compiling the forward for a step of ") for m in caplog.messages if "compiling" in m]
    assert shapes[:2] == ["DECODE, 1 request of 1 token, 1 logits row", "EXTEND, 1 request of 2 tokens, 1 logits row"]
    assert "MIXED, 2 requests of 2+1 tokens, 2 logits rows" in shapes
    compiled = re.search(r"hybrid_ops: compiled the forward in \d+ s", bar).start()
    assert all(f"compiling ({s}):" in bar[:compiled] for s in shapes)
    assert re.search(r"generating: 100%.* 4/4 ", bar[compiled:]) and "compiling" not in bar[compiled:]
    assert stats.compile_seconds >= 1 and max(stats.first_token_seconds) < 1 and stats.seconds < stats.compile_seconds
    assert [m for m in caplog.messages if m.startswith("compiled in ")]


# Everything at once.


@pytest.mark.slow
def test_load_ragged_requests_through_a_small_budget(model):
    """200 ragged requests through a third of the worst case's pages: added at different steps, some aborted,
    some streamed, greedy and seeded sampling mixed. Every finished request has its solo tokens (seeded sampling
    included); an aborted one a prefix of them; every page is free at the end."""
    rng = random.Random(0)
    options = dict(max_batch_size=8, max_seq_len=48, page_size=4, prefill_chunk=16)
    generator = HybridGenerator(model, **options, num_pages=8 * 12 // 3 - 1, compile=False)
    requests = []  # (prompt, max_new_tokens, sampling options)
    for i in range(200):
        sampling = dict(do_sample=True, temperature=rng.choice([0.7, 1.3]), top_p=0.9, seed=i) if i % 3 == 0 else {}
        requests.append((random_prompts(1, (1, 30))[0], rng.randint(1, 16), sampling))
    got, finished, ids, aborted = {}, set(), {}, set()
    stats = GenerationStats()

    def collect(events):
        for rid, tokens, done in events:
            got[ids[rid]] += tokens
            if done:
                finished.add(ids[rid])

    streamed = list(range(150, 200, 2))
    queue = [i for i in range(200) if i not in streamed]
    stream_at = 60  # queued requests left when the stream runs
    while queue or generator.has_unfinished():
        for i in queue[: rng.randint(0, 4)]:
            prompt, max_new_tokens, sampling = requests[i]
            ids[generator.add_request(prompt, max_new_tokens, **sampling)], got[i] = i, []
            queue.remove(i)
        if ids and rng.random() < 0.05:
            rid = rng.choice(list(ids))
            if generator.abort(rid):
                aborted.add(ids[rid])
        if len(queue) <= stream_at:  # a stream in the middle: the step API's requests go on meanwhile
            stream_at = -1
            seeded = [requests[i] for i in streamed]
            for index, tokens, _done in generator.stream(
                [p for p, _, _ in seeded], 8, stats=stats, do_sample=True, seed=1000
            ):
                got.setdefault(streamed[index], []).extend(tokens)
        collect(generator.step())
    assert stats.preemptions > 0 and len(aborted) > 0
    assert_empty(generator)
    for i, (prompt, max_new_tokens, sampling) in enumerate(requests):
        if i in streamed:
            want = solo(model, prompt, 8, do_sample=True, seed=1000 + streamed.index(i))
        else:
            want = solo(model, prompt, max_new_tokens, **sampling)
        if i in aborted:
            assert got[i] == want[: len(got[i])] and i not in finished
        else:
            assert got[i] == want, f"request {i}"


@pytest.mark.slow
def test_serve_example():
    """examples/serve.py, eager: its stream and its step API through a page budget give generate's tokens."""
    out = run_script(EXAMPLES / "serve.py", "--no-compile", "--max-new-tokens", "6")
    assert "step API tokens equal generate's: True" in out
    assert "aborted request 0 after" in out
    assert int(re.search(r"(\d+) preemptions", out)[1]) > 0
