"""Test helpers: random paged batches and the float64 reference attention, written without the library's code."""

import math
import random
from dataclasses import dataclass

import pytest
import torch

POISON = 1e4  # fills every cache slot a batch does not own; any read of it shows in the output
# Every backend that runs on the CPU: triton through its interpreter (conftest.py), cpu the native kernels.
CPU_BACKENDS = ["torch", "triton", "cpu"]


def slow_except(fast, values):
    """Parametrize values, all but `fast` in the slow tier (a tuple: the values of several arguments)."""
    return [
        v if v == fast else pytest.param(*v if isinstance(v, tuple) else (v,), marks=pytest.mark.slow) for v in values
    ]


# CPU_BACKENDS to parametrize with: the interpreter takes seconds where the others take milliseconds, so triton's cases
# are in the slow tier, and test_triton*.py keep Triton in the fast one.
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.slow), "cpu"]


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    q_lens: list
    prefix_lens: list
    pages: list  # per request, its page ids
    prefix_k: list  # per request, [prefix, Hkv, D] in the cache dtype
    prefix_v: list  # per request, [prefix, Hkv, Dv]

    @property
    def args(self):
        return (self.q, self.k, self.v, self.k_cache, self.v_cache, self.cu_seqlens_q, self.seq_lens, self.block_table)


