"""Continuous-batching generation for transformers models through the hybrid ops: `HybridGenerator` and `generate`.

A generator joins the parts of this package: the `Scheduler` (which requests run in a step, with how many tokens:
admission by free pages, chunked prefill, preemption, prefix caching) over a `KVCacheManager`, the `ModelRunner` (one
compiled forward for every step and mode) and the sampler (`SamplingParams`, transformers' warpers). The API:
`generate(prompts, ...)` returns every request's tokens, `stream(prompts, ...)` yields them step by step, and
`add_request` / `step` / `abort` serve requests that come and go (docs/generation.md).
"""

import inspect
import logging
import math
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from ..errors import HybridInputError, HybridOpsError
from .cache_manager import KVCacheManager, num_snapshots, paged_cache, state_pool
from .checks import (
    check_compile_options,
    check_flags,
    check_model_sizes,
    check_sizes,
    is_int,
    max_positions,
    prompt_list,
    token_list,
)
from .runner import ModelRunner
from .sampler import SamplingParams, next_tokens
from .scheduler import Request, Scheduler

log = logging.getLogger(__name__)


@dataclass
class GenerationStats:
    steps: Counter = field(default_factory=Counter)  # ForwardMode name -> steps
    prompt_tokens: int = 0  # prefilled tokens, recomputed ones included
    prefix_cache_hit_tokens: int = 0  # tokens taken from the prefix cache at admission instead of prefilled
    generated_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0  # generating, the compiles of the first run left out
    first_token_seconds: list = field(default_factory=list)  # per request, from the start of the run (compiled)
    compile_seconds: float = 0.0  # the compiled forward's warm-up, in a generator's first run

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


