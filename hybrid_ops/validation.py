"""Argument checks of the ops.

`check_args` looks only at metadata (rank, shape, dtype, device), so the fake implementations run it too and the
same errors surface under torch.compile. `check_metadata_values` reads the metadata's values, which on CUDA is a
host sync: it runs only with validation switched on (`settings.set_validation`).
Every check runs before the KV cache is written, so a rejected call leaves the cache untouched.
"""

import math

import torch

from .errors import HybridInputError
from .fp8 import FP8_DTYPES

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(cond, message) -> None:
    # Works for plain bools and for SymBools in the fake implementations (a runtime assert, not a guard).
    torch._check_with(HybridInputError, cond, message)


# The ops' arguments in their schemas' order: two lines here and in check_args (fmt: skip), not the same fifteen.
def args_ok(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window, logit_cap,
            sinks=None, attention_chunk=-1, k_scale=None, v_scale=None):  # fmt: skip
    """True when `check_args` would pass, in about a microsecond: the per-call path of the real ops.

    It compares sizes with `==`, which on symbolic sizes would add guards, so the fake implementations call
    `check_args` instead.
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
        and (
            k_scale is None
            and v_scale is None
            or k_cache.dtype in FP8_DTYPES
            and _kv_scale_ok(k_scale, k_shape[1], device)
            and _kv_scale_ok(v_scale, k_shape[1], device)
        )
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
        and v_cache.is_contiguous()
        and (scale is None or 0 < scale < math.inf)
        and (sliding_window == -1 or sliding_window > 0)
        and 0 <= logit_cap < math.inf
        and (attention_chunk == -1 or attention_chunk > 0)
        and (sinks is None or (sinks.shape == q_shape[1:2] and sinks.dtype == torch.float32 and sinks.device == device))
    )


def _kv_scale_ok(kv_scale, num_kv_heads, device):
    return (
        kv_scale is not None
        and kv_scale.dtype == torch.float32
        and kv_scale.device == device
        and kv_scale.shape in ((), (1,), (num_kv_heads,))
    )


def check_args(q, k, v, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, sliding_window, logit_cap,
               sinks=None, attention_chunk=-1, k_scale=None, v_scale=None):  # fmt: skip
    """Shape, dtype and device checks that need no data; raises `HybridInputError` naming the argument. Shapes:

    q: [T, Hq, D]; k: [T, Hkv, D]; v: [T, Hkv, Dv]; k_cache: [num_pages, page_size, Hkv, D], v_cache:
    [num_pages, page_size, Hkv, Dv], contiguous, q's dtype or both one of FP8_DTYPES; cu_seqlens_q: [B + 1] int32;
    seq_lens: [B] int32; block_table: [B, max_pages] int32; sinks: [Hq] float32 or None; k_scale, v_scale: float32
    [] or [1] (one scale) or [Hkv] (one per kv head), both or neither, with fp8 caches only (neither: 1.0). Dv may
    differ from D (MLA-style models).
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
    _check(
        v_cache.shape[:3] == k_cache.shape[:3],
        lambda: (
            f"v_cache must be [num_pages, page_size, Hkv, Dv] with k_cache's first three sizes "
            f"{tuple(k_cache.shape[:3])}, got {tuple(v_cache.shape)}"
        ),
    )
    _check(v_head_dim > 0, lambda: f"v_cache's head dim Dv must be positive, got shape {tuple(v_cache.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise HybridInputError(
                f"{name} must be a contiguous [num_pages, page_size, Hkv, D] tensor, got strides {t.stride()}"
            )
    _check(cache_head_dim == head_dim, lambda: f"k_cache head dim {cache_head_dim} must equal q's head dim {head_dim}")
    for name, t, dim in (("k", k, head_dim), ("v", v, v_head_dim)):
        _check(t.shape[0] == num_tokens, lambda: f"{name} must have q's {num_tokens} tokens, got {t.shape[0]}")
        _check(
            t.shape[1] == num_kv_heads,
            lambda: f"{name} must have k_cache's {num_kv_heads} kv heads, got shape {tuple(t.shape)}",
        )
        _check(t.shape[2] == dim, lambda: f"{name} head dim must equal its cache's {dim}, got {t.shape[2]}")
    _check(
        num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
        lambda: f"q's {num_q_heads} heads must be a multiple of the caches' {num_kv_heads} kv heads (Hq % Hkv == 0)",
    )

    num_requests = seq_lens.shape[0]
    _check(
        cu_seqlens_q.shape[0] == num_requests + 1,
        lambda: (
            f"cu_seqlens_q must have B + 1 = {num_requests + 1} entries (B = len(seq_lens)), "
            f"got {cu_seqlens_q.shape[0]}"
        ),
    )
    _check(
        block_table.shape[0] == num_requests,
        lambda: f"block_table must have B = {num_requests} rows (B = len(seq_lens)), got {block_table.shape[0]}",
    )

    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise HybridInputError(f"scale must be a finite positive float or None, got {scale}")
    if not (sliding_window == -1 or sliding_window > 0):
        raise HybridInputError(f"sliding_window must be -1 (no window) or a positive int, got {sliding_window}")
    if not (math.isfinite(logit_cap) and logit_cap >= 0):
        raise HybridInputError(f"logit_cap must be 0.0 (no soft-cap) or a finite positive float, got {logit_cap}")
    if not (attention_chunk == -1 or attention_chunk > 0):
        raise HybridInputError(f"attention_chunk must be -1 (no chunking) or a positive int, got {attention_chunk}")
    if sinks is not None:
        if sinks.dtype != torch.float32 or sinks.dim() != 1 or sinks.device != q.device:
            raise HybridInputError(
                f"sinks must be a [Hq] float32 tensor on q's device {q.device}, got "
                f"{sinks.dtype} of shape {tuple(sinks.shape)} on {sinks.device}"
            )
        _check(sinks.shape[0] == num_q_heads, lambda: f"sinks must have q's {num_q_heads} heads, got {sinks.shape[0]}")
    _check_kv_scales(k_scale, v_scale, k_cache.dtype, num_kv_heads, q.device)


