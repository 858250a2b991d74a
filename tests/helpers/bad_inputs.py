"""The ops' bad inputs, each with the words of its error: bad arguments (`BAD_INPUTS`, checked from shapes, dtypes
and options alone) and bad metadata values (`VALUE_INPUTS`, checked by reading them), as mutations of a valid call."""

import math

import torch

from .reference import make_case

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ARGS = ("q", "k", "v", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table")


def replace(**changes):
    """A mutation of a valid case's arguments: each value is a function of the old argument."""

    def mutate(args, kwargs):
        args = dict(zip(ARGS, args))
        for name, fn in changes.items():
            if name in args:
                args[name] = fn(args[name])
            else:
                kwargs[name] = fn(kwargs.get(name))
        return tuple(args.values()), kwargs

    return mutate


def fp8_caches(dtype, **scales):
    """A mutation to caches of the fp8 `dtype`, with `scales` (k_scale, v_scale: functions as `replace` takes)."""
    return replace(k_cache=lambda t: t.to(dtype), v_cache=lambda t: t.to(dtype), **scales)


def set_value(index, value):
    def fn(t):
        t = t.clone()
        t[index] = value
        return t

    return fn


def chain(*q_lens, width=None):
    """A causal tree_mask for requests of `q_lens` new tokens: [T, width or the longest] bool."""
    width = width or max(q_lens)
    return torch.cat([torch.ones(n, width).tril() for n in q_lens]).bool()


# name -> (op, mutation, words the message must contain). Metadata-only ones also run
# under torch.compile (the fake implementations raise them); value ones need the data.
BAD_INPUTS = {
    "float_block_table": ("prefill", replace(block_table=lambda t: t.float()), "block_table must be int32"),
    "int64_block_table": ("prefill", replace(block_table=lambda t: t.long()), "block_table must be int32"),
    "int64_seq_lens": ("prefill", replace(seq_lens=lambda t: t.long()), "seq_lens must be int32"),
    "int64_cu_seqlens": ("decode", replace(cu_seqlens_q=lambda t: t.long()), "cu_seqlens_q must be int32"),
    "int_q": ("prefill", replace(q=lambda t: t.int()), "q must be float16, bfloat16 or float32"),
    "float64_q": ("prefill", replace(q=lambda t: t.double()), "q must be float16, bfloat16 or float32"),
    "k_dtype": ("prefill", replace(k=lambda t: t.half()), "k must have q's dtype"),
    "cache_dtype": ("prefill", replace(v_cache=lambda t: t.half()), "v_cache must have k_cache's dtype"),
    "int8_cache": (
        "prefill",
        replace(k_cache=lambda t: t.to(torch.int8), v_cache=lambda t: t.to(torch.int8)),
        "k_cache must have q's dtype torch.float32 or be float8_e4m3fn or float8_e5m2",
    ),
    "fp8_caches_differ": (
        "prefill",
        replace(k_cache=lambda t: t.to(E4M3), v_cache=lambda t: t.to(E5M2)),
        "v_cache must have k_cache's dtype",
    ),
    "scale_without_fp8": (
        "prefill",
        replace(k_scale=lambda _: torch.ones(()), v_scale=lambda _: torch.ones(())),
        "k_scale applies to float8 caches only",
    ),
    "fp8_k_scale_alone": (
        "decode",
        fp8_caches(E4M3, k_scale=lambda _: torch.ones(())),
        "v_scale must be given with k_scale",
    ),
    "fp8_scale_dtype": (
        "attn",
        fp8_caches(E5M2, k_scale=lambda _: torch.ones(2, dtype=torch.float64), v_scale=lambda _: torch.ones(2)),
        "k_scale must be a float32 tensor",
    ),
    "fp8_scale_heads": (
        "prefill",
        fp8_caches(E4M3, k_scale=lambda _: torch.ones(2), v_scale=lambda _: torch.ones(3)),
        "v_scale must have 1 or the caches'",
    ),
    "meta_device": ("prefill", replace(block_table=lambda t: t.to("meta")), "block_table must be on q's device"),
    "q_rank": ("prefill", replace(q=lambda t: t[None]), "q must have 3 dimensions"),
    "cache_rank": ("decode", replace(k_cache=lambda t: t.flatten(0, 1)), "k_cache must have 4 dimensions"),
    "block_table_rank": ("prefill", replace(block_table=lambda t: t.flatten()), "block_table must have 2"),
    "k_tokens": ("prefill", replace(k=lambda t: t[1:]), "k must have q's"),
    "v_heads": ("prefill", replace(v=lambda t: t[:, :1]), "v must have k_cache's"),
    "head_dim_mismatch": ("prefill", replace(q=lambda t: t[..., :8]), "head dim"),
    "gqa_ratio": ("prefill", replace(q=lambda t: t[:, :3]), "Hq % Hkv"),
    "v_cache_shape": (
        "prefill",
        replace(v_cache=lambda t: t[:-1]),
        "v_cache must be [num_pages, page_size, Hkv, Dv] with k_cache's first three sizes",
    ),
    "v_head_dim": ("prefill", replace(v=lambda t: t[..., :8]), "v head dim must equal its cache's"),
    "sinks_heads": ("prefill", replace(sinks=lambda _: torch.zeros(3)), "sinks must have q's"),
    "sinks_dtype": (
        "prefill",
        replace(sinks=lambda _: torch.zeros(4, dtype=torch.bfloat16)),
        "sinks must be a [Hq] float32 tensor",
    ),
    "zero_chunk": ("decode", replace(attention_chunk=lambda _: 0), "attention_chunk must be -1"),
    "tree_dtype": ("prefill", replace(tree_mask=lambda _: chain(3, 4).byte()), "tree_mask must be a [T, Q] bool"),
    "tree_rank": ("decode", replace(tree_mask=lambda _: chain(1, 1, 1)[None]), "tree_mask must be a [T, Q] bool"),
    "tree_rows": ("prefill", replace(tree_mask=lambda _: chain(3, 3)), "tree_mask must have q's"),
    "tree_columns": ("prefill", replace(tree_mask=lambda _: chain(3, 4)[:, :0]), "tree_mask must have Q >= 1"),
    "cache_not_contiguous": (
        "prefill",
        replace(k_cache=lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
        "contiguous",
    ),
    "cu_seqlens_len": ("prefill", replace(cu_seqlens_q=lambda t: t[:-1]), "cu_seqlens_q must have B + 1"),
    "block_table_rows": ("prefill", replace(block_table=lambda t: t[:-1]), "block_table must have B"),
    "decode_ragged_T": (
        "decode",
        replace(q=lambda t: t[:-1], k=lambda t: t[:-1], v=lambda t: t[:-1]),
        "same number of query tokens",
    ),
    "nan_scale": ("prefill", replace(scale=lambda _: math.nan), "scale must be a finite positive"),
    "negative_scale": ("prefill", replace(scale=lambda _: -1.0), "scale must be a finite positive"),
    "zero_window": ("prefill", replace(sliding_window=lambda _: 0), "sliding_window must be -1"),
    "inf_logit_cap": ("prefill", replace(logit_cap=lambda _: math.inf), "logit_cap must be 0.0"),
    "unknown_backend": ("prefill", replace(backend=lambda _: "cudnn"), "backend must be 'auto' or one of"),
    "unknown_decode_backend": ("attn", replace(decode_backend=lambda _: "x"), "decode_backend must be 'auto'"),
    "unknown_spec_mode": (
        "attn",
        replace(speculative_attention_mode=lambda _: "draft"),
        "speculative_attention_mode must be one of",
    ),
}
VALUE_INPUTS = {
    "cu_seqlens_not_from_0": ("prefill", replace(cu_seqlens_q=set_value(0, 1)), "cu_seqlens_q must start at 0"),
    "cu_seqlens_decreasing": ("prefill", replace(cu_seqlens_q=set_value(1, 9)), "non-decreasing"),
    "cu_seqlens_not_T": ("prefill", replace(cu_seqlens_q=set_value(-1, 6)), "must end at the number of tokens"),
    "seq_lens_short": ("prefill", replace(seq_lens=set_value(0, 1)), "seq_lens[0] = 1 is shorter"),
    "seq_lens_negative": ("prefill", replace(seq_lens=set_value(1, -3)), "seq_lens[1] = -3 is shorter"),
    "block_id_high": ("prefill", replace(block_table=set_value((0, 0), 10_000)), "block_table[0, 0] = 10000"),
    "block_id_negative": ("decode", replace(block_table=set_value((1, 0), -1)), "block_table[1, 0] = -1"),
    "table_too_short": ("prefill", replace(seq_lens=set_value(1, 400)), "exceeds block_table's capacity"),
    # valid_case("prefill")'s table has 4 columns of 4-token pages: 17 tokens are one past its capacity.
    "table_one_short": (
        "prefill",
        replace(seq_lens=set_value(1, 17)),
        "seq_lens[1] = 17 exceeds block_table's capacity of 4 pages x 4 = 16 tokens",
    ),
    "tree_narrow": (
        "prefill",
        replace(tree_mask=lambda _: chain(3, 4)[:, :3]),
        "tree_mask has Q = 3 columns, fewer than the longest request's 4 new tokens",
    ),
    "tree_blind": (
        "prefill",
        replace(tree_mask=lambda _: set_value((5, 2), False)(chain(3, 4))),
        "tree_mask[5, 2] is False: a token always sees itself",
    ),
    "tree_later": (
        "prefill",
        replace(tree_mask=lambda _: set_value((3, 1), True)(chain(3, 4))),
        "tree_mask[3, 1] is True: a token sees only earlier new tokens",
    ),
    "decode_ragged_lengths": (
        "decode",
        replace(cu_seqlens_q=lambda t: torch.tensor([0, 1, 1, 3], dtype=t.dtype)),
        "same query length for every request",
    ),
}


def valid_case(op):
    """The valid call the mutations start from: a decode batch for "decode", else a prefill batch."""
    if op == "decode":
        return make_case([1, 1, 1], [3, 0, 6], seed=0)
    return make_case([3, 4], [2, 5], seed=0)


def call(op, args, kwargs):
    """torch.ops.hybrid.`op` on the case's arguments; "attn" in EXTEND (forward_mode 1)."""
    if op == "attn":
        return torch.ops.hybrid.attn(*args, 1, **kwargs)
    return getattr(torch.ops.hybrid, op)(*args, **kwargs)
