"""HybridAttnBackend routes each per-step call as sglang's does; pinned by a table."""

import dataclasses
import random

import pytest
import torch
from helpers.reference import assert_close, fp8_case, make_case, random_tree, reference, tree_mask_for

import hybrid_ops
from hybrid_ops import AttentionLayer, ForwardMode, HybridAttnBackend, PagedKVCache, PhaseBackend, build_metadata
from hybrid_ops.options import FIELDS

P, D = "prefill", "decode"
# forward mode -> which backend init_forward_metadata / forward_extend / get_indexer_metadata / capture / replay
# reach, with speculative_attention_mode "prefill" and with "decode".
BACKENDS = {
    ForwardMode.EXTEND: (P, P),
    ForwardMode.DECODE: (D, D),
    ForwardMode.MIXED: (P, P),
    ForwardMode.IDLE: (D, D),
    ForwardMode.TARGET_VERIFY: (P, D),
    ForwardMode.DRAFT_EXTEND: (P, D),
}
# (forward mode, speculative_attention_mode) -> that backend
ROUTES = {(mode, spec): backends[i] for mode, backends in BACKENDS.items() for i, spec in enumerate((P, D))}
# (speculative, speculative_attention_mode) -> backends whose CUDA-graph state is set up.
GRAPH_STATE = {
    (False, "prefill"): {D},
    (False, "decode"): {D},
    (True, "prefill"): {P, D},
    (True, "decode"): {D},
}


class Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getattr__(self, method):
        def record(*args, **kwargs):
            self.log.append((self.name, method))
            return f"{self.name}:{method}"

        return record


def make(spec, speculative=True):
    log = []
    return HybridAttnBackend(Recorder(P, log), Recorder(D, log), spec, speculative), log


@pytest.mark.parametrize("mode, spec", list(ROUTES))
def test_routing_table(mode, spec):
    hybrid, log = make(spec)
    batch = build_metadata([1], [1], [[0]], forward_mode=mode)
    want = ROUTES[mode, spec]
    hybrid.init_forward_metadata(batch)
    hybrid.init_forward_metadata_capture_cuda_graph(1, 1, mode)
    hybrid.init_forward_metadata_replay_cuda_graph(1, batch)
    assert hybrid.forward_extend(None, None, None, None, batch) == f"{want}:forward_extend"
    assert hybrid.get_indexer_metadata(0, batch) == f"{want}:get_indexer_metadata"
    assert hybrid.forward_decode(None, None, None, None, batch) == f"{D}:forward_decode"
    assert [name for name, _ in log[:3]] == [want] * 3


@pytest.mark.parametrize("speculative, spec", list(GRAPH_STATE))
def test_cuda_graph_state(speculative, spec):
    hybrid, log = make(spec, speculative)
    hybrid.init_cuda_graph_state(8, 64)
    assert {name for name, method in log if method == "init_cuda_graph_state"} == GRAPH_STATE[speculative, spec]
    assert hybrid.get_cuda_graph_seq_len_fill_value() == f"{D}:get_cuda_graph_seq_len_fill_value"


def test_phase_backends_run_the_ops():
    """PhaseBackend over a PagedKVCache: eager metadata, and capture/replay through its static buffers."""
    case = make_case([2, 3], [3, 0], seed=5, page_size=4)
    cache = PagedKVCache(num_pages=case.k_cache.shape[0], page_size=4, num_kv_heads=2, head_dim=16)
    cache.k_caches[0].copy_(case.k_cache)
    cache.v_caches[0].copy_(case.v_cache)
    hybrid = HybridAttnBackend(PhaseBackend(cache, "torch"), PhaseBackend(cache, "torch"))
    batch = build_metadata(case.q_lens, case.seq_lens.tolist(), case.pages, forward_mode=ForwardMode.EXTEND)
    hybrid.init_forward_metadata(batch)
    out = hybrid.forward_extend(case.q, case.k, case.v, AttentionLayer(0, sliding_window=2), batch)
    assert_close(out, reference(case, sliding_window=2), torch.float32)
    assert hybrid.get_indexer_metadata(0, batch) is None

    decode = make_case([1, 1], [4, 9], seed=6, page_size=4)
    cache = PagedKVCache(
        num_pages=decode.k_cache.shape[0],
        page_size=4,
        num_kv_heads=2,
        head_dim=16,
        max_pages_per_request=decode.block_table.shape[1],
    )
    cache.k_caches[0].copy_(decode.k_cache)
    cache.v_caches[0].copy_(decode.v_cache)
    hybrid = HybridAttnBackend(PhaseBackend(cache, "torch"), PhaseBackend(cache, "torch"))
    hybrid.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    hybrid.init_forward_metadata_capture_cuda_graph(2, 2, ForwardMode.DECODE)
    real = build_metadata([1, 1], decode.seq_lens.tolist(), decode.pages, forward_mode=ForwardMode.DECODE)
    hybrid.init_forward_metadata_replay_cuda_graph(2, real)
    out = hybrid.forward_decode(decode.q, decode.k, decode.v, AttentionLayer(0), real)
    assert_close(out, reference(decode), torch.float32)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_phase_backend_passes_an_fp8_caches_scales(backend):
    case = make_case([2, 3], [3, 7], seed=7, page_size=4)
    fp8, read, (k_expected, _) = fp8_case(case, torch.float8_e4m3fn, torch.tensor(0.5), torch.tensor(0.5))
    cache = PagedKVCache(
        num_pages=case.k_cache.shape[0],
        page_size=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float8_e4m3fn,
        kv_scale=0.5,
    )
    cache.k_caches[0].copy_(fp8.k_cache)
    cache.v_caches[0].copy_(fp8.v_cache)
    hybrid = HybridAttnBackend(PhaseBackend(cache, backend), PhaseBackend(cache, backend))
    batch = build_metadata(case.q_lens, case.seq_lens.tolist(), case.pages, forward_mode=ForwardMode.EXTEND)
    hybrid.init_forward_metadata(batch)
    out = hybrid.forward_extend(case.q, case.k, case.v, AttentionLayer(0, sliding_window=4), batch)
    assert_close(out, reference(read, sliding_window=4), torch.float32)
    assert torch.equal(cache.k_caches[0].view(torch.uint8), k_expected)


