"""Argument checks of the ops.

`check_args` looks only at metadata (rank, shape, dtype, device), so the fake implementations run it too and the
same errors surface under torch.compile. `check_metadata_values` reads the metadata's values, which on CUDA is a
host sync: it runs only with validation switched on (`settings.set_validation`).
Every check runs before the KV cache is written, so a rejected call leaves the cache untouched.
"""

import torch

from .errors import HybridInputError, check_input
from .fp8 import FP8_DTYPES
from .options import check_options

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def tensors_ok(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table):
    """True when `check_tensors` would pass, in about a microsecond: the per-call path of the real ops.

    It compares sizes with `==`, which on symbolic sizes would add guards, so the fake implementations call
    `check_tensors` instead.
    """
    q_shape, k_shape, cache_shape, dtype, device = q.shape, k.shape, k_cache.shape, q.dtype, q.device
    v_shape, v_cache_shape = v.shape, v_cache.shape
    return (
        len(q_shape) == 3
        and len(k_shape) == 3
        and len(cache_shape) == 4
        and len(v_shape) == 3
        and len(v_cache_shape) == 4
        and v_shape[:2] == k_shape[:2]
        and v_cache_shape[:3] == cache_shape[:3]
        and v_shape[2] == v_cache_shape[3] > 0
        and k_shape[0] == q_shape[0]
        and k_shape[1] == cache_shape[2] > 0
        and k_shape[2] == q_shape[2] == cache_shape[3]
        and q_shape[1] % cache_shape[2] == 0
        and dtype in FLOAT_DTYPES
        and k.dtype == dtype
        and v.dtype == dtype
        and (k_cache.dtype == dtype or k_cache.dtype in FP8_DTYPES)
        and v_cache.dtype == k_cache.dtype
        and cu_seqlens_q.dtype == torch.int32
        and seq_lens.dtype == torch.int32
        and block_table.dtype == torch.int32
        and cu_seqlens_q.dim() == 1
        and seq_lens.dim() == 1
        and block_table.dim() == 2
        and cu_seqlens_q.shape[0] == seq_lens.shape[0] + 1 == block_table.shape[0] + 1
        and k.device == device
        and v.device == device
        and k_cache.device == device
        and v_cache.device == device
        and cu_seqlens_q.device == device
        and seq_lens.device == device
        and block_table.device == device
        and k_cache.is_contiguous()
        and value_rows_ok(v_cache)
    )


def value_rows_ok(v_cache) -> bool:
    """v_cache [num_pages, page_size, Hkv, Dv] is contiguous, or the leading Dv values of each row of a contiguous
    [num_pages, page_size, Hkv, E] tensor (E > Dv): MLA's latent cache passes `k_cache[..., :Dv]`, whose values are
    the first Dv of its keys, stored once."""
    if v_cache.is_contiguous():
        return True
    _, page_size, num_kv_heads, v_head_dim = v_cache.shape
    row = v_cache.stride(2)
    return v_cache.stride() == (page_size * num_kv_heads * row, num_kv_heads * row, row, 1) and row > v_head_dim


def check_args(tensors, options) -> None:
    """`check_tensors` of the op's tensors (q through block_table), then `options.check_options`."""
    check_tensors(*tensors)
    check_options(options, tensors[0], tensors[3])


