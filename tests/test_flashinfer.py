"""The FlashInfer backend's CPU-side logic: metadata conversion, plan bookkeeping, planning outside CUDA graphs.

FlashInfer's kernels need CUDA: scripts/gpu_check.py runs them against the reference on a GPU.
"""

import sys
import types

import pytest
import torch
from reference import make_case

import hybrid_ops
from hybrid_ops.backends.flashinfer import FlashInferBackend, to_flashinfer_metadata


def flashinfer_reference(q_lens, seq_lens, tables, page_size):
    """FlashInfer's paged layout, from its documentation: pages of request i at kv_indices[kv_indptr[i]:...]."""
    qo, kv_indptr, kv_indices, last = [0], [0], [], []
    for n, length, table in zip(q_lens, seq_lens, tables):
        pages = -(-length // page_size)
        qo.append(qo[-1] + n)
        kv_indptr.append(kv_indptr[-1] + pages)
        kv_indices += table[:pages]
        last.append(length - (pages - 1) * page_size if pages else 0)
    return qo, kv_indptr, kv_indices, last


@pytest.mark.parametrize("q_lens, seq_lens, page_size, num_kv_heads", [
    ([3, 1, 4], [3, 17, 9], 4, 2),
    ([2, 2], [16, 32], 16, 1),  # exact multiples of the page size, Hkv = 1
    ([1, 0, 5], [1, 0, 5], 4, 2),  # a zero-length request
    ([7], [7], 1, 8),
])
def test_metadata_conversion(q_lens, seq_lens, page_size, num_kv_heads):
    gen = torch.Generator().manual_seed(0)
    max_pages = max(-(-s // page_size) for s in seq_lens) + 2
    tables = [torch.randperm(100, generator=gen)[:max_pages].tolist() for _ in seq_lens]
    batch = hybrid_ops.build_metadata(q_lens, seq_lens, tables, max_pages=max_pages)
    qo, kv_indptr, kv_indices, last = to_flashinfer_metadata(*batch.metadata, page_size)
    want = flashinfer_reference(q_lens, seq_lens, tables, page_size)
    assert all(t.dtype == torch.int32 for t in (qo, kv_indptr, kv_indices, last))
    assert qo.tolist() == want[0] and kv_indptr.tolist() == want[1] and last.tolist() == want[3]
    assert kv_indices[: kv_indptr[-1]].tolist() == want[2]
    assert kv_indices.shape == (len(seq_lens) * max_pages + 1,)  # static: no host sync to size it


class _Wrapper:
    def __init__(self, log, kind, workspace, layout, **kwargs):
        self.log, self.kind = log, kind
        assert layout == "NHD" and workspace.dtype == torch.uint8

    def plan(self, *args, **kwargs):
        self.log.append(("plan", self.kind, args, kwargs))

    def run(self, q, kv_caches):
        self.log.append(("run", self.kind))
        return torch.zeros_like(q)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A stand-in `flashinfer` module whose wrappers record their calls."""
    log = []
    module = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=lambda *a, **k: _Wrapper(log, "decode", *a, **k),
        BatchPrefillWithPagedKVCacheWrapper=lambda *a, **k: _Wrapper(log, "prefill", *a, **k))
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr("hybrid_ops.backends.flashinfer.WORKSPACE_BYTES", 1024)
    return log


def test_plan_once_per_step(fake_flashinfer):
    backend = FlashInferBackend()
    case = make_case([1, 1, 1], [4, 9, 2], page_size=4)
    scale = 0.25
    for _layer in range(3):  # one step, three layers: one plan
        backend.decode(*case.args, scale, 5, 2.0)
    plans = [e for e in fake_flashinfer if e[0] == "plan"]
    assert len(plans) == 1 and sum(e[0] == "run" for e in fake_flashinfer) == 3
    _, kind, args, kwargs = plans[0]
    assert kind == "decode" and kwargs["window_left"] == 4 and kwargs["logits_soft_cap"] == 2.0
    assert kwargs["sm_scale"] == scale and args[3:7] == (4, 2, 16, 4)  # Hq, Hkv, D, page size
    case.seq_lens += 1  # the next step updates the metadata in place: a new version, a new plan
    case.cu_seqlens_q.copy_(case.cu_seqlens_q)
    backend.decode(*case.args, scale, 5, 2.0)
    assert backend.plans_made == 2
    backend.prefill(*case.args, scale, -1, 0.0)  # prefill has its own wrapper
    prefill_plan = [e for e in fake_flashinfer if e[0] == "plan"][-1]
    assert prefill_plan[1] == "prefill" and prefill_plan[3]["causal"] is True
    assert prefill_plan[3]["window_left"] == -1 and prefill_plan[3]["logits_soft_cap"] is None
    assert backend.plans_made == 3
    other = make_case([1, 1, 1], [4, 9, 2], page_size=4)  # new tensors: a new plan, the wrapper reused
    backend.decode(*other.args, scale, 5, 2.0)
    assert backend.plans_made == 4 and len({id(p.wrapper) for p in backend._plans.values()}) == 2
    with torch.inference_mode():  # inference tensors have no version: identity alone, and an explicit plan re-plans
        step = make_case([1, 1, 1], [4, 9, 2], page_size=4)
        for _layer in range(2):
            backend.decode(*step.args, scale, 5, 2.0)
        assert backend.plans_made == 5
        backend.plan("decode", step.q.dtype, step.q.shape[1], step.k_cache, *step.args[5:], scale, 5, 2.0)
        assert backend.plans_made == 6


def test_plan_op_is_kept_and_marked_cudagraph_unsafe():
    """Inductor keeps hybrid::plan (no outputs) ahead of the attention, and its own partition predicate puts it
    outside the CUDA-graph partitions while hybrid::attn stays inside."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    seen = {}

    class Capture(CustomGraphPass):
        def __call__(self, graph):
            for node in graph.nodes:
                # The mutating attn op sits inside auto_functionalized_v2 until inductor re-inplaces it.
                name = str(node.args[0] if "auto_functionalized" in str(node.target) else node.target)
                if node.op == "call_function" and "hybrid" in name:
                    seen.setdefault(name, []).append(is_cudagraph_unsafe_fx_node(node))

        def uuid(self):
            return None

    case = make_case([3, 2], [4, 0])

    def forward(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, forward_mode: int):
        torch.ops.hybrid.plan(k_cache, cu_seqlens_q, seq_lens, block_table, forward_mode, q_dtype=q.dtype,
                              num_q_heads=q.shape[1])
        return torch.ops.hybrid.attn(q.sin(), k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table,
                                     forward_mode).cos()

    torch._dynamo.reset()
    with torch._inductor.config.patch(graph_partition=True, post_grad_custom_post_pass=Capture(),
                                      force_disable_caches=True):
        torch.compile(forward, fullgraph=True, dynamic=True)(*case.args, 1)
    assert seen == {"hybrid.plan.default": [True], "hybrid.attn.default": [False]}, seen


def test_clear_errors():
    case = make_case([2], [3])
    backend = hybrid_ops.get_backend.__globals__["_BACKENDS"]["flashinfer"]
    want = "needs flashinfer" if not backend.is_available() else "does not support q on cpu"
    with pytest.raises(hybrid_ops.HybridInputError, match=want):
        torch.ops.hybrid.prefill(*case.args, backend="flashinfer")
    torch.ops.hybrid.plan(case.k_cache, *case.args[5:], 1, q_dtype=torch.float32, num_q_heads=4)  # no-op: torch
