"""torch.compile: one graph for every mode, zero recompiles after warm-up, the cache written in place."""

import random

import pytest
import torch
from helpers.reference import assert_close, make_case, reference
from torch._dynamo.testing import CompileCounter
from torch._inductor.utils import run_and_get_code

import hybrid_ops
from hybrid_ops import ROUTING, ForwardMode

# Dynamo keeps what it learnt about a code object (which sizes are dynamic) across compiles.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Attention(torch.nn.Module):
    """A layer around the op, as a model calls it: a projection before, one after. args: the op's k through
    forward_mode (an int)."""

    def forward(self, q, *args):
        return torch.ops.hybrid.attn(q * 1.0, *args, sliding_window=8, speculative_attention_mode="decode") + 0.0


def random_step(rng, mode, batch_size, **case_kwargs):
    """A batch for `mode`: uniform query lengths on the decode path, ragged ones (zero included) otherwise."""
    if mode == ForwardMode.IDLE:
        return make_case([], [], seed=rng.random(), **case_kwargs)
    if hybrid_ops.select_path(mode, "decode") == "decode":
        n = 1 if mode == ForwardMode.DECODE else rng.randint(2, 4)
        q_lens = [n] * batch_size
    else:
        q_lens = [rng.randint(0, 6) for _ in range(batch_size)]
    return make_case(q_lens, [rng.randint(0, 12) for _ in range(batch_size)], seed=rng.random(), **case_kwargs)


def size_class(case):
    """Which of Dynamo's size specialisations (0, 1, or more) each dimension of the case's tensors falls in: the
    steps of one class share a graph, whatever their mode."""
    return tuple(min(size, 2) for t in case.args for size in t.shape)


WARM_UP = len(ROUTING) * 3  # the steps of every mode at batch sizes 1 to 3 that `random_steps` begins with


def warm_then_check(compiled, steps, check, warm_up=WARM_UP):
    """The first `warm_up` steps (every mode at a few batch sizes: Dynamo learns which sizes vary) and one step of
    each further size class, then every step with recompiles made errors; `check(out, case)` each output."""
    classes = set()
    for i, (mode, case) in enumerate(steps):
        if i < warm_up or size_class(case) not in classes:
            classes.add(size_class(case))
            compiled(*case.args, int(mode))
    warm = compiled.counter.frame_count
    assert warm <= 8  # a graph per size class, a few at most: the modes add none
    with torch._dynamo.config.patch(error_on_recompile=True):
        for mode, case in steps:
            check(compiled(*case.args, int(mode)), case)
    assert compiled.counter.frame_count == warm


class FeatureAttention(torch.nn.Module):
    """A layer with attention sinks (a parameter, as gpt-oss), chunks of 5 positions and a value head dim of 8."""

    def __init__(self):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(4) * 2)

    def forward(self, *args):
        """args: the op's positional arguments, forward_mode an int."""
        return torch.ops.hybrid.attn(
            *args, sinks=self.sinks.float(), attention_chunk=5, speculative_attention_mode="decode"
        )


def compiled_with_counter(module):
    counter = CompileCounter()
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)
    compiled.counter = counter
    return compiled


def random_steps(rng, count, **case_kwargs):
    """(mode, case): every mode at batch sizes 1 to 3, then `count` random ones."""
    steps = [(mode, random_step(rng, mode, b, **case_kwargs)) for mode in ROUTING for b in (1, 2, 3)]
    for _ in range(count):
        mode = rng.choice(list(ROUTING))
        steps.append((mode, random_step(rng, mode, rng.randint(1, 6), **case_kwargs)))
    return steps


def test_features_all_modes_no_recompiles():
    rng = random.Random(1)
    layer = FeatureAttention()
    check = lambda out, case: assert_close(
        out, reference(case, sinks=layer.sinks.detach(), attention_chunk=5), torch.float32
    )
    with torch.no_grad():
        warm_then_check(compiled_with_counter(layer), random_steps(rng, 30, v_head_dim=8), check)


