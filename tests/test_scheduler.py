"""The scheduler without a model: admission, chunked prefill, preemption, abort and prefix-cache waiting, step by
step against hand-written expectations; then random loads against a simulated model that reads every token back
through the step's block table, whose tokens must be those of each request run alone."""

import random

import pytest

from hybrid_ops import ForwardMode, PagedKVCache
from hybrid_ops.generation import GenerationStats, KVCacheManager, Request, Scheduler


def make_scheduler(num_pages, page_size, max_batch_size, prefill_chunk, prefix_caching=False):
    cache = PagedKVCache(num_pages, page_size, num_kv_heads=1, head_dim=1, max_pages_per_request=num_pages)
    return Scheduler(KVCacheManager(cache, prefix_caching), max_batch_size, prefill_chunk), cache


def plan(step):
    """A step as (mode, [(request id, new tokens, positions)], sampling request ids, logits rows)."""
    rows, start = [], 0
    for request, n in zip(step.requests, step.num_new_tokens):
        rows.append((request.id, step.token_ids[start : start + n], step.positions[start : start + n]))
        start += n
    return step.forward_mode, rows, [r.id for r in step.sampled], step.logits_rows


def assert_all_free(scheduler, cache):
    assert not scheduler.has_unfinished() and not scheduler.running and not scheduler.waiting
    assert cache.requests == [] and cache.num_free_pages == cache.num_pages


def test_admission_in_arrival_order_within_the_batch_slots():
    scheduler, cache = make_scheduler(num_pages=16, page_size=4, max_batch_size=2, prefill_chunk=16)
    ids = [
        scheduler.add(Request([1, 2, 3], 1)),
        scheduler.add(Request([4, 5, 6, 7, 8], 2)),
        scheduler.add(Request([9, 10], 1)),
    ]
    assert ids == [0, 1, 2]
    step = scheduler.schedule()
    assert plan(step) == (
        ForwardMode.EXTEND,
        [(0, [1, 2, 3], [0, 1, 2]), (1, [4, 5, 6, 7, 8], [0, 1, 2, 3, 4])],
        [0, 1],
        [2, 7],
    )
    assert [r.id for r in scheduler.waiting] == [2]
    assert step.batch.seq_lens.tolist() == [3, 5] and step.batch.cu_seqlens_q.tolist() == [0, 3, 8]
    assert scheduler.update(step, [20, 21]) == [(0, [20], True), (1, [21], False)]
    # Request 0 finished: request 2 takes its slot and prefills while request 1 decodes.
    step = scheduler.schedule()
    assert plan(step) == (ForwardMode.MIXED, [(1, [21], [5]), (2, [9, 10], [0, 1])], [1, 2], [0, 2])
    assert scheduler.update(step, [30, 31]) == [(1, [30], True), (2, [31], True)]
    assert scheduler.schedule() is None
    assert_all_free(scheduler, cache)


def test_prefill_chunks_share_one_budget_per_step_oldest_first():
    scheduler, cache = make_scheduler(num_pages=16, page_size=4, max_batch_size=4, prefill_chunk=4)
    stats = GenerationStats()
    scheduler.add(Request([1, 2, 3, 4, 5, 6], 2))
    scheduler.add(Request([7, 8, 9], 1))
    steps = []
    for tokens in ([], [40], [41, 42], []):
        step = scheduler.schedule(stats)
        if step is None:
            break
        steps.append(plan(step))
        scheduler.update(step, tokens, stats)
    assert steps == [
        (ForwardMode.EXTEND, [(0, [1, 2, 3, 4], [0, 1, 2, 3])], [], []),  # request 1 gets none of the budget
        (ForwardMode.EXTEND, [(0, [5, 6], [4, 5]), (1, [7, 8], [0, 1])], [0], [1]),
        (ForwardMode.MIXED, [(0, [40], [6]), (1, [9], [2])], [0, 1], [0, 1]),
    ]
    assert stats.prompt_tokens == 9 and stats.generated_tokens == 3
    assert stats.steps == {"EXTEND": 2, "MIXED": 1}
    assert_all_free(scheduler, cache)