def _check_kv_scales(k_scale, v_scale, cache_dtype, num_kv_heads, device):
    if k_scale is None and v_scale is None:
        return
    if cache_dtype not in FP8_DTYPES:
        name = "k_scale" if k_scale is not None else "v_scale"
        raise HybridInputError(f"{name} applies to float8 caches only; k_cache is {cache_dtype}")
    for name, kv_scale, other in (("k_scale", k_scale, "v_scale"), ("v_scale", v_scale, "k_scale")):
        if kv_scale is None:
            raise HybridInputError(f"{name} must be given with {other}: an fp8 cache takes both scales or neither")
        if kv_scale.dtype != torch.float32 or kv_scale.device != device or kv_scale.dim() > 1:
            raise HybridInputError(
                f"{name} must be a float32 tensor of shape [], [1] or [Hkv] on q's device {device}, "
                f"got {kv_scale.dtype} of shape {tuple(kv_scale.shape)} on {kv_scale.device}"
            )
        if kv_scale.dim() == 1:
            _check(
                (kv_scale.shape[0] == 1) | (kv_scale.shape[0] == num_kv_heads),
                lambda: f"{name} must have 1 or the caches' {num_kv_heads} kv heads, got {kv_scale.shape[0]}",
            )


def decode_shape_ok(num_tokens, num_requests):
    """`decode` needs the same query length for every request: T must be a multiple of B (T = 0 when B = 0)."""
    return num_tokens % num_requests == 0 if num_requests > 0 else num_tokens == 0


def check_decode_shape(q, seq_lens):
    """Raises unless `decode_shape_ok`; T // B is then each request's query length."""
    num_tokens, num_requests = q.shape[0], seq_lens.shape[0]
    _check(
        decode_shape_ok(num_tokens, num_requests),
        lambda: (
            f"decode needs the same number of query tokens per request: T = {num_tokens} "
            f"is not a multiple of B = {num_requests}"
        ),
    )


def check_metadata_values(cu_seqlens_q, seq_lens, block_table, num_tokens, num_pages, page_size, decode):
    """Value checks of the metadata. Reads the values to the host (a sync on CUDA).

    Returns `(cu_seqlens_q, seq_lens)` as Python lists, for callers that loop over requests.
    """
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    if cu[0] != 0:
        raise HybridInputError(f"cu_seqlens_q must start at 0, got {cu[0]}")
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in q_lens):
        raise HybridInputError(f"cu_seqlens_q must be non-decreasing, got {cu}")
    if cu[-1] != num_tokens:
        raise HybridInputError(f"cu_seqlens_q must end at the number of tokens T = {num_tokens}, got {cu[-1]}")
    capacity = block_table.shape[1] * page_size
    for i, (n, length) in enumerate(zip(q_lens, lens)):
        if length < n:
            raise HybridInputError(f"seq_lens[{i}] = {length} is shorter than request {i}'s {n} new tokens")
        if length > capacity:
            raise HybridInputError(
                f"seq_lens[{i}] = {length} exceeds block_table's capacity of {block_table.shape[1]} pages "
                f"x {page_size} = {capacity} tokens"
            )
    if decode and len(set(q_lens)) > 1:
        raise HybridInputError(f"decode needs the same query length for every request, got {q_lens}")
    pages_used = (seq_lens.to(torch.int64) + page_size - 1) // page_size
    in_use = torch.arange(block_table.shape[1], device=block_table.device) < pages_used[:, None]
    bad = in_use & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise HybridInputError(
            f"block_table[{i}, {j}] = {int(block_table[i, j])} is not a page of the cache (0 <= id < {num_pages})"
        )
    return cu, lens