def test_all_modes_one_graph_no_recompiles():
    """Dynamo specialises sizes 0 and 1 (T = 0, B = 1, a single token), so those get their own graphs; the modes add
    none."""
    rng = random.Random(0)
    check = lambda out, case: assert_close(out, reference(case, sliding_window=8), torch.float32)
    warm_then_check(compiled_with_counter(Attention()), random_steps(rng, 60), check)


def test_dynamic_none_recompiles_once():
    """With dynamic=None the first call compiles static sizes; the first change makes them (and the mode)
    symbolic with one recompile; then no more. Cache and block-table widths stay fixed, as PagedKVCache keeps them."""
    cache = hybrid_ops.PagedKVCache(num_pages=64, page_size=4, num_kv_heads=2, head_dim=16, max_pages_per_request=8)
    k_cache, v_cache = cache.layer(0)
    counter = CompileCounter()
    compiled = torch.compile(Attention(), backend=counter, fullgraph=True)
    for rid in range(4):
        cache.add(rid)
    modes = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY]
    for i in range(12):
        mode = modes[i % 4]
        rids = list(range(2 + i % 3))
        if hybrid_ops.select_path(mode, "decode") == "decode":
            new = [1 if mode == ForwardMode.DECODE else 2] * len(rids)
        else:
            new = [2 + (r + i) % 3 for r in rids]
        batch = cache.step(rids, new, mode)
        T = sum(new)
        q, k, v = torch.randn(T, 4, 16), torch.randn(T, 2, 16), torch.randn(T, 2, 16)
        compiled(q, k, v, k_cache, v_cache, *batch.metadata, int(mode))
    assert counter.frame_count == 2


@pytest.mark.parametrize("cache_as", ["inputs", "buffers"])
def test_cache_written_in_place(cache_as):
    """The generated code hands the caller's cache tensors to the op: no clone, no copy, the writes land."""
    case = make_case([3, 2], [4, 0], seed=3)

    class WithBuffers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k_cache", case.k_cache)
            self.register_buffer("v_cache", case.v_cache)

        def forward(self, q, k, v, cu_seqlens_q, seq_lens, block_table, forward_mode: int):
            return torch.ops.hybrid.attn(
                q, k, v, self.k_cache, self.v_cache, cu_seqlens_q, seq_lens, block_table, forward_mode
            )

    if cache_as == "inputs":
        fn, args = torch.compile(Attention(), fullgraph=True, dynamic=True), (*case.args, 1)
    else:
        fn = torch.compile(WithBuffers(), fullgraph=True, dynamic=True)
        args = (case.q, case.k, case.v, case.cu_seqlens_q, case.seq_lens, case.block_table, 1)
    k_ptr = case.k_cache.data_ptr()
    with torch.no_grad():
        out, codes = run_and_get_code(fn, *args)
    code = "\n".join(codes)
    assert "torch.ops.hybrid.attn.default(" in code
    for forbidden in ("clone", "copy_", "empty_strided"):
        lines = [line for line in code.splitlines() if forbidden in line and "cache" in line.lower()]
        assert not lines, lines
    assert "aten.copy" not in code and ".clone(" not in code
    assert case.k_cache.data_ptr() == k_ptr
    # The new tokens are in the caller's cache: request 1 (no prefix) starts at its first page, row 0.
    assert torch.equal(case.k_cache[case.pages[1][0], 0], case.k[3])
    assert_close(out, reference(case), torch.float32)


def test_bad_input_errors_under_compile():
    case = make_case([2, 2], [1, 1])
    compiled = torch.compile(Attention(), fullgraph=True, dynamic=True, backend="aot_eager")
    bad = list(case.args)
    bad[6] = bad[6].long()
    before = case.k_cache.clone()
    with pytest.raises(Exception, match="seq_lens must be int32"):
        compiled(*bad, 1)
    assert torch.equal(case.k_cache, before)
    with pytest.raises(hybrid_ops.HybridInputError, match="forward_mode must be one of"):
        compiled(*case.args, 10)
    assert torch.equal(case.k_cache, before)
