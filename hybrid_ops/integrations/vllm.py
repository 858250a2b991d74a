"""hybrid_ops as vLLM's out-of-tree attention backend (vLLM 0.32's v1 interface, `AttentionBackendEnum.CUSTOM`).

Installing hybrid_ops makes it available: its entry point in vLLM's plugin group `vllm.general_plugins` (`register`)
runs in every process vLLM starts (the LLM process, the engine core, each worker) and registers the backend as
CUSTOM. `LLM(..., attention_backend="CUSTOM")` or `vllm serve ... --attention-backend CUSTOM` then run the ops.
vLLM's CPU platform answers any non-MLA request with its own CPU_ATTN, so on the CPU the plugin lets an explicit
CUSTOM through (and checks it there, when vLLM builds the layer); a request for no backend still gets CPU_ATTN.
This module imports vLLM; `import hybrid_ops` never does.

vLLM's objects, served in place (no copy per step):

    kv_cache   one tensor per layer, its block b's bytes in `kv_cache[b]` (vLLM zeroes and copies blocks whole,
               copy-on-write included). Those bytes are read as the block's K page then its V page, each
               [block_size, Hkv, D]: the layer's cache is 2 * num_blocks pages of one contiguous tensor, K of block
               b at page 2b and V at page 2b + 1, so `k_cache = pages[:-1]`, `v_cache = pages[1:]` (contiguous,
               as the ops take them) with block b at row 2b of both, and every block table doubled. (This needs D
               = Dv, and a layout whose blocks are dense, which `supported_kv_cache_layouts` asks for.)
    metadata   `CommonAttentionMetadata`: query_start_loc is the ops' cu_seqlens_q, seq_lens their seq_lens (the
               KV length after the step), block_table_tensor (doubled) their block table; a step whose requests
               all decode one token is DECODE, any other EXTEND (the ops route it to prefill).
    writes     the ops store the new K/V at positions seq_lens - q_len ... of the block table, the slots vLLM's
               slot_mapping names (`forward_includes_kv_cache_update`).

The layer's options: `sliding_window` (vLLM's counts the token itself, as the ops' does), `logits_soft_cap`,
`sinks` ([Hq], any float dtype), fp8 caches ("fp8", "fp8_e4m3", "fp8_e5m2") with the layer's `_k_scale` /
`_v_scale`. ALiBi, encoder and cross attention, KV sharing and fused output quantization are refused when vLLM
builds the layer. On the CPU vLLM calls attention eagerly (an opaque op inside its compiled graph).
"""

import logging
from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import KVCacheLayout

from ..errors import HybridInputError
from ..modes import ForwardMode

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Under vLLM's logger, whose handlers print it in vLLM's log.
logger = logging.getLogger("vllm.plugins.hybrid_ops")


def register() -> None:
    """The plugin: our backend as CUSTOM, and on vLLM's CPU platform an explicit CUSTOM let through (idempotent)."""
    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.HybridOpsBackend")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.platforms.cpu import CpuPlatform

        if not getattr(CpuPlatform.get_attn_backend_cls, "lets_custom_through", False):
            CpuPlatform.get_attn_backend_cls = classmethod(_letting_custom_through(CpuPlatform.get_attn_backend_cls))


def _letting_custom_through(choose):
    """CpuPlatform.get_attn_backend_cls (`choose`, bound), but for an explicit CUSTOM request: ours, once vLLM's
    checks of the layer's needs (`validate_configuration`) pass."""

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend != AttentionBackendEnum.CUSTOM or attn_selector_config.use_mla:
            return choose(selected_backend, attn_selector_config, num_heads)
        reasons = HybridOpsBackend.validate_configuration(device_capability=None, **attn_selector_config._asdict())
        if reasons:
            raise HybridInputError(f"the hybrid_ops attention backend (CUSTOM) cannot serve this layer: {reasons}")
        logger.info("Using the hybrid_ops attention backend (CUSTOM) on vLLM's CPU platform")
        return AttentionBackendEnum.CUSTOM.get_path()

    get_attn_backend_cls.lets_custom_through = True
    return get_attn_backend_cls


