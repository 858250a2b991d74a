"""The native CPU kernel's work schedule (kernels/cpu/schedule.cpp), a function of the metadata alone: its units cover
every (request, kv head, query token, key the token sees) exactly once; a request with one query block splits its keys
into slices of at most KV_SPLIT keys (KV_SPLIT_ALL_HEADS for units of every kv head), whose rows one merge reads back;
the units of longer requests read the tiles their request's pack jobs pack; and a request's units are the same in any
batch. Fixed batches past the slice, query-block and tile boundaries, then random ones."""

import itertools

import pytest
import torch
from helpers.reference import first_visible_key
from hypothesis import given, settings
from hypothesis import strategies as st

import hybrid_ops

# The schedule's rows: the fields of kernels/cpu/schedule.h's Unit, Merge and PackJob, in order.
UNIT = ("request", "head", "num_heads", "t0", "num_tokens", "lo", "hi", "partial", "packed", "packed_from")
MERGE = ("request", "head", "num_tokens", "num_splits", "partial", "split_stride")
PACK_JOB = ("request", "head", "j0", "n")


def kernels():
    return hybrid_ops.get_backend("cpu")._module


def schedule(
    q_lens, prefix_lens, num_kv_heads, group, head_dim, v_head_dim, sliding_window, attention_chunk, gemm_rows
):
    """(units, merges, pack_jobs), each a list of dicts; gemm_rows: GEMM_ROWS_AMX or GEMM_ROWS."""
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    seq_lens = torch.tensor([p + n for p, n in zip(prefix_lens, q_lens)], dtype=torch.int32)
    tables = kernels().schedule(
        cu_seqlens_q, seq_lens, num_kv_heads, group, head_dim, v_head_dim, sliding_window, attention_chunk, gemm_rows
    )
    return [[dict(zip(fields, row)) for row in t.tolist()] for fields, t in zip((UNIT, MERGE, PACK_JOB), tables)]


