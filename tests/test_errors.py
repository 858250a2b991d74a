"""Bad input: a clear error naming the argument, the cache untouched, and the next valid call still works."""

import re

import pytest
import torch
from helpers.bad_inputs import BAD_INPUTS, VALUE_INPUTS, call, valid_case
from helpers.reference import assert_close, reference

import hybrid_ops
from hybrid_ops import ForwardMode, HybridInputError, OutOfPagesError, PagedKVCache


def check_rejected(op, mutation, words, fn=call):
    case = valid_case(op)
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    args, kwargs = mutation(case.args, {})
    with pytest.raises(HybridInputError, match=re.escape(words)):
        fn(op, args, kwargs)
    assert torch.equal(case.k_cache, k_before) and torch.equal(case.v_cache, v_before), "a rejected call wrote"
    # The process keeps working: the same cache, a valid call.
    assert_close(call(op, case.args, {}), reference(case), torch.float32)


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_eager(name):
    check_rejected(*BAD_INPUTS[name])


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("name", VALUE_INPUTS)
def test_bad_values(name, validate):
    """Value checks run in validation mode; the torch backend reads the metadata anyway and always runs them."""
    with hybrid_ops.set_validation(validate):
        check_rejected(*VALUE_INPUTS[name])


def compiled_call(op, args, kwargs):
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: call(op, a, kwargs), fullgraph=True, dynamic=True, backend="aot_eager")
    try:
        return fn(*args)
    except torch._dynamo.exc.TorchRuntimeError as e:  # Dynamo wraps what the fake implementation raised
        raise HybridInputError(str(e)) from e


@pytest.mark.parametrize("name", [n for n in BAD_INPUTS if n != "meta_device"])
def test_bad_input_compiled(name):
    check_rejected(*BAD_INPUTS[name], fn=compiled_call)


def test_unknown_mode():
    case = valid_case("prefill")
    for mode in (0, 10, -1):
        with pytest.raises(HybridInputError, match="forward_mode must be one of"):
            torch.ops.hybrid.attn(*case.args, mode)


@pytest.mark.parametrize("mode", [ForwardMode.PREBUILT, ForwardMode.DLLM_EXTEND])
def test_refused_mode_is_named(mode):
    """sglang's modes that the ops cannot serve are refused by name, the cache untouched."""
    case = valid_case("prefill")
    before = case.k_cache.clone()
    with pytest.raises(HybridInputError, match=f"forward_mode {mode.name} \\({int(mode)}\\) is not served: "):
        torch.ops.hybrid.attn(*case.args, int(mode))
    assert torch.equal(case.k_cache, before)


def test_backend_missing_dependency_is_named():
    class NeedsGpu(hybrid_ops.Backend):
        name, requirement = "needs_gpu", "a CUDA device"

        def is_available(self):
            return False

    case = valid_case("prefill")
    with hybrid_ops.register_backend(NeedsGpu()):
        with pytest.raises(HybridInputError) as error:
            torch.ops.hybrid.prefill(*case.args, backend="needs_gpu")
    assert str(error.value) == "backend='needs_gpu' needs a CUDA device, which is not installed"
    assert "needs_gpu" not in hybrid_ops.backend_names()


CACHE_ERRORS = {
    "zero_pages": (lambda: PagedKVCache(0, 4, 2, 16), HybridInputError, "num_pages must be a positive int"),
    "bad_page_size": (lambda: PagedKVCache(8, 0, 2, 16), HybridInputError, "page_size must be a positive int"),
}


def test_paged_cache_errors():
    for make, error, words in CACHE_ERRORS.values():
        with pytest.raises(error, match=words):
            make()
    cache = PagedKVCache(num_pages=4, page_size=4, num_kv_heads=2, head_dim=16, max_pages_per_request=3)
    cache.add("a")
    with pytest.raises(HybridInputError, match="in the cache already"):
        cache.add("a")
    with pytest.raises(HybridInputError, match="request_id 'b' is not in the cache"):
        cache.step(["b"], [1])
    with pytest.raises(HybridInputError, match="num_new_tokens must be non-negative"):
        cache.step(["a"], [-2])
    with pytest.raises(HybridInputError, match="one entry per request"):
        cache.step(["a"], [1, 2])
    with pytest.raises(HybridInputError, match="request_ids must be distinct"):
        cache.step(["a", "a"], [1, 2])
    with pytest.raises(OutOfPagesError, match="max_pages_per_request = 3"):
        cache.step(["a"], [13])
    cache.add("b")
    cache.step(["a"], [12])  # 3 pages
    with pytest.raises(OutOfPagesError, match="needs 2 new pages, only 1 are free"):
        cache.step(["b"], [5])
    assert cache.seq_len("b") == 0 and cache.num_free_pages == 1  # the failed step changed nothing
    with pytest.raises(HybridInputError, match="length must be an int"):
        cache.truncate("a", 13)
    cache.free("a")
    with pytest.raises(HybridInputError, match="freed already"):
        cache.free("a")
    assert cache.num_free_pages == 4 - 0  # b holds no page yet


@pytest.fixture
def backend_named(request, monkeypatch):
    """The backend under test by name. FlashInfer's kernels need CUDA: on the CPU it is made to accept CPU tensors,
    and reaching its prefill or decode fails the test (validation must reject the call before that)."""
    from hybrid_ops.backends.flashinfer import FlashInferBackend

    name = request.param
    if name == "flashinfer":

        def reached(self, *args):
            raise AssertionError("metadata with bad values reached the FlashInfer backend")

        for method, fn in (
            ("is_available", lambda self: True),
            ("supports", lambda self, *args: True),
            ("prefill", reached),
            ("decode", reached),
        ):
            monkeypatch.setattr(FlashInferBackend, method, fn)
    return name


@pytest.mark.parametrize("backend_named", ["triton", "flashinfer"], indirect=True)
@pytest.mark.parametrize("name", VALUE_INPUTS)
def test_bad_values_in_validation_mode_for_backends_that_mask(name, backend_named, validation_on):
    """Triton and FlashInfer never read the metadata to the host (they mask instead); in validation mode the ops
    check its values for them, before the cache is written."""
    op, mutation, words = VALUE_INPUTS[name]
    assert not hybrid_ops.get_backend(backend_named).checks_values
    check_rejected(op, lambda args, kwargs: mutation(args, {**kwargs, "backend": backend_named}), words)