def test_preemption_frees_the_newest_running_request_which_is_prefilled_again_first():
    """4 pages of 2 tokens. Requests 0 and 1 (3-token prompts) take 2 pages each; request 2 waits. When both need a
    third page, request 1 (the newest) is preempted and queued before request 2; it comes back once request 0
    finishes, prefilling its prompt and its 2 tokens again."""
    scheduler, cache = make_scheduler(num_pages=4, page_size=2, max_batch_size=3, prefill_chunk=16)
    stats = GenerationStats()
    scheduler.add(Request([1, 2, 3], 4))
    scheduler.add(Request([4, 5, 6], 4))
    scheduler.add(Request([7], 2))
    expected = [  # (plan, tokens the step samples, running ids after, waiting ids after, free pages after)
        ((ForwardMode.EXTEND, [(0, [1, 2, 3], [0, 1, 2]), (1, [4, 5, 6], [0, 1, 2])], [0, 1], [2, 5]), [10, 11]),
        ((ForwardMode.DECODE, [(0, [10], [3]), (1, [11], [3])], [0, 1], [0, 1]), [12, 13]),
        ((ForwardMode.DECODE, [(0, [12], [4])], [0], [0]), [14]),  # request 1 preempted
        ((ForwardMode.DECODE, [(0, [14], [5])], [0], [0]), [15]),  # request 1 needs 3 pages, 1 is free
        ((ForwardMode.EXTEND, [(1, [4, 5, 6, 11, 13], [0, 1, 2, 3, 4]), (2, [7], [0])], [1, 2], [4, 5]), [16, 17]),
        ((ForwardMode.DECODE, [(1, [16], [5]), (2, [17], [1])], [1, 2], [0, 1]), [18, 19]),
    ]
    queues = []
    for want, tokens in expected:
        step = scheduler.schedule(stats)
        assert plan(step) == want
        queues.append(([r.id for r in scheduler.running], [r.id for r in scheduler.waiting], cache.num_free_pages))
        scheduler.update(step, tokens, stats)
    assert queues == [
        ([0, 1], [2], 0),
        ([0, 1], [2], 0),
        ([0], [1, 2], 1),
        ([0], [1, 2], 1),
        ([1, 2], [], 0),
        ([1, 2], [], 0),
    ]
    assert stats.preemptions == 1 and stats.prompt_tokens == 3 + 3 + 5 + 1
    assert scheduler.schedule() is None
    assert_all_free(scheduler, cache)


def test_abort_frees_a_running_requests_pages_and_forgets_a_waiting_one():
    scheduler, cache = make_scheduler(num_pages=8, page_size=2, max_batch_size=1, prefill_chunk=16)
    running = scheduler.add(Request([1, 2, 3, 4, 5], 3))
    waiting = scheduler.add(Request([6, 7], 3))
    scheduler.update(scheduler.schedule(), [9])
    assert cache.num_free_pages == 8 - 3 and cache.requests == [running]
    assert scheduler.abort(waiting) and [r.id for r in scheduler.waiting] == []
    assert cache.num_free_pages == 8 - 3
    assert scheduler.abort(running) and not scheduler.abort(running) and not scheduler.abort(12345)
    assert scheduler.schedule() is None
    assert_all_free(scheduler, cache)


def test_a_failed_step_drops_its_requests_and_keeps_the_waiting_ones():
    scheduler, cache = make_scheduler(num_pages=8, page_size=2, max_batch_size=1, prefill_chunk=16)
    scheduler.add(Request([1, 2, 3], 2))
    waiting = scheduler.add(Request([4], 1))
    step = scheduler.schedule()
    scheduler.abort_step(step.requests)
    assert list(scheduler.requests) == [waiting] and cache.num_free_pages == 8
    assert plan(scheduler.schedule()) == (ForwardMode.EXTEND, [(waiting, [4], [0])], [waiting], [0])


def test_prefix_caching_waits_for_the_pages_a_running_prefill_computes():
    """Request 1 shares request 0's first 8 tokens (2 pages of 4). While request 0 prefills them (a chunk of 4 per
    step) request 1 waits, and request 2 behind it; then request 1 starts on both pages, which it shares, and
    prefills only its own 3 tokens. Request 2 is those 8 tokens alone: it takes the first page only, since its last
    token must be prefilled for its logits."""
    scheduler, cache = make_scheduler(num_pages=8, page_size=4, max_batch_size=3, prefill_chunk=4, prefix_caching=True)
    stats = GenerationStats()
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    scheduler.add(Request(shared + [19, 20], 1))
    scheduler.add(Request(shared + [21, 22, 23], 1))
    scheduler.add(Request(shared, 1))
    steps = []
    for tokens in ([], [], [30], [31], [32]):
        step = scheduler.schedule(stats)
        steps.append((plan(step), [r.id for r in scheduler.waiting]))
        table = step.batch.block_table
        assert all(table[i, 0] == table[0, 0] for i in range(len(step.requests)))  # the first page, shared
        scheduler.update(step, tokens, stats)
    assert steps == [
        ((ForwardMode.EXTEND, [(0, [11, 12, 13, 14], [0, 1, 2, 3])], [], []), [1, 2]),
        ((ForwardMode.EXTEND, [(0, [15, 16, 17, 18], [4, 5, 6, 7])], [], []), [1, 2]),
        ((ForwardMode.EXTEND, [(0, [19, 20], [8, 9]), (1, [21, 22], [8, 9])], [0], [1]), []),
        ((ForwardMode.EXTEND, [(1, [23], [10]), (2, [15, 16, 17], [4, 5, 6])], [1], [0]), []),
        ((ForwardMode.EXTEND, [(2, [18], [7])], [2], [0]), []),
    ]
    assert stats.prefix_cache_hit_tokens == 8 + 4 and stats.prompt_tokens == 10 + 3 + 4
    assert_all_free(scheduler, cache)
    assert cache.num_evictable_pages == 2  # the shared pages stay cached, and count as free


