"""The runners: one step over the paged cache, a step function of tensors called once per step.

`forward(input_ids, position_ids, logits_index, forward_mode, cu_seqlens_q, seq_lens, block_table[, state_slots,
tree_mask]) -> logits` is the whole step as one function of its inputs (the model, the cache's and state pool's
tensors and the backends are its state). A `StepRunner` runs any callable of that signature (a loaded package's,
`packaged.py`), padding steps to buckets (`cuda_graphs`) and holding the tensor-parallel group's agreement helpers; a
`ModelRunner` is one whose forward is a transformers model's, compiled once for every step, with the warm-up and the
compile cache file; compiled on a CPU other than Intel's, it pads steps of one token to two (`pad_one_token`).
"""

import hashlib
import os
import types
import weakref

import torch
import torch.distributed as dist

from ..backends import registry
from ..backends.cpu import cpuinfo_field
from ..buckets import batch_buckets, pad_batch, padding_q_lens, token_buckets
from ..cache import PagedKVCache
from ..errors import HybridInputError
from ..metadata import ForwardBatch
from ..modes import ForwardMode
from ..state import StatePool

# (tokens per request, logits rows, mode) of steps with one request, one token or one logits row: sizes that
# Dynamo specialises, with a graph each.
_WARM_UP_STEPS = [
    ([1], [0], ForwardMode.DECODE),
    ([2], [1], ForwardMode.EXTEND),
    ([2, 1], [2], ForwardMode.MIXED),
    ([2, 1], [1, 2], ForwardMode.MIXED),
    ([1, 1], [0, 1], ForwardMode.DECODE),
]

# Dynamo keeps compiled graphs, and counts them against its recompile limit, per code object. Runners of one model
# and the same shapes share a copy of `_forward` (a later one compiles nothing); others get their own, so that the
# generators of several models or sizes in one process never add up to that limit, past which fullgraph fails.
_FORWARD_CODES = weakref.WeakKeyDictionary()  # model -> {shapes: code object}


def step_shapes(counts, rows, mode) -> str:
    """A step's shapes as the warm-up says them: "MIXED, 2 requests of 2+1 tokens, 1 logits row"."""
    plural = lambda n, word: f"{n} {word}{'s' if n != 1 else ''}"
    tokens = plural(counts[0], "token") if len(counts) == 1 else "+".join(map(str, counts)) + " tokens"
    return f"{mode.name}, {plural(len(counts), 'request')} of {tokens}, {plural(len(rows), 'logits row')}"


def graph_backends(device, cuda_graphs: bool, backends) -> tuple:
    """(prefill backend, decode backend) as a step runs them: with CUDA graphs on CUDA, "auto" is the first backend
    that plans nothing on the host (`Registry.for_captured_steps`: Triton), since a captured step cannot plan."""
    if cuda_graphs and device.type == "cuda":
        return tuple(registry.for_captured_steps(b, device.type) for b in backends)
    return tuple(backends)


def default_compile_options(device) -> dict:
    """Inductor's options for a step's compile on `device`. On the CPU the weights are frozen into the graphs and
    prepacked for oneDNN's matrix products (`freezing`: a decode step's linears read their weights at 2-4x the rate
    of the unpacked products), and the linears that read one input become one product (`cpp.enable_concat_linear`:
    q/k/v, gate/up). Each compiled graph holds its own packed copy of the weights. Measured by `python -m bench step`
    (docs/benchmarks.md)."""
    return {"freezing": True, "cpp.enable_concat_linear": True} if device.type == "cpu" else {}


def mkl_is_native() -> bool:
    """Whether MKL takes its own kernels on this CPU: on Intel's (/proc/cpuinfo's vendor). A decode step's fp32
    products of one row, as Inductor's freezing packs them for a graph of static sizes (MKL's sgemm), took 0.92x the
    time of oneDNN's on an Intel Xeon and 1.38x on an AMD Zen 4 (`python -m bench step`)."""
    return cpuinfo_field("vendor_id") == "GenuineIntel"


def with_inductor_options(fn, options: dict):
    """`fn` (a compiled function) called under Inductor's config `options`: Dynamo reads some of them while it traces
    (`freezing`: whether the parameters become constants), so `torch.compile(options=...)`, which applies them only to
    Inductor's own compile, would freeze nothing."""
    if not options:
        return fn
    from torch._inductor import config

    def call(*args):
        with config.patch(options):
            return fn(*args)

    return call


