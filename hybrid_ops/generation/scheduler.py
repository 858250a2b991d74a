"""The scheduler: which requests run in the next step, and with how many new tokens each.

Pure bookkeeping over a `KVCacheManager`, no model: requests wait in arrival order and are admitted while fewer than
`max_batch_size` run and the cache can hold their prefill. A step gives each running request, oldest first, its next
prefill chunk (`prefill_chunk` tokens in all per step) or one decode token; the two mix (MIXED) when requests join
while others decode. When the step's new pages are not free, the newest running request is preempted: its pages are
freed and it waits at the head of the queue, to prefill its prompt and its tokens so far again (recomputation, as in
vLLM), so a budget smaller than the worst case gives every request the tokens of an unconstrained run. With prefix
caching a request starts on the cached pages of its tokens, and waits while a running request's prefill computes the
next page it could take, so requests sharing a prompt prefix compute it once.
"""

import bisect
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate, count

import torch

from ..metadata import ForwardBatch
from ..modes import ForwardMode
from .cache_manager import KVCacheManager
from .sampler import SamplingParams


@dataclass(eq=False)
class Request:
    """A request's tokens and its progress. `prefill_end`: the tokens to prefill since admission (the prompt, or
    prompt + generated after a preemption)."""

    prompt: list
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset = frozenset()
    generator: torch.Generator | None = None  # the seeded request's own (`SamplingParams.generator`)
    id: int = -1  # given by `Scheduler.add`
    generated: list = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V the cache holds for it: computed, or taken from the prefix cache
    prefill_end: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def tokens(self, start: int, stop: int) -> list:
        """(prompt + generated)[start:stop]."""
        p = len(self.prompt)
        return self.prompt[start:stop] + self.generated[max(start - p, 0) : max(stop - p, 0)]


@dataclass
class ScheduledStep:
    """One step, its pages allocated: request i computes `token_ids[cu[i]:cu[i + 1]]` at `positions` likewise
    (`cu`: the running sum of `num_new_tokens`); the requests in `sampled` reach their last token in it and sample
    from the logits of the token rows `logits_rows`; `state_slots`: [B] int32, each request's state slot (a hybrid
    model's), else None."""

    requests: list
    num_new_tokens: list
    prefills: list  # per request: whether its tokens are prefilled (else one decode token)
    forward_mode: ForwardMode
    batch: ForwardBatch
    token_ids: list
    positions: list
    sampled: list
    logits_rows: list
    state_slots: torch.Tensor | None = None


