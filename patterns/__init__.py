"""The fusions, in the order the pass manager applies them.

Each pattern is one file here; ``build_patterns`` maps its name to an instance. Later patterns
match on the ops earlier ones produced (norm_rope and residual_norm match gemma4opt.rms_norm
calls; gelu_tanh_mul reads the merged gate/up halves; paged_qkv fuses norm_rope's output with the
paged cache's KV append; decode_linear runs last, on the GEMMs merged_projections left), so order
matters. ``paged_only`` patterns run only with attention="paged".
"""
from __future__ import annotations

PATTERN_NAMES = ("rms_norm", "merged_projections", "norm_rope", "paged_qkv", "gelu_tanh_mul", "residual_norm",
                 "moe_router", "moe_experts", "logit_softcap", "decode_linear")


def build_patterns() -> dict:
    from .decode_linear import DecodeLinearPattern
    from .gelu_tanh_mul import GeluTanhMulPattern
    from .logit_softcap import LogitSoftcapPattern
    from .merged_projections import MergedProjectionsPattern
    from .moe_experts import MoeExpertsPattern
    from .moe_router import MoeRouterPattern
    from .norm_rope import NormRopePattern
    from .paged_qkv import PagedQKVPattern
    from .residual_norm import ResidualNormPattern
    from .rms_norm import RMSNormPattern

    patterns = [RMSNormPattern(), MergedProjectionsPattern(), NormRopePattern(), PagedQKVPattern(), GeluTanhMulPattern(),
                ResidualNormPattern(), MoeRouterPattern(), MoeExpertsPattern(), LogitSoftcapPattern(), DecodeLinearPattern()]
    assert tuple(p.name for p in patterns) == PATTERN_NAMES
    return {p.name: p for p in patterns}