# Of the ops' options, those that are not a layer's: the fp8 scales are the cache's, the tree mask the batch's.
NOT_PER_LAYER = {"k_scale", "v_scale", "tree_mask"}


def test_attention_layer_carries_every_per_layer_option():
    """AttentionLayer's fields but its id are the ops' per-layer options, at the ops' defaults, and its keywords."""
    options = {f.name: f.default for f in dataclasses.fields(AttentionLayer) if f.name != "layer_id"}
    assert options == {f.name: f.default for f in FIELDS if f.name not in NOT_PER_LAYER}
    assert AttentionLayer(3).keywords() == options


# (forward mode, q_lens, prefix_lens): requests of several pages of 4, the windows and chunks ending within them.
STEPS = [(ForwardMode.EXTEND, [6, 9, 3], [10, 0, 13]), (ForwardMode.DECODE, [1, 1, 1], [10, 17, 6])]


def serve(case, layers, mode, flat=False):
    """Each layer's output for `case`'s batch in `mode` (forward_decode in DECODE, forward_extend otherwise) through a
    HybridAttnBackend of torch PhaseBackends, every layer's cache holding the case's; q, k, v flattened with `flat`."""
    cache = PagedKVCache(
        num_pages=case.k_cache.shape[0],
        page_size=case.k_cache.shape[1],
        num_kv_heads=case.k.shape[1],
        head_dim=case.k.shape[2],
        v_head_dim=case.v.shape[2],
        num_layers=len(layers),
    )
    for k_cache, v_cache in zip(cache.k_caches, cache.v_caches):
        k_cache.copy_(case.k_cache)
        v_cache.copy_(case.v_cache)
    hybrid = HybridAttnBackend(PhaseBackend(cache, "torch"), PhaseBackend(cache, "torch"))
    batch = build_metadata(case.q_lens, case.seq_lens.tolist(), case.pages, forward_mode=mode)
    hybrid.init_forward_metadata(batch)
    forward = hybrid.forward_decode if mode == ForwardMode.DECODE else hybrid.forward_extend
    q, k, v = (t.flatten(1) if flat else t for t in (case.q, case.k, case.v))
    return [forward(q, k, v, layer, batch) for layer in layers]


def random_sinks(seed, num_q_heads=4):
    return torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed)) + 1.0


@pytest.mark.parametrize("mode, q_lens, prefix_lens", STEPS)
def test_gpt_oss_layers(mode, q_lens, prefix_lens):
    """gpt-oss: sinks on every layer, a sliding window on every other; each layer attends with its own."""
    case = make_case(q_lens, prefix_lens, seed=11)
    layers = [AttentionLayer(0, sliding_window=5, sinks=random_sinks(0)), AttentionLayer(1, sinks=random_sinks(1))]
    windowed, full = serve(case, layers, mode)
    assert_close(windowed, reference(case, sliding_window=5, sinks=layers[0].sinks), torch.float32)
    assert_close(full, reference(case, sinks=layers[1].sinks), torch.float32)


@pytest.mark.parametrize("mode, q_lens, prefix_lens", STEPS)
def test_llama4_chunked_layer(mode, q_lens, prefix_lens):
    """Llama 4: a chunked layer (chunks of two pages) beside a global one; each attends with its own."""
    case = make_case(q_lens, prefix_lens, seed=12)
    chunked, full = serve(case, [AttentionLayer(0, attention_chunk=8), AttentionLayer(1)], mode)
    assert_close(chunked, reference(case, attention_chunk=8), torch.float32)
    assert_close(full, reference(case), torch.float32)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("mode, q_lens, prefix_lens", STEPS)
