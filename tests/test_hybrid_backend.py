"""HybridAttnBackend routes each per-step call as sglang's does; pinned by a table."""

import pytest
import torch
from reference import assert_close, make_case, reference

from hybrid_ops import AttentionLayer, ForwardMode, HybridAttnBackend, PagedKVCache, PhaseBackend, build_metadata

P, D = "prefill", "decode"
# (forward mode, speculative_attention_mode) -> which backend init_forward_metadata / forward_extend /
# get_indexer_metadata / capture / replay reach.
ROUTES = {
    (ForwardMode.EXTEND, "prefill"): P, (ForwardMode.EXTEND, "decode"): P,
    (ForwardMode.DECODE, "prefill"): D, (ForwardMode.DECODE, "decode"): D,
    (ForwardMode.MIXED, "prefill"): P, (ForwardMode.MIXED, "decode"): P,
    (ForwardMode.IDLE, "prefill"): D, (ForwardMode.IDLE, "decode"): D,
    (ForwardMode.TARGET_VERIFY, "prefill"): P, (ForwardMode.TARGET_VERIFY, "decode"): D,
    (ForwardMode.DRAFT_EXTEND, "prefill"): P, (ForwardMode.DRAFT_EXTEND, "decode"): D,
}
# (speculative, speculative_attention_mode) -> backends whose CUDA-graph state is set up.
GRAPH_STATE = {
    (False, "prefill"): {D}, (False, "decode"): {D},
    (True, "prefill"): {P, D}, (True, "decode"): {D},
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
    cache = PagedKVCache(num_pages=decode.k_cache.shape[0], page_size=4, num_kv_heads=2, head_dim=16,
                         max_pages_per_request=decode.block_table.shape[1])
    cache.k_caches[0].copy_(decode.k_cache)
    cache.v_caches[0].copy_(decode.v_cache)
    hybrid = HybridAttnBackend(PhaseBackend(cache, "torch"), PhaseBackend(cache, "torch"))
    hybrid.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    hybrid.init_forward_metadata_capture_cuda_graph(2, 2, ForwardMode.DECODE)
    real = build_metadata([1, 1], decode.seq_lens.tolist(), decode.pages, forward_mode=ForwardMode.DECODE)
    hybrid.init_forward_metadata_replay_cuda_graph(2, real)
    out = hybrid.forward_decode(decode.q, decode.k, decode.v, AttentionLayer(0), real)
    assert_close(out, reference(decode), torch.float32)