def check_schedule(
    q_lens, prefix_lens, num_kv_heads, group, head_dim, v_head_dim, sliding_window, attention_chunk, gemm_rows
):
    """Asserts the schedule's properties; returns it. Head dims from 20, 36, 64, 80, 128, 144: whole vectors of every
    vector width (8 or 16 floats) when a multiple of 16, of none otherwise."""
    k = kernels()
    shape = (num_kv_heads, group, head_dim, v_head_dim, sliding_window, attention_chunk, gemm_rows)
    units, merges, pack_jobs = schedule(q_lens, prefix_lens, *shape)
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    block_tokens = max(1, k.BLOCK_ROWS // group)
    in_place = head_dim % 16 == 0 and v_head_dim % 16 == 0

    def first_key(request, token):
        return first_visible_key(prefix_lens[request] + token, sliding_window, attention_chunk)

    # Each unit: keys that its rows see, within its request; every kv head for few rows read in place, else one.
    spans = {}  # (request, kv head, query token) -> the units' key spans [lo, hi)
    for u in units:
        i, rows = u["request"], u["num_tokens"] * group
        assert 0 <= u["t0"] < u["t0"] + u["num_tokens"] <= q_lens[i], u
        assert first_key(i, u["t0"]) <= u["lo"] < u["hi"] <= prefix_lens[i] + u["t0"] + u["num_tokens"], u
        assert u["num_heads"] == (num_kv_heads if rows < gemm_rows and in_place else 1), u
        assert u["head"] % u["num_heads"] == 0 and u["head"] + u["num_heads"] <= num_kv_heads, u
        heads, tokens = range(u["head"], u["head"] + u["num_heads"]), range(u["t0"], u["t0"] + u["num_tokens"])
        for h, t in itertools.product(heads, tokens):
            spans.setdefault((i, h, t), []).append((u["lo"], u["hi"]))
    # Every key a token sees, in exactly one of its units: disjoint spans that cover first_key .. pos.
    for i, (n, prefix) in enumerate(zip(q_lens, prefix_lens)):
        for h, t in itertools.product(range(num_kv_heads), range(n)):
            covered = sorted(spans.pop((i, h, t), ()))
            assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:])), (i, h, t, covered)
            first, end = first_key(i, t), prefix + t + 1
            assert sum(max(0, min(hi, end) - max(lo, first)) for lo, hi in covered) == end - first, (i, h, t, covered)
    assert not spans

    # A request of one query block: its keys in slices of at most `split` keys from its first, all full but the last.
    for u in units:
        i = u["request"]
        if q_lens[i] > block_tokens:
            assert u["partial"] == -1, u
            continue
        split = k.KV_SPLIT_ALL_HEADS if u["num_heads"] > 1 else k.KV_SPLIT
        assert (u["lo"] - first_key(i, 0)) % split == 0, u
        assert u["hi"] - u["lo"] == split or u["hi"] == seq_lens[i], u
        assert (u["partial"] >= 0) == (seq_lens[i] - first_key(i, 0) > split), u

    # The slices' rows, each read by one merge, which takes every slice of its rows' request, kv head and token.
    written = {}  # partial row -> (request, kv head, token, query head in the group), the slice's first key
    for u in units:
        rows = u["num_tokens"] * group
        for g, r in itertools.product(range(u["num_heads"]) if u["partial"] >= 0 else (), range(rows)):
            row = u["partial"] + g * rows + r
            assert row not in written, u
            written[row] = ((u["request"], u["head"] + g, u["t0"] + r // group, r % group), u["lo"])
    for m in merges:
        for r in range(m["num_tokens"] * group):
            slices = [written.pop(m["partial"] + s * m["split_stride"] + r) for s in range(m["num_splits"])]
            assert {row for row, _ in slices} == {(m["request"], m["head"], r // group, r % group)}, m
            assert len({lo for _, lo in slices}) == m["num_splits"], m
    assert not written

    # Units that read packed tiles: their request's and kv head's, each of GEMM_BLOCK_N keys from packed_from; every
    # packed tile is read.
    tile, read = k.GEMM_BLOCK_N, set()
    for u in (u for u in units if u["packed"] >= 0):
        assert u["num_tokens"] * group >= gemm_rows and u["partial"] == -1, u
        assert u["packed_from"] % tile == 0 and u["packed_from"] <= u["lo"], u
        start = u["packed_from"] + (u["lo"] - u["packed_from"]) // tile * tile
        for j0 in range(start, u["hi"], tile):
            index = u["packed"] + (j0 - u["packed_from"]) // tile
            n = min(tile, seq_lens[u["request"]] - j0)
            assert pack_jobs[index] == dict(request=u["request"], head=u["head"], j0=j0, n=n), u
            read.add(index)
    assert read == set(range(len(pack_jobs)))

    # A request's units, merges and pack jobs are the same alone as in the batch.
    def of_request(tables, i):
        units, merges, pack_jobs = tables
        return (
            [(*(u[f] for f in UNIT[1:7]), u["partial"] >= 0, u["packed"] >= 0) for u in units if u["request"] == i],
            [tuple(m[f] for f in MERGE[1:4]) + (m["split_stride"],) for m in merges if m["request"] == i],
            [(j["head"], j["j0"], j["n"]) for j in pack_jobs if j["request"] == i],
        )

    for i, (n, prefix) in enumerate(zip(q_lens, prefix_lens)):
        assert of_request((units, merges, pack_jobs), i) == of_request(schedule([n], [prefix], *shape), 0), i
    return units, merges, pack_jobs


# q_lens, prefix_lens, Hkv, group, head dim, value head dim, brgemm's rows ("amx": GEMM_ROWS_AMX, "vec": GEMM_ROWS);
# what the schedule must hold: slices (merges), units of every kv head, packed tiles.
CASES = {
    # Units of every kv head: 5 slices, exactly 2, a slice boundary at the last key, and one key alone.
    "decode": ([1] * 4, [1100, 511, 1536, 0], 2, 4, 128, 128, "amx", ("merges", "all_heads")),
    # 12 rows per kv head: units of every kv head; 3 and 2 slices.
    "verify_all_heads": ([3] * 2, [600, 260], 4, 4, 64, 64, "amx", ("merges", "all_heads")),
    # 32 rows per kv head: a unit per kv head (the brgemm path on AMX), 2 and 3 slices; without AMX units of every kv
    # head, up to 127 rows, and a unit per kv head from 128.
    "verify": ([4] * 2, [700, 1030], 2, 8, 128, 144, "amx", ("merges",)),
    "verify_vec": ([4] * 2, [700, 1030], 2, 8, 128, 144, "vec", ("merges", "all_heads")),
    "verify_vec_brgemm": ([8] * 2, [700, 1030], 2, 16, 128, 128, "vec", ("merges",)),
    # A short chunk over a long prefix (sliced) beside a chunk of two query blocks (packed tiles).
    "chunk_over_prefix": ([9, 150], [1200, 400], 2, 4, 64, 64, "amx", ("merges", "packed")),
    # Fresh prefills, one of two query blocks (group 1: 512 tokens a block), none with a request of no new token.
    "prefill": ([600, 70, 0], [0, 0, 5], 3, 1, 128, 128, "amx", ("packed",)),
    # Few rows of a head dim of no whole vectors: a unit per kv head, 2 slices and 1.
    "verify_head_dim_20": ([2] * 2, [700, 90], 2, 2, 20, 36, "amx", ("merges",)),
}
OPTIONS = {"default": (-1, -1), "window": (200, -1), "chunk": (-1, 300), "window_chunk": (77, 100)}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", CASES)
def test_schedule(name, option):
    *shape, gemm, reaches = CASES[name]
    gemm_rows = {"amx": kernels().GEMM_ROWS_AMX, "vec": kernels().GEMM_ROWS}[gemm]
    units, merges, pack_jobs = check_schedule(*shape, *OPTIONS[option], gemm_rows)
    if option == "default":  # windows and chunks may leave too few keys to split
        assert bool(merges) == ("merges" in reaches)
    assert any(u["num_heads"] > 1 for u in units) == ("all_heads" in reaches)
    assert bool(pack_jobs) == ("packed" in reaches)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_schedules(data):
    num_requests = data.draw(st.integers(1, 5))
    q_lens = data.draw(st.lists(st.integers(0, 4) | st.integers(0, 700), min_size=num_requests, max_size=num_requests))
    prefix_lens = data.draw(st.lists(st.integers(0, 2100), min_size=num_requests, max_size=num_requests))
    head_dim = data.draw(st.sampled_from([20, 64, 128]))
    check_schedule(
        q_lens,
        prefix_lens,
        data.draw(st.integers(1, 4)),
        data.draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
        head_dim,
        data.draw(st.sampled_from([head_dim, 36, 80])),
        data.draw(st.just(-1) | st.integers(1, 700)),
        data.draw(st.just(-1) | st.integers(1, 700)),
        data.draw(st.sampled_from([kernels().GEMM_ROWS_AMX, kernels().GEMM_ROWS])),
    )