class HybridOpsBackend(AttentionBackend):
    forward_includes_kv_cache_update = True
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto", "float16", "bfloat16", *FP8]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM looks the layer's backend up by this name

    @staticmethod
    def get_impl_cls():
        return HybridOpsImpl

    @staticmethod
    def get_builder_cls():
        return HybridOpsMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls):
        # Layer-compact layouts: each block's bytes dense in the layer's tensor, read as its K page then V page.
        return (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class HybridOpsMetadata:
    """One step's metadata as the ops take it (shapes in the module's docstring)."""

    num_actual_tokens: int
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32, doubled: block b is page 2b of k_cache and of v_cache
    forward_mode: ForwardMode


class HybridOpsMetadataBuilder(AttentionMetadataBuilder[HybridOpsMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if kv_cache_spec.head_size_v != kv_cache_spec.head_size:
            raise HybridInputError(
                f"the hybrid_ops attention backend (CUSTOM) needs keys and values of one head size in vLLM's cache; "
                f"layers {layer_names} have {kv_cache_spec.head_size} and {kv_cache_spec.head_size_v}"
            )

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False) -> HybridOpsMetadata:
        metadata = common_attn_metadata
        num_requests, num_tokens = metadata.num_reqs, metadata.num_actual_tokens
        decode = num_tokens == num_requests and metadata.max_query_len == 1
        return HybridOpsMetadata(
            num_tokens,
            metadata.query_start_loc[: num_requests + 1],
            metadata.seq_lens[:num_requests],
            metadata.block_table_tensor[:num_requests] * 2,
            ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        )


class HybridOpsImpl(AttentionImpl[HybridOpsMetadata]):
    def __init__(
        self,
        num_heads,
        head_size,
        scale,
        num_kv_heads=None,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="auto",
        logits_soft_cap=None,
        attn_type=AttentionType.DECODER,
        kv_sharing_target_layer_name=None,
        sinks=None,
        **kwargs,
    ):
        refused = {
            "ALiBi slopes": alibi_slopes is not None,
            f"{AttentionType(attn_type).value} attention": attn_type != AttentionType.DECODER,
            "KV sharing": kv_sharing_target_layer_name is not None,
            f"the options {sorted(kwargs)}": bool(kwargs),
        }
        if any(refused.values()):
            raise HybridInputError(
                "the hybrid_ops attention backend (CUSTOM) does not serve "
                + ", ".join(name for name, present in refused.items() if present)
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window or -1
        self.logit_cap = logits_soft_cap or 0.0
        self.sinks = sinks

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        """query: [T, Hq, D], key, value: [T, Hkv, D] (views, strided); output: [T, Hq, D], of which the first
        num_actual_tokens rows are written. attn_metadata is None while vLLM profiles (nothing to attend)."""
        if output_scale is not None or output_block_scale is not None:
            raise HybridInputError("the hybrid_ops attention backend (CUSTOM) does not quantize its output")
        if attn_metadata is None:
            return output
        num_tokens = attn_metadata.num_actual_tokens
        k_cache, v_cache = self._caches(kv_cache)
        fp8 = self.kv_cache_dtype in FP8
        out = torch.ops.hybrid.attn(
            query[:num_tokens],
            key[:num_tokens],
            value[:num_tokens],
            k_cache,
            v_cache,
            attn_metadata.cu_seqlens_q,
            attn_metadata.seq_lens,
            attn_metadata.block_table,
            int(attn_metadata.forward_mode),
            scale=self.scale,
            sliding_window=self.sliding_window,
            logit_cap=self.logit_cap,
            sinks=None if self.sinks is None else self.sinks.float(),
            k_scale=layer._k_scale if fp8 else None,
            v_scale=layer._v_scale if fp8 else None,
        )
        output[:num_tokens].copy_(out)
        return output

    def _caches(self, kv_cache):
        """The layer's tensor [num_blocks, Hkv, block_size, 2 * D] (logical; its blocks dense) as the ops' caches:
        (k_cache, v_cache), each [2 * num_blocks - 1, block_size, Hkv, D], block b's K and V at row 2b."""
        num_blocks, num_kv_heads, block_size, width = kv_cache.shape
        page = block_size * num_kv_heads * (width // 2)
        if kv_cache.stride(0) != 2 * page:
            raise HybridInputError(
                f"the hybrid_ops attention backend (CUSTOM) needs each block's bytes dense in the layer's KV cache; "
                f"its block stride is {kv_cache.stride(0)} elements, not {2 * page}"
            )
        dtype = FP8.get(self.kv_cache_dtype, kv_cache.dtype)
        pages = kv_cache.as_strided(
            (2 * num_blocks, block_size, num_kv_heads, width // 2),
            (page, num_kv_heads * (width // 2), width // 2, 1),
        ).view(dtype)
        return pages[:-1], pages[1:]