def step_buckets(cache: PagedKVCache, max_batch_size: int, prefill_chunk: int):
    """(token counts, batch sizes): the buckets that `cuda_graphs` pads steps of at most `max_batch_size` requests and
    `prefill_chunk + max_batch_size` tokens to; their last entries bound every step, padded or not."""
    max_tokens = prefill_chunk + max_batch_size  # a prefill budget plus every other request's decode token
    # Room for the padding requests of any step, each holding at most a block-table row's capacity.
    max_padding_requests = -(-max_tokens // (cache.max_pages_per_request * cache.page_size))
    return token_buckets(max_tokens), batch_buckets(max_batch_size + max_padding_requests)


def model_step(model, step, input_ids, position_ids, logits_index):
    """The model's forward over the paged cache that `step` (a `HybridStep`) names -> logits [n, vocab].
    input_ids, position_ids: [1, T] int64; logits_index: [n] int64, the token rows to project."""
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=logits_index,
        hybrid_step=step,
    )
    return out.logits[0]


class StepRunner:
    """Runs `forward` (the step function of the module docstring) over `cache`, for steps of at most
    `max_batch_size` requests and `prefill_chunk + max_batch_size` tokens, each request of at most `max_seq_len`
    tokens. cuda_graphs=True: every step is padded to a bucket of requests and tokens (`hybrid_ops.buckets`).
    group: the tensor-parallel process group whose ranks run the same steps, or None."""

    def __init__(
        self,
        forward,
        cache: PagedKVCache,
        max_batch_size: int,
        max_seq_len: int,
        prefill_chunk: int,
        cuda_graphs: bool = False,
        group=None,
    ):
        self.forward, self.cache, self.device = forward, cache, cache.device
        self.max_batch_size, self.max_seq_len, self.cuda_graphs = max_batch_size, max_seq_len, cuda_graphs
        self.prefill_chunk = prefill_chunk
        self.token_counts, self.batch_sizes = step_buckets(cache, max_batch_size, prefill_chunk)
        self.warmed_up = True
        self.group = group
        self.pad_one_token = False  # see ModelRunner

    def run(self, batch: ForwardBatch, num_new_tokens, token_ids, positions, logits_rows, state_slots=None):
        """One step -> logits [len(logits_rows), vocab]. batch: the step's metadata (its pages allocated);
        num_new_tokens: per request; token_ids, positions: host lists of the step's T tokens; logits_rows: the token
        rows whose logits to return; state_slots: the requests' state slots (a hybrid model's). A batch with a
        `tree_mask` (a speculative tree's step, positions prefix + depth) is not padded."""
        num_rows = len(logits_rows)
        # At least one row even when no request samples (a long prompt mid-chunk): Dynamo gives size 0 a graph
        # of its own, which a later run could meet for the first time.
        rows = logits_rows or [len(token_ids) - 1]
        pad = self._padding(batch, num_new_tokens, len(token_ids))
        if pad is not None:
            real = batch.batch_size
            batch, token_ids, positions, rows = self._pad(batch, pad, token_ids, positions, rows)
            if state_slots is not None:  # padding requests hold no slot: they read and write no state
                state_slots = torch.cat([state_slots, state_slots.new_full((batch.batch_size - real,), -1)])
        if self.cuda_graphs:
            self.begin_padded_step()
        # The optional inputs only when in use: a packaged step takes the seven others.
        extra = () if state_slots is None and batch.tree_mask is None else (state_slots, batch.tree_mask)
        logits = self.forward(
            torch.tensor([token_ids], device=self.device),
            torch.tensor([positions], device=self.device),
            torch.tensor(rows, device=self.device),
            int(batch.forward_mode),
            *batch.metadata,
            *extra,
        )
        return logits[:num_rows]

    def begin_padded_step(self) -> None:
        """Before each padded step's forward: nothing for a packaged step (its graphs are `graphs.py`'s)."""

    def _padding(self, batch, num_new_tokens, num_tokens) -> list | None:
        """The query lengths of the step's padding requests: those that bring it to buckets with `cuda_graphs` (maybe
        none, the logits rows still padded), one token beside a step of one token with `pad_one_token`; else None."""
        if self.cuda_graphs:
            if batch.tree_mask is not None:
                raise HybridInputError("a step with a tree_mask cannot be padded to buckets (cuda_graphs=True)")
            capacity = self.cache.max_pages_per_request * self.cache.page_size
            return padding_q_lens(num_new_tokens, batch.forward_mode, self.batch_sizes, self.token_counts, capacity)
        return [1] if self.pad_one_token and num_tokens == 1 and batch.tree_mask is None else None

    def _pad(self, batch, pad, token_ids, positions, rows):
        """The step followed by padding requests of query lengths `pad` over the scratch page (`buckets.pad_batch`),
        their tokens id 0 at position 0, and the logits rows repeated up to the padded batch size (only the first
        len(rows) are returned)."""
        batch = pad_batch(batch, pad, self.cache.scratch_page, self.cache.page_size)
        self.cache.mark_table(batch)
        extra = [0] * sum(pad)
        return batch, token_ids + extra, positions + extra, rows + rows[-1:] * (batch.batch_size - len(rows))

    # Tensor parallelism: every rank of the group runs the same steps.

    def check_same_on_every_rank(self, args) -> None:
        """Raises on every rank alike unless `args` are equal on all ranks of the group: ranks given different
        prompts would take different steps and pair up mismatched collectives. No group: nothing to check."""
        if self.group is None:
            return
        digest = int.from_bytes(hashlib.sha256(repr(args).encode()).digest()[:7], "little")
        highest = torch.tensor([digest, -digest], device=self.device)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX, group=self.group)
        if highest.tolist() != [digest, -digest]:
            raise HybridInputError(
                "prompts, max_new_tokens and the sampling options must be the same on every rank of "
                "the tensor-parallel group"
            )

    def broadcast_from_rank_0(self, tensor: torch.Tensor) -> None:
        """Overwrites `tensor` with rank 0's on every rank of the group (the sampled tokens: each rank then
        schedules alike)."""
        if self.group is not None:
            dist.broadcast(tensor, group=self.group, group_src=0)