class HybridGenerator:
    """Generates for a causal LM whose attention runs through `torch.ops.hybrid.attn`.

    The paged cache holds `num_pages` pages of `page_size` tokens (default: `max_batch_size` requests of
    `max_seq_len` tokens, the worst case); at most `max_batch_size` requests run at once, each of at most
    `max_seq_len` tokens (prompt + new tokens; default and limit: the model's `max_position_embeddings`, capped at
    1024 by default); a step prefills at most `prefill_chunk` prompt tokens. Requests are admitted while the cache has
    free pages for their prompts; when a step needs more pages than are free, the newest running request is
    preempted and later prefilled again (`Scheduler`), so any budget gives every request the tokens of an
    unconstrained run. The cache and the compiled forward are kept across calls, so later runs neither allocate nor
    recompile; the first step of a compiled generator also compiles the graphs of one-request and one-token steps,
    which Dynamo specialises, so no later step compiles. With `compile_cache=PATH` the compiled artifacts
    (`torch.compiler.save_cache_artifacts`) are written to PATH after that first step and loaded from it at
    construction, so a later process with the same model, sizes and torch skips Inductor's code generation.
    `cuda_graphs=True` pads every step to a bucket of requests and tokens (padding requests write only the cache's
    scratch page) and, on CUDA, compiles with `mode="reduce-overhead"`; on other devices the same padding runs
    under a plain compile. The backends must then be CUDA-graph safe: on CUDA "auto" means "triton" here (FlashInfer
    plans on the host, and this forward does not plan outside its graphs). `runner` (a `ModelRunner`) holds the
    forward, `scheduler` (a `Scheduler`) the requests, `cache` the `PagedKVCache`.

    `prefix_caching=True` keeps the K/V of every full page of tokens in the cache, keyed by its tokens and all before
    it (`PagedKVCache`), until the pages are needed: an admitted request starts on the cached pages of its prompt
    (and of its tokens so far, after a preemption) and prefills only the rest, at least its last token, whose logits
    it samples from. A request waits while a running request's prefill computes the next page it could take, so
    requests sharing a prompt prefix compute it once. Greedy and seeded tokens are those of `prefix_caching=False`
    (tested); `GenerationStats.prefix_cache_hit_tokens` counts the tokens not prefilled. It is off by default because
    it changes which step each request samples in: unseeded sampling, which draws from torch's default generator in
    step order, would then depend on what earlier calls left in the cache.

    `compile_options` are Inductor's config options for the compiled forward (`torch._inductor.config`). The default
    (`runner.default_compile_options`) freezes the weights on the CPU: each compiled graph (one for most steps, a few
    more for the sizes Dynamo specialises) holds its own copy of the linear layers' weights, prepacked for oneDNN,
    which makes a decode step's products 2-4x faster and costs that memory (the 8-layer, 1024-wide fp32 model of
    docs/benchmarks.md: 2.5 GB resident against 1.0 GB); the weights are read when a graph compiles, so a later change
    to them is not seen. Inductor caches no graph holding prepacked weights, and cannot freeze a tensor-parallel
    model's, so with `compile_cache` or `tp_plan` the default is `{}`, which keeps the weights as they are.

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
    preempted request's state is dropped and computed again from its tokens. With `prefix_caching`, prefill chunks end
    on page boundaries, the state after each chunk's last page is kept as a snapshot (`2 * max_batch_size` of them,
    beside the budget, the least recently used replaced), and a request starts on cached pages only up to the last
    one with a snapshot. The layers of the families in `integrations/layers.py` run in every mode, under
    `cuda_graphs` (padding requests hold no slot) and in packages; those served through `hybrid::mixer` (MiniMax,
    RecurrentGemma, Zaya) refuse prefix caching and `cuda_graphs`.

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
        compile_options: dict | None = None,
    ):
        from ..integrations.servable import check_servable
        from ..integrations.transformers import kv_heads_per_rank, tensor_parallel_group

        config = model.config.get_text_config()
        max_seq_len, kv_cache_dtype = check_model_sizes(
            model, max_seq_len, kv_cache_dtype, max_batch_size=max_batch_size, page_size=page_size,
            prefill_chunk=prefill_chunk, num_pages=num_pages,
        )  # fmt: skip
        check_flags(compile=compile, cuda_graphs=cuda_graphs, prefix_caching=prefix_caching)
        check_compile_options(compile_options)
        param = next(model.parameters())
        model.set_attn_implementation("hybrid")
        self.model = model.eval()
        if tensor_parallel_group(model) is not None:  # refuses KV heads split across ranks, before any forward
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            kv_heads_per_rank(model, head_dim)
        # Each layer's (Hkv, D, Dv) as its attention passes K and V; the layers that keep state.
        layer_shapes, mixers = check_servable(model)
        per_request = [m for m in mixers if m.family is None]
        for option, on, reason in (
            ("prefix_caching", prefix_caching, "keeps no state at page boundaries"),
            ("cuda_graphs", cuda_graphs, "reads each step's metadata on the host"),
        ):
            if per_request and on:
                raise HybridInputError(
                    f"{option}=True is not supported for a model whose layers keep recurrent or convolution state "
                    f"({per_request[0].name}): its state op (hybrid::mixer) {reason}"
                )
        snapshots = num_snapshots(max_batch_size, prefix_caching)
        states, state_pages = state_pool(
            mixers, layer_shapes, max_batch_size, page_size, kv_cache_dtype, param.device, snapshots
        )
        pages_per_request = -(-max_seq_len // page_size)
        # The scratch page of padding requests: cuda_graphs', and a compiled CPU step's of one token (ModelRunner's
        # pad_one_token), which hybrid::mixer's layers cannot take.
        scratch = cuda_graphs or (compile and param.device.type == "cpu" and not per_request)
        cache = paged_cache(
            layer_shapes, max_batch_size, pages_per_request, page_size,
            num_pages or max_batch_size * (pages_per_request + state_pages), kv_cache_dtype, param.device, scratch,
        )  # fmt: skip
        runner = ModelRunner(
            model,
            cache,
            max_batch_size,
            max_seq_len,
            prefill_chunk,
            compile=compile,
            prefill_backend=prefill_backend,
            decode_backend=decode_backend,
            cuda_graphs=cuda_graphs,
            compile_cache=compile_cache,
            states=states,
            compile_options=compile_options,
        )
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self._serve(runner, prefix_caching, config.vocab_size, eos_token_id, states, state_pages)

    @classmethod
    def from_package(
        cls,
        path,
        *,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        prefill_chunk: int | None = None,
        num_pages: int | None = None,
        cuda_graphs: bool = False,
        prefix_caching: bool = False,
        kv_cache_dtype=None,
        config=None,
    ):
        """A generator whose every step runs through the package at `path` (`hybrid_ops.package`), with the same
        scheduler, sampling, page budget, prefix caching and fp8 cache; nothing traced or compiled, no transformers
        and no model built in this process. The sizes default to the package's and may be smaller; num_pages is free;
        cuda_graphs=True pads steps to buckets and, on CUDA, replays a CUDA graph per bucket. A package of another
        torch, hybrid_ops or op schema, or, when given, of another `config` (a transformers config or its
        `to_dict()`) or `kv_cache_dtype`, is refused with a `HybridInputError` naming the difference, unloaded.
        """
        from .packaged import load

        check_sizes(None, 1, num_pages=num_pages)
        check_flags(cuda_graphs=cuda_graphs, prefix_caching=prefix_caching)
        sizes = (max_batch_size, max_seq_len, prefill_chunk, num_pages)
        info, runner, states, state_pages = load(path, config, kv_cache_dtype, *sizes, cuda_graphs, prefix_caching)
        generator = cls.__new__(cls)
        generator.model = None
        generator._serve(runner, prefix_caching, info.vocab_size, info.eos_token_id, states, state_pages)
        return generator

    def _serve(self, runner, prefix_caching, vocab_size, eos_token_id, states=None, state_pages=0):
        """Starts serving through `runner` (a `StepRunner` over its cache and, for a hybrid model, `states`, whose
        slots count as `state_pages` pages each)."""
        self.runner, self.cache, self.device = runner, runner.cache, runner.device
        self.max_batch_size, self.max_seq_len = runner.max_batch_size, runner.max_seq_len
        self.vocab_size, self.eos_token_id = vocab_size, eos_token_id
        self.states, self.state_pages = states, state_pages
        kv = KVCacheManager(self.cache, prefix_caching, states, state_pages)
        self.scheduler = Scheduler(kv, self.max_batch_size, runner.prefill_chunk)
        self._undelivered = []  # step events of step-API requests, produced while `stream` ran the steps
        self._lock = threading.Lock()

    # The serving API: requests come and go between steps.

    def add_request(self, prompt, max_new_tokens: int, **options) -> int:
        """Queues a request; returns its id. prompt: token ids (a list, tuple, 1-D int tensor or array); options:
        the fields of `SamplingParams` (do_sample, temperature, top_k, top_p, min_p, seed, eos_token_id)."""
        with self._exclusive():
            request = self._make_request("prompt", prompt, max_new_tokens, SamplingParams(**options))
            self.runner.check_same_on_every_rank(_collective_args(request))
            return self.scheduler.add(request)

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
            return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # Batch calls on top of it.

    def generate(
        self, prompts, max_new_tokens: int, *, progress: bool = False, stats: GenerationStats | None = None, **options
    ):
        """prompts: token-id sequences -> the generated ids of each, at most `max_new_tokens` (stops at eos).

        options: as `add_request`'s; with an int `seed`, request i of the call is seeded with `seed + i`.
        progress: a tqdm bar of the tokens; stats: a `GenerationStats` that the call adds to.
        """
        prompts = prompt_list(prompts)
        results = [[] for _ in prompts]
        for index, tokens, _ in self.stream(prompts, max_new_tokens, progress=progress, stats=stats, **options):
            results[index] += tokens
        return results

    def stream(
        self, prompts, max_new_tokens: int, *, progress: bool = False, stats: GenerationStats | None = None, **options
    ):
        """Yields (index in prompts, new token ids, finished) as the steps produce them; arguments as `generate`'s.

        Steps also advance requests added with `add_request`; their events wait for the next `step()`. Closing the
        iterator early (or an error) drops the call's unfinished requests.
        """
        stats = stats if stats is not None else GenerationStats()
        with self._exclusive(), torch.inference_mode():
            sampling = SamplingParams(**options)
            requests = [
                self._make_request(
                    f"prompts[{i}]",
                    prompt,
                    max_new_tokens,
                    sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i),
                )
                for i, prompt in enumerate(prompt_list(prompts))
            ]
            self.runner.check_same_on_every_rank([_collective_args(r) for r in requests])
            index = {self.scheduler.add(r): i for i, r in enumerate(requests)}
        warm = self.runner.warmed_up
        bar = _progress_bar(sum(r.max_new_tokens for r in requests), progress, "generating" if warm else "compiling")
        if not warm:
            with self._exclusive(), torch.inference_mode():
                self._warm_up(stats, bar)
        start = time.perf_counter()
        try:
            while any(rid in self.scheduler.requests for rid in index):
                with self._exclusive(), torch.inference_mode():
                    events = self._step(stats)
                self._undelivered += [e for e in events if e[0] not in index]
                for rid, tokens, finished in events:
                    if rid in index:
                        if len(requests[index[rid]].generated) == len(tokens):  # its first tokens
                            stats.first_token_seconds.append(time.perf_counter() - start)
                        if bar is not None:
                            bar.update(len(tokens))
                        yield index[rid], tokens, finished
        finally:
            with self._lock:
                for rid in index:
                    self.scheduler.abort(rid)
            if bar is not None:
                bar.close()
            stats.seconds += time.perf_counter() - start

    def _make_request(self, name, prompt, max_new_tokens, sampling: SamplingParams) -> Request:
        """A checked request, not yet queued; every HybridInputError names `name` (the prompt) or the option."""
        prompt = token_list(name, prompt, self.vocab_size)
        if not is_int(max_new_tokens, 1):
            raise HybridInputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r} (for {name})")
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise HybridInputError(
                f"{name}: {len(prompt)} prompt tokens + max_new_tokens = {max_new_tokens} exceed "
                f"max_seq_len = {self.max_seq_len}"
            )
        pages = self.scheduler.kv.request_pages(len(prompt) + max_new_tokens)
        if pages > self.cache.num_pages:
            state = f" ({self.state_pages} for its state)" if self.state_pages else ""
            raise HybridInputError(
                f"{name}: {len(prompt)} prompt tokens + max_new_tokens = {max_new_tokens} need "
                f"{pages} pages{state}, more than num_pages = {self.cache.num_pages}"
            )
        stop_token_ids = sampling.stop_token_ids(self.eos_token_id)
        return Request(prompt, int(max_new_tokens), sampling, stop_token_ids, sampling.generator(self.device))

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

    def _warm_up(self, stats, bar=None) -> None:
        """The runner's warm-up, which compiles the forward: each step's shapes said on the bar (its rate then starts
        from zero) or logged, its time counted in `stats.compile_seconds`."""

        def announce(shapes):
            if bar is not None:
                bar.set_description(f"compiling ({shapes})")
            log.info("compiling the forward for a step of %s", shapes)

        start = time.perf_counter()
        self.runner.warm_up(announce)
        seconds = time.perf_counter() - start
        if stats is not None:
            stats.compile_seconds += seconds
        log.info("compiled in %.1f s", seconds)
        if bar is not None:
            bar.set_description("generating", refresh=False)
            bar.reset()  # the rate from here on: generated tokens only
            bar.write(f"hybrid_ops: compiled the forward in {seconds:.0f} s", file=sys.stderr)

    def _step(self, stats) -> list:
        """One forward step over the running requests -> [(id, new tokens, finished)]."""
        if not self.runner.warmed_up:
            self._warm_up(stats)
        step = self.scheduler.schedule(stats)
        if step is None:
            return []
        try:
            logits = self.runner.run(
                step.batch, step.num_new_tokens, step.token_ids, step.positions, step.logits_rows, step.state_slots
            )
            sampled = step.sampled
            next_ids = next_tokens(logits, [r.sampling for r in sampled], [r.generator for r in sampled])
            self.runner.broadcast_from_rank_0(next_ids)
            return self.scheduler.update(step, next_ids.tolist(), stats)
        except BaseException:
            self.scheduler.abort_step(step.requests)
            raise


def _collective_args(request: Request):
    """What every rank of a tensor-parallel group must agree on (not the seed: rank 0's samples are broadcast)."""
    sampling = replace(request.sampling, seed=None, eos_token_id=None) if request.sampling.do_sample else None
    return request.prompt, request.max_new_tokens, sampling, sorted(request.stop_token_ids)


def _progress_bar(total, enabled, description):
    """A tqdm bar of `total` tokens, or none (tqdm is imported only for a bar)."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="tok", desc=description)


def generate(model, prompts, max_new_tokens: int, **options):
    """One call: a `HybridGenerator(model, ...)` sized for `prompts`, then its `generate(prompts, max_new_tokens,
    ...)`. A keyword that names a parameter of `HybridGenerator` goes to it, any other to `HybridGenerator.generate`.
    Unless given, max_batch_size is the number of prompts and max_seq_len the longest prompt + max_new_tokens, at most
    the model's max_position_embeddings. Keep a `HybridGenerator` to keep its compiled forward across calls.
    """
    constructor = inspect.signature(HybridGenerator.__init__).parameters
    init = {name: options.pop(name) for name in list(options) if name in constructor}
    prompts = prompt_list(prompts)
    limit = max_positions(model.config.get_text_config()) or math.inf
    if is_int(max_new_tokens, 1) and all(hasattr(p, "__len__") for p in prompts):
        # At most max_position_embeddings: longer requests are refused, not given a cache they cannot use.
        init.setdefault("max_seq_len", min(max((len(p) for p in prompts), default=1) + max_new_tokens, limit))
    init.setdefault("max_batch_size", max(len(prompts), 1))
    return HybridGenerator(model, **init).generate(prompts, max_new_tokens, **options)
