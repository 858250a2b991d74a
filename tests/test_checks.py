"""The argument checks are declared once, as rows (check_rows.py: validation.TENSOR_CHECKS and each option's), which
Python runs two ways (all at once on the per-call path, row by row for the message) and the cpu backend's checks.h
spells in C++; the metadata-value checks too (validation.LENGTH_VALUES and the rest), which Python evaluates over
tensors at once (naming the culprit) and value_checks.h loops over in C++ (the cpu backend's kernel, which decides
without Python whether a call may run). All must accept exactly the same inputs: one that C++ accepted and Python
would refuse would run unchecked; one C++ refused and Python accepts only costs a detour. Random batches (caches in
q's dtype or fp8, with scale arguments good and bad, sinks, chunks, trees good and bad), each with a random set of
the bad inputs of helpers/bad_inputs.py and random metadata values, are put to each."""

import math

import pytest
import torch
from helpers.bad_inputs import BAD_INPUTS, VALUE_INPUTS, valid_case
from helpers.reference import make_case
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import hybrid_ops
from hybrid_ops import HybridInputError
from hybrid_ops.options import FIELDS, Options, options_ok
from hybrid_ops.validation import check_args, check_metadata_values, check_tensors, decode_shape_ok, tensors_ok

OPTION_NAMES = {f.name for f in FIELDS}
# The mutations of helpers/bad_inputs.py that change the op's tensors or its options.
MUTATIONS = {
    name: mutation
    for name, (op, mutation, _) in {**BAD_INPUTS, **VALUE_INPUTS}.items()
    if set(mutation(valid_case("decode").args, {})[1]) <= OPTION_NAMES
}
VALID_OPTIONS = {
    "scale": [None, 0.125, 1.0],
    "sliding_window": [-1, 1, 5],
    "logit_cap": [0.0, 3.0],
    "attention_chunk": [-1, 1, 7],
}
BAD_OPTIONS = {
    "scale": [0.0, -1.0, math.nan, math.inf],
    "sliding_window": [0, -2],
    "logit_cap": [-1.0, math.nan, math.inf],
    "attention_chunk": [0, -2],
}
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# The caches' dtypes: q's (None), fp8, or two that differ.
CACHE_DTYPES = [None, E4M3, E5M2, (E4M3, E5M2), (E5M2, torch.float32)]
# (k_scale, v_scale) for the batches' 2 kv heads: the accepted shapes (any strides), and bad ones.
KV_SCALE_ARGS = {
    "none": lambda: (None, None),
    "scalar": lambda: (torch.tensor(0.5), torch.tensor(2.0)),
    "one": lambda: (torch.tensor([0.5]), torch.tensor(2.0)),
    "per_head": lambda: (torch.tensor([0.5, 1.5]), torch.tensor([2.0, 0.25])),
    "stride_0": lambda: (torch.tensor(0.5).expand(2), torch.tensor([2.0]).expand(2)),
    "strided": lambda: (torch.rand(4)[::2], torch.rand(2)),
    "k_only": lambda: (torch.tensor(0.5), None),
    "v_only": lambda: (None, torch.ones(2)),
    "float64": lambda: (torch.ones((), dtype=torch.float64), torch.ones(())),
    "bfloat16": lambda: (torch.ones(2), torch.ones(2, dtype=torch.bfloat16)),
    "three_heads": lambda: (torch.ones(3), torch.ones(2)),
    "no_heads": lambda: (torch.ones(2), torch.ones(0)),
    "two_dims": lambda: (torch.ones(1, 1), torch.ones(1)),
    "meta": lambda: (torch.ones(2, device="meta"), torch.ones(2)),
}
# v_cache's layouts: contiguous or the leading values of wider rows (MLA's latent cache) are accepted, others not.
V_CACHE_LAYOUTS = {
    "contiguous": lambda v: v,
    "leading_values": lambda v: torch.cat([v, v[..., :3]], -1)[..., : v.shape[-1]],
    "trailing_values": lambda v: torch.cat([v[..., :3], v], -1)[..., 3:],
    "rows_apart": lambda v: torch.cat([v, v], 1)[:, ::2],
    "every_other_value": lambda v: torch.cat([v, v], -1)[..., ::2],
}

KV_SCALE_ARGS_OF = ("k_scale", "v_scale")  # what KV_SCALE_ARGS draws, good and bad


def native():
    return hybrid_ops.get_backend("cpu")._module


def python_accepts(check, *args, **kwargs) -> bool:
    try:
        check(*args, **kwargs)
    except HybridInputError:
        return False
    return True


