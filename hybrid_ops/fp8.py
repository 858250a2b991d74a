"""fp8 KV caches: `k_cache` / `v_cache` of float8_e4m3fn or float8_e5m2 hold k / scale and v / scale.

The ops take the scales as tensors (`k_scale=`, `v_scale=`: float32, one for all kv heads or one per kv head), so a
new value never recompiles and a CUDA graph reads the current one. Every backend stores and reads the same values:

    stored = (x.float() / scale).clamp(-max, max).to(fp8)   (fp32 division, round to nearest even, saturating)
    read   = stored.float() * scale
"""

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def per_head(kv_scale, num_kv_heads, device):
    """A scale argument as backends take it: [Hkv] float32 (a view; ones when the caller gave none)."""
    if kv_scale is None:
        kv_scale = torch.ones((), dtype=torch.float32, device=device)
    return kv_scale.reshape(-1).expand(num_kv_heads)


def quantize(x, kv_scale, dtype):
    """x: [..., Hkv, D] in q's dtype; kv_scale: [Hkv] float32. Returns x / scale in `dtype`, saturated to its range."""
    limit = torch.finfo(dtype).max
    return (x.float() / kv_scale[:, None]).clamp_(-limit, limit).to(dtype)


def raw(cache):
    """A view of an fp8 cache as uint8, for the copies torch does not implement for fp8 (index_copy_, index_fill_);
    other caches as they are."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache
