"""Gemma-4 text configs with the real dimensions (random-init runs; no weights here) and tiny test variants.

Real presets follow the public model cards/metadata. Where those are silent we keep
transformers' Gemma4TextConfig defaults: layer pattern 5 sliding : 1 full (last layer full),
RoPE theta 10k sliding / 1M proportional (partial 0.25) full, eps 1e-6. ``attention_k_eq_v``
is set where the full layers have fewer KV heads than the sliding ones (31b, 26b-a4b), since
transformers only applies ``num_global_key_value_heads`` together with it.
"""
from __future__ import annotations

import torch

_COMMON = dict(vocab_size=262144, final_logit_softcapping=30.0, tie_word_embeddings=True, head_dim=256,
               global_head_dim=512, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072)

PRESETS: dict[str, dict] = {
    "31b": dict(_COMMON, num_hidden_layers=60, hidden_size=5376, intermediate_size=21504,
                num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
                attention_k_eq_v=True, sliding_window=1024, hidden_size_per_layer_input=0),
    "26b-a4b": dict(_COMMON, num_hidden_layers=30, hidden_size=2816, intermediate_size=2112,
                    num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                    attention_k_eq_v=True, sliding_window=1024, hidden_size_per_layer_input=0,
                    enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    "e4b": dict(_COMMON, num_hidden_layers=42, hidden_size=2560, intermediate_size=10240,
                num_attention_heads=8, num_key_value_heads=2, sliding_window=512,
                hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=18),
    "e2b": dict(_COMMON, num_hidden_layers=35, hidden_size=1536, intermediate_size=6144,
                num_attention_heads=8, num_key_value_heads=1, sliding_window=512,
                hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, num_kv_shared_layers=20,
                use_double_wide_mlp=True),
}

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, global_head_dim=32, sliding_window=8, final_logit_softcapping=30.0,
             hidden_size_per_layer_input=0, vocab_size_per_layer_input=128, max_position_embeddings=512,
             layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
             num_hidden_layers=4)

# Tiny configs of every Gemma-4 variant, for CPU tests (and the example's default).
TINY_PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    "tiny-k-eq-v": dict(_TINY, attention_k_eq_v=True, num_global_key_value_heads=1),
    "tiny-ple-shared": dict(_TINY, num_hidden_layers=5, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                            use_double_wide_mlp=True,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                         "sliding_attention", "full_attention"]),
    "tiny-moe": dict(_TINY, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16,
                     attention_k_eq_v=True, num_global_key_value_heads=1),
}

# The example's embedded default: E2B's structure (sliding + full layers with two head dims,
# PLE, KV sharing, double-wide MLP, softcap) at a width a CPU generates with in seconds.
DEMO_PRESETS: dict[str, dict] = {
    "demo": dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=64, global_head_dim=128, sliding_window=32,
                 final_logit_softcapping=30.0, hidden_size_per_layer_input=32, vocab_size_per_layer_input=4096,
                 num_kv_shared_layers=2, use_double_wide_mlp=True, num_hidden_layers=6,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                 max_position_embeddings=4096),
}

ALL_PRESETS = {**PRESETS, **DEMO_PRESETS, **TINY_PRESETS}


def preset_config(name: str, layers: int | None = None, **overrides):
    """A Gemma4TextConfig for a preset; ``layers`` cuts depth (KV-shared layers scale with it);
    ``overrides``: other config fields."""
    from transformers import Gemma4TextConfig

    if name not in ALL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; supported: {sorted(ALL_PRESETS)}")
    kw = dict(ALL_PRESETS[name])
    if layers is not None and layers != kw["num_hidden_layers"]:
        if layers < 2:
            raise ValueError(f"--layers {layers}: need at least 2 (one sliding and one full layer)")
        full = kw["num_hidden_layers"]
        shared = kw.get("num_kv_shared_layers", 0)
        kw["num_kv_shared_layers"] = min(round(shared * layers / full), max(layers - 6, 0)) if shared else 0
        kw["num_hidden_layers"] = layers
        kw.pop("layer_types", None)
    return Gemma4TextConfig(**{**kw, **overrides})


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Make random-init weights exercise every multiply: norm weights off 1, layer_scalar off 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 + 0.2 * torch.randn(p.shape, generator=g)).to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.5 + torch.rand((), generator=g).item())
    return model


def build_model(name: str = "tiny", layers: int | None = None, dtype=torch.float32, device="cpu", seed: int = 0,
                attn_implementation: str = "sdpa", **overrides):
    """A random-init Gemma4ForCausalLM for a preset, built directly on ``device`` in ``dtype``
    (``overrides``: config fields, preset_config's)."""
    from transformers import Gemma4ForCausalLM

    config = preset_config(name, layers, **overrides)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Gemma4ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    return randomize_(model.eval(), seed)


def finegrained_fp8_(model: torch.nn.Module, block_size=(128, 128), skip=("lm_head",),
                     scale_fmt: str = "float") -> torch.nn.Module:
    """The model, in place, as transformers leaves one loaded with ``FineGrainedFP8Config(weight_block_size=
    block_size)`` (no fp8 checkpoint can be downloaded here): transformers' own replace_with_fp8_linear
    swaps every nn.Linear but those ``skip`` names (and the MoE experts modules unless skipped) and its
    own Fp8Quantize makes each weight's e4m3 bytes and tile scales from the model's weights; a weight
    whose shape is not a multiple of the block stays unquantized, as transformers leaves it.
    ``scale_fmt="ue8m0"``: the tile scales rounded up to powers of two, stored as float8_e8m0fnu."""
    import types

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, replace_with_fp8_linear

    cfg = FineGrainedFP8Config(weight_block_size=tuple(block_size), scale_fmt=scale_fmt)
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    device = next(model.parameters()).device
    replace_with_fp8_linear(model, modules_to_not_convert=list(skip), quantization_config=cfg)  # on "meta"
    quantize = Fp8Quantize(types.SimpleNamespace(quantization_config=cfg))
    for path, module in model.named_modules():
        if any(p.is_meta for p in module.parameters(recurse=False)):
            for name, _ in list(module.named_parameters(recurse=False)):
                if name.endswith("_scale_inv"):
                    continue
                key = f"{path}.{name}"
                out = quantize.convert({key: weights[key]})
                scale_key = (key[:-len(".weight")] + ".weight_scale_inv" if key.endswith(".weight")
                             else key + "_scale_inv")
                setattr(module, name, torch.nn.Parameter(out[key].to(device), requires_grad=False))
                if scale_key in out:
                    setattr(module, scale_key.rsplit(".", 1)[1], torch.nn.Parameter(out[scale_key].to(device),
                                                                                    requires_grad=False))
                else:       # left unquantized: its scales are never read
                    setattr(module, scale_key.rsplit(".", 1)[1], None)
    model.config.quantization_config = cfg
    return model