def check_tensors(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table):
    """Shape, dtype and device checks that need no data; raises `HybridInputError` naming the argument. Shapes:

    q: [T, Hq, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv]; k_cache: [num_pages, page_size, Hkv, D], v_cache:
    [num_pages, page_size, Hkv, Dv], contiguous (v_cache: or the leading Dv values of contiguous rows,
    `value_rows_ok`), q's dtype or both one of FP8_DTYPES; cu_seqlens_q: [B + 1] int32;
    seq_lens: [B] int32; block_table: [B, max_pages] int32. Dv may differ from D (MLA-style models).
    """
    for name, t, rank in (
        ("q", q, 3),
        ("k", k, 3),
        ("v", v, 3),
        ("k_cache", k_cache, 4),
        ("v_cache", v_cache, 4),
        ("cu_seqlens_q", cu_seqlens_q, 1),
        ("seq_lens", seq_lens, 1),
        ("block_table", block_table, 2),
    ):
        if t.dim() != rank:
            raise HybridInputError(f"{name} must have {rank} dimensions, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise HybridInputError(f"{name} must be on q's device {q.device}, got {t.device}")
    if q.dtype not in FLOAT_DTYPES:
        raise HybridInputError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise HybridInputError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    if k_cache.dtype != q.dtype and k_cache.dtype not in FP8_DTYPES:
        raise HybridInputError(
            f"k_cache must have q's dtype {q.dtype} or be float8_e4m3fn or float8_e5m2, got {k_cache.dtype}"
        )
    if v_cache.dtype != k_cache.dtype:
        raise HybridInputError(f"v_cache must have k_cache's dtype {k_cache.dtype}, got {v_cache.dtype}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.dtype != torch.int32:
            raise HybridInputError(f"{name} must be int32, got {t.dtype}")

    num_tokens, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = k_cache.shape
    v_head_dim = v_cache.shape[3]
    check_input(
        v_cache.shape[:3] == k_cache.shape[:3],
        lambda: (
            f"v_cache must be [num_pages, page_size, Hkv, Dv] with k_cache's first three sizes "
            f"{tuple(k_cache.shape[:3])}, got {tuple(v_cache.shape)}"
        ),
    )
    check_input(v_head_dim > 0, lambda: f"v_cache's head dim Dv must be positive, got shape {tuple(v_cache.shape)}")
    if not k_cache.is_contiguous():
        raise HybridInputError(
            f"k_cache must be a contiguous [num_pages, page_size, Hkv, D] tensor, got strides {k_cache.stride()}"
        )
    if not value_rows_ok(v_cache):
        raise HybridInputError(
            f"v_cache must be a contiguous [num_pages, page_size, Hkv, Dv] tensor or the leading Dv values of the rows "
            f"of one (as k_cache[..., :Dv] of a latent cache), got strides {v_cache.stride()}"
        )
    check_input(
        cache_head_dim == head_dim, lambda: f"k_cache head dim {cache_head_dim} must equal q's head dim {head_dim}"
    )
    for name, t, dim in (("k", k, head_dim), ("v", v, v_head_dim)):
        check_input(t.shape[0] == num_tokens, lambda: f"{name} must have q's {num_tokens} tokens, got {t.shape[0]}")
        check_input(
            t.shape[1] == num_kv_heads,
            lambda: f"{name} must have k_cache's {num_kv_heads} kv heads, got shape {tuple(t.shape)}",
        )
        check_input(t.shape[2] == dim, lambda: f"{name} head dim must equal its cache's {dim}, got {t.shape[2]}")
    check_input(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        lambda: f"q's {num_q_heads} heads must be a multiple of the caches' {num_kv_heads} kv heads (Hq % Hkv == 0)",
    )

    num_requests = seq_lens.shape[0]
    check_input(
        cu_seqlens_q.shape[0] == num_requests + 1,
        lambda: (
            f"cu_seqlens_q must have B + 1 = {num_requests + 1} entries (B = len(seq_lens)), "
            f"got {cu_seqlens_q.shape[0]}"
        ),
    )
    check_input(
        block_table.shape[0] == num_requests,
        lambda: f"block_table must have B = {num_requests} rows (B = len(seq_lens)), got {block_table.shape[0]}",
    )


def decode_shape_ok(num_tokens, num_requests):
    """`decode` needs the same query length for every request: T must be a multiple of B (T = 0 when B = 0)."""
    return num_tokens % num_requests == 0 if num_requests > 0 else num_tokens == 0


def check_decode_shape(q, seq_lens):
    """Raises unless `decode_shape_ok`; T // B is then each request's query length."""
    num_tokens, num_requests = q.shape[0], seq_lens.shape[0]
    check_input(
        decode_shape_ok(num_tokens, num_requests),
        lambda: (
            f"decode needs the same number of query tokens per request: T = {num_tokens} "
            f"is not a multiple of B = {num_requests}"
        ),
    )


def check_metadata_values(
    cu_seqlens_q, seq_lens, block_table, num_tokens, num_pages, page_size, decode, tree_mask=None
):
    """Value checks of the metadata (and of a tree mask). Reads the values to the host (a sync on CUDA).

    Returns `(cu_seqlens_q, seq_lens)` as Python lists, for callers that loop over requests.
    """
    cu, lens = check_lengths(cu_seqlens_q, seq_lens, num_tokens, decode)
    capacity = block_table.shape[1] * page_size
    for i, length in enumerate(lens):
        if length > capacity:
            raise HybridInputError(
                f"seq_lens[{i}] = {length} exceeds block_table's capacity of {block_table.shape[1]} pages "
                f"x {page_size} = {capacity} tokens"
            )
    pages_used = (seq_lens.to(torch.int64) + page_size - 1) // page_size
    in_use = torch.arange(block_table.shape[1], device=block_table.device) < pages_used[:, None]
    bad = in_use & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise HybridInputError(
            f"block_table[{i}, {j}] = {int(block_table[i, j])} is not a page of the cache (0 <= id < {num_pages})"
        )
    if tree_mask is not None:
        check_tree_values(tree_mask, cu)
    return cu, lens


def check_lengths(cu_seqlens_q, seq_lens, num_tokens, decode):
    """Value checks of cu_seqlens_q against T = `num_tokens` and of seq_lens against each request's new tokens (and,
    on the decode path, one q_len for all). Returns both as Python lists."""
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    if cu[0] != 0:
        raise HybridInputError(f"cu_seqlens_q must start at 0, got {cu[0]}")
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in q_lens):
        raise HybridInputError(f"cu_seqlens_q must be non-decreasing, got {cu}")
    if cu[-1] != num_tokens:
        raise HybridInputError(f"cu_seqlens_q must end at the number of tokens T = {num_tokens}, got {cu[-1]}")
    for i, (n, length) in enumerate(zip(q_lens, lens)):
        if length < n:
            raise HybridInputError(f"seq_lens[{i}] = {length} is shorter than request {i}'s {n} new tokens")
    if decode and len(set(q_lens)) > 1:
        raise HybridInputError(f"decode needs the same query length for every request, got {q_lens}")
    return cu, lens


def check_tree_values(tree_mask, cu):
    """tree_mask: [T, Q] bool; cu: cu_seqlens_q as a host list. Each request's block of new tokens must fit in Q, and
    each row see itself and no later token (the rows of a tree laid out parents first)."""
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    longest = max(q_lens, default=0)
    if longest > tree_mask.shape[1]:
        raise HybridInputError(
            f"tree_mask has Q = {tree_mask.shape[1]} columns, fewer than the longest request's {longest} new tokens"
        )
    device, rows = tree_mask.device, torch.tensor(q_lens)
    local = torch.arange(tree_mask.shape[0]) - torch.tensor(cu[:-1]).repeat_interleave(rows)  # [T]: token t is j
    column = torch.arange(tree_mask.shape[1])
    own = (column == local[:, None]).to(device)
    later = ((column > local[:, None]) & (column < rows.repeat_interleave(rows)[:, None])).to(device)
    blind = (~tree_mask & own).any(1)
    if bool(blind.any()):
        t = int(blind.nonzero()[0])
        raise HybridInputError(f"tree_mask[{t}, {int(local[t])}] is False: a token always sees itself")
    ahead = tree_mask & later
    if bool(ahead.any()):
        t, c = (int(x) for x in ahead.nonzero()[0])
        raise HybridInputError(
            f"tree_mask[{t}, {c}] is True: a token sees only earlier new tokens (lay the tree out parents first)"
        )


def check_state_metadata_values(
    cu_seqlens_q, seq_lens, state_slots, num_tokens, num_slots, decode, tree_mask, verify_len
):
    """Value checks of a state op's metadata (`state_ops`; and of a tree mask); reads it to the host (a sync on
    CUDA). verify_len: Q of intermediate_states in TARGET_VERIFY, else None. Returns (cu_seqlens_q, seq_lens,
    state_slots) as lists."""
    cu, lens = check_lengths(cu_seqlens_q, seq_lens, num_tokens, decode)
    slots = state_slots.tolist()
    held = [s for s in slots if s != -1]
    if len(set(held)) != len(held) or not all(0 <= s < num_slots for s in held):
        raise HybridInputError(
            f"state_slots must be distinct slots in [0, {num_slots}) or -1 (a padding request), got {slots}"
        )
    if tree_mask is not None:
        check_tree_values(tree_mask, cu)
    longest = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    if verify_len is not None and longest > verify_len:
        raise HybridInputError(
            f"intermediate_states holds Q = {verify_len} tokens per slot, fewer than the longest request's {longest}"
        )
    return cu, lens, slots
