"""torch.ops.hybrid.{prefill, decode, attn} against the float64 reference, and their contract with opcheck."""

import zlib

import pytest
import torch
from helpers.cases import mode_batch
from helpers.reference import BACKENDS, assert_close, expected_cache, make_case, reference

import hybrid_ops
from hybrid_ops import ROUTING, ForwardMode
from hybrid_ops.backends.torch_ref import TorchBackend

# Each axis covered once or twice; the product of all axes is the property-based tests' job.
PREFILL_CASES = {
    "single": dict(q_lens=[7], prefix_lens=[0]),
    "ragged": dict(q_lens=[5, 1, 9], prefix_lens=[0, 0, 0]),
    "prefix": dict(q_lens=[3, 6], prefix_lens=[10, 5]),
    "zero_len_request": dict(q_lens=[4, 0, 3], prefix_lens=[2, 6, 0]),
    "page_1": dict(q_lens=[5, 3], prefix_lens=[2, 4], page_size=1),
    "page_16": dict(q_lens=[20, 3], prefix_lens=[17, 30], page_size=16),
    "page_5": dict(q_lens=[7, 11], prefix_lens=[3, 9], page_size=5),  # lengths not multiples of the page size
    "mha": dict(q_lens=[4, 6], prefix_lens=[3, 0], num_q_heads=2, num_kv_heads=2),
    "gqa4": dict(q_lens=[4, 6], prefix_lens=[3, 0], num_q_heads=8, num_kv_heads=2),
    "mqa": dict(q_lens=[4, 6], prefix_lens=[3, 0], num_q_heads=4, num_kv_heads=1),
    "d64": dict(q_lens=[3, 2], prefix_lens=[4, 1], head_dim=64),
    "d128": dict(q_lens=[3, 2], prefix_lens=[4, 1], head_dim=128),
    "d80": dict(q_lens=[3, 2], prefix_lens=[4, 1], head_dim=80),
    "strided": dict(q_lens=[4, 3], prefix_lens=[2, 5], strided=True),
}
OPTIONS = {
    "default": dict(),
    "scale": dict(scale=0.3),
    "window": dict(sliding_window=3),
    "softcap": dict(logit_cap=2.0),
    "window_softcap": dict(sliding_window=5, logit_cap=1.5),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def check_call(op, case, options, dtype, **kwargs):
    k_ref, v_ref = expected_cache(case)
    out = op(*case.args, **options, **kwargs)
    assert out.shape == (*case.q.shape[:2], case.v.shape[2]) and out.is_contiguous()
    assert_close(out, reference(case, **options), dtype)
    assert torch.equal(case.k_cache, k_ref) and torch.equal(case.v_cache, v_ref), "cache differs from the expected"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_shapes(backend, dtype, name):
    case = make_case(**PREFILL_CASES[name], dtype=dtype, seed=zlib.crc32(name.encode()))
    check_call(torch.ops.hybrid.prefill, case, {}, dtype, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", OPTIONS)
def test_prefill_options(backend, dtype, option):
    case = make_case([6, 9, 2], [4, 0, 8], num_q_heads=4, num_kv_heads=2, dtype=dtype)
    check_call(torch.ops.hybrid.prefill, case, OPTIONS[option], dtype, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("q_len", [1, 3])  # DECODE, TARGET_VERIFY with 3 draft tokens
def test_decode(backend, dtype, option, q_len):
    case = make_case([q_len] * 4, [0, 5, 17, 33], num_q_heads=8, num_kv_heads=2, dtype=dtype)
    check_call(torch.ops.hybrid.decode, case, OPTIONS[option], dtype, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prefixes", [[6], [9, 9, 9], [0]])  # one request; equal lengths; no prefix
@pytest.mark.parametrize("q_len", [1, 2])
def test_decode_lengths_off_page_boundaries(backend, prefixes, q_len):
    case = make_case([q_len] * len(prefixes), prefixes, page_size=4, seed=len(prefixes))
    check_call(torch.ops.hybrid.decode, case, {}, torch.float32, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["prefill", "decode"])
@pytest.mark.parametrize("mode", list(ROUTING))
def test_attn_every_mode(backend, spec, mode):
    q_lens, prefixes = mode_batch(mode, spec)
    case = make_case(q_lens, prefixes, num_q_heads=4, num_kv_heads=1)
    check_call(
        torch.ops.hybrid.attn,
        case,
        {"sliding_window": 6},
        torch.float32,
        forward_mode=int(mode),
        prefill_backend=backend,
        decode_backend=backend,
        speculative_attention_mode=spec,
    )


def sinks(num_q_heads, seed=0):
    """[Hq] float32 logits around the scores' scale (N(0, 1) inputs, scale 1/sqrt(D)), so they move the output."""
    return torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed)) * 2


# The options that only some backends serve (`options`): the torch, cpu and Triton backends serve them all; "auto"
# finds one that does.
FEATURES = {
    "sinks": dict(sinks=sinks(8)),
    "chunk": dict(attention_chunk=5),  # chunks of 5 positions across 4-token pages
    "chunk_window": dict(attention_chunk=8, sliding_window=3),
    "chunk_softcap_sinks": dict(attention_chunk=3, logit_cap=2.0, sinks=sinks(8, 1)),
    "v_head_dim": dict(),
    "all": dict(attention_chunk=6, sliding_window=4, sinks=sinks(8, 2), scale=0.2),
}
FEATURE_V_HEAD_DIM = {"v_head_dim": 24, "all": 8}


BACKEND_FEATURES = [
    pytest.param(backend, feature, marks=[pytest.mark.slow] if backend == "triton" else [])  # as BACKENDS
    for backend in ("torch", "cpu", "triton", "auto")
    for feature in FEATURES
]


@pytest.mark.parametrize("backend, feature", BACKEND_FEATURES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "op, q_lens, prefix_lens",
    [
        ("prefill", [6, 13, 2, 0], [4, 0, 11, 3]),  # prefill, chunked prefill past chunk and page boundaries
        ("decode", [1] * 4, [0, 5, 17, 33]),
        ("decode", [3] * 2, [9, 20]),  # verify
    ],
)
def test_features(backend, dtype, feature, op, q_lens, prefix_lens):
    case = make_case(
        q_lens, prefix_lens, num_q_heads=8, num_kv_heads=2, dtype=dtype, v_head_dim=FEATURE_V_HEAD_DIM.get(feature)
    )
    check_call(getattr(torch.ops.hybrid, op), case, FEATURES[feature], dtype, backend=backend)


@pytest.mark.parametrize("feature", FEATURES)
def test_features_under_attn(feature):
    """attn passes the options to either path's backend, and the sink is per head (a wrong head's sink fails)."""
    case = make_case([1, 1, 1], [2, 9, 14], num_q_heads=8, num_kv_heads=2, v_head_dim=FEATURE_V_HEAD_DIM.get(feature))
    check_call(torch.ops.hybrid.attn, case, FEATURES[feature], torch.float32, forward_mode=int(ForwardMode.DECODE))


@pytest.mark.parametrize("feature", ["sinks", "chunk"])
def test_features_refused_by_backends_without_them(feature):
    """A backend whose `features` lack an option in use is never called with it (FlashInfer has none of these)."""

    class Plain(TorchBackend):
        name, features = "plain", frozenset()

    case = make_case([3, 2], [1, 4], num_q_heads=8, num_kv_heads=2)
    before = case.k_cache.clone()
    name = {"chunk": "attention_chunk"}.get(feature, feature)
    with hybrid_ops.register_backend(Plain()):
        with pytest.raises(hybrid_ops.HybridInputError, match=f"backend='plain' does not support {name}"):
            torch.ops.hybrid.prefill(*case.args, **FEATURES[feature], backend="plain")
    assert torch.equal(case.k_cache, before)


def test_backends_see_both_head_dims():
    """`supports` sees the value head dim: "auto" passes over a backend that refuses it (the call still runs on
    another), and naming that backend is refused with both head dims, the cache untouched."""

    class SameHeadDims(TorchBackend):
        name = "same_head_dims"

        def supports(self, spec):
            return spec.head_dim == spec.v_head_dim

    case = make_case([3, 2], [1, 4], num_q_heads=8, num_kv_heads=2, v_head_dim=24)
    before = case.k_cache.clone()
    with hybrid_ops.register_backend(SameHeadDims(), prefer=True):
        with pytest.raises(hybrid_ops.HybridInputError, match="does not support .* head dims D = 16, Dv = 24"):
            torch.ops.hybrid.prefill(*case.args, backend="same_head_dims")
        assert torch.equal(case.k_cache, before)
        check_call(torch.ops.hybrid.prefill, case, {}, torch.float32)


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_empty_batch(op):
    """T = 0 (IDLE): an empty [0, Hq, D] output, the cache untouched."""
    case = make_case([], [])
    out = getattr(torch.ops.hybrid, op)(*case.args)
    assert out.shape == (0, 4, 16)


def test_fp32_cache_is_written_exactly():
    case = make_case([3, 4], [5, 0], seed=1)
    check_call(torch.ops.hybrid.prefill, case, {}, torch.float32)


def test_routing_reaches_the_named_backend():
    """attn sends each mode to the backend its table names, and the other backend is never called."""
    calls = []

    class Recorder(hybrid_ops.Backend):
        def __init__(self, name):
            self.name = name

        def supports(self, spec):
            return True

        def prefill(self, q, *args):
            calls.append((self.name, "prefill"))
            return q.new_empty(q.shape)

        def decode(self, q, *args):
            calls.append((self.name, "decode"))
            return q.new_empty(q.shape)

    case = make_case([2, 2], [1, 1])
    prefill, decode = ("rec_p", "prefill"), ("rec_d", "decode")
    expected = {  # mode -> the backend method called with speculative_attention_mode "prefill" and with "decode"
        1: (prefill, prefill),
        2: (decode, decode),
        3: (prefill, prefill),
        4: (decode, decode),
        5: (prefill, decode),
        6: (prefill, prefill),
        8: (prefill, prefill),
    }
    with hybrid_ops.register_backend(Recorder("rec_p")), hybrid_ops.register_backend(Recorder("rec_d")):
        for mode, methods in expected.items():
            for spec, want in zip(("prefill", "decode"), methods):
                calls.clear()
                torch.ops.hybrid.attn(
                    *case.args, mode, prefill_backend="rec_p", decode_backend="rec_d", speculative_attention_mode=spec
                )
                assert calls == [want], (mode, spec)
    assert "rec_p" not in hybrid_ops.backend_names()


OPCHECK_CASES = [
    ("prefill", dict(q_lens=[3, 5], prefix_lens=[0, 4])),
    ("prefill", dict(q_lens=[2, 0, 4], prefix_lens=[6, 1, 0], page_size=1, num_q_heads=8, num_kv_heads=2)),
    ("prefill", dict(q_lens=[4], prefix_lens=[13], page_size=5, dtype=torch.bfloat16, strided=True)),
    ("decode", dict(q_lens=[1, 1, 1], prefix_lens=[0, 7, 20], num_q_heads=4, num_kv_heads=1)),
    ("decode", dict(q_lens=[3, 3], prefix_lens=[5, 9], page_size=16, dtype=torch.float16)),
]


@pytest.mark.parametrize("op, case_kwargs", OPCHECK_CASES)
def test_opcheck(op, case_kwargs):
    case = make_case(**case_kwargs, seed=0)
    torch.library.opcheck(getattr(torch.ops.hybrid, op).default, case.args, {"sliding_window": 4, "logit_cap": 3.0})


@pytest.mark.parametrize("op", ["prefill", "decode", "attn"])
def test_opcheck_features(op):
    case = make_case([2, 2], [3, 6], num_q_heads=4, num_kv_heads=2, v_head_dim=8, seed=0)
    args = (*case.args, int(ForwardMode.DECODE)) if op == "attn" else case.args
    torch.library.opcheck(
        getattr(torch.ops.hybrid, op).default, args, {"sinks": sinks(4), "attention_chunk": 3, "sliding_window": 4}
    )


@pytest.mark.parametrize(
    "mode, q_lens",
    [
        (ForwardMode.EXTEND, [3, 5]),
        (ForwardMode.DECODE, [1, 1]),
        (ForwardMode.MIXED, [4, 1]),
        (ForwardMode.IDLE, []),
        (ForwardMode.TARGET_VERIFY, [2, 2]),
        (ForwardMode.DRAFT_EXTEND_V2, [2, 3]),
        (ForwardMode.SPLIT_PREFILL, [4, 1]),
    ],
)
@pytest.mark.parametrize("spec", ["prefill", "decode"])
def test_opcheck_attn(mode, q_lens, spec):
    case = make_case(q_lens, [4] * len(q_lens), seed=1)
    torch.library.opcheck(torch.ops.hybrid.attn.default, (*case.args, int(mode)), {"speculative_attention_mode": spec})


@pytest.mark.parametrize("inference", [False, True])
def test_torch_step_metadata_follows_the_metadata(inference):
    """The torch backend checks and derives a step's metadata once: layers that pass the same metadata share it, and
    metadata rewritten in place (static buffers; inference tensors have no version counter) is derived again."""
    with torch.inference_mode(inference):
        case = make_case([1, 1, 1], [3, 9, 5], seed=2)  # both: 3 requests, 4-page tables, 9-page caches
        other = make_case([1, 1, 1], [10, 2, 7], seed=3)
        backend = hybrid_ops.get_backend("torch")
        derived = backend.steps_derived
        for _layer in range(3):
            check_call(torch.ops.hybrid.decode, case, {}, torch.float32, backend="torch")
        assert backend.steps_derived == derived + 1
        for mine, theirs in zip(case.args[5:], other.args[5:]):
            mine.copy_(theirs)
        other.cu_seqlens_q, other.seq_lens, other.block_table = case.args[5:]
        check_call(torch.ops.hybrid.decode, other, {}, torch.float32, backend="torch")
        assert backend.steps_derived == derived + 2
        other.block_table[1, 0] = other.k_cache.shape[0]  # out of range, in place: checked again
        before = other.k_cache.clone()
        with pytest.raises(hybrid_ops.HybridInputError, match=r"block_table\[1, 0\]"):
            torch.ops.hybrid.decode(*other.args, backend="torch")
        assert torch.equal(other.k_cache, before)


def test_captured_steps_pass_over_backends_that_plan_on_the_host():
    """A step captured whole in a CUDA graph cannot plan: "auto" there is the first backend of the device's order
    that plans nothing on the host, a named backend stays as named, and a preferred backend counts too."""
    from hybrid_ops.backends import registry
    from hybrid_ops.generation.runner import graph_backends

    class Planning(TorchBackend):
        name = "planning"

        def plan(self, *args, **kwargs):
            pass

    class Plain(TorchBackend):
        name = "plain"

    cuda = torch.device("cuda")
    assert hybrid_ops.get_backend("flashinfer").plans_on_host and not hybrid_ops.get_backend("triton").plans_on_host
    assert graph_backends(cuda, True, ("auto", "auto")) == ("triton", "triton")
    assert graph_backends(cuda, True, ("flashinfer", "auto")) == ("flashinfer", "triton")
    assert graph_backends(cuda, False, ("auto", "auto")) == ("auto", "auto")
    assert graph_backends(torch.device("cpu"), True, ("auto", "torch")) == ("auto", "torch")
    with hybrid_ops.register_backend(Planning(), prefer=True):
        assert registry.for_captured_steps("auto", "cuda") == "triton"
        with hybrid_ops.register_backend(Plain(), prefer=True):
            assert registry.for_captured_steps("auto", "cuda") == "plain"