def test_value_head_dim(mode, q_lens, prefix_lens, flat):
    """Values of 24 dims for keys of 16, q, k, v as they are or flattened (as sglang's layers hand them over): the
    output [T, Hq, 24], or [T, Hq * 24] for a flattened q."""
    case = make_case(q_lens, prefix_lens, v_head_dim=24, seed=13)
    (out,) = serve(case, [AttentionLayer(0)], mode, flat)
    num_tokens = sum(q_lens)
    assert out.shape == ((num_tokens, 4 * 24) if flat else (num_tokens, 4, 24))
    assert_close(out.view(num_tokens, 4, 24), reference(case), torch.float32)


# (forward mode, speculative_attention_mode, tokens per request) for the CUDA-graph tests: verify has 3 per
# request, so a batch of 2 has 6 tokens and any swap of the two sizes shows.
GRAPH_CASES = [
    (ForwardMode.DECODE, "prefill", 1),
    (ForwardMode.TARGET_VERIFY, "prefill", 3),
    (ForwardMode.TARGET_VERIFY, "decode", 3),
]


def graph_ready(cache, spec):
    """A HybridAttnBackend of two torch PhaseBackends, CUDA-graph state set up for 8 requests and 32 tokens."""
    hybrid = HybridAttnBackend(PhaseBackend(cache, "torch"), PhaseBackend(cache, "torch"), spec, speculative=True)
    hybrid.init_cuda_graph_state(max_bs=8, max_num_tokens=32)
    return hybrid


def routed(hybrid, mode, spec):
    return hybrid.decode_backend if hybrid_ops.select_path(mode, spec) == "decode" else hybrid.prefill_backend


@pytest.mark.parametrize("mode, spec, per_request", GRAPH_CASES)
def test_capture_metadata(mode, spec, per_request):
    """Capture for 2 requests of `per_request` tokens: the routed backend points its metadata at its static
    buffers, sized for 2 requests, with their token boundaries."""
    cache = PagedKVCache(num_pages=12, page_size=4, num_kv_heads=2, head_dim=16, max_pages_per_request=5)
    hybrid = graph_ready(cache, spec)
    hybrid.init_forward_metadata_capture_cuda_graph(2, 2 * per_request, mode)
    phase = routed(hybrid, mode, spec)
    batch = phase.forward_batch
    assert batch.forward_mode == mode
    assert batch.cu_seqlens_q.tolist() == [0, per_request, 2 * per_request]
    # Each request holds at least its own tokens, so the captured metadata passes validation.
    assert batch.seq_lens.tolist() == [max(hybrid.get_cuda_graph_seq_len_fill_value(), per_request)] * 2
    assert batch.block_table.shape == (2, 5)
    hybrid_ops.validation.check_metadata_values(
        *batch.metadata, 2 * per_request, cache.num_pages, cache.page_size, phase is hybrid.decode_backend
    )
    for tensor, buffer in zip(batch.metadata, phase.graph_buffers):
        assert tensor.data_ptr() == buffer.data_ptr()  # views of the static buffers a graph would read
    other = hybrid.prefill_backend if phase is hybrid.decode_backend else hybrid.decode_backend
    assert other.forward_batch is None


@pytest.mark.parametrize("mode, spec, per_request", GRAPH_CASES)
def test_replay_metadata_and_output(mode, spec, per_request):
    """Replay copies a real batch (a block table narrower than the buffers') into the static buffers; attention
    over them matches the reference."""
    case = make_case([per_request] * 2, [7, 2], page_size=4, seed=per_request)
    width = case.block_table.shape[1]
    cache = PagedKVCache(
        num_pages=case.k_cache.shape[0], page_size=4, num_kv_heads=2, head_dim=16, max_pages_per_request=width + 2
    )
    cache.k_caches[0].copy_(case.k_cache)
    cache.v_caches[0].copy_(case.v_cache)
    hybrid = graph_ready(cache, spec)
    hybrid.init_forward_metadata_capture_cuda_graph(2, 2 * per_request, mode)
    real = build_metadata(case.q_lens, case.seq_lens.tolist(), case.pages, forward_mode=mode)
    hybrid.init_forward_metadata_replay_cuda_graph(2, real)
    phase = routed(hybrid, mode, spec)
    batch = phase.forward_batch
    assert batch.cu_seqlens_q.tolist() == real.cu_seqlens_q.tolist()
    assert batch.seq_lens.tolist() == real.seq_lens.tolist()
    assert batch.block_table[:, : real.block_table.shape[1]].tolist() == real.block_table.tolist()
    for tensor, buffer in zip(batch.metadata, phase.graph_buffers):
        assert tensor.data_ptr() == buffer.data_ptr()
    layer = AttentionLayer(0, scale=0.2, logit_cap=2.0)
    forward = hybrid.forward_decode if mode == ForwardMode.DECODE else hybrid.forward_extend
    assert_close(forward(case.q, case.k, case.v, layer, real), reference(case, scale=0.2, logit_cap=2.0), torch.float32)