def make_case(
    q_lens,
    prefix_lens,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=16,
    page_size=4,
    dtype=torch.float32,
    extra_pages=3,
    strided=False,
    seed=None,
    device="cpu",
    v_head_dim=None,
) -> Case:
    """A batch whose requests own shuffled, non-contiguous pages; all other pages hold POISON.

    v_head_dim: the value head dim Dv (v, v_cache), head_dim when None.
    seed: None draws one from `random`, which conftest.py seeds from the test's id.
    """
    v_head_dim = v_head_dim or head_dim
    rng = random.Random(random.getrandbits(32) if seed is None else seed)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    pages_per_req = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + extra_pages
    ids = list(range(num_pages))
    rng.shuffle(ids)
    pages, it = [], iter(ids)
    for n in pages_per_req:
        pages.append([next(it) for _ in range(n)])
    max_pages = max(pages_per_req + [1]) + 1  # one spare column, pointing at a poisoned page
    table = torch.full((len(q_lens), max_pages), ids[-1], dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    k_cache = torch.full((num_pages, page_size, num_kv_heads, head_dim), POISON, dtype=dtype)
    v_cache = torch.full((num_pages, page_size, num_kv_heads, v_head_dim), POISON, dtype=dtype)
    prefix_k, prefix_v = [], []
    for i, plen in enumerate(prefix_lens):
        pk, pv = randn(plen, num_kv_heads, head_dim), randn(plen, num_kv_heads, v_head_dim)
        for pos in range(plen):
            page, row = pages[i][pos // page_size], pos % page_size
            k_cache[page, row], v_cache[page, row] = pk[pos], pv[pos]
        prefix_k.append(pk)
        prefix_v.append(pv)
    total = sum(q_lens)
    if strided:  # non-contiguous views, as torch.compile hands them over
        q = randn(total, num_q_heads + 1, head_dim)[:, 1:]
        kv = randn(total, 2, num_kv_heads, head_dim + v_head_dim)
        k, v = kv[:, 0, :, :head_dim], kv[:, 1, :, head_dim:]
    else:
        q, k, v = (
            randn(total, num_q_heads, head_dim),
            randn(total, num_kv_heads, head_dim),
            randn(total, num_kv_heads, v_head_dim),
        )
    cu = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32)
    to = lambda t: t.to(device)  # noqa: E731
    return Case(
        to(q),
        to(k),
        to(v),
        to(k_cache),
        to(v_cache),
        to(cu),
        to(torch.tensor(seq_lens, dtype=torch.int32)),
        to(table),
        list(q_lens),
        list(prefix_lens),
        pages,
        prefix_k,
        prefix_v,
    )


def latent_case(q_lens, prefix_lens, num_q_heads=8, head_dim=40, v_head_dim=32, **kwargs) -> Case:
    """A batch over an MLA latent cache: one kv head whose values are the first Dv values of its keys, stored once
    (v_cache is `k_cache[..., :Dv]`, v is `k[..., :Dv]`), as a model stores [normalised latent, roped key part]."""
    case = make_case(q_lens, prefix_lens, num_q_heads, 1, head_dim, v_head_dim=v_head_dim, **kwargs)
    latent = dict(
        v=case.k[..., :v_head_dim],
        v_cache=case.k_cache[..., :v_head_dim],
        prefix_v=[k[..., :v_head_dim] for k in case.prefix_k],
    )
    return Case(**{**case.__dict__, **latent})


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def tree_sees(tree_mask, start, n):
    """Which new tokens each of a request's n new tokens sees under a tree mask (rows start .. start + n - 1):
    itself, and the earlier ones its row names; all earlier ones without a mask. A list of n lists of n bools."""
    return [
        [c == j or (c < j and (tree_mask is None or bool(tree_mask[start + j, c]))) for c in range(n)] for j in range(n)
    ]


def first_visible_key(pos, sliding_window=-1, attention_chunk=-1):
    """The first key a query at position `pos` sees (it sees keys first_visible_key .. pos): the window's last
    sliding_window positions, from the start of its attention_chunk-long chunk."""
    lo = max(0, pos - sliding_window + 1) if sliding_window > 0 else 0
    return max(lo, pos - pos % attention_chunk) if attention_chunk > 0 else lo


def reference(case: Case, scale=None, sliding_window=-1, logit_cap=0.0, sinks=None, attention_chunk=-1, tree_mask=None):
    """float64 attention from the dense per-request K/V, written plainly: [T, Hq, Dv] float64.

    sinks: [Hq] logits, each one more term exp(sink) in its head's softmax denominator; attention_chunk: a query at
    position p sees keys from p - p % attention_chunk on; tree_mask: [T, Q] bool, a token sees the new tokens its
    row names (`tree_sees`), and a new token's position is prefix + the number of earlier new tokens it sees.
    """
    q = case.q.double().cpu()
    num_q_heads, head_dim = q.shape[1:]
    group = num_q_heads // case.k.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(*q.shape[:2], case.v.shape[2], dtype=torch.float64)
    start = 0
    for i, (n, prefix) in enumerate(zip(case.q_lens, case.prefix_lens)):
        keys = torch.cat([case.prefix_k[i], case.k[start : start + n].cpu()]).double()
        values = torch.cat([case.prefix_v[i], case.v[start : start + n].cpu()]).double()
        sees = tree_sees(tree_mask, start, n)
        positions = list(range(prefix)) + [prefix + sum(row) - 1 for row in sees]  # of every key
        for j in range(n):
            pos = positions[prefix + j]
            lo = first_visible_key(pos, sliding_window, attention_chunk)
            seen = [s for s in range(prefix + n) if (s < prefix or sees[j][s - prefix]) and lo <= positions[s] <= pos]
            for h in range(num_q_heads):
                s = keys[seen, h // group] @ q[start + j, h] * scale
                if logit_cap > 0:
                    s = logit_cap * torch.tanh(s / logit_cap)
                weights = torch.exp(s - s.max())
                denominator = weights.sum()
                if sinks is not None:
                    denominator += torch.exp(sinks[h].double() - s.max())
                out[start + j, h] = weights / denominator @ values[seen, h // group]
        start += n
    return out


def dense_attention(q, keys, values, prefix, sliding_window=-1):
    """float64 causal attention of q [n, Hq, D] over keys/values [L, Hkv, D], token j at position prefix + j."""
    group = q.shape[1] // keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        hi = prefix + j + 1
        lo = max(0, hi - sliding_window) if sliding_window > 0 else 0
        for h in range(q.shape[1]):
            s = keys[lo:hi, h // group].double() @ q[j, h].double() / q.shape[-1] ** 0.5
            out[j, h] = torch.softmax(s, 0) @ values[lo:hi, h // group].double()
    return out


def expected_cache(case: Case):
    """The caches as they must be after the call: the inputs' caches plus the new k, v at their positions."""
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    start = 0
    for i, (n, prefix) in enumerate(zip(case.q_lens, case.prefix_lens)):
        for j in range(n):
            pos = prefix + j
            page, row = case.pages[i][pos // k_cache.shape[1]], pos % k_cache.shape[1]
            k_cache[page, row], v_cache[page, row] = case.k[start + j], case.v[start + j]
        start += n
    return k_cache, v_cache


TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_close(out, ref, dtype):
    """Max abs error against the float64 reference, bounded per dtype (outputs are O(1) averages of N(0, 1))."""
    assert out.dtype == dtype
    err = (out.double().cpu() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= TOLERANCE[dtype], f"max abs error {err:.3g} > {TOLERANCE[dtype]:.1g} for {dtype}"


def to_fp8(x, kv_scale, dtype):
    """The store of an fp8 cache, written plainly: x [..., Hkv, D] / kv_scale ([Hkv] or one value) in fp32, saturated
    to the format's largest value, rounded to nearest even by the conversion."""
    limit = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[dtype]
    per_head = kv_scale.to(x.device, torch.float32).reshape(-1, 1).expand(x.shape[-2], 1)
    return (x.float() / per_head).clamp(-limit, limit).to(dtype)


def from_fp8(x, kv_scale):
    """The read of an fp8 cache: float64 stored value times its kv head's scale."""
    return x.double() * kv_scale.to(x.device, torch.float64).reshape(-1, 1).expand(x.shape[-2], 1)


def fp8_case(case: Case, dtype, k_scale, v_scale):
    """`case` with fp8 caches (every slot quantized, poison included) and the case the float64 reference must attend
    over: the dequantized prefix rows and new k, v. Returns (fp8 case, reference case, expected caches after the
    call as uint8)."""
    k_expected, v_expected = (
        to_fp8(c, s, dtype).view(torch.uint8) for c, s in zip(expected_cache(case), (k_scale, v_scale))
    )
    stored = dict(k_cache=to_fp8(case.k_cache, k_scale, dtype), v_cache=to_fp8(case.v_cache, v_scale, dtype))
    fp8 = Case(**{**case.__dict__, **stored})

    def read(x, kv_scale):
        return from_fp8(to_fp8(x, kv_scale, dtype), kv_scale)

    reads = dict(
        k=read(case.k, k_scale),
        v=read(case.v, v_scale),
        prefix_k=[read(x, k_scale) for x in case.prefix_k],
        prefix_v=[read(x, v_scale) for x in case.prefix_v],
    )
    return fp8, Case(**{**case.__dict__, **reads}), (k_expected, v_expected)


def fp8_hard_values(dtype):
    """fp32 values where a conversion to fp8 `dtype` goes wrong, of either sign: every finite fp8 value, the ties
    between neighbours, the floats next to each of these, fp32 subnormals, 0, inf, NaN, and values past the largest
    finite one (its tie with the next power of two included)."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = values[values.isfinite() & (values >= 0)].double().sort().values
    limit = values[-1].item()
    ties = ((values[1:] + values[:-1]) / 2).float()
    special = torch.tensor(
        [
            0.0,
            float("inf"),
            float("nan"),
            1e-45,
            2e-40,
            1.17e-38,
            limit * 1.0625,
            limit * 1.125,
            limit * 1.5,
            2 * limit,
            1e30,
        ]
    )
    hard = torch.cat([values.float(), ties, special])
    hard = torch.cat([hard, *(torch.nextafter(hard, torch.tensor(to)) for to in (0.0, float("inf")))])
    return torch.cat([hard, -hard])


def fp8_store_case(cache_dtype, k_scale, v_scale, head_dim=64):
    """One request of new tokens (fp32, no prefix) whose k, v hold `fp8_hard_values` times their kv head's scale
    (k_scale, v_scale: [Hkv] float32): the store's quotients land at and next to the format's rounding ties (where a
    division that is not correctly rounded, or a multiplication by the reciprocal, shows), past its largest value and
    among its subnormals. Its attention output means nothing (inf, NaN)."""
    hard = fp8_hard_values(cache_dtype)
    tokens = -(-hard.numel() // head_dim)
    num_kv_heads = k_scale.shape[0]
    case = make_case(
        [tokens], [0], num_q_heads=num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=16, seed=0
    )
    values = torch.cat([hard, hard[: tokens * head_dim - hard.numel()]]).view(tokens, 1, head_dim)
    case.k.copy_(values * k_scale[:, None])
    case.v.copy_(values * v_scale[:, None])
    return case


def random_tree(depth, width, rng, full=False):
    """An EAGLE-style draft tree laid out level by level: the root, then up to `width` nodes per level (`full`:
    exactly `width`) for `depth` levels, each node's parent on the level above. Returns its [n, n] bool rows (a node
    sees itself and its ancestors) and its depths."""
    parents, levels = [-1], [[0]]
    for _ in range(depth):
        level = []
        for _ in range(width if full else rng.randint(1, width)):
            parents.append(rng.choice(levels[-1]))
            level.append(len(parents) - 1)
        levels.append(level)
    n = len(parents)
    rows = torch.zeros(n, n, dtype=torch.bool)
    for j in range(n):
        node = j
        while node >= 0:
            rows[j, node] = True
            node = parents[node]
    return rows, rows.sum(1) - 1


def tree_mask_for(trees, width, rng, above=False):
    """[T, width] bool of per-request tree rows (`random_tree`'s), the columns past each request's tokens random (the
    ops never read them); with `above`, the entries above the diagonal too (read by no kernel, but refused by the value
    checks)."""
    blocks = []
    for rows in trees:
        n = rows.shape[0]
        block = torch.tensor([[rng.random() < 0.5 for _ in range(width)] for _ in range(n)], dtype=torch.bool)
        block = block.view(n, width)
        upper = torch.ones(n, n, dtype=torch.bool).triu(1)
        block[:, :n] = rows | (block[:, :n] & upper) if above else rows
        blocks.append(block)
    return torch.cat(blocks) if blocks else torch.zeros(0, width, dtype=torch.bool)
