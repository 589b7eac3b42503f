"""Importing this registers every torch.ops.gemma4opt op (reference + fake + CUDA kernels)."""
from gemma4opt.ops import (  # noqa: F401
    add_rms_norm,
    add_rms_norm_quant,
    fp8_linear,
    gelu_tanh_mul,
    gelu_tanh_mul_quant,
    kv_append,
    linear,
    linear_softcap,
    moe_experts,
    moe_router,
    norm_add,
    qkv_norm_rope_append,
    quantize_rows,
    rms_norm,
    rms_norm_quant,
    rms_norm_rope,
)