def tree_rows(num_requests, seed, width=4):
    """[num_requests * 4, width] bool: a random tree of 4 nodes (depth 3, width 1 or depth 1, width 3 and the like)
    per request, the columns past them random."""
    rng = random.Random(seed)
    trees = [random_tree(*rng.choice([(3, 1), (1, 3)]), rng, full=True)[0] for _ in range(num_requests)]
    return tree_mask_for(trees, width, rng)


def chains(num_requests, q_len):
    """[num_requests * q_len, q_len] bool: each token sees its request's earlier tokens."""
    return torch.ones(q_len, q_len, dtype=torch.bool).tril().repeat(num_requests, 1)


@pytest.mark.parametrize("spec", ["prefill", "decode"])
def test_replay_reads_the_current_tree(spec):
    """A verify graph captured with `tree`: the routed backend's tree mask is a view of its static buffer (chains
    at capture); each replay copies that step's tree into it (chains for a step without one), and attention over
    the static metadata and tree matches the reference over the step's tree."""
    mode, layer = ForwardMode.TARGET_VERIFY, AttentionLayer(0, sliding_window=2)
    cache = PagedKVCache(num_pages=20, page_size=4, num_kv_heads=2, head_dim=16, max_pages_per_request=5)
    hybrid = graph_ready(cache, spec)
    hybrid.init_forward_metadata_capture_cuda_graph(2, 8, mode, tree=True)
    phase = routed(hybrid, mode, spec)
    static = phase.forward_batch.tree_mask
    assert static.data_ptr() == phase.tree_buffer.data_ptr() and torch.equal(static, chains(2, 4))
    for seed, tree_mask in enumerate([tree_rows(2, 1), tree_rows(2, 2, width=6), None]):
        case = make_case([4, 4], [7, 2 + seed], page_size=4, seed=seed)
        cache.k_caches[0][: case.k_cache.shape[0]] = case.k_cache
        cache.v_caches[0][: case.v_cache.shape[0]] = case.v_cache
        real = build_metadata(case.q_lens, case.seq_lens.tolist(), case.pages, forward_mode=mode)
        real.tree_mask = tree_mask
        hybrid.init_forward_metadata_replay_cuda_graph(2, real)
        batch = phase.forward_batch
        assert batch.tree_mask.data_ptr() == static.data_ptr()
        assert torch.equal(batch.tree_mask, chains(2, 4) if tree_mask is None else tree_mask[:, :4])
        out = hybrid.forward_extend(case.q, case.k, case.v, layer, real)
        assert_close(out, reference(case, tree_mask=tree_mask, sliding_window=2), torch.float32)


def test_tree_graph_errors():
    """A tree for a graph captured without one, a tree mask narrower than the graph's requests or with more rows,
    and a tree graph whose requests the tree buffer cannot hold, are refused by name; the static buffers stay as
    they were."""
    mode = ForwardMode.TARGET_VERIFY
    cache = PagedKVCache(num_pages=20, page_size=4, num_kv_heads=2, head_dim=16, max_pages_per_request=5)
    hybrid = graph_ready(cache, "decode")
    hybrid.init_forward_metadata_capture_cuda_graph(2, 6, mode)
    real = build_metadata([3, 3], [5, 8], [[0, 1], [2, 3]], forward_mode=mode)
    real.tree_mask = chains(2, 3)
    with pytest.raises(hybrid_ops.HybridInputError, match="captured without one"):
        hybrid.init_forward_metadata_replay_cuda_graph(2, real)
    hybrid.init_forward_metadata_capture_cuda_graph(2, 6, mode, tree=True)
    before = [t.clone() for t in (*hybrid.decode_backend.graph_buffers, hybrid.decode_backend.tree_buffer)]
    for bad in (chains(2, 3)[:, :2], chains(3, 3)):
        real.tree_mask = bad
        with pytest.raises(hybrid_ops.HybridInputError, match="does not fit the graph of bs = 2"):
            hybrid.init_forward_metadata_replay_cuda_graph(2, real)
    after = (*hybrid.decode_backend.graph_buffers, hybrid.decode_backend.tree_buffer)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(hybrid_ops.HybridInputError, match="more than the tree buffer's 128 entries"):
        hybrid.init_forward_metadata_capture_cuda_graph(1, 16, mode, tree=True)
