"""Every option of `options.FIELDS` on every backend that claims it (the backend's `features` for an option with a
feature, every backend for the others), against the float64 reference, prefill and decode. Each case is one where the
option changes the output (checked), so a backend that claimed an option and ignored it would fail."""

import random

import pytest
import torch
from helpers.reference import BACKENDS, assert_close, fp8_case, make_case, random_tree, reference, tree_mask_for

import hybrid_ops
from hybrid_ops.options import FIELDS

# Options of no feature; then those of one, with the value set.
PLAIN = {"scale": 0.05, "sliding_window": 3, "logit_cap": 0.4}


def option_case(path, option, seed):
    """(case, the op's keywords, the reference's keywords, the case the reference reads) for one option."""
    q_lens = [1, 1, 1] if path == "decode" else [4, 1, 6]
    rng = random.Random(seed)
    if option == "tree_mask":
        trees = [random_tree(2, 2, rng, full=True)[0] for _ in range(2)]  # 5 tokens each: decode takes them too
        q_lens = [len(t) for t in trees]
    case = make_case(q_lens, [9, 5, 12][: len(q_lens)], num_q_heads=4, head_dim=16, page_size=4, seed=seed)
    if option in PLAIN:
        return case, {option: PLAIN[option]}, {option: PLAIN[option]}, case
    if option == "sinks":
        sinks = torch.randn(4, generator=torch.Generator().manual_seed(seed)) + 1.0
        return case, {"sinks": sinks}, {"sinks": sinks}, case
    if option == "attention_chunk":
        return case, {"attention_chunk": 4}, {"attention_chunk": 4}, case
    if option in ("k_scale", "v_scale"):  # fp8 caches: both scales, their own per kv head
        scales = {"k_scale": torch.tensor([0.7, 1.9]), "v_scale": torch.tensor([2.3, 0.4])}
        fp8, read, _ = fp8_case(case, torch.float8_e4m3fn, scales["k_scale"], scales["v_scale"])
        return fp8, scales, {}, read
    if option == "tree_mask":
        tree_mask = tree_mask_for(trees, max(q_lens), rng)
        return case, {"tree_mask": tree_mask}, {"tree_mask": tree_mask}, case
    raise AssertionError(f"no case for the option {option!r}: add one")


def claims(backend, field) -> bool:
    feature = field.metadata["feature"]
    return feature is None or feature in hybrid_ops.get_backend(backend).features


@pytest.mark.parametrize("path", ["prefill", "decode"])
@pytest.mark.parametrize("option", [f.name for f in FIELDS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_option_on_every_backend_that_claims_it(backend, option, path):
    field = next(f for f in FIELDS if f.name == option)
    if not claims(backend, field):
        pytest.skip(f"{backend} does not claim {option} (feature {field.metadata['feature']})")
    case, keywords, reference_keywords, read = option_case(path, option, seed=len(option))
    op = getattr(torch.ops.hybrid, path)
    out = op(*case.args, backend=backend, **keywords)
    expected = reference(read, **reference_keywords)
    assert_close(out, expected, torch.float32)
    without = reference(case)  # the option not applied (an fp8 case's prefix rows are the unquantized ones)
    assert (expected - without).abs().max() > 1e-2, f"the case does not show {option}"


def test_each_backend_claims_what_it_lists():
    """The features are lists of their own, not every feature there is: a new option is claimed by none until added."""
    listed = {name: hybrid_ops.get_backend(name).features for name in ("torch", "cpu", "triton", "flashinfer")}
    features = {f.metadata["feature"] for f in FIELDS if f.metadata["feature"]}
    assert all(isinstance(f, frozenset) for f in listed.values())
    assert {name: sorted(f & features) for name, f in listed.items()} == {
        "torch": ["attention_chunk", "fp8_kv", "sinks", "tree_mask"],
        "cpu": ["attention_chunk", "fp8_kv", "sinks", "tree_mask"],
        "triton": ["attention_chunk", "fp8_kv", "sinks", "tree_mask"],
        "flashinfer": ["fp8_kv", "tree_mask"],
    }