class Scheduler:
    """Requests waiting and running over `kv` (see the module docstring); `requests`: id -> Request, every request
    added and not yet finished, aborted or dropped."""

    def __init__(self, kv: KVCacheManager, max_batch_size: int, prefill_chunk: int):
        self.kv, self.max_batch_size, self.prefill_chunk = kv, max_batch_size, prefill_chunk
        self.requests = {}
        self.waiting = deque()  # admission order: preempted requests go back to the front
        self.running = []  # sorted by id, oldest first: the last is the one to preempt
        self._ids = count()

    def add(self, request: Request) -> int:
        """Queues a request; returns the id it is given."""
        request.id = next(self._ids)
        self.requests[request.id] = request
        self.waiting.append(request)
        return request.id

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id) -> bool:
        """Drops a request; False when it is not in flight (finished, dropped or unknown)."""
        request = self.requests.get(request_id)
        if request is not None:
            self.drop(request)
        return request is not None

    def drop(self, request: Request) -> None:
        """Forgets a request wherever it is; frees its pages."""
        self.requests.pop(request.id, None)
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self, stats=None) -> ScheduledStep | None:
        """Admits what fits, then plans the next step and allocates its pages; None when nothing runs. Counts
        preemptions and tokens taken from the prefix cache in `stats` (a `GenerationStats`) if given."""
        self._admit(stats)
        if not self.running:
            return None
        requests, counts, prefills = self._plan(stats)
        if not any(prefills):
            mode = ForwardMode.DECODE
        elif all(prefills):
            mode = ForwardMode.EXTEND
        else:
            mode = ForwardMode.MIXED
        try:
            batch = self.kv.allocate(requests, counts, mode)
        except BaseException:
            self.abort_step(requests)
            raise
        token_ids, positions, sampled, rows = [], [], [], []
        for request, n, end in zip(requests, counts, accumulate(counts)):
            start = request.num_computed_tokens
            token_ids += request.tokens(start, start + n)
            positions += range(start, start + n)
            if start + n == request.num_tokens:  # the step reaches its last token: it samples
                sampled.append(request)
                rows.append(end - 1)
        slots = self.kv.state_slots(requests)
        return ScheduledStep(requests, counts, prefills, mode, batch, token_ids, positions, sampled, rows, slots)

    def _admit(self, stats):
        """Moves waiting requests to running, oldest first, while a batch slot is free and the cache admits them."""
        reserved = sum(self.kv.prefill_pages(r) for r in self.running)
        while self.waiting and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            if self._waits_for_a_prefill(request) or not self.kv.admit(request, reserved):
                break
            self.waiting.popleft()
            bisect.insort(self.running, request, key=lambda r: r.id)
            reserved += self.kv.prefill_pages(request)
            if stats is not None:
                stats.prefix_cache_hit_tokens += request.num_computed_tokens

    def _waits_for_a_prefill(self, request) -> bool:
        """Whether a running request's prefill will compute the page of `request` after the tokens the prefix cache
        holds for it (the same tokens from the first on), which `request` can then take from the prefix cache."""
        if not self.kv.prefix_caching:
            return False
        end = self.kv.reusable_tokens(request) + self.kv.cache.page_size
        if end >= request.num_tokens:
            return False
        prefix = request.tokens(0, end)
        return any(r.num_computed_tokens < end <= r.prefill_end and r.tokens(0, end) == prefix for r in self.running)

    def _plan(self, stats):
        """This step's requests, their numbers of new tokens and whether each prefills. Preempts the newest running
        requests until the step's new pages are free."""
        while True:
            budget, requests, counts, prefills = self.prefill_chunk, [], [], []
            for request in self.running:
                n, prefill = 1, request.num_computed_tokens < request.prefill_end
                if prefill:
                    n = self.kv.chunk(request, min(budget, request.prefill_end - request.num_computed_tokens))
                    budget -= n
                if n:
                    requests.append(request)
                    counts.append(n)
                    prefills.append(prefill)
            if self.kv.step_fits(requests, counts):
                return requests, counts, prefills
            self._preempt(self.running[-1], stats)

    def _preempt(self, request, stats):
        """Frees a running request's pages (and state slot) and queues it first: its prompt and tokens are prefilled
        again (and its state computed again from them)."""
        self.running.remove(request)
        self.kv.free(request)
        self.waiting.appendleft(request)
        if stats is not None:
            stats.preemptions += 1

    def update(self, step: ScheduledStep, next_token_ids, stats=None) -> list:
        """The step has run: its tokens' K/V are in the cache, and `next_token_ids` (host ints) are the tokens of
        `step.sampled`. Finished requests are dropped -> [(request id, [token], finished)] per sampled request.
        Counts the step, its prefilled and generated tokens in `stats` if given."""
        starts = accumulate(step.num_new_tokens, initial=0)
        for request, n, prefill, start in zip(step.requests, step.num_new_tokens, step.prefills, starts):
            self.kv.computed(request, step.token_ids[start : start + n])
            request.num_computed_tokens += n
            if prefill and stats is not None:
                stats.prompt_tokens += n
        events = []
        for request, token in zip(step.sampled, next_token_ids):
            request.generated.append(token)
            finished = len(request.generated) >= request.max_new_tokens or token in request.stop_token_ids
            if finished:
                self.drop(request)
            events.append((request.id, [token], finished))
        if stats is not None:
            stats.steps[step.forward_mode.name] += 1
            stats.generated_tokens += len(step.sampled)
        return events

    def abort_step(self, requests) -> None:
        """Drops the requests of a step that failed (`ScheduledStep.requests`): their K/V are not all written."""
        for request in requests:
            self.drop(request)