# Random loads against a simulated model.

VOCAB = 50


def next_token(tokens) -> int:
    """The simulated model: a token that depends on every token before it and on their order."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


def solo_tokens(prompt, max_new_tokens, stop=frozenset()):
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(next_token(tokens))
        if tokens[-1] in stop:
            break
    return tokens[len(prompt) :]


def run_step(step, memory, page_size):
    """The simulated forward: writes the step's tokens into `memory` ((page, row) -> token) through the batch's
    block table, then reads each sampling request's whole sequence back from it -> its next tokens."""
    cu, seq_lens, table = (t.tolist() for t in step.batch.metadata)
    for i in range(len(step.requests)):
        for j, token in enumerate(step.token_ids[cu[i] : cu[i + 1]]):
            position = seq_lens[i] - (cu[i + 1] - cu[i]) + j
            assert position == step.positions[cu[i] + j]
            memory[table[i][position // page_size], position % page_size] = token
    tokens = []
    for request in step.sampled:
        i = step.requests.index(request)
        assert step.logits_rows[step.sampled.index(request)] == cu[i + 1] - 1
        sequence = [memory[table[i][p // page_size], p % page_size] for p in range(seq_lens[i])]
        tokens.append(next_token(sequence))
    return tokens


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_loads_give_every_request_its_solo_tokens(seed, prefix_caching):
    """Requests arriving at random steps (some sharing prompt prefixes or repeating a prompt, some with a stop token),
    a few aborted, through a third of the worst case's pages: each step keeps the batch and chunk limits, every
    finished request has the tokens it gets alone, an aborted one a prefix of them, and every page is free at the
    end."""
    rng = random.Random(seed)
    page_size, max_batch_size, prefill_chunk, max_len = 4, 4, 8, 40
    scheduler, cache = make_scheduler(
        max_batch_size * max_len // page_size // 3, page_size, max_batch_size, prefill_chunk, prefix_caching
    )
    stats = GenerationStats()
    stems = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(3)]
    requests = []
    for _ in range(40):
        prompt = rng.choice(stems)[: rng.randint(0, 12)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        if requests and rng.random() < 0.2:  # an earlier prompt again
            prompt = list(rng.choice(requests).prompt)
        stop = frozenset({rng.randrange(VOCAB)}) if rng.random() < 0.3 else frozenset()
        requests.append(Request(prompt, rng.randint(1, max_len - len(prompt)), stop_token_ids=stop))
    pending, memory, got, finished, aborted = list(requests), {}, {}, set(), set()
    while pending or scheduler.has_unfinished():
        for request in pending[: rng.randint(0, 3)]:
            got[scheduler.add(request)] = []
            pending.remove(request)
        rid = rng.choice(list(got)) if got and rng.random() < 0.05 else None
        if rid is not None and scheduler.abort(rid):
            aborted.add(rid)
        step = scheduler.schedule(stats)
        if step is None:
            continue
        ids = [r.id for r in step.requests]
        assert len(ids) <= max_batch_size and ids == sorted(ids)
        assert sum(n for n, prefill in zip(step.num_new_tokens, step.prefills) if prefill) <= prefill_chunk
        for rid, tokens, done in scheduler.update(step, run_step(step, memory, page_size), stats):
            got[rid] += tokens
            if done:
                finished.add(rid)
    assert_all_free(scheduler, cache)
    assert stats.preemptions > 0 and (stats.prefix_cache_hit_tokens > 0) == prefix_caching
    assert finished | aborted == set(got) and not finished & aborted and aborted
    for request in requests:
        want = solo_tokens(request.prompt, request.max_new_tokens, request.stop_token_ids)
        if request.id in aborted:
            assert got[request.id] == want[: len(got[request.id])]
        else:
            assert got[request.id] == want, request.id
