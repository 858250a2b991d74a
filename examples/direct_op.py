"""Calling torch.ops.hybrid.attn directly over a PagedKVCache, switching modes by hand.

Two requests are prefilled (EXTEND), decode a few tokens (DECODE), a third joins while they decode (MIXED), and
the first finishes and frees its pages. Every output is checked against dense attention over the request's tokens.
"""

import torch

from hybrid_ops import ForwardMode, PagedKVCache

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 64


def dense_attention(q, keys, values):
    """q: [n, Hq, D] (the last n positions), keys/values: [L, Hkv, D] -> causal attention [n, Hq, D]."""
    n, length = q.shape[0], keys.shape[0]
    group = NUM_Q_HEADS // NUM_KV_HEADS
    scores = torch.einsum("nhd,lhd->hnl", q, keys.repeat_interleave(group, 1)) / HEAD_DIM**0.5
    causal = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, values.repeat_interleave(group, 1))


def main():
    torch.manual_seed(0)
    cache = PagedKVCache(num_pages=32, page_size=16, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    k_cache, v_cache = cache.layer(0)
    history = {}  # request -> (keys, values) it has written

    def step(mode, requests, new_tokens):
        batch = cache.step(requests, new_tokens, mode)
        total = sum(new_tokens)
        q = torch.randn(total, NUM_Q_HEADS, HEAD_DIM)
        k, v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM), torch.randn(total, NUM_KV_HEADS, HEAD_DIM)
        out = torch.ops.hybrid.attn(q, k, v, k_cache, v_cache, *batch.metadata, int(mode))
        error, start = 0.0, 0
        for rid, n in zip(requests, new_tokens):
            keys, values = history.get(rid, (k[:0], v[:0]))
            keys, values = torch.cat([keys, k[start : start + n]]), torch.cat([values, v[start : start + n]])
            history[rid] = keys, values
            ref = dense_attention(q[start : start + n], keys, values)
            error = max(error, (out[start : start + n] - ref).abs().max().item())
            start += n
        print(
            f"{mode.name:8s} requests {requests} new tokens {new_tokens}: max error {error:.1e}, "
            f"seq_lens {batch.seq_lens.tolist()}, free pages {cache.num_free_pages}"
        )
        return error

    errors = []
    for rid in ("a", "b"):
        cache.add(rid)
    errors.append(step(ForwardMode.EXTEND, ["a", "b"], [37, 5]))
    for _ in range(3):
        errors.append(step(ForwardMode.DECODE, ["a", "b"], [1, 1]))
    cache.add("c")
    errors.append(step(ForwardMode.MIXED, ["a", "b", "c"], [1, 1, 20]))
    cache.free("a")
    errors.append(step(ForwardMode.DECODE, ["b", "c"], [1, 1]))
    assert max(errors) < 1e-4, errors
    print("all outputs match dense attention")


if __name__ == "__main__":
    main()
