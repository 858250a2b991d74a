"""The FlashInfer backend run through FlashInfer's own Python code, on the CPU, with its compiled kernels replaced
(helpers/flashinfer_stand_in.py): outputs compared with the float64 reference check what the backend passed to
FlashInfer (index arrays, window, soft-cap, scale, causal alignment, custom masks, the cache's dtype and scales),
and the kernel calls it records check which variants were planned and, for CUDA graphs, which buffers a captured call
reads. FlashInfer's kernels themselves are checked on a GPU by scripts/gpu_check.py.
"""

import dataclasses
import random

import numpy
import pytest
import torch
from helpers.cases import FP8_CASES, check_fp8_call, scales
from helpers.flashinfer_stand_in import HALF, cuda_graph_capture, install, replay
from helpers.reference import (
    assert_close,
    expected_cache,
    fp8_case,
    make_case,
    random_tree,
    reference,
    slow_except,
    tree_mask_for,
    tree_sees,
)

import hybrid_ops
from hybrid_ops import ROUTING, ForwardMode
from hybrid_ops.backends.flashinfer import FlashInferBackend, to_flashinfer_metadata
from hybrid_ops.buckets import plan_for_graph
from hybrid_ops.options import Options

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
D = 64  # the smallest head dim FlashInfer's wrappers take


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


@pytest.mark.parametrize(
    "q_lens, seq_lens, page_size, padding",
    [
        ([3, 1, 4], [3, 17, 9], 4, "stale"),  # unused table entries name other pages
        ([3, 1, 4], [3, 17, 9], 4, -1),  # ... or hold -1
        ([2, 2], [16, 32], 16, -1),  # exact multiples of the page size
        ([1, 0, 5], [1, 0, 5], 4, -1),  # a zero-length request
        ([7], [7], 1, "stale"),
    ],
)
def test_metadata_conversion(q_lens, seq_lens, page_size, padding):
    gen = torch.Generator().manual_seed(0)
    max_pages = max(-(-s // page_size) for s in seq_lens) + 2
    tables = [torch.randperm(100, generator=gen)[:max_pages].tolist() for _ in seq_lens]
    if padding == -1:
        tables = [t[: -(-s // page_size)] + [-1] * (max_pages + s // -page_size) for t, s in zip(tables, seq_lens)]
    batch = hybrid_ops.build_metadata(q_lens, seq_lens, tables, max_pages=max_pages)
    qo, kv_indptr, kv_indices, last = to_flashinfer_metadata(*batch.metadata, page_size)
    want = flashinfer_reference(q_lens, seq_lens, tables, page_size)
    assert all(t.dtype == torch.int32 for t in (qo, kv_indptr, kv_indices, last))
    assert qo.tolist() == want[0] and kv_indptr.tolist() == want[1] and last.tolist() == want[3]
    assert kv_indices[: kv_indptr[-1]].tolist() == want[2]
    assert kv_indices.shape == (len(seq_lens) * max_pages + 1,)  # static: no host sync to size it


@pytest.fixture
def flashinfer_on_cpu(monkeypatch):
    """(a fresh registered FlashInferBackend, the Kernels stand-in), with FlashInfer's Python code running on CPU
    tensors."""
    pytest.importorskip("flashinfer")
    kernels = install(monkeypatch)
    backend = FlashInferBackend()
    with hybrid_ops.register_backend(backend):
        yield backend, kernels


def attn_options(backend="flashinfer", spec="prefill", sliding_window=-1, logit_cap=0.0):
    return dict(
        sliding_window=sliding_window,
        logit_cap=logit_cap,
        prefill_backend=backend,
        decode_backend=backend,
        speculative_attention_mode=spec,
    )


def step_case(mode, spec, dtype=torch.float16, seed=0, prefixes=(9, 0, 6, 13)):
    """A batch for `mode`: none for IDLE; 1 or 3 tokens per request on the decode path; ragged on the prefill path
    (with a request of no new tokens)."""
    if mode == ForwardMode.IDLE:
        q_lens = []
    elif hybrid_ops.select_path(mode, spec) == "decode":
        q_lens = [1 if mode == ForwardMode.DECODE else 3] * 3
    else:
        q_lens = [7, 1, 0, 5]
    return make_case(q_lens, list(prefixes[: len(q_lens)]), head_dim=D, dtype=dtype, seed=seed)


@pytest.mark.parametrize("spec", ["prefill", "decode"])
@pytest.mark.parametrize("mode", list(ROUTING))
def test_every_mode(flashinfer_on_cpu, mode, spec):
    backend, kernels = flashinfer_on_cpu
    dtype = HALF[int(mode) % 2]
    case = step_case(mode, spec, dtype, seed=int(mode))
    k_want, v_want = expected_cache(case)
    options = attn_options(spec=spec, sliding_window=6, logit_cap=2.0)
    out = torch.ops.hybrid.attn(*case.args, int(mode), **options)
    assert_close(out, reference(case, sliding_window=6, logit_cap=2.0), dtype)
    assert torch.equal(case.k_cache, k_want) and torch.equal(case.v_cache, v_want)
    planned = mode != ForwardMode.IDLE
    assert (backend.plans_made, len(kernels.runs)) == (planned, planned)
    if hybrid_ops.select_path(mode, spec) == "decode" and planned:  # rows of a multi-token decode are causal
        assert kernels.runs[0]["causal"] == (mode != ForwardMode.DECODE)


@pytest.mark.parametrize("mode, spec", [(ForwardMode.EXTEND, "prefill"), (ForwardMode.TARGET_VERIFY, "decode")])
def test_requests_without_new_tokens(flashinfer_on_cpu, mode, spec):
    """T = 0 with B > 0: an empty output, no plan, the cache untouched."""
    backend, kernels = flashinfer_on_cpu
    case = make_case([0, 0], [5, 3], head_dim=D, dtype=torch.float16)
    k_before = case.k_cache.clone()
    torch.ops.hybrid.plan(
        case.k_cache, *case.args[5:], int(mode), q_dtype=case.q.dtype, num_q_heads=4, **attn_options(spec=spec)
    )
    out = torch.ops.hybrid.attn(*case.args, int(mode), **attn_options(spec=spec))
    assert out.shape == (0, 4, D) and torch.equal(case.k_cache, k_before)
    assert backend.plans_made == 0 and not kernels.runs


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_one_plan_per_variant(flashinfer_on_cpu, path):
    """Six layers alternating windows and soft-caps (four variants): four plans a step, each layer run with its own
    variant's window, cap and scale."""
    backend, _ = flashinfer_on_cpu
    layers = [dict(sliding_window=5 if i % 2 else -1, logit_cap=0.0 if i % 3 else 2.0) for i in range(6)]
    q_lens = [1, 1, 1] if path == "decode" else [4, 0, 6]
    for step in range(2):  # the second step: longer requests, new metadata tensors
        case = make_case(q_lens, [6 + 5 * step, 9, 2 + step], head_dim=D, dtype=torch.bfloat16, seed=step)
        for layer in layers:
            out = getattr(backend, path)(*case.args, Options(scale=0.2, **layer))
            assert_close(out, reference(case, scale=0.2, **layer), torch.bfloat16)
        assert backend.plans_made == 4 * (step + 1)


def test_plan_op_before_the_layers(flashinfer_on_cpu):
    """`hybrid::plan` per variant ahead of the layers: the layers plan nothing. Metadata made under inference_mode
    has no version, so a step that rewrites it in place must call `hybrid::plan` again (and does here)."""
    backend, _ = flashinfer_on_cpu
    windows = (-1, 4)
    with torch.inference_mode():
        step = make_case([1, 1], [6, 11], head_dim=D, dtype=torch.float16)
        for seed in range(3):
            new = make_case([1, 1], [6, 11], head_dim=D, dtype=torch.float16, seed=seed)  # other pages and values
            for tensor, value in zip(step.args, new.args):
                tensor.copy_(value)
            for window in windows:
                torch.ops.hybrid.plan(
                    step.k_cache,
                    *step.args[5:],
                    int(ForwardMode.DECODE),
                    q_dtype=step.q.dtype,
                    num_q_heads=4,
                    **attn_options(sliding_window=window),
                )
            for window in windows * 2:
                out = torch.ops.hybrid.attn(*step.args, int(ForwardMode.DECODE), **attn_options(sliding_window=window))
                assert_close(out, reference(new, sliding_window=window), torch.float16)
            assert backend.plans_made == 2 * (seed + 1)


BUFFERS = ("qo_indptr", "kv_indptr", "kv_indices", "last_page_len")
GRAPH_STEPS = {  # (mode, speculative_attention_mode, q_lens): the same B and T at every step
    "decode": (ForwardMode.DECODE, "prefill", [1, 1, 1]),
    "verify-decode": (ForwardMode.TARGET_VERIFY, "decode", [3, 3, 3]),
    "verify-prefill": (ForwardMode.TARGET_VERIFY, "prefill", [3, 3, 3]),
    "extend": (ForwardMode.EXTEND, "prefill", [70, 2, 0]),  # past 64 query rows FlashInfer plans FA3 on an H200
}
# One kind of step in the fast tier (extend's 70 query rows take seconds through the stand-in kernels).
GRAPH_STEP_CASES = slow_except(GRAPH_STEPS["decode"], GRAPH_STEPS.values())


@pytest.mark.parametrize("mode, spec, q_lens", GRAPH_STEP_CASES, ids=list(GRAPH_STEPS))
def test_cuda_graph_replays(flashinfer_on_cpu, monkeypatch, mode, spec, q_lens):
    """reduce-overhead's sequence, step by step: `hybrid::plan(cuda_graph=True)` per variant, an eager warm-up, a
    capture in which the layers get copies of the metadata and must not plan, then steps that plan outside the
    graph and replay the captured calls. Those read the CUDA-graph wrappers' fixed buffers, so each replay attends
    over its own step's batch (block tables padded with -1), with the plan info of the capture."""
    backend, kernels = flashinfer_on_cpu
    windows, width = (-1, 5), 24
    k_cache = torch.zeros(48, 4, 2, D, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)

    def load(seed):
        """Step `seed`'s batch in the persistent cache (with the new tokens stored), its table padded with -1."""
        case = make_case(q_lens, [3 + 4 * seed, 9, 5 + seed], head_dim=D, dtype=torch.float16, seed=seed)
        k_new, v_new = expected_cache(case)
        k_cache[: k_new.shape[0]], v_cache[: v_new.shape[0]] = k_new, v_new
        table = torch.full((len(q_lens), width), -1, dtype=torch.int32)
        for i, pages in enumerate(case.pages):
            table[i, : len(pages)] = torch.tensor(pages)
        return case, (case.cu_seqlens_q, case.seq_lens, table)

    def plan(metadata, window):
        options = attn_options(spec=spec, sliding_window=window)
        torch.ops.hybrid.plan(
            k_cache, *metadata, int(mode), q_dtype=torch.float16, num_q_heads=4, cuda_graph=True, **options
        )

    def attn(case, metadata, window):
        options = attn_options(spec=spec, sliding_window=window)
        return torch.ops.hybrid.attn(case.q, case.k, case.v, k_cache, v_cache, *metadata, int(mode), **options)

    case, metadata = load(0)
    for window in windows:
        plan(metadata, window)
    for window in windows:  # the warm-up
        assert_close(attn(case, metadata, window), reference(case, sliding_window=window), torch.float16)
    captured = len(kernels.runs)
    with cuda_graph_capture(monkeypatch, kernels):
        with pytest.raises(RuntimeError, match="capturing"):
            plan(metadata, windows[0])
        copies = tuple(t.clone() for t in metadata)  # as CUDA-graph trees hand them to the captured partition
        outs = [attn(case, copies, window) for window in windows]
        with pytest.raises(hybrid_ops.HybridInputError, match="no CUDA-graph plan"):
            attn(case, copies, 3)
    graph = kernels.runs[captured:]
    assert backend.plans_made == 2 and len(graph) == 2
    for seed in (1, 2):
        case, metadata = load(seed)
        for window in windows:
            plan(metadata, window)
        graph[0]["q"].copy_(case.q)
        replay(graph)
        for out, window in zip(outs, windows):
            assert_close(out, reference(case, sliding_window=window), torch.float16)
        assert backend.plans_made == 2 + 2 * seed
        for call, window in zip(graph, windows):  # an eager call now runs the same plan on the same buffers
            attn(case, metadata, window)
            run = kernels.runs[-1]
            assert run["plan_info"] == call["plan_info"] and run["plan_info"][5]  # planned for CUDA graphs
            assert all(run[name].data_ptr() == call[name].data_ptr() for name in BUFFERS)


@pytest.mark.slow
def test_compiled_plan_then_attn(flashinfer_on_cpu):
    """Inductor keeps hybrid::plan (no outputs) ahead of the attention, and its own partition predicate puts it
    outside the CUDA-graph partitions while hybrid::attn stays inside; the compiled step plans once, for CUDA
    graphs, and the attention runs that plan."""
    from torch._inductor.custom_graph_pass import CustomGraphPass
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node

    backend, kernels = flashinfer_on_cpu
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

    def forward(q, k, v, k_cache, v_cache, *metadata_and_mode):
        """metadata_and_mode: cu_seqlens_q, seq_lens, block_table and forward_mode (an int)."""
        options = attn_options(logit_cap=2.0)
        torch.ops.hybrid.plan(
            k_cache, *metadata_and_mode, q_dtype=q.dtype, num_q_heads=q.shape[1], cuda_graph=True, **options
        )
        return torch.ops.hybrid.attn(q.sin(), k, v, k_cache, v_cache, *metadata_and_mode, **options).cos()

    case = make_case([3, 2], [4, 0], head_dim=D, dtype=torch.float16)
    want = reference(dataclasses.replace(case, q=case.q.sin()), logit_cap=2.0).cos()
    torch._dynamo.reset()
    with torch._inductor.config.patch(
        graph_partition=True, post_grad_custom_post_pass=Capture(), force_disable_caches=True
    ):
        out = torch.compile(forward, fullgraph=True, dynamic=True)(*case.args, int(ForwardMode.EXTEND))
    assert seen == {"hybrid.plan.default": [True], "hybrid.attn.default": [False]}, seen
    assert_close(out, want, torch.float16)
    assert backend.plans_made == 1 and kernels.runs[-1]["plan_info"][5]


def test_multi_token_decode_graphs_stay_on_fa2(flashinfer_on_cpu):
    """On an SM90, `backend="auto"` would route an fp16 CUDA-graph decode of 16 x 4 tokens over KV lengths all 1024
    (D 128, page 16, 32/8 heads) to XQA, then refuse the next plan, whose lengths differ. Ours names fa2."""
    backend, _ = flashinfer_on_cpu
    k_cache = torch.empty(16 * 65, 16, 8, 128, dtype=torch.float16)
    cu_seqlens_q = torch.arange(17, dtype=torch.int32) * 4
    block_table = torch.arange(16 * 65, dtype=torch.int32).view(16, 65)
    for seq_lens in ([1024] * 16, list(range(1024, 1040))):
        backend.plan(
            "decode",
            torch.float16,
            32,
            k_cache,
            cu_seqlens_q,
            torch.tensor(seq_lens, dtype=torch.int32),
            block_table,
            Options(scale=0.1),
            cuda_graph=True,
        )
    assert backend.plans_made == 2


def planned_fp8(kernels, q_dtype, cache_dtype):
    """Whether every kernel module FlashInfer asked for is fa2's for this q and fp8 cache, and every run read the
    fp8 cache."""
    return (
        bool(kernels.modules)
        and all(m[:4] == ("fa2", q_dtype, cache_dtype, q_dtype) for m in kernels.modules)
        and all(run["k_cache"].dtype == run["v_cache"].dtype == cache_dtype for run in kernels.runs)
    )


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_cache(flashinfer_on_cpu, name, cache_dtype):
    """test_fp8's conformance cases at FlashInfer's head dim, an fp32 q as fp16 (FlashInfer has no fp32-q kernel):
    the cache holds `reference.to_fp8` of the inputs, FlashInfer plans and runs its fp8 kernels, and the output is
    float64 attention over the dequantized cache."""
    _, kernels = flashinfer_on_cpu
    op, case_kwargs, options, dtype, kind = FP8_CASES[name]
    dtype = torch.float16 if dtype == torch.float32 else dtype
    case = make_case(**{**case_kwargs, "head_dim": D}, dtype=dtype)
    check_fp8_call(getattr(torch.ops.hybrid, op), case, cache_dtype, kind, options, backend="flashinfer")
    assert planned_fp8(kernels, dtype, cache_dtype) and len(kernels.runs) == 1


@pytest.mark.parametrize("spec", ["prefill", "decode"])
@pytest.mark.parametrize("mode", list(ROUTING))
def test_fp8_every_mode(flashinfer_on_cpu, mode, spec):
    backend, kernels = flashinfer_on_cpu
    dtype, cache_dtype = HALF[int(mode) % 2], (E4M3, E5M2)[int(mode) // 2 % 2]
    case = step_case(mode, spec, dtype, seed=int(mode))
    check_fp8_call(
        torch.ops.hybrid.attn,
        case,
        cache_dtype,
        "per_head",
        dict(sliding_window=6, logit_cap=2.0),
        forward_mode=int(mode),
        prefill_backend="flashinfer",
        decode_backend="flashinfer",
        speculative_attention_mode=spec,
    )
    planned = mode != ForwardMode.IDLE
    assert backend.plans_made == planned and (planned_fp8(kernels, dtype, cache_dtype) or not planned)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_fp8_new_scales_without_replanning(flashinfer_on_cpu, mode):
    """`hybrid::plan` once, then calls with other scales, written into the same tensors (as a CUDA graph's inputs)
    or in new ones: each attends with its own scales, and nothing plans again."""
    backend, kernels = flashinfer_on_cpu
    case = make_case(
        [1, 1, 1] if mode == ForwardMode.DECODE else [5, 0, 3], [6, 9, 2], head_dim=D, dtype=torch.bfloat16
    )
    torch.ops.hybrid.plan(
        case.k_cache.to(E4M3), *case.args[5:], int(mode), q_dtype=torch.bfloat16, num_q_heads=4, **attn_options()
    )
    k_scale, v_scale = torch.empty(2), torch.empty(2)
    for seed in range(3):
        for tensor, value in zip((k_scale, v_scale), scales("per_head", 2, seed)):
            tensor.copy_(value)
        fp8, read, _ = fp8_case(case, E4M3, k_scale, v_scale)  # the same metadata tensors
        out = torch.ops.hybrid.attn(*fp8.args, int(mode), k_scale=k_scale, v_scale=v_scale, **attn_options())
        assert_close(out, reference(read), torch.bfloat16)
    check_fp8_call(torch.ops.hybrid.attn, case, E4M3, "one", {}, forward_mode=int(mode), **attn_options())
    assert backend.plans_made == 1 and planned_fp8(kernels, torch.bfloat16, E4M3) and len(kernels.runs) == 4


@pytest.mark.parametrize("mode, spec, q_lens", GRAPH_STEP_CASES, ids=list(GRAPH_STEPS))
def test_fp8_cuda_graph(flashinfer_on_cpu, monkeypatch, mode, spec, q_lens):
    """fp8 caches through the CUDA-graph path: `hybrid::plan(cuda_graph=True)` plans FlashInfer's fp8 kernels into
    the CUDA-graph wrappers, and the layer captured after an eager warm-up plans nothing and reads no scale to the
    host. Run again as a replay runs it (each step planned outside the graph, its scales written into the captured
    scale tensors), it stores and attends over that step with those scales."""
    backend, kernels = flashinfer_on_cpu
    k_cache = torch.zeros(48, 4, 2, D, dtype=E5M2)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.empty(2), torch.empty(2)
    for seed in range(3):
        case = make_case(q_lens, [3 + 4 * seed, 9, 5 + seed], head_dim=D, dtype=torch.bfloat16, seed=seed)
        for tensor, value in zip((k_scale, v_scale), scales("per_head", 2, seed)):
            tensor.copy_(value)
        fp8, read, (k_want, v_want) = fp8_case(case, E5M2, k_scale, v_scale)
        pages = fp8.k_cache.shape[0]
        k_cache[:pages], v_cache[:pages] = fp8.k_cache, fp8.v_cache
        table = torch.full((len(q_lens), 24), -1, dtype=torch.int32)  # padded, as the graph's static table
        for i, ids in enumerate(case.pages):
            table[i, : len(ids)] = torch.tensor(ids)
        metadata = (case.cu_seqlens_q, case.seq_lens, table)
        options = attn_options(spec=spec)
        torch.ops.hybrid.plan(
            k_cache, *metadata, int(mode), q_dtype=torch.bfloat16, num_q_heads=4, cuda_graph=True, **options
        )

        def attn(metadata):
            scales = dict(k_scale=k_scale, v_scale=v_scale)
            return torch.ops.hybrid.attn(
                case.q, case.k, case.v, k_cache, v_cache, *metadata, int(mode), **scales, **options
            )

        if seed == 0:  # the warm-up
            assert_close(attn(metadata), reference(read), torch.bfloat16)
        with cuda_graph_capture(monkeypatch, kernels):
            out = attn(tuple(t.clone() for t in metadata))  # copies, as CUDA-graph trees hand them over
        assert_close(out, reference(read), torch.bfloat16)
        assert torch.equal(k_cache[:pages].view(torch.uint8), k_want)
        assert torch.equal(v_cache[:pages].view(torch.uint8), v_want)
        assert backend.plans_made == seed + 1 and kernels.runs[-1]["plan_info"][5]  # planned for CUDA graphs
    assert planned_fp8(kernels, torch.bfloat16, E5M2)


def test_fp8_fp32_q_goes_to_another_backend(flashinfer_on_cpu):
    """FlashInfer has no kernel for fp32 q (fp8 caches included): named, it is refused naming q's dtype; preferred,
    "auto" takes it for bf16 q and passes fp32 q to another backend."""
    backend, kernels = flashinfer_on_cpu
    with hybrid_ops.register_backend(backend, prefer=True):
        for dtype in (torch.bfloat16, torch.float32):
            case = make_case([3, 1], [5, 8], head_dim=D, dtype=dtype)
            check_fp8_call(torch.ops.hybrid.prefill, case, E5M2, "per_head", {}, backend="auto")
            assert len(kernels.runs) == 1  # the bf16 call's
        fp8 = fp8_case(case, E5M2, *scales("per_head", 2))[0]
        with pytest.raises(
            hybrid_ops.HybridInputError, match="'flashinfer' does not support q on cpu with dtype torch.float32"
        ):
            torch.ops.hybrid.prefill(*fp8.args, k_scale=torch.ones(2), v_scale=torch.ones(2), backend="flashinfer")


# -- speculative trees: FlashInfer's custom mask ---------------------------------------------------------------------

TREE_OPTIONS = {
    "plain": {},
    "window": dict(sliding_window=3),  # shorter than the trees' depths: positions, not slots, decide
    "softcap_scale": dict(logit_cap=2.0, scale=0.2),
    "window_softcap": dict(sliding_window=5, logit_cap=2.0),
}


def tree_case(shapes, prefixes, width, seed, dtype=torch.float16, full=False, unread=False):
    """A batch of random EAGLE-style trees: shapes[i] = (depth, width) of request i's tree (`full`: exactly that
    many nodes a level), None for a request without new tokens. Returns (case, tree_mask [T, width] bool), whose
    columns past a request's tokens are random; with `unread`, so are the entries above the diagonal, and the
    diagonal is False (the ops read neither)."""
    rng = random.Random(seed)
    empty = torch.zeros(0, 0, dtype=torch.bool)
    trees = [empty if shape is None else random_tree(*shape, rng, full=full)[0] for shape in shapes]
    q_lens = [tree.shape[0] for tree in trees]
    case = make_case(q_lens, prefixes, num_q_heads=8, num_kv_heads=2, head_dim=D, dtype=dtype, seed=seed)
    tree_mask = tree_mask_for(trees, width, rng, above=unread)
    if unread:
        for start, n in zip(case.cu_seqlens_q.tolist(), q_lens):
            tree_mask[start + torch.arange(n), torch.arange(n)] = False
    return case, tree_mask


def flashinfer_mask_reference(case, tree_mask, sliding_window):
    """FlashInfer's custom mask as its documentation lays it out: per request a [q_len, kv_len] bool block, row j
    the keys its new token j sees (the prefix, the new tokens `tree_sees` names; with a window, keys at positions
    within it, a new token's position prefix + the earlier new tokens it sees). A list of blocks."""
    blocks, start = [], 0
    for n, prefix in zip(case.q_lens, case.prefix_lens):
        sees = tree_sees(tree_mask, start, n)
        position = list(range(prefix)) + [prefix + sum(row) - 1 for row in sees]
        block = torch.zeros(n, prefix + n, dtype=torch.bool)
        for j in range(n):
            for key in range(prefix + n):
                in_window = sliding_window <= 0 or position[key] > position[prefix + j] - sliding_window
                block[j, key] = (key < prefix or sees[j][key - prefix]) and in_window
        blocks.append(block)
        start += n
    return blocks


@pytest.mark.parametrize("sliding_window", [-1, 3])
@pytest.mark.parametrize(
    "shapes, prefixes", [([(6, 4), None, (1, 1), (3, 2)], [30, 5, 0, 17]), ([(2, 3)] * 5, [1, 9, 40, 0, 7])]
)
def test_custom_mask_layout(shapes, prefixes, sliding_window):
    """`kernels.custom_mask` against FlashInfer's documented layout: packed, each request's block flattened row-major
    and packed little-endian (numpy.packbits) from byte indptr[i], request after request; unpacked, the flat bools
    FlashInfer's plan takes. Bytes past the mask are left as they were; the tree's entries on and above the diagonal
    are not read."""
    from hybrid_ops.kernels.custom_mask import custom_mask

    case, tree_mask = tree_case(shapes, prefixes, 64, seed=len(shapes), unread=True)
    blocks = flashinfer_mask_reference(case, tree_mask, sliding_window)
    packed = [numpy.packbits(block.flatten().numpy(), bitorder="little") for block in blocks]
    want = torch.from_numpy(numpy.concatenate(packed))
    indptr = torch.empty(len(shapes) + 1, dtype=torch.int32)
    out = torch.full((want.numel() + 40,), 0xA5, dtype=torch.uint8)
    custom_mask(tree_mask, case.cu_seqlens_q, case.seq_lens, sliding_window, out, indptr)
    assert indptr.tolist() == [0, *numpy.cumsum([p.size for p in packed]).tolist()]
    assert torch.equal(out[: want.numel()], want) and (out[want.numel() :] == 0xA5).all()
    flat = torch.cat([block.flatten() for block in blocks])
    out = torch.zeros(flat.numel() + 40, dtype=torch.bool)
    custom_mask(tree_mask, case.cu_seqlens_q, case.seq_lens, sliding_window, out, indptr)
    assert torch.equal(out[: flat.numel()], flat) and not out[flat.numel() :].any()
    assert indptr.tolist() == [0, *numpy.cumsum([block.numel() for block in blocks]).tolist()]


def ran_trees(kernels):
    """Whether FlashInfer planned fa2's prefill kernel without its sliding window (the window is in the mask) for
    every run, and every run read a custom mask."""
    # get_batch_prefill_module(backend, q, kv, o, index dtype, head dims, pos encoding, window, ...)
    return (
        bool(kernels.runs)
        and all(m[0] == "fa2" and not m[8] for m in kernels.modules)
        and all(run["custom_mask"] is not None and run["window_left"] == -1 for run in kernels.runs)
    )


TREE_CASES = {  # op, trees (depth, width) per request, the tree mask's width Q
    "prefill-ragged": ("prefill", [(1, 1), None, (3, 2), (6, 4)], 64),  # a request without new tokens, Q = 64
    "prefill": ("prefill", [(4, 3), (2, 4)], 30),
    "verify": ("decode", [(3, 2)] * 3, 9),  # the decode path: as many nodes in every tree
    "verify-chains": ("decode", [(6, 1)] * 2, 7),
}


@pytest.mark.parametrize("option", TREE_OPTIONS)
@pytest.mark.parametrize("name", TREE_CASES)
def test_trees(flashinfer_on_cpu, name, option):
    """Random trees through FlashInfer's prefill wrapper on both paths, against the float64 reference over the same
    tree: the output checks the custom mask's values, read as FlashInfer's kernels read them."""
    backend, kernels = flashinfer_on_cpu
    op, shapes, width = TREE_CASES[name]
    dtype = HALF[len(name) % 2]
    rng = random.Random(width)
    prefixes = [rng.randint(0, 40) for _ in shapes]
    case, tree_mask = tree_case(shapes, prefixes, width, len(option), dtype, full=op == "decode", unread=True)
    options = TREE_OPTIONS[option]
    k_want, v_want = expected_cache(case)
    out = getattr(torch.ops.hybrid, op)(*case.args, tree_mask=tree_mask, backend="flashinfer", **options)
    assert_close(out, reference(case, tree_mask=tree_mask, **options), dtype)
    assert torch.equal(case.k_cache, k_want) and torch.equal(case.v_cache, v_want)
    assert backend.plans_made == 1 and ran_trees(kernels)


@pytest.mark.parametrize("spec", ["prefill", "decode"])
@pytest.mark.parametrize(
    "mode",
    [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2],
)
def test_tree_every_mode(flashinfer_on_cpu, mode, spec):
    backend, kernels = flashinfer_on_cpu
    dtype = HALF[int(mode) % 2]
    decode_path = hybrid_ops.select_path(mode, spec) == "decode"
    shapes = [(0, 1)] * 3 if mode == ForwardMode.DECODE else [(2, 2)] * 3 if decode_path else [(3, 2), (1, 3), (2, 1)]
    case, tree_mask = tree_case(shapes, [9, 0, 21], 8, seed=int(mode), dtype=dtype, full=decode_path)
    options = attn_options(spec=spec, sliding_window=4, logit_cap=2.0)
    out = torch.ops.hybrid.attn(*case.args, int(mode), tree_mask=tree_mask, **options)
    assert_close(out, reference(case, tree_mask=tree_mask, sliding_window=4, logit_cap=2.0), dtype)
    assert backend.plans_made == 1 and ran_trees(kernels)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_tree_fp8_cache(flashinfer_on_cpu, op, cache_dtype):
    """fp8 caches under a tree: FlashInfer's fp8 kernels with the custom mask, the scales applied around them."""
    _, kernels = flashinfer_on_cpu
    shapes = [(3, 2)] * 2 if op == "decode" else [(4, 3), (2, 2), None]
    case, tree_mask = tree_case(
        shapes, [13, 0, 6][: len(shapes)], 12, seed=3, dtype=torch.bfloat16, full=op == "decode"
    )
    options = dict(tree_mask=tree_mask, sliding_window=4, logit_cap=2.0)
    check_fp8_call(getattr(torch.ops.hybrid, op), case, cache_dtype, "per_head", options, backend="flashinfer")
    assert planned_fp8(kernels, torch.bfloat16, cache_dtype) and ran_trees(kernels)


def test_tree_plans(flashinfer_on_cpu):
    """Layers of a variant share its plan while the tree mask is the same tensor at the same version; a tree written
    in place, or another tensor, plans again. Tree variants (two windows) and a causal one plan apart, and each layer
    attends with its own."""
    backend, kernels = flashinfer_on_cpu
    layers = [dict(tree=True), dict(tree=True, sliding_window=3), dict(tree=False), dict(tree=True)]
    case, tree_mask = tree_case([(3, 2), (2, 3)], [11, 4], 8, seed=0, full=True)
    for step in range(3):
        if step:  # new trees, in the same tensor and then in a new one
            new = tree_case([(3, 2), (2, 3)], [11, 4], 8, seed=step, full=True)[1]
            tree_mask = tree_mask.copy_(new) if step == 1 else new
        for layer in layers:
            options = dict(sliding_window=layer.get("sliding_window", -1), scale=0.2)
            tree = tree_mask if layer["tree"] else None
            out = backend.prefill(*case.args, Options(tree_mask=tree, **options))
            assert_close(out, reference(case, tree_mask=tree, **options), torch.float16)
        assert backend.plans_made == 3 + 2 * step
    assert sum(run["custom_mask"] is None for run in kernels.runs) == 3  # the causal layer's


def test_tree_plan_op(flashinfer_on_cpu):
    """`hybrid::plan` with a tree plans the tree variant: the layers after it plan nothing."""
    backend, _ = flashinfer_on_cpu
    case, tree_mask = tree_case([(2, 2)] * 2, [6, 11], 6, seed=4, full=True)
    options = attn_options(spec="decode", sliding_window=2)
    mode = int(ForwardMode.TARGET_VERIFY)
    torch.ops.hybrid.plan(
        case.k_cache, *case.args[5:], mode, q_dtype=torch.float16, num_q_heads=8, tree_mask=tree_mask, **options
    )
    for _ in range(2):
        out = torch.ops.hybrid.attn(*case.args, mode, tree_mask=tree_mask, **options)
        assert_close(out, reference(case, tree_mask=tree_mask, sliding_window=2), torch.float16)
    assert backend.plans_made == 1


TREE_GRAPH_STEPS = {  # (mode, speculative_attention_mode, tree shapes): the same B and T at every step
    "verify-decode": (ForwardMode.TARGET_VERIFY, "decode", [(2, 2)] * 3),
    "verify-prefill": (ForwardMode.TARGET_VERIFY, "prefill", [(2, 2)] * 3),
    "draft-extend": (ForwardMode.DRAFT_EXTEND_V2, "prefill", [(3, 2), None, (1, 1)]),  # ragged
}
TREE_GRAPH_STEP_CASES = slow_except(TREE_GRAPH_STEPS["verify-decode"], TREE_GRAPH_STEPS.values())


@pytest.mark.parametrize("mode, spec, shapes", TREE_GRAPH_STEP_CASES, ids=list(TREE_GRAPH_STEPS))
def test_tree_cuda_graph_replays(flashinfer_on_cpu, monkeypatch, mode, spec, shapes):
    """reduce-overhead's sequence with trees: `hybrid::plan(cuda_graph=True)` per variant (two tree variants and a
    causal one, of one batch shape), an eager warm-up, a capture that must not plan (a tree variant planned for no
    graph is refused), then steps with other trees, batches and pages that plan outside the graph and replay the
    captured calls: those read the tree variants' own mask buffers, packed with each step's tree."""
    backend, kernels = flashinfer_on_cpu
    variants = [(True, -1), (True, 5), (False, -1)]  # (tree, window)
    width = 24
    k_cache = torch.zeros(60, 4, 2, D, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)

    def load(seed):
        case, tree_mask = tree_case(shapes, [3 + 4 * seed, 9, 5 + seed], 8, seed=seed, full=True)
        k_new, v_new = expected_cache(case)
        k_cache[: k_new.shape[0]], v_cache[: v_new.shape[0]] = k_new, v_new
        table = torch.full((len(shapes), width), -1, dtype=torch.int32)
        for i, pages in enumerate(case.pages):
            table[i, : len(pages)] = torch.tensor(pages)
        return case, (case.cu_seqlens_q, case.seq_lens, table), tree_mask

    def keywords(tree_mask, tree, window):
        return dict(
            attn_options(spec=spec, sliding_window=window, logit_cap=2.0), tree_mask=tree_mask if tree else None
        )

    def plan(metadata, tree_mask, variant):
        options = keywords(tree_mask, *variant)
        torch.ops.hybrid.plan(
            k_cache, *metadata, int(mode), q_dtype=torch.float16, num_q_heads=8, cuda_graph=True, **options
        )

    def attn(case, metadata, tree_mask, variant):
        options = keywords(tree_mask, *variant)
        return torch.ops.hybrid.attn(case.q, case.k, case.v, k_cache, v_cache, *metadata, int(mode), **options)

    def want(case, tree_mask, tree, window):
        return reference(case, tree_mask=tree_mask if tree else None, sliding_window=window, logit_cap=2.0)

    case, metadata, tree_mask = load(0)
    for variant in variants:
        plan(metadata, tree_mask, variant)
    for variant in variants:  # the warm-up
        assert_close(attn(case, metadata, tree_mask, variant), want(case, tree_mask, *variant), torch.float16)
    captured = len(kernels.runs)
    with cuda_graph_capture(monkeypatch, kernels):
        copies = tuple(t.clone() for t in metadata)  # as CUDA-graph trees hand them to the captured partition
        outs = [attn(case, copies, tree_mask.clone(), variant) for variant in variants]
        with pytest.raises(hybrid_ops.HybridInputError, match="no CUDA-graph plan"):
            attn(case, copies, tree_mask, (True, 3))
    graph = kernels.runs[captured:]
    assert backend.plans_made == 3 and len(graph) == 3
    for seed in (1, 2):
        case, metadata, tree_mask = load(seed)
        for variant in variants:
            plan(metadata, tree_mask, variant)
        graph[0]["q"].copy_(case.q)
        replay(graph)
        for out, variant in zip(outs, variants):
            assert_close(out, want(case, tree_mask, *variant), torch.float16)
        assert backend.plans_made == 3 + 3 * seed
    assert [run["custom_mask"] is not None for run in graph] == [True, True, False]
    assert graph[0]["custom_mask"].data_ptr() != graph[1]["custom_mask"].data_ptr()  # each tree variant its own


def test_graph_planning_takes_each_steps_tree(flashinfer_on_cpu, monkeypatch):
    """An engine's CUDA graph of verify steps with trees over static buffers (`buckets.plan_for_graph` before the
    capture and before every replay, as the sglang backend's hooks call it): the eager warm-up plans each layer
    variant into its CUDA-graph wrapper, the captured layers only run, and after each re-plan with another tree in the
    static buffer the replayed layers attend over that tree."""
    backend, kernels = flashinfer_on_cpu
    options = [dict(logit_cap=2.0), dict(sliding_window=3)]
    static_case, static_tree = tree_case([(2, 2)] * 3, [4, 9, 2], 6, 0, torch.bfloat16, full=True)
    # Caches and tables with room for every step's case.
    k_cache, v_cache = (
        torch.zeros(32, *c.shape[1:], dtype=c.dtype) for c in (static_case.k_cache, static_case.v_cache)
    )
    width = 8
    static = hybrid_ops.build_metadata(
        [5] * 3,
        static_case.seq_lens.tolist(),
        static_case.pages,
        max_pages=width,
        forward_mode=ForwardMode.TARGET_VERIFY,
    )
    static.tree_mask = static_tree.clone()
    q, k, v = static_case.q.clone(), static_case.k.clone(), static_case.v.clone()

    def layers():
        return [
            torch.ops.hybrid.prefill(
                q, k, v, k_cache, v_cache, *static.metadata, tree_mask=static.tree_mask, backend="flashinfer", **o
            )
            for o in options
        ]

    plan_for_graph("flashinfer", "prefill", k_cache, v_cache, static, torch.bfloat16)
    layers()  # the warm-up
    with cuda_graph_capture(monkeypatch, kernels):
        outs = layers()
    for seed in (1, 2):
        case, tree_mask = tree_case([(2, 2)] * 3, [4 + seed, 9, 2 * seed], 6, seed, torch.bfloat16, full=True)
        pages = case.k_cache.shape[0]
        k_cache[:pages], v_cache[:pages] = case.k_cache, case.v_cache
        real = hybrid_ops.build_metadata(case.q_lens, case.seq_lens.tolist(), case.pages, max_pages=width)
        for buffer, value in zip((*static.metadata, static.tree_mask), (*real.metadata, tree_mask)):
            buffer.copy_(value)
        for buffer, value in zip((q, k, v), (case.q, case.k, case.v)):
            buffer.copy_(value)
        plan_for_graph("flashinfer", "prefill", k_cache, v_cache, static, torch.bfloat16)
        with cuda_graph_capture(monkeypatch, kernels):
            outs = layers()
        for out, o in zip(outs, options):
            assert_close(out, reference(case, tree_mask=tree_mask, **o), torch.bfloat16)
        assert backend.plans_made == 2 + 2 * seed
    assert ran_trees(kernels)


def test_clear_errors(flashinfer_on_cpu):
    case = make_case([2, 1], [3, 0], head_dim=D, dtype=torch.float16)
    with pytest.raises(hybrid_ops.HybridInputError, match="same query length for every request"):
        torch.ops.hybrid.plan(
            case.k_cache,
            *case.args[5:],
            int(ForwardMode.TARGET_VERIFY),
            q_dtype=case.q.dtype,
            num_q_heads=4,
            **attn_options(spec="decode"),
        )


def test_needs_cuda():
    case = make_case([2], [3], head_dim=D, dtype=torch.float16)
    backend = FlashInferBackend()
    want = "needs flashinfer" if not backend.is_available() else "does not support q on cpu"
    with pytest.raises(hybrid_ops.HybridInputError, match=want):
        torch.ops.hybrid.prefill(*case.args, backend="flashinfer")
    torch.ops.hybrid.plan(case.k_cache, *case.args[5:], 1, q_dtype=torch.float16, num_q_heads=4)  # no-op: torch
