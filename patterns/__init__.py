"""The fusions, in the order the pass manager applies them.

Each pattern is one file here; ``build_patterns`` maps its name to an instance. Later patterns
match on the ops earlier ones produced (norm_rope and residual_norm match gemma4opt.rms_norm
calls; gelu_tanh_mul reads the merged gate/up halves; paged_qkv fuses norm_rope's output with the
paged cache's KV append; fp8_quant moves each fp8 GEMM input's quantization into the rms_norm,
residual tail or gelu kernel that produced it, quant_linear the rest into the fp8 GEMM reading it; norm_add takes the norm + add sums residual_norm
leaves; decode_linear runs after them, on the GEMMs merged_projections left, then gate_up_gelu, on the
MLP's gate/up gemma4opt.linear and its gelu_tanh_mul, and gelu_linear, on the PLE gelu_tanh_mul and
the gemma4opt.linear it feeds; rope_cos_sin, on the rotary embedding, reads nothing the others
make; norm_linear, on the residual tails residual_norm and norm_add left and the
gemma4opt.linear each feeds; moe_streams last, on the experts op and the sum of its branch with the
dense MLP's), so order matters. ``paged_only`` patterns run only with
attention="paged", ``quantized_only`` ones only with quantization="fp8".
"""
from __future__ import annotations

PATTERN_NAMES = ("rms_norm", "merged_projections", "norm_rope", "paged_qkv", "gelu_tanh_mul", "residual_norm",
                 "norm_add", "fp8_quant", "quant_linear", "moe_router", "moe_experts", "logit_softcap", "decode_linear",
                 "gate_up_gelu", "gelu_linear", "rope_cos_sin", "norm_linear", "moe_streams")

# Applied only where Gemma4OptConfig.patterns names them (a pattern waits here until a GPU has run its
# tests and timed it); it holds none.
OPT_IN: tuple[str, ...] = ()
DEFAULT_PATTERNS = tuple(p for p in PATTERN_NAMES if p not in OPT_IN)


def build_patterns(quantization: str | None = None, quantize_lm_head: bool = False) -> dict:
    """Every pattern, built for what the graph's linears are (Gemma4OptConfig.quantization and
    quantize_lm_head)."""
    from .decode_linear import DecodeLinearPattern
    from .fp8_quant import Fp8QuantPattern
    from .gate_up_gelu import GateUpGeluPattern
    from .gelu_linear import GeluLinearPattern
    from .gelu_tanh_mul import GeluTanhMulPattern
    from .logit_softcap import LogitSoftcapPattern
    from .merged_projections import MergedProjectionsPattern
    from .moe_experts import MoeExpertsPattern
    from .moe_router import MoeRouterPattern
    from .moe_streams import MoeStreamsPattern
    from .norm_add import NormAddPattern
    from .norm_linear import NormLinearPattern
    from .norm_rope import NormRopePattern
    from .paged_qkv import PagedQKVPattern
    from .quant_linear import QuantLinearPattern
    from .residual_norm import ResidualNormPattern
    from .rms_norm import RMSNormPattern
    from .rope_cos_sin import RopeCosSinPattern

    classes = [RMSNormPattern, MergedProjectionsPattern, NormRopePattern, PagedQKVPattern, GeluTanhMulPattern,
               ResidualNormPattern, NormAddPattern, Fp8QuantPattern, QuantLinearPattern, MoeRouterPattern, MoeExpertsPattern, LogitSoftcapPattern,
               DecodeLinearPattern, GateUpGeluPattern, GeluLinearPattern, RopeCosSinPattern, NormLinearPattern,
               MoeStreamsPattern]
    patterns = [cls(quantization, quantize_lm_head) for cls in classes]
    assert tuple(p.name for p in patterns) == PATTERN_NAMES
    return {p.name: p for p in patterns}