@st.composite
def inputs(draw, first=None):
    """(args, options, decode): a random valid batch, then the mutation `first`, and random bad inputs and metadata
    values on top."""
    decode = draw(st.booleans())
    num_requests = draw(st.integers(0, 4))
    q_lens = (
        [draw(st.integers(1, 3))] * num_requests
        if decode
        else draw(st.lists(st.integers(0, 5), min_size=num_requests, max_size=num_requests))
    )
    case = make_case(
        q_lens,
        draw(st.lists(st.integers(0, 9), min_size=num_requests, max_size=num_requests)),
        num_q_heads=draw(st.sampled_from([2, 4, 8])),
        num_kv_heads=2,
        head_dim=draw(st.sampled_from([8, 16])),
        v_head_dim=draw(st.sampled_from([None, 8, 24])),
        page_size=draw(st.sampled_from([1, 4])),
        strided=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        seed=draw(st.integers(0, 2**16)),
    )
    args, options = list(case.args), {name: draw(st.sampled_from(values)) for name, values in VALID_OPTIONS.items()}
    cache_dtypes = draw(st.sampled_from(CACHE_DTYPES))
    if cache_dtypes is not None:
        cache_dtypes = cache_dtypes if isinstance(cache_dtypes, tuple) else (cache_dtypes, cache_dtypes)
        args[3:5] = (cache.to(dtype) for cache, dtype in zip(args[3:5], cache_dtypes))
    args[4] = V_CACHE_LAYOUTS[draw(st.sampled_from(list(V_CACHE_LAYOUTS)))](args[4])
    options |= dict(zip(KV_SCALE_ARGS_OF, KV_SCALE_ARGS[draw(st.sampled_from(list(KV_SCALE_ARGS)))]()))
    options["sinks"] = torch.randn(case.q.shape[1]) if draw(st.booleans()) else None
    width = max(q_lens, default=0) + draw(st.integers(0, 2))
    options["tree_mask"] = None
    if draw(st.booleans()):
        options["tree_mask"] = torch.cat([torch.ones(n, width).tril() for n in [0, *q_lens]]).bool()
        for _ in range(
            draw(st.integers(0, 2))
        ):  # values flipped: a row blind to itself or seeing ahead, or still a tree
            if options["tree_mask"].numel():
                row, column = draw(st.integers(0, len(options["tree_mask"]) - 1)), draw(st.integers(0, width - 1))
                options["tree_mask"][row, column] ^= True
    bad_option = st.sampled_from([(name, value) for name, values in BAD_OPTIONS.items() for value in values])
    for mutation in [first or (lambda *a: a)] + draw(
        st.lists(st.one_of(st.sampled_from(list(MUTATIONS.values())), bad_option), max_size=2)
    ):
        if isinstance(mutation, tuple):
            options = {**options, mutation[0]: mutation[1]}
            continue
        try:
            args, options = mutation(args, options)
        except (IndexError, RuntimeError):  # a mutation made for another shape (an index past this batch's end)
            pass
    args = list(args)
    for _ in range(draw(st.integers(0, 2))):  # metadata values anywhere, in and out of range
        which = draw(st.sampled_from([5, 6, 7]))
        if args[which].numel() and args[which].dtype == torch.int32 and args[which].device.type == "cpu":
            args[which] = args[which].clone()
            args[which].view(-1)[draw(st.integers(0, args[which].numel() - 1))] = draw(st.integers(-2, 40))
    return args, options, decode


@pytest.mark.parametrize("first", [None, *MUTATIONS])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cpp_and_python_checks_agree(first, data):
    """Each bad input of the tables in turn (and none: random ones only), on random batches."""
    args, options, decode = data.draw(inputs(MUTATIONS.get(first)))
    accepted = python_accepts(check_args, args, Options(**options))
    assert tensors_ok(*args) == python_accepts(check_tensors, *args)
    if tensors_ok(*args):
        assert options_ok(Options(**options), args[0], args[3]) == accepted
    assert native().args_ok(*args, **Options(**options).keywords()) == accepted
    event(f"arguments accepted: {accepted}")
    if not accepted:
        return
    q, k_cache, seq_lens = args[0], args[3], args[6]
    assert native().decode_shape_ok(q.shape[0], seq_lens.shape[0]) == decode_shape_ok(q.shape[0], seq_lens.shape[0])
    if decode and not decode_shape_ok(q.shape[0], seq_lens.shape[0]):
        return
    metadata, sizes = args[5:], (q.shape[0], k_cache.shape[0], k_cache.shape[1], decode)
    accepted = python_accepts(check_metadata_values, *metadata, *sizes, options["tree_mask"])
    assert native().metadata_values_ok(*metadata, *sizes, options["tree_mask"]) == accepted
    event(f"metadata values accepted: {accepted}")


def test_every_option_is_put_to_both_checks():
    """The random inputs above hold every option of the table, good and bad: an option whose C++ check is missing
    or differs fails them."""
    mutated = {name for mutation in MUTATIONS.values() for name in mutation(valid_case("decode").args, {})[1]}
    assert {*BAD_OPTIONS, *KV_SCALE_ARGS_OF, *mutated} == OPTION_NAMES


@pytest.mark.parametrize("page_size", [4, 5])
@pytest.mark.parametrize("bad_id", ["negative", "past_the_cache"])
def test_block_table_checked_through_the_last_partly_filled_page(page_size, bad_id):
    """Every table entry a request's keys reach is checked, the last, partly filled page included; the spare entries
    past it are not read, so any value there is accepted. Each entry of the table in turn holds a bad page id."""
    q_lens, prefix_lens = [2, 1, 3], [5, 9, 0]  # seq_lens 7, 10, 3: none a multiple of the page size
    case = make_case(q_lens, prefix_lens, page_size=page_size)
    num_pages = case.k_cache.shape[0]
    sizes = (case.q.shape[0], num_pages, page_size, False)
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        for j in range(case.block_table.shape[1]):
            table = case.block_table.clone()
            table[i, j] = -1 if bad_id == "negative" else num_pages
            metadata = (case.cu_seqlens_q, case.seq_lens, table)
            expected = j >= -(-seq_len // page_size)  # the pages holding positions 0 .. seq_len - 1
            assert python_accepts(check_metadata_values, *metadata, *sizes) == expected, (i, j)
            assert native().metadata_values_ok(*metadata, *sizes) == expected, (i, j)
