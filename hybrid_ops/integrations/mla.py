"""MLA attention (DeepSeek-V2's multi-head latent attention and the families built on its layer) over a latent cache.

transformers' MLA layers compute, per token, a normalised latent [kv_lora_rank] and a roped key part
[qk_rope_head_dim] shared by every head, then expand them with `kv_b_proj` into per-head keys [qk_nope_head_dim +
qk_rope_head_dim] and values [v_head_dim] (`expand_kv`) before their attention call. A latent layer's cache keeps the
[latent, roped key part] row instead, once per token (`cache.LayerShape(latent=True)`: one kv head, D = rank + rope,
its values the first Dv = rank of each row), and attends by weight absorption:

    W = kv_b_proj.weight viewed [H, nope + v, rank]: W_uk = W[:, :nope], W_uv = W[:, nope:]
    q  = [q_nope W_uk, q_rope]                [T, H, rank + rope]   (q_nope . k_nope = (q_nope W_uk) . latent)
    o  = attention(q, K = [latent, k_rope], V = latent)              [T, H, rank], one kv head
    out = o W_uv^T                            [T, H, v]

with the layer's own scale (its softmax over the same logits as the expanded keys'). Prefill and decode alike go
through the absorbed form (exact; one path for every mode, cache and backend).

`serve_latent(model)` sets this up for the layers of `LATENT_CLASSES` (their forward computes q, the latent and the
roped key part, calls `expand_kv(latent, k_rope)` and the attention function with what it returns; verified on each
family's tiny config, tests/test_models.py): while a forward with a paged step runs, the instance's `expand_kv`
returns the latent row itself, and `hybrid_attention` hands the call to `LatentAttention.attend`. Any other forward
(the servability probe, transformers' own generate) expands as before. A layer of another class keeps the expanded
path: K and V per head in the cache, exact too.
"""

from dataclasses import dataclass

import torch

from ..cache import LayerShape
from .stateful import step_holder

# MLA attention classes whose forward feeds expand_kv's output straight to the attention function.
LATENT_CLASSES = {
    "DeepseekV2Attention",
    "DeepseekV3Attention",
    "Glm4MoeLiteAttention",
    "LongcatFlashMLA",
    "MiniCPM3Attention",
    "Mistral4Attention",
    "MistralLarge4TextAttention",
    "YoutuAttention",
    "KimiLinearAttention",
    "BailingHybridAttention",
}


@dataclass(eq=False)
class LatentAttention:
    """One MLA layer served over its latent cache."""

    module: torch.nn.Module
    num_heads: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    rank: int  # kv_lora_rank
    v_head_dim: int

    @property
    def shape(self) -> LayerShape:
        return LayerShape(1, self.rank + self.rope, self.rank, latent=True)

    def expand_kv(self, original, holder):
        """The instance's expand_kv: the latent row [1, 1, T, rank + rope] as the keys and its latent as the
        values while a paged step runs (`holder`'s), else the layer's own expansion."""

        def expand_kv(kv_nope, k_rot):
            step = holder.step
            if step is None or step.k_caches is None:
                return original(kv_nope, k_rot)
            return torch.cat([kv_nope, k_rot], dim=-1), kv_nope

        return expand_kv

    def attend(self, query, key, attn):
        """query: [1, H, T, nope + rope]; key: [1, 1, T, rank + rope] (expand_kv's); attn(q, k, v, v_cache_dims) the
        op over the layer's cache -> [1, T, H, v_head_dim]."""
        weight = self.module.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.rank)
        q_nope, q_rope = query[0].split([self.nope, self.rope], dim=-1)  # [H, T, *]
        q = torch.cat([torch.einsum("htn,hnr->thr", q_nope, weight[:, : self.nope]), q_rope.transpose(0, 1)], -1)
        k = key[0].transpose(0, 1)  # [T, 1, rank + rope]
        out = attn(q, k, k[..., : self.rank], self.rank)  # [T, H, rank]
        return torch.einsum("thr,hvr->thv", out, weight[:, self.nope :])[None]


def serve_latent(model, modules) -> dict:
    """Serves each attention module of `modules` ({layer index: module}, those the probe saw) that is of
    `LATENT_CLASSES` and has a roped key part over its latent cache -> {layer index: its `LayerShape`}."""
    shapes = {}
    for layer, module in modules.items():
        if type(module).__name__ not in LATENT_CLASSES or not getattr(module, "qk_rope_head_dim", 0):
            continue
        latent = getattr(module, "hybrid_latent", None)
        if latent is None:
            per_head = module.qk_nope_head_dim + module.v_head_dim
            latent = LatentAttention(
                module,
                module.kv_b_proj.weight.shape[0] // per_head,  # this rank's heads, under tensor parallelism too
                module.qk_nope_head_dim,
                module.qk_rope_head_dim,
                module.kv_lora_rank,
                module.v_head_dim,
            )
            module.expand_kv = latent.expand_kv(module.expand_kv, step_holder(model))
            module.hybrid_latent = latent
        shapes[layer] = latent.shape
    return shapes