class ModelRunner(StepRunner):
    """A `StepRunner` of `model` (attention through `torch.ops.hybrid.attn`).

    pad_one_token: compiled on a CPU whose MKL is not native (`mkl_is_native`) with Inductor's freezing, over a
    cache with a scratch page, without `cuda_graphs`, a step of one token runs with a padding request of one token on
    the scratch page. Dynamo gives a step of one token a graph of its own, of static sizes, whose fp32 linears
    freezing packs for MKL's sgemm: on an AMD Zen 4 such a step took 1.2x the padded step's time, on an Intel Xeon
    0.77x (the static graph's wrapper is also lighter), `python -m bench step`.

    compile=True: `forward` is `torch.compile(fullgraph=True, dynamic=True)` of `_forward` (on CUDA with
    `cuda_graphs`, `mode="reduce-overhead"`), called under `compile_options`; `warm_up` then compiles the graphs Dynamo
    specialises, and with `compile_cache=PATH` the compiled artifacts are loaded from PATH at construction and written
    there after the warm-up. cuda_graphs=True: "auto" backends mean "triton" on CUDA (FlashInfer plans on the host,
    outside the graphs).
    `states`: a hybrid model's state slots (`StatePool`), whose slots each step's `state_slots` name.
    speculative_attention_mode: the ops' routing of TARGET_VERIFY steps ("prefill" or "decode").
    compile_backend: torch.compile's backend ("eager" traces and guards as "inductor" does, without code generation).
    compile_options: Inductor's config while the forward runs and compiles; None: `default_compile_options`, or none
    with a compile_cache (Inductor caches no graph holding prepacked weights), for a tensor-parallel model (Inductor
    cannot freeze its graph) or with another compile_backend.
    """

    def __init__(
        self,
        model,
        cache: PagedKVCache,
        max_batch_size: int,
        max_seq_len: int,
        prefill_chunk: int,
        compile: bool = True,
        prefill_backend: str = "auto",
        decode_backend: str = "auto",
        cuda_graphs: bool = False,
        compile_cache: str | None = None,
        states: StatePool | None = None,
        speculative_attention_mode: str = "prefill",
        compile_backend: str = "inductor",
        compile_options: dict | None = None,
    ):
        from ..integrations.transformers import HybridStep, tensor_parallel_group

        # What `_own_forward` keys the code object by, set before the forward is built.
        self.model, self.cache, self.cuda_graphs, self._step_type = model, cache, cuda_graphs, HybridStep
        self.states = states
        self.speculative_attention_mode, self.compile_backend = speculative_attention_mode, compile_backend
        self.backends = graph_backends(cache.device, cuda_graphs, (prefill_backend, decode_backend))
        group = tensor_parallel_group(model)
        if compile_options is None:
            # Inductor caches no graph that holds prepacked weights (a compile cache keeps them as they are), and
            # cannot freeze a sharded model's (its process group is not a tensor).
            defaults = compile_backend == "inductor" and not compile_cache and group is None
            compile_options = default_compile_options(cache.device) if defaults else {}
        self.compile_options = dict(compile_options)
        mode = "reduce-overhead" if cuda_graphs and cache.device.type == "cuda" else None
        forward = self._forward
        if compile:
            forward = torch.compile(
                self._own_forward(), fullgraph=True, dynamic=True, mode=mode, backend=compile_backend
            )
            forward = with_inductor_options(forward, self.compile_options)
        super().__init__(forward, cache, max_batch_size, max_seq_len, prefill_chunk, cuda_graphs, group)
        self.warmed_up = not compile
        self.compile_cache = compile_cache
        self.pad_one_token = (
            compile
            and cache.device.type == "cpu"
            and bool(self.compile_options.get("freezing"))
            and cache.scratch_page is not None
            and not cuda_graphs
            and not mkl_is_native()
        )
        if compile and compile_cache and os.path.exists(compile_cache):
            with open(compile_cache, "rb") as f:
                torch.compiler.load_cache_artifacts(f.read())

    def begin_padded_step(self) -> None:
        torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are read: graphs may reuse them

    def _own_forward(self):
        """`_forward` on the code object that this runner's model and shapes share (see _FORWARD_CODES)."""
        shapes = (
            tuple((t.shape, t.dtype) for t in self.cache.k_caches + self.cache.v_caches),
            None if self.states is None else tuple((t.shape, t.dtype) for t in self.states.all_states),
            self.cache.max_pages_per_request,
            self.backends,
            self.speculative_attention_mode,
            self.compile_backend,
            tuple(sorted(self.compile_options.items())),
            self.cuda_graphs,
        )
        fn = ModelRunner._forward
        code = _FORWARD_CODES.setdefault(self.model, {}).setdefault(shapes, fn.__code__.replace())
        return types.MethodType(types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__), self)

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
        tree_mask=None,
    ):
        """input_ids, position_ids: [1, T] int64; logits_index: [n] int64, the token rows to project; forward_mode:
        a `ForwardMode` value; the metadata as in the ops; state_slots: [B] int32 (a hybrid model's) or None;
        tree_mask: the ops' [T, Q] bool or None -> logits [n, vocab]. Writes the tokens' K/V into the cache, and their
        states into the slots."""
        step = self._step_type(
            forward_mode,
            cu_seqlens_q,
            seq_lens,
            block_table,
            self.cache.k_caches,
            self.cache.v_caches,
            *self.backends,
            self.speculative_attention_mode,
            k_scales=self.cache.k_scales,
            v_scales=self.cache.v_scales,
            state_slots=state_slots,
            states=None if self.states is None else self.states.states,
            tree_mask=tree_mask,
            intermediate_states=None if self.states is None else self.states.intermediate_states,
        )
        return model_step(self.model, step, input_ids, position_ids, logits_index)

    def warm_up(self, announce=None):
        """Compiles the graphs Dynamo specialises for sizes 1 (one request, one token, one logits row), which a run
        might otherwise first meet deep into serving; then writes the compile cache file. Writes only pages it frees
        again. announce: called with each step's shapes (`step_shapes`) before the step compiles."""
        for counts, rows, mode in _WARM_UP_STEPS:
            if (
                len(counts) > self.max_batch_size
                or max(counts) > self.max_seq_len
                or sum(-(-n // self.cache.page_size) for n in counts) > self.cache.num_pages
                or (self.states is not None and len(counts) > self.states.num_slots)
            ):
                continue  # a step no run can take either
            if announce is not None:
                announce(step_shapes(counts, rows, mode))
            ids = [("warm-up", i) for i in range(len(counts))]
            for rid in ids:
                self.cache.add(rid)
                if self.states is not None:
                    self.states.add(rid)
            try:
                positions = [p for n in counts for p in range(n)]
                slots = None if self.states is None else self.states.slots(ids)
                self.run(self.cache.step(ids, counts, mode), counts, [0] * len(positions), positions, rows, slots)
            finally:
                for rid in ids:
                    self.cache.free(rid)
                    if self.states is not None:
                        self.states.free(rid)
        self.warmed_up = True
        artifacts = torch.compiler.save_cache_artifacts() if self.compile_cache else None
        if artifacts is not None:
            with open(self.compile_cache, "wb") as f:
                f.write(artifacts[0])
