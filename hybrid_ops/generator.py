"""Continuous-batching generation for transformers models through the hybrid ops.

Every step packs the running requests into one sequence: prompts are prefilled in chunks, generated tokens are
decoded one per request, and the two mix (MIXED) when new requests join while others decode. Requests are admitted
while the cache has free pages for their prompts; when a step needs more pages than are free, the newest running
request is preempted (its pages freed, its prompt and tokens so far prefilled again later), so a budget of pages
smaller than the worst case still gives every request the tokens of an unconstrained run. One compiled forward
(`fullgraph=True, dynamic=True`) serves every step and mode. With `cuda_graphs=True` every step is padded to a bucket
(`hybrid_ops.buckets`) and, on CUDA, the forward is compiled with `mode="reduce-overhead"`: one CUDA graph per bucket
and mode, not per batch. With `prefix_caching=True` a request whose prompt begins with full pages that the cache holds
(from a finished request, or from a running one that has computed them) starts after them.

The API: `generate(prompts, ...)` returns every request's tokens, `stream(prompts, ...)` yields them step by step,
and `add_request` / `step` / `abort` serve requests that come and go (docs/generation.md).
"""

import bisect
import hashlib
import math
import numbers
import os
import threading
import time
import types
import weakref
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate, count
from typing import NamedTuple

import torch
import torch.distributed as dist

from .buckets import batch_buckets, pad_batch, padding_q_lens, token_buckets
from .cache import PagedKVCache
from .errors import HybridInputError, HybridOpsError
from .fp8 import FP8_DTYPES
from .modes import ForwardMode
from .state import StatePool

# (tokens per request, logits rows, mode) of steps with one request, one token or one logits row: sizes that
# Dynamo specialises, with a graph each.
_WARM_UP_STEPS = [
    ([1], [0], ForwardMode.DECODE),
    ([2], [1], ForwardMode.EXTEND),
    ([2, 1], [2], ForwardMode.MIXED),
    ([2, 1], [1, 2], ForwardMode.MIXED),
    ([1, 1], [0, 1], ForwardMode.DECODE),
]


class _Sampling(NamedTuple):
    temperature: float
    top_k: int
    top_p: float
    min_p: float


@dataclass(eq=False)
class _Request:
    id: int
    prompt: list
    max_new_tokens: int
    eos: frozenset
    sampling: _Sampling | None  # None: greedy
    generator: torch.Generator | None  # a seeded request's own; None: torch's default generator
    generated: list = field(default_factory=list)
    cached: int = 0  # tokens in the cache (prefilled, or taken from the prefix cache)
    prefill_end: int = 0  # tokens to prefill since admission: the prompt, or prompt + generated after a preemption

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def tokens(self, start: int, stop: int) -> list:
        """(prompt + generated)[start:stop]."""
        p = len(self.prompt)
        return self.prompt[start:stop] + self.generated[max(start - p, 0) : max(stop - p, 0)]


@dataclass
class GenerationStats:
    steps: Counter = field(default_factory=Counter)  # ForwardMode name -> steps
    prompt_tokens: int = 0  # prefilled tokens, recomputed ones included
    cached_tokens: int = 0  # tokens taken from the prefix cache at admission instead of prefilled
    generated_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    first_token_seconds: list = field(default_factory=list)  # per request, from the start of the run

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


# Dynamo keeps compiled graphs, and counts them against its recompile limit, per code object. Generators of one model
# and the same shapes share a copy of `_forward` (a later one compiles nothing); others get their own, so that the
# generators of several models or sizes in one process never add up to that limit, past which fullgraph fails.
_FORWARD_CODES = weakref.WeakKeyDictionary()  # model -> {shapes: code object}


