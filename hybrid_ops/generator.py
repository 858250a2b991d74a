"""Continuous-batching generation for transformers models through the hybrid ops.

Every step packs the running requests into one sequence: prompts are prefilled in chunks, generated tokens are
decoded one per request, and the two mix (MIXED) when new requests join while others decode. Finished requests
free their pages and waiting ones take their place. One compiled forward (`fullgraph=True, dynamic=True`) serves
every step and mode. With `cuda_graphs=True` every step is padded to a bucket (`hybrid_ops.buckets`) and, on CUDA,
the forward is compiled with `mode="reduce-overhead"`: one CUDA graph per bucket and mode, not per batch.
"""

import hashlib
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.distributed as dist

from .buckets import batch_buckets, pad_batch, padding_q_lens, token_buckets
from .cache import PagedKVCache
from .errors import HybridInputError
from .modes import ForwardMode


@dataclass
class _Request:
    index: int  # position in the caller's prompt list
    prompt: list
    generated: list = field(default_factory=list)
    prefilled: int = 0  # prompt tokens in the cache


@dataclass
class GenerationStats:
    steps: Counter = field(default_factory=Counter)  # ForwardMode name -> steps
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: list = field(default_factory=list)  # per request, from the start of the run

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


class HybridGenerator:
    """Generates for a causal LM whose attention runs through `torch.ops.hybrid.attn`.

    The paged cache holds `max_batch_size` requests of up to `max_seq_len` tokens; it and the compiled forward are
    kept across `generate` calls, so later runs neither allocate nor recompile.
    `cuda_graphs=True` pads every step to a bucket of requests and tokens (padding requests write only the cache's
    scratch page) and, on CUDA, compiles with `mode="reduce-overhead"`; on other devices the same padding runs
    under a plain compile. The backends must then be CUDA-graph safe: on CUDA "auto" means "triton" here (FlashInfer
    plans on the host, and this forward does not plan outside its graphs).

    A model sharded with `tp_plan` runs on every rank of its group with the same prompts (checked): the cache holds the
    rank's own KV heads, the scheduling depends only on the tokens, and rank 0's sampled tokens are broadcast.
    """

    def __init__(self, model, max_batch_size: int = 8, max_seq_len: int = 1024, page_size: int = 16,
                 prefill_chunk: int = 256, compile: bool = True, prefill_backend: str = "auto",
                 decode_backend: str = "auto", cuda_graphs: bool = False):
        from .integrations.transformers import HybridStep, check_servable, kv_heads_per_rank, tensor_parallel_group

        config = model.config.get_text_config()
        model.set_attn_implementation("hybrid")
        self.model = model.eval()
        self.max_batch_size, self.max_seq_len, self.prefill_chunk = max_batch_size, max_seq_len, prefill_chunk
        if tensor_parallel_group(model) is not None:  # refuses KV heads split across ranks, before any forward
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            kv_heads_per_rank(model, head_dim)
        layer_shapes = check_servable(model)  # each layer's (Hkv, D, Dv) as its attention passes K and V
        pages_per_request = -(-max_seq_len // page_size)
        param = next(model.parameters())
        self.cache = PagedKVCache(max_batch_size * pages_per_request, page_size, *layer_shapes[0][:2],
                                  layer_shapes=layer_shapes, max_pages_per_request=pages_per_request,
                                  dtype=param.dtype, device=param.device, reserve_scratch=cuda_graphs)
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
        self.forward = torch.compile(self._forward, fullgraph=True, dynamic=True, mode=mode) if compile \
            else self._forward
        self.device = param.device
        self._group = tensor_parallel_group(model)

    def _forward(self, input_ids, position_ids, logits_index, forward_mode: int, cu_seqlens_q, seq_lens,
                 block_table):
        """input_ids, position_ids: [1, T]; logits_index: [n] token rows to project -> logits [n, vocab]."""
        step = self._step_type(forward_mode, cu_seqlens_q, seq_lens, block_table, self.cache.k_caches,
                               self.cache.v_caches, *self._backends)
        out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                         logits_to_keep=logits_index, hybrid_step=step)
        return out.logits[0]

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, seed: int | None = None, eos_token_id: int | None = None, progress: bool = False,
                 stats: GenerationStats | None = None):
        """prompts: token-id lists -> the generated ids of each, at most `max_new_tokens` (stops at eos)."""
        for i, prompt in enumerate(prompts):
            if not prompt or len(prompt) + max_new_tokens > self.max_seq_len:
                raise HybridInputError(f"prompts[{i}] must have 1 to max_seq_len - max_new_tokens = "
                                       f"{self.max_seq_len - max_new_tokens} tokens, got {len(prompt)}")
        if max_new_tokens < 1:
            raise HybridInputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if self._group is not None:
            _check_same_on_every_rank((prompts, max_new_tokens, do_sample, temperature, top_k, eos_token_id),
                                      self._group, self.device)
        stats = stats if stats is not None else GenerationStats()
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(seed)
        waiting = deque(_Request(i, list(p)) for i, p in enumerate(prompts))
        running, results = [], [None] * len(prompts)
        bar = _progress_bar(len(prompts) * max_new_tokens, progress)
        start = time.perf_counter()
        while waiting or running:
            while waiting and len(running) < self.max_batch_size:
                request = waiting.popleft()
                self.cache.add(request.index)
                running.append(request)
            batch, mode, sampled = self._schedule(running)
            tokens, positions, counts = [], [], []
            for request, chunk in batch:
                base = request.prefilled if chunk is not None else len(request.prompt) + len(request.generated) - 1
                new = chunk if chunk is not None else request.generated[-1:]
                tokens += new
                positions += range(base, base + len(new))
                counts.append(len(new))
            meta = self.cache.step([r.index for r, _ in batch], counts, mode)
            ends = list(accumulate(counts))
            # At least one row even when no request samples (a long prompt mid-chunk): Dynamo gives size 0 a graph
            # of its own, which a later run could meet for the first time.
            rows = [ends[i] - 1 for i, s in enumerate(sampled) if s] or [ends[-1] - 1]
            num_rows = len(rows)
            if self.cuda_graphs:
                meta, tokens, positions, rows = self._pad(meta, counts, tokens, positions, rows)
                torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are read: graphs may reuse them
            logits = self.forward(torch.tensor([tokens], device=self.device),
                                  torch.tensor([positions], device=self.device),
                                  torch.tensor(rows, device=self.device), int(mode), *meta.metadata)
            next_ids = _sample(logits[:num_rows], do_sample, temperature, top_k, generator)
            if self._group is not None:
                dist.broadcast(next_ids, group=self._group, group_src=0)
            next_tokens = iter(next_ids.tolist())
            stats.steps[mode.name] += 1
            for request, chunk in batch:
                if chunk is not None:
                    request.prefilled += len(chunk)
                    stats.prompt_tokens += len(chunk)
            for request in [r for (r, _), s in zip(batch, sampled) if s]:
                token = next(next_tokens)
                request.generated.append(token)
                if len(request.generated) == 1:
                    stats.first_token_seconds.append(time.perf_counter() - start)
                stats.generated_tokens += 1
                bar.update(1)
                if len(request.generated) >= max_new_tokens or token == eos_token_id:
                    results[request.index] = request.generated
                    self.cache.free(request.index)
                    running.remove(request)
        bar.close()
        stats.seconds += time.perf_counter() - start
        return results

    def _pad(self, batch, counts, tokens, positions, rows):
        """The step padded to buckets: padding requests over the scratch page (`buckets.pad_batch`), their tokens
        id 0 at position 0, and the logits rows repeated up to the padded batch size (only the first len(rows) are
        sampled). counts: the real requests' token counts; tokens, positions, rows: host lists."""
        capacity = self.cache.max_pages_per_request * self.cache.page_size
        pad = padding_q_lens(counts, batch.forward_mode, self.batch_sizes, self.token_counts, capacity)
        batch = pad_batch(batch, pad, self.cache.scratch_page, self.cache.page_size)
        extra = [0] * sum(pad)
        return batch, tokens + extra, positions + extra, rows + rows[-1:] * (batch.batch_size - len(rows))

    def _schedule(self, running):
        """This step's (request, prompt chunk or None for a decode token) pairs, its mode, and which are sampled."""
        budget = self.prefill_chunk
        batch, sampled = [], []
        for request in running:
            if request.prefilled < len(request.prompt):
                if budget == 0:
                    continue
                chunk = request.prompt[request.prefilled : request.prefilled + budget]
                budget -= len(chunk)
                batch.append((request, chunk))
                sampled.append(request.prefilled + len(chunk) == len(request.prompt))
            else:
                batch.append((request, None))
                sampled.append(True)
        prefills = sum(chunk is not None for _, chunk in batch)
        if prefills == 0:
            mode = ForwardMode.DECODE
        elif prefills == len(batch):
            mode = ForwardMode.EXTEND
        else:
            mode = ForwardMode.MIXED
        return batch, mode, sampled


