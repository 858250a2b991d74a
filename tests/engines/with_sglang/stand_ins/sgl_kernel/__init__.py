"""A stand-in for sgl_kernel, sglang's compiled kernels, in the engine tests' environment.

sglang's CPU platform (`SGLANG_USE_CPU_ENGINE=1`, which its `--enable-torch-compile` graph runner needs) imports
sgl_kernel at module level in about thirty modules, but its CPU build is not in the package registry (only CUDA
wheels are). Its kernels serve sglang's own intel_amx attention, AMX-only layers (sglang calls them where the CPU
has AMX tiles: `cpu_has_amx_support()`) and speculative decoding's tree helpers; hybrid_ops' attention backend uses
none of them. Every name here is a placeholder that raises when called, and every operator below raises when run,
so a path that does reach sgl_kernel fails loudly instead of computing anything.
"""

import torch
from _unavailable import stand_in

__getattr__ = stand_in(__name__)

# The operators that sglang 0.5.23's CPU graph runner gives fake implementations and Inductor fallbacks
# (`cpu_graph_runner.register_fake_ops`): they must exist for it to register those.
CPU_GRAPH_OPS = [
    "apply_multidimensional_rope_cpu",
    "apply_rotary_pos_emb_cpu",
    "biased_grouped_topk_cpu",
    "bmm_cpu",
    "causal_conv1d_fwd_cpu",
    "causal_conv1d_update_cpu",
    "chunk_gated_delta_rule_cpu",
    "decode_attention_cpu",
    "extend_attention_cpu",
    "fp8_per_tensor_scaled_mm_cpu",
    "fp8_scaled_mm_cpu",
    "fused_add_layernorm_cpu",
    "fused_add_rmsnorm_cpu",
    "fused_dual_residual_rmsnorm_cpu",
    "fused_experts_cpu",
    "fused_gdn_gating_cpu",
    "fused_input_proj_cpu",
    "fused_linear_sigmoid_mul",
    "fused_moe_router_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qk_rmsnorm_apply_from_stats_cpu",
    "fused_qk_rmsnorm_cpu",
    "fused_qk_rmsnorm_sumsq_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_qkvzba_split_reshape_cat_cpu",
    "fused_rmsnorm_gated_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
    "fused_sigmoid_mul_cpu",
    "gelu_and_mul_cpu",
    "gelu_tanh_and_mul_cpu",
    "gemma3_rmsnorm_cpu",
    "gemma4_rmsnorm_cpu",
    "gemma_fused_add_rmsnorm_cpu",
    "gemma_rmsnorm_cpu",
    "grouped_topk_cpu",
    "int4_scaled_mm_cpu",
    "int8_scaled_mm_cpu",
    "int8_scaled_mm_with_quant",
    "l2norm_cpu",
    "layernorm_cpu",
    "multimodal_rotary_embedding_cpu",
    "mxfp4_scaled_mm_cpu",
    "per_token_quant_int8_cpu",
    "qkv_proj_with_rope",
    "qkv_proj_with_rope_fused_weight",
    "rmsnorm_cpu",
    "rotary_embedding_cpu",
    "shared_expert_cpu",
    "shm_allgather",
    "shm_allreduce",
    "silu_and_mul_cpu",
    "topk_sigmoid_cpu",
    "topk_softmax_cpu",
    "weight_packed_linear",
]


def _unavailable_op(*args, **kwargs):
    raise RuntimeError("an sgl_kernel operator ran: this environment has a stand-in for sgl_kernel")


_library = torch.library.Library("sgl_kernel", "DEF")
for _name in CPU_GRAPH_OPS:
    _library.define(f"{_name}(Tensor[] args) -> ()")
    _library.impl(_name, _unavailable_op, "CompositeExplicitAutograd")