class HybridGenerator:
    """Generates for a causal LM whose attention runs through `torch.ops.hybrid.attn`.

    The paged cache holds `num_pages` pages of `page_size` tokens (default: `max_batch_size` requests of
    `max_seq_len` tokens, the worst case); at most `max_batch_size` requests run at once, each of at most
    `max_seq_len` tokens (prompt + new tokens; default and limit: the model's `max_position_embeddings`, capped at
    1024 by default). The cache and the compiled forward are kept across calls, so later runs neither allocate nor
    recompile; the first step of a compiled generator also compiles the graphs of one-request and one-token steps,
    which Dynamo specialises, so no later step compiles. With `compile_cache=PATH` the compiled artifacts
    (`torch.compiler.save_cache_artifacts`) are written to PATH after that first step and loaded from it at
    construction, so a later process with the same model, sizes and torch skips Inductor's code generation.
    `cuda_graphs=True` pads every step to a bucket of requests and tokens (padding requests write only the cache's
    scratch page) and, on CUDA, compiles with `mode="reduce-overhead"`; on other devices the same padding runs
    under a plain compile. The backends must then be CUDA-graph safe: on CUDA "auto" means "triton" here (FlashInfer
    plans on the host, and this forward does not plan outside its graphs).

    `prefix_caching=True` keeps the K/V of every full page of tokens in the cache, keyed by its tokens and all before
    it (`PagedKVCache`), until the pages are needed: an admitted request starts on the cached pages of its prompt
    (and of its tokens so far, after a preemption) and prefills only the rest, at least its last token, whose logits
    it samples from. A request waits while a running request's prefill computes the next page it could take, so
    requests sharing a prompt prefix compute it once. Greedy and seeded tokens are those of `prefix_caching=False`
    (tested); `GenerationStats.cached_tokens` counts the tokens not prefilled. It is off by default because it
    changes which step each request samples in: unseeded sampling, which draws from torch's default generator in
    step order, would then depend on what earlier calls left in the cache.

    `kv_cache_dtype=torch.float8_e4m3fn` (or `float8_e5m2`) stores K/V in fp8, half the cache of bf16, with a
    per-tensor scale of 1.0 in every layer (the K/V of the models measured stay well inside e4m3's range of 448;
    `cache.k_scales` / `cache.v_scales` hold them, to set before generating); the accuracy cost on the demo model is
    in docs/correctness.md.

    One generator serves one thread: a call made while another thread's call runs raises `HybridOpsError`.
    If a step raises (the model's forward, a KeyboardInterrupt, ...), the requests of that step are dropped and
    their pages freed; `generate` and `stream` drop all of their call's requests. The error propagates and the
    generator stays usable.

    A hybrid model (layers with recurrent or convolution state: linear attention, state space, short convolutions;
    `integrations/stateful.py`) keeps each running request's state in a slot of `states` (a `StatePool` of
    `max_batch_size` slots), taken at admission and freed with the request's pages; a slot counts as `state_pages`
    pages of the budget (the pages its bytes would fill), so admission and preemption see K/V and state together. A
    preempted request's state is dropped and computed again from its tokens. Prefix caching and `cuda_graphs` are
    refused for such models.

    A model sharded with `tp_plan` runs on every rank of its group with the same prompts (checked): the cache holds the
    rank's own KV heads, the scheduling depends only on the tokens, and rank 0's sampled tokens are broadcast.
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        page_size: int = 16,
        prefill_chunk: int = 256,
        compile: bool = True,
        prefill_backend: str = "auto",
        decode_backend: str = "auto",
        cuda_graphs: bool = False,
        num_pages: int | None = None,
        compile_cache: str | None = None,
        prefix_caching: bool = False,
        kv_cache_dtype=None,
    ):
        from .integrations.transformers import HybridStep, check_servable, kv_heads_per_rank, tensor_parallel_group

        config = model.config.get_text_config()
        max_positions = _max_positions(config)
        if max_seq_len is None:
            max_seq_len = min(1024, max_positions or 1024)
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("max_seq_len", max_seq_len),
            ("page_size", page_size),
            ("prefill_chunk", prefill_chunk),
            ("num_pages", num_pages),
        ):
            if value is not None and not _is_int(value, 1):
                raise HybridInputError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("compile", compile), ("cuda_graphs", cuda_graphs), ("prefix_caching", prefix_caching)):
            if not isinstance(value, bool):
                raise HybridInputError(f"{name} must be a bool, got {value!r}")
        if max_positions and max_seq_len > max_positions:
            raise HybridInputError(
                f"max_seq_len ({max_seq_len}) exceeds the model's max_position_embeddings "
                f"({max_positions}); raise model.config.max_position_embeddings to go past it"
            )
        param = next(model.parameters())
        kv_cache_dtype = param.dtype if kv_cache_dtype is None else kv_cache_dtype
        if kv_cache_dtype not in (param.dtype, *FP8_DTYPES):
            raise HybridInputError(
                f"kv_cache_dtype must be None (the model's {param.dtype}), torch.float8_e4m3fn "
                f"or torch.float8_e5m2, got {kv_cache_dtype!r}"
            )
        model.set_attn_implementation("hybrid")
        self.model = model.eval()
        self.max_batch_size, self.max_seq_len, self.prefill_chunk = max_batch_size, max_seq_len, prefill_chunk
        self.prefix_caching = prefix_caching
        self.vocab_size = config.vocab_size
        self.eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if tensor_parallel_group(model) is not None:  # refuses KV heads split across ranks, before any forward
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            kv_heads_per_rank(model, head_dim)
        # Each layer's (Hkv, D, Dv) as its attention passes K and V; the layers that keep state.
        layer_shapes, mixers = check_servable(model)
        for option, on, reason in (
            ("prefix_caching", prefix_caching, "a cached page holds no state to start from"),
            ("cuda_graphs", cuda_graphs, "their state op reads each step's metadata on the host"),
        ):
            if mixers and on:
                raise HybridInputError(
                    f"{option}=True is not supported for a model whose layers keep recurrent or convolution state "
                    f"({mixers[0].name}): {reason}"
                )
        pages_per_request = -(-max_seq_len // page_size)
        self.states, self.state_pages = None, 0
        if mixers:
            self.states = StatePool(
                [[(s.shape, s.dtype) for s in m.states] for m in mixers], max_batch_size, param.device
            )
            # A slot costs the pages that its bytes would fill, so that the budget bounds K/V and state together.
            bytes_per_page = page_size * kv_cache_dtype.itemsize * sum(h * (d + dv) for h, d, dv in layer_shapes)
            self.state_pages = -(-self.states.bytes_per_slot // bytes_per_page)
        self.cache = PagedKVCache(
            num_pages or max_batch_size * (pages_per_request + self.state_pages),
            page_size,
            *layer_shapes[0][:2],
            layer_shapes=layer_shapes,
            max_pages_per_request=pages_per_request,
            dtype=kv_cache_dtype,
            device=param.device,
            reserve_scratch=cuda_graphs,
        )
        graphs_on_cuda = cuda_graphs and param.device.type == "cuda"
        backends = (prefill_backend, decode_backend)
        if graphs_on_cuda:
            backends = tuple("triton" if b == "auto" else b for b in backends)
        self._step_type, self._backends = HybridStep, backends
        self.cuda_graphs = cuda_graphs
        max_tokens = prefill_chunk + max_batch_size  # a prefill budget plus every other request's decode token
        self.token_counts = token_buckets(max_tokens)
        # Room for the padding requests of any step, each holding at most a block-table row's capacity.
        max_padding_requests = -(-max_tokens // (pages_per_request * page_size))
        self.batch_sizes = batch_buckets(max_batch_size + max_padding_requests)
        mode = "reduce-overhead" if graphs_on_cuda else None
        self.forward = (
            torch.compile(self._own_forward(), fullgraph=True, dynamic=True, mode=mode) if compile else self._forward
        )
        self._warm = not compile
        self.compile_cache = compile_cache
        if compile and compile_cache and os.path.exists(compile_cache):
            with open(compile_cache, "rb") as f:
                torch.compiler.load_cache_artifacts(f.read())
        self.device = param.device
        self._group = tensor_parallel_group(model)
        self._ids = count()
        self._requests = {}  # id -> _Request, every request not finished
        self._waiting = deque()  # admission order: preempted requests go back to the front
        self._running = []  # sorted by id, oldest first: the last is the one to preempt
        self._undelivered = []  # step events of step-API requests, produced while `stream` ran the steps
        self._lock = threading.Lock()

    def _own_forward(self):
        """`_forward` on the code object that this generator's model and shapes share (see _FORWARD_CODES)."""
        shapes = (
            tuple((t.shape, t.dtype) for t in self.cache.k_caches + self.cache.v_caches),
            None if self.states is None else tuple((t.shape, t.dtype) for t in self.states.all_states),
            self.cache.max_pages_per_request,
            self._backends,
            self.cuda_graphs,
        )
        fn = HybridGenerator._forward
        code = _FORWARD_CODES.setdefault(self.model, {}).setdefault(shapes, fn.__code__.replace())
        return types.MethodType(types.FunctionType(code, fn.__globals__, fn.__name__), self)

    def _forward(
        self,
        input_ids,
        position_ids,
        logits_index,
        forward_mode: int,
        cu_seqlens_q,
        seq_lens,
        block_table,
        state_slots=None,
    ):
        """input_ids, position_ids: [1, T]; logits_index: [n] token rows to project; state_slots: [B] int32 or None
        (a model without state) -> logits [n, vocab]."""
        step = self._step_type(
            forward_mode,
            cu_seqlens_q,
            seq_lens,
            block_table,
            self.cache.k_caches,
            self.cache.v_caches,
            *self._backends,
            k_scales=self.cache.k_scales,
            v_scales=self.cache.v_scales,
            state_slots=state_slots,
            states=None if self.states is None else self.states.states,
        )
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=logits_index,
            hybrid_step=step,
        )
        return out.logits[0]

    # The serving API: requests come and go between steps.

    def add_request(self, prompt, max_new_tokens: int, **options) -> int:
        """Queues a request; returns its id. prompt: token ids (a list, tuple, 1-D int tensor or array).

        options: do_sample, temperature, top_k, top_p, min_p, seed (this request's own generator; None draws from
        torch's default one), eos_token_id (an int or a list; None: the model's generation_config's, [] for none).
        """
        with self._exclusive():
            request = self._make_request("prompt", prompt, max_new_tokens, **options)
            if self._group is not None:
                _check_same_on_every_rank(_collective_args(request), self._group, self.device)
            return self._queue(request)

    @torch.inference_mode()
    def step(self, stats: GenerationStats | None = None) -> list:
        """Runs one forward step -> [(request id, new token ids, finished)] for the requests that got tokens;
        counts the step in `stats` if given."""
        with self._exclusive():
            events, self._undelivered = self._undelivered + self._step(stats), []
            return events

    def abort(self, request_id: int) -> bool:
        """Drops a request and frees its pages; False when it is not in flight (finished, dropped or unknown)."""
        with self._exclusive():
            request = self._requests.get(request_id)
            if request is not None:
                self._drop(request)
            return request is not None

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # Batch calls on top of it.

    def generate(
        self,
        prompts,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
        eos_token_id=None,
        progress: bool = False,
        stats: GenerationStats | None = None,
    ):
        """prompts: token-id sequences -> the generated ids of each, at most `max_new_tokens` (stops at eos).

        Options as in `add_request`; with an int `seed`, request i of the call is seeded with `seed + i`.
        """
        prompts = _prompt_list(prompts)
        results = [[] for _ in prompts]
        for index, tokens, _ in self.stream(
            prompts,
            max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            eos_token_id=eos_token_id,
            progress=progress,
            stats=stats,
        ):
            results[index] += tokens
        return results

    def stream(
        self,
        prompts,
        max_new_tokens: int,
        seed: int | None = None,
        progress: bool = False,
        stats: GenerationStats | None = None,
        **options,
    ):
        """Yields (index in prompts, new token ids, finished) as the steps produce them; arguments as `generate`'s.

        Steps also advance requests added with `add_request`; their events wait for the next `step()`. Closing the
        iterator early (or an error) drops the call's unfinished requests.
        """
        stats = stats if stats is not None else GenerationStats()
        with self._exclusive(), torch.inference_mode():
            if seed is not None and not _is_int(seed, 0):
                raise HybridInputError(f"seed must be None or a non-negative int, got {seed!r}")
            requests = [
                self._make_request(
                    f"prompts[{i}]", prompt, max_new_tokens, seed=None if seed is None else seed + i, **options
                )
                for i, prompt in enumerate(_prompt_list(prompts))
            ]
            if self._group is not None:
                _check_same_on_every_rank([_collective_args(r) for r in requests], self._group, self.device)
            index = {self._queue(r): i for i, r in enumerate(requests)}
        bar = _progress_bar(sum(r.max_new_tokens for r in requests), progress)
        start = time.perf_counter()
        try:
            while any(rid in self._requests for rid in index):
                with self._exclusive(), torch.inference_mode():
                    events = self._step(stats)
                self._undelivered += [e for e in events if e[0] not in index]
                for rid, tokens, finished in events:
                    if rid in index:
                        if len(requests[index[rid]].generated) == len(tokens):  # its first tokens
                            stats.first_token_seconds.append(time.perf_counter() - start)
                        bar.update(len(tokens))
                        yield index[rid], tokens, finished
        finally:
            with self._lock:
                for rid in index:
                    if rid in self._requests:
                        self._drop(self._requests[rid])
            bar.close()
            stats.seconds += time.perf_counter() - start

    # Requests.

    def _make_request(
        self,
        name,
        prompt,
        max_new_tokens,
        do_sample=False,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        seed=None,
        eos_token_id=None,
    ) -> _Request:
        """A checked request, not yet queued; every HybridInputError names `name` (the prompt) or the option."""
        prompt = _token_list(name, prompt, self.vocab_size)
        if not _is_int(max_new_tokens, 1):
            raise HybridInputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r} (for {name})")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise HybridInputError(
                f"{name}: {len(prompt)} prompt tokens + max_new_tokens = {max_new_tokens} exceed "
                f"max_seq_len = {self.max_seq_len}"
            )
        pages = self._pages(len(prompt) + max_new_tokens) + self.state_pages
        if pages > self.cache.num_pages:
            state = f" and {self.state_pages} for its state" if self.state_pages else ""
            raise HybridInputError(
                f"{name}: {len(prompt)} prompt tokens + max_new_tokens = {max_new_tokens} need "
                f"{pages} pages{state}, more than num_pages = {self.cache.num_pages}"
            )
        if not isinstance(do_sample, bool):
            raise HybridInputError(f"do_sample must be a bool, got {do_sample!r}")
        sampling = _check_sampling(temperature, top_k, top_p, min_p) if do_sample else None
        if seed is not None and not _is_int(seed, 0):
            raise HybridInputError(f"seed must be None or a non-negative int, got {seed!r}")
        generator = None
        if seed is not None and do_sample:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        eos = self.eos_token_id if eos_token_id is None else eos_token_id
        eos = [] if eos is None else [eos] if _is_int(eos, 0) else eos
        if not (isinstance(eos, (list, tuple)) and all(_is_int(t, 0) for t in eos)):
            raise HybridInputError(
                f"eos_token_id must be None, a non-negative int or a list of them, got {eos_token_id!r}"
            )
        return _Request(-1, prompt, int(max_new_tokens), frozenset(map(int, eos)), sampling, generator)

    def _queue(self, request) -> int:
        request.id = next(self._ids)
        self._requests[request.id] = request
        self._waiting.append(request)
        return request.id

    def _drop(self, request):
        """Forgets a request wherever it is; frees its pages."""
        self._requests.pop(request.id, None)
        if request in self._running:
            self._running.remove(request)
            self._free(request.id)
        elif request in self._waiting:
            self._waiting.remove(request)

    def _pages(self, num_tokens) -> int:
        return -(-num_tokens // self.cache.page_size)

    def _held_state(self) -> int:
        """The pages that the running requests' state slots count for."""
        return self.state_pages * len(self._running)

    def _free(self, request_id):
        """Frees a request's pages and state slot."""
        self.cache.free(request_id)
        if self.states is not None:
            self.states.free(request_id)

    @contextmanager
    def _exclusive(self):
        if not self._lock.acquire(blocking=False):
            raise HybridOpsError(
                "this HybridGenerator is running a call in another thread: one generator serves one thread at a time"
            )
        try:
            yield
        finally:
            self._lock.release()

    # Scheduling.

    def _admit(self, stats):
        """Moves waiting requests to running, oldest first, while a slot and the pages for their prefill are free.
        With prefix caching a request starts on the cached pages of its tokens, and waits while a running request's
        prefill computes the next page it could take."""
        promised = sum(self._pages(r.prefill_end) - self._pages(r.cached) for r in self._running) + self._held_state()
        while self._waiting and len(self._running) < self.max_batch_size:
            request = self._waiting[0]
            # Never the last token from the cache: the step that prefills it samples from its logits.
            cached = self.cache.add(
                request.id, request.tokens(0, request.num_tokens - 1) if self.prefix_caching else ()
            )
            need = self._pages(request.num_tokens) - self._pages(cached) + self.state_pages
            # Taking cached pages that no request held lowered num_free_pages already.
            if need > self.cache.num_free_pages - promised or self._computing(request, cached):
                self.cache.free(request.id)
                break
            self._waiting.popleft()
            if self.states is not None:
                self.states.add(request.id)
            request.cached, request.prefill_end = cached, request.num_tokens
            bisect.insort(self._running, request, key=lambda r: r.id)
            promised += need
            if stats is not None:
                stats.cached_tokens += cached

    def _computing(self, request, cached) -> bool:
        """Whether a running request's prefill will compute the page of `request` after its first `cached` tokens
        (the same tokens from the first on), which `request` can then take from the prefix cache."""
        end = cached + self.cache.page_size
        if not self.prefix_caching or end >= request.num_tokens:
            return False
        prefix = request.tokens(0, end)
        return any(r.cached < end <= r.prefill_end and r.tokens(0, end) == prefix for r in self._running)

    def _schedule(self, stats):
        """This step's (request, number of new tokens, prefills?) triples and its mode. Preempts the newest running
        requests until the step's new pages are free."""
        while True:
            budget, batch = self.prefill_chunk, []
            for request in self._running:
                if request.cached < request.prefill_end:
                    n = min(budget, request.prefill_end - request.cached)
                    budget -= n
                    if n:
                        batch.append((request, n, True))
                else:
                    batch.append((request, 1, False))
            need = sum(self._pages(r.cached + n) - self._pages(r.cached) for r, n, _ in batch)
            if need <= self.cache.num_free_pages - self._held_state():
                break
            self._preempt(self._running[-1], stats)
        prefills = sum(prefill for _, _, prefill in batch)
        if prefills == 0:
            mode = ForwardMode.DECODE
        elif prefills == len(batch):
            mode = ForwardMode.EXTEND
        else:
            mode = ForwardMode.MIXED
        return batch, mode

    def _preempt(self, request, stats):
        """Frees a running request's pages and state and queues it first: its prompt and tokens are prefilled again
        (so its state is computed again from them)."""
        self._running.remove(request)
        self._free(request.id)
        self._waiting.appendleft(request)
        if stats is not None:
            stats.preemptions += 1

    def _step(self, stats) -> list:
        """One forward step over the running requests -> [(id, new tokens, finished)]."""
        if not self._warm:
            self._warm_up()
        self._admit(stats)
        if not self._running:
            return []
        batch, mode = self._schedule(stats)
        try:
            counts = [n for _, n, _ in batch]
            ends = list(accumulate(counts))
            chunks = [request.tokens(request.cached, request.cached + n) for request, n, _ in batch]
            tokens, positions, sampled, rows = [t for chunk in chunks for t in chunk], [], [], []
            for (request, n, _), end in zip(batch, ends):
                positions += range(request.cached, request.cached + n)
                if request.cached + n == request.num_tokens:  # the step reaches its last token: it samples
                    sampled.append(request)
                    rows.append(end - 1)
            # At least one row even when no request samples (a long prompt mid-chunk): Dynamo gives size 0 a graph
            # of its own, which a later run could meet for the first time.
            logits = self._run([r.id for r, _, _ in batch], counts, tokens, positions, rows or [ends[-1] - 1], mode)
            if self.prefix_caching:  # their K/V are written: the pages they fill can serve later requests
                for (request, _, _), chunk in zip(batch, chunks):
                    self.cache.register_tokens(request.id, chunk)
            next_ids = _next_tokens(logits[: len(rows)], sampled)
            if self._group is not None:
                dist.broadcast(next_ids, group=self._group, group_src=0)
            events = []
            for request, n, prefill in batch:
                request.cached += n
                if prefill and stats is not None:
                    stats.prompt_tokens += n
            for request, token in zip(sampled, next_ids.tolist()):
                request.generated.append(token)
                finished = len(request.generated) >= request.max_new_tokens or token in request.eos
                if finished:
                    self._drop(request)
                events.append((request.id, [token], finished))
        except BaseException:
            for request, _, _ in batch:
                self._drop(request)
            raise
        if stats is not None:
            stats.steps[mode.name] += 1
            stats.generated_tokens += len(sampled)
        return events

    def _run(self, request_ids, counts, tokens, positions, rows, mode):
        """Grows the requests in the cache and runs the forward -> logits [len(rows), vocab]."""
        meta = self.cache.step(request_ids, counts, mode)
        num_rows = len(rows)
        if self.cuda_graphs:
            meta, tokens, positions, rows = self._pad(meta, counts, tokens, positions, rows)
            torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are read: graphs may reuse them
        logits = self.forward(
            torch.tensor([tokens], device=self.device),
            torch.tensor([positions], device=self.device),
            torch.tensor(rows, device=self.device),
            int(mode),
            *meta.metadata,
            None if self.states is None else self.states.slots(request_ids),
        )
        return logits[:num_rows]

    def _warm_up(self):
        """Compiles the graphs Dynamo specialises for sizes 1 (one request, one token, one logits row), which a run
        might otherwise first meet deep into serving. Writes only pages it frees again."""
        for counts, rows, mode in _WARM_UP_STEPS:
            if (
                len(counts) > self.max_batch_size
                or max(counts) > self.max_seq_len
                or sum(map(self._pages, counts)) + self.state_pages * len(counts) > self.cache.num_pages
            ):
                continue  # a step no run can take either
            ids = [("warm-up", i) for i in range(len(counts))]
            for rid in ids:
                self.cache.add(rid)
                if self.states is not None:
                    self.states.add(rid)
            try:
                positions = [p for n in counts for p in range(n)]
                self._run(ids, counts, [0] * len(positions), positions, rows, mode)
            finally:
                for rid in ids:
                    self._free(rid)
        self._warm = True
        artifacts = torch.compiler.save_cache_artifacts() if self.compile_cache else None
        if artifacts is not None:
            with open(self.compile_cache, "wb") as f:
                f.write(artifacts[0])

    def _pad(self, batch, counts, tokens, positions, rows):
        """The step padded to buckets: padding requests over the scratch page (`buckets.pad_batch`), their tokens
        id 0 at position 0, and the logits rows repeated up to the padded batch size (only the first len(rows) are
        sampled). counts: the real requests' token counts; tokens, positions, rows: host lists."""
        capacity = self.cache.max_pages_per_request * self.cache.page_size
        pad = padding_q_lens(counts, batch.forward_mode, self.batch_sizes, self.token_counts, capacity)
        batch = pad_batch(batch, pad, self.cache.scratch_page, self.cache.page_size)
        extra = [0] * sum(pad)
        return batch, tokens + extra, positions + extra, rows + rows[-1:] * (batch.batch_size - len(rows))


def _max_positions(config) -> int | None:
    """The model's max_position_embeddings, None for no limit (none, or -1 as XLNet's says)."""
    value = getattr(config, "max_position_embeddings", None)
    return value if _is_int(value, 1) else None


def _is_int(value, low: int) -> bool:
    """An int (numpy's included, bool not) of at least `low`."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _token_list(name, prompt, vocab_size) -> list:
    """prompt: a list or tuple of ints, a 1-D int tensor or numpy array -> a list of ids in [0, vocab_size)."""
    if not isinstance(prompt, (list, tuple)) and hasattr(prompt, "tolist"):  # a tensor or an array
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise HybridInputError(f"{name} must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise HybridInputError(f"{name} is empty: a prompt needs at least one token")
    for position, token in enumerate(prompt):
        if not (_is_int(token, 0) and token < vocab_size):
            raise HybridInputError(f"{name}[{position}] must be a token id in [0, {vocab_size}), got {token!r}")
    return [int(t) for t in prompt]


def _prompt_list(prompts) -> list:
    """prompts: any iterable of prompts (not a string) -> a list."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise HybridInputError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    return list(prompts)


def _check_sampling(temperature, top_k, top_p, min_p) -> _Sampling:
    if not (_is_real(temperature) and temperature > 0):
        raise HybridInputError(f"temperature must be a finite number > 0 when do_sample=True, got {temperature!r}")
    if not _is_int(top_k, 0):
        raise HybridInputError(f"top_k must be a non-negative int (0: no limit), got {top_k!r}")
    if not (_is_real(top_p) and 0 < top_p <= 1):
        raise HybridInputError(f"top_p must be in (0, 1], got {top_p!r}")
    if not (_is_real(min_p) and 0 <= min_p <= 1):
        raise HybridInputError(f"min_p must be in [0, 1], got {min_p!r}")
    return _Sampling(float(temperature), int(top_k), float(top_p), float(min_p))


def _collective_args(request):
    """What every rank of a tensor-parallel group must agree on (not the seed: rank 0's samples are broadcast)."""
    return request.prompt, request.max_new_tokens, request.sampling, sorted(request.eos)


def _check_same_on_every_rank(args, group, device):
    """Raises on every rank alike unless `args` are equal on all ranks of `group`: ranks given different prompts
    would take different steps and pair up mismatched collectives."""
    digest = int.from_bytes(hashlib.sha256(repr(args).encode()).digest()[:7], "little")
    highest = torch.tensor([digest, -digest], device=device)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    if highest.tolist() != [digest, -digest]:
        raise HybridInputError(
            "prompts, max_new_tokens and the sampling options must be the same on every rank of "
            "the tensor-parallel group"
        )


def _next_tokens(logits, requests):
    """logits: [n, vocab], one row per request -> [n] token ids: greedy, or sampled with each request's options."""
    next_ids = logits.argmax(-1)
    for i, request in enumerate(requests):
        if request.sampling is not None:
            next_ids[i] = _sample(logits[i : i + 1], request.sampling, request.generator)[0]
    return next_ids


def _sample(logits, sampling: _Sampling, generator):
    """logits: [n, vocab] -> [n] token ids drawn as transformers' warpers do, in their order: temperature, top-k,
    top-p (the smallest set of tokens whose probability reaches top_p), min-p (tokens of at least min_p times the
    top token's probability). generator None: torch's default generator."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ascending, order = logits.sort(-1)
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        drop[:, -1] = False  # the top token always stays
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if sampling.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress_bar(total, enabled):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc="generating")


def generate(model, prompts, max_new_tokens: int, **kwargs):
    """One-call generation: `HybridGenerator(model, ...)` with sizes fitted to `prompts`, then `.generate`.

    Keyword arguments of `HybridGenerator` (max_batch_size, max_seq_len, num_pages, page_size, prefill_chunk,
    compile, backends, cuda_graphs, compile_cache, prefix_caching, kv_cache_dtype) go to it, the rest to `generate`.
    Reuse a
    `HybridGenerator` to keep its compiled forward across calls.
    """
    init_keys = (
        "max_batch_size",
        "max_seq_len",
        "num_pages",
        "page_size",
        "prefill_chunk",
        "compile",
        "prefill_backend",
        "decode_backend",
        "cuda_graphs",
        "compile_cache",
        "prefix_caching",
        "kv_cache_dtype",
    )
    init = {k: kwargs.pop(k) for k in init_keys if k in kwargs}
    prompts = _prompt_list(prompts)
    max_positions = _max_positions(model.config.get_text_config()) or math.inf
    if _is_int(max_new_tokens, 1) and all(hasattr(p, "__len__") for p in prompts):
        # At most max_position_embeddings: longer requests are refused, not given a cache they cannot use.
        init.setdefault("max_seq_len", min(max((len(p) for p in prompts), default=1) + max_new_tokens, max_positions))
    init.setdefault("max_batch_size", max(len(prompts), 1))
    return HybridGenerator(model, **init).generate(prompts, max_new_tokens, **kwargs)