def _check_same_on_every_rank(args, group, device):
    """Raises on every rank alike unless `args` are equal on all ranks of `group`: ranks given different prompts
    would take different steps and pair up mismatched collectives."""
    digest = int.from_bytes(hashlib.sha256(repr(args).encode()).digest()[:7], "little")
    highest = torch.tensor([digest, -digest], device=device)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=group)
    if highest.tolist() != [digest, -digest]:
        raise HybridInputError("prompts, max_new_tokens and the sampling options must be the same on every rank of "
                               "the tensor-parallel group")


def _sample(logits, do_sample, temperature, top_k, generator):
    """logits: [n, vocab] -> [n] token ids; greedy, or sampled with temperature and top-k from `generator`."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
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

    Keyword arguments of `HybridGenerator` (max_batch_size, page_size, prefill_chunk, compile, backends,
    cuda_graphs) go to it, the rest to `generate`. Reuse a `HybridGenerator` to keep its compiled forward across calls.
    """
    init_keys = ("max_batch_size", "max_seq_len", "page_size", "prefill_chunk", "compile", "prefill_backend",
                 "decode_backend", "cuda_graphs")
    init = {k: kwargs.pop(k) for k in init_keys if k in kwargs}
    init.setdefault("max_seq_len", max(len(p) for p in prompts) + max_new_tokens)
    init.setdefault("max_batch_size", len(prompts))
    return HybridGenerator(model, **init).generate(prompts, max_new_tokens, **kwargs)
