"""MLA decode over a latent cache against the expanded K and V, side by side in one run.

One attention layer of DeepSeek-V2-Lite's sizes (16 heads; kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim
128, v_head_dim 128), 4 requests decoding one token each over contexts of 1k, 4k and 16k tokens, pages of 16
scattered over the cache, fp32 and bf16, the cpu backend:

    latent     the cache holds [latent, roped key part], 576 values per token; the step absorbs kv_b_proj into the
               query (q_nope W_uk) and the output (o W_uv^T) around one op call over one kv head, D 576, Dv 512
               (integrations/mla.py)
    expanded   the cache holds per-head K and V, 16 x (192 + 128) = 5120 values per token (what transformers passes
               the attention function); the step expands the new token with kv_b_proj, then one op call over 16 kv
               heads, D 192, Dv 128

    python -m bench mla            # 1k, 4k, 16k
    python -m bench mla --quick    # 1k, 4k
"""

import torch

HEADS, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128
PAGE, REQUESTS = 16, 4


class Layer:
    """The two caches of one layer over the same contexts, and the step's inputs."""

    def __init__(self, context, dtype):
        import hybrid_ops

        generator = torch.Generator().manual_seed(0)
        pages_per_request = -(-(context + 1) // PAGE)
        num_pages = REQUESTS * pages_per_request
        order = torch.randperm(num_pages, generator=generator).to(torch.int32)
        self.block_table = order.view(REQUESTS, pages_per_request)
        self.cu_seqlens_q = torch.arange(REQUESTS + 1, dtype=torch.int32)
        self.seq_lens = torch.full((REQUESTS,), context + 1, dtype=torch.int32)
        shapes = {"latent": (1, RANK + ROPE, RANK, True), "expanded": (HEADS, NOPE + ROPE, V)}
        self.caches = {
            name: hybrid_ops.PagedKVCache(num_pages, PAGE, 1, 1, layer_shapes=[shape], dtype=dtype, for_compile=False)
            for name, shape in shapes.items()
        }
        for cache in self.caches.values():
            for t in cache.stored_caches:
                t.normal_(generator=generator)
        randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype)  # noqa: E731
        self.q = randn(REQUESTS, HEADS, NOPE + ROPE)
        self.latent = randn(REQUESTS, 1, RANK + ROPE)
        self.kv_b = randn(HEADS * (NOPE + V), RANK) / RANK**0.5
        self.scale = (NOPE + ROPE) ** -0.5

    def bytes_per_token(self, name):
        cache = self.caches[name]
        return sum(t[0, 0].numel() * t.element_size() for t in cache.stored_caches)

    def run(self, name):
        k_cache, v_cache = self.caches[name].layer(0)
        metadata = (self.cu_seqlens_q, self.seq_lens, self.block_table)
        weight = self.kv_b.view(HEADS, NOPE + V, RANK)
        if name == "latent":
            q_nope, q_rope = self.q.split([NOPE, ROPE], dim=-1)
            q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, weight[:, :NOPE]), q_rope], dim=-1)
            k = self.latent
            out = torch.ops.hybrid.decode(q, k, k[..., :RANK], k_cache, v_cache, *metadata, scale=self.scale)
            return torch.einsum("thr,hvr->thv", out, weight[:, NOPE:])
        kv = (self.latent[:, 0, :RANK] @ self.kv_b.t()).view(REQUESTS, HEADS, NOPE + V)
        k = torch.cat([kv[..., :NOPE], self.latent[:, :, RANK:].expand(-1, HEADS, -1)], dim=-1)
        return torch.ops.hybrid.decode(self.q, k, kv[..., NOPE:], k_cache, v_cache, *metadata, scale=self.scale)


def mla_section(quick, reps=None):
    """Rows of (context, dtype): bytes per token and milliseconds per step of each layout, and their ratios."""
    from .run import timeit_side_by_side

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for context in (1024, 4096) if quick else (1024, 4096, 16384):
            layer = Layer(context, dtype)
            times = timeit_side_by_side({name: (lambda n=name: lambda: layer.run(n)) for name in layer.caches},
                                        reps or (5 if quick else 15))  # fmt: skip
            row = dict(context=context, dtype=str(dtype).removeprefix("torch."))
            for name, seconds in times.items():
                row[f"{name}_bytes_per_token"] = layer.bytes_per_token(name)
                row[f"{name}_ms"] = seconds * 1e3
            row["speedup"] = row["expanded_ms"] / row["latent_ms"]
            rows.append(row)
            print(
                f"  mla {row['dtype']} {context}: latent {row['latent_ms']:.2f} ms, expanded {row['expanded_ms']:.2f} "
                f"ms ({row['speedup']:.1f}x)",
                flush=True,
            )
    return rows


def markdown(rows) -> str:
    lines = [
        "## MLA decode: latent cache against expanded K and V (python -m bench mla)",
        "",
        f"One layer of DeepSeek-V2-Lite's sizes ({HEADS} heads, kv_lora_rank {RANK}, rope {ROPE}, nope {NOPE}, "
        f"v {V}), {REQUESTS} requests decoding one token, pages of {PAGE}, cpu backend.",
        "",
        "| context | dtype | latent bytes/token | expanded bytes/token | latent ms/step | expanded ms/step | "
        "expanded / latent |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['context']} | {r['dtype']} | {r['latent_bytes_per_token']} | {r['expanded_bytes_per_token']} | "
        f"{r['latent_ms']:.2f} | {r['expanded_ms']:.2f} | {r['speedup']:.1f}x |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"
