"""FP8 weights in place of a model's nn.Linear modules (Gemma4OptConfig(quantization="fp8")).

Each quantized projection becomes an ``Fp8Linear``: its weight in e4m3 with one fp32 scale per
output channel (ops/fp8.py's quantize_weight), and a forward that quantizes its input per token and
runs gemma4opt::fp8_linear. So every path that runs the modules runs fp8 — the compiled graph (where
patterns/fp8_quant.py moves each input's quantization into the kernel that produces it) and HF's own
forward (fallbacks) alike — and an unoptimized model with the same swap is the reference path.

The bf16 weight is dropped as each module is swapped, so the peak memory is one projection's fp8
copy above the bf16 model, and the swap cannot be undone.
"""
from __future__ import annotations

import torch

from gemma4opt.ops.fp8 import FP8_DTYPE, quantize_weight_reference

# The blocks whose linears are quantized, and their projections.
QUANTIZED_BLOCKS = {"Gemma4TextAttention": ("q_proj", "k_proj", "v_proj", "o_proj"),
                    "Gemma4TextMLP": ("gate_proj", "up_proj", "down_proj")}


class Fp8Linear(torch.nn.Module):
    """y = fp8_linear(quantize_rows(x), weight, weight_scale) in x's dtype; no bias."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "Fp8Linear":
        with torch.no_grad():
            q, s = quantize_weight_reference(linear.weight)
        return cls(q, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = torch.ops.gemma4opt.quantize_rows.default(x)     # .default: the overload patterns match
        return torch.ops.gemma4opt.fp8_linear.default(xq, xs, self.weight, self.weight_scale, x.dtype)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A checkpoint of the unquantized model (its weight in bf16, no scale) is quantized as it
        # loads; copying its bf16 values into the e4m3 buffer as they are would drop the scales.
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dtype != FP8_DTYPE and prefix + "weight_scale" not in state_dict:
            state_dict[prefix + "weight"], state_dict[prefix + "weight_scale"] = quantize_weight_reference(w)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        # .to(dtype)/.half() would cast the e4m3 bytes and the fp32 scales like any float tensor:
        # only the device follows fn (read off an empty probe), the dtypes stay.
        device = fn(torch.empty(0, dtype=FP8_DTYPE, device=self.weight.device)).device
        if device != self.weight.device:
            self.weight = self.weight.to(device)
            self.weight_scale = self.weight_scale.to(device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel scales"


def quantize_linears(root: torch.nn.Module, drop_attrs: tuple[str, ...] = ()) -> dict[str, int]:
    """Swap the projections of every QUANTIZED_BLOCKS module under root for Fp8Linear, in place.
    ``drop_attrs``: attributes of a block that hold its bf16 weights too (merged weights of an earlier
    optimize()), deleted so the bf16 bytes go. Returns {"Fp8Linear": n, "skipped: <why>": n}."""
    counts: dict[str, int] = {}
    for module in list(root.modules()):
        names = QUANTIZED_BLOCKS.get(type(module).__name__)
        if not names:
            continue
        for attr in drop_attrs:
            if attr in module.__dict__:
                delattr(module, attr)
        for name in names:
            lin = getattr(module, name, None)
            if lin is None:
                continue
            why = None if isinstance(lin, Fp8Linear) else _unsupported(lin)
            if why:
                counts[f"skipped: {why}"] = counts.get(f"skipped: {why}", 0) + 1
                continue
            if not isinstance(lin, Fp8Linear):      # (one from an earlier optimize() stays)
                setattr(module, name, Fp8Linear.from_linear(lin))
            counts["Fp8Linear"] = counts.get("Fp8Linear", 0) + 1
    return counts


def _unsupported(lin) -> str | None:
    if type(lin) is not torch.nn.Linear:
        return f"{type(lin).__name__} is not an nn.Linear"
    if lin.bias is not None:
        return "a linear with a bias"
    return None


def fp8_linears(root: torch.nn.Module) -> list[Fp8Linear]:
    return [m for m in root.modules() if isinstance(m, Fp8Linear)]
