"""FP8 weights in place of a model's nn.Linear and MoE experts modules (Gemma4OptConfig(quantization="fp8")).

Each quantized projection becomes an ``Fp8Linear``: its weight in e4m3 with one fp32 scale per
output channel (ops/fp8.py's quantize_weight), and a forward that quantizes its input per token and
runs gemma4opt::fp8_linear. So every path that runs the modules runs fp8 — the compiled graph (where
patterns/fp8_quant.py moves each input's quantization into the kernel that produces it) and HF's own
forward (fallbacks) alike — and an unoptimized model with the same swap is the reference path.

Each MoE experts module (Gemma4TextExperts) becomes an ``Fp8Experts``: its stacked gate_up and
down weights in e4m3 with one fp32 scale per (expert, output row), run by gemma4opt::moe_experts_fp8
(weight-only: the tokens stay in the model dtype).

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
        return _move_only(self, fn, ("weight", "weight_scale"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel scales"


class Fp8Experts(torch.nn.Module):
    """A Gemma4TextExperts with e4m3 weights: forward(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H], as HF's module is called by its decoder layer."""

    def __init__(self, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                 down_scale: torch.Tensor):
        super().__init__()
        self.num_experts, two_i, self.hidden_dim = gate_up.shape
        self.intermediate_dim = two_i // 2
        self.register_buffer("gate_up_proj", gate_up)
        self.register_buffer("gate_up_proj_scale", gate_up_scale)
        self.register_buffer("down_proj", down)
        self.register_buffer("down_proj_scale", down_scale)

    @classmethod
    def from_experts(cls, experts: torch.nn.Module) -> "Fp8Experts":
        with torch.no_grad():
            return cls(*_quantize_stack(experts.gate_up_proj), *_quantize_stack(experts.down_proj))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return torch.ops.gemma4opt.moe_experts_fp8.default(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.gate_up_proj_scale,
            self.down_proj, self.down_proj_scale)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name in ("gate_up_proj", "down_proj"):     # an unquantized checkpoint: quantized as it loads
            w = state_dict.get(prefix + name)
            if w is not None and w.dtype != FP8_DTYPE and prefix + name + "_scale" not in state_dict:
                state_dict[prefix + name], state_dict[prefix + name + "_scale"] = _quantize_stack(w)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        return _move_only(self, fn, ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"))

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, e4m3 per-(expert, row) scales")


def _quantize_stack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3 [E, N, K], fp32 [E, N]), one expert at a time (an fp32 copy of one
    expert at most, not of the 26b-a4b's whole 2 GB stack)."""
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], s[e] = quantize_weight_reference(w[e].detach())
    return q, s


def _move_only(module: torch.nn.Module, fn, names: tuple[str, ...]) -> torch.nn.Module:
    # .to(dtype)/.half() would cast the e4m3 bytes and the fp32 scales like any float tensor:
    # only the device follows fn (read off an empty probe), the dtypes stay.
    first = getattr(module, names[0])
    device = fn(torch.empty(0, dtype=FP8_DTYPE, device=first.device)).device
    if device != first.device:
        for name in names:
            setattr(module, name, getattr(module, name).to(device))
    return module


def quantize_linears(root: torch.nn.Module, drop_attrs: tuple[str, ...] = ()) -> dict[str, int]:
    """Swap the projections of every QUANTIZED_BLOCKS module under root for Fp8Linear, and every
    MoE experts module for Fp8Experts, in place. ``drop_attrs``: attributes of a block that hold its
    bf16 weights too (merged weights of an earlier optimize()), deleted so the bf16 bytes go.
    Returns {"Fp8Linear": n, "Fp8Experts": n, "skipped: <why>": n}."""
    counts: dict[str, int] = {}
    # Only the parents: a list of every module would keep each swapped-out one alive to the end.
    parents = [m for m in root.modules() if hasattr(m, "experts") or type(m).__name__ in QUANTIZED_BLOCKS]
    for module in parents:
        experts = getattr(module, "experts", None)
        if type(experts).__name__ == "Gemma4TextExperts":
            fp8 = Fp8Experts.from_experts(experts)
            # tensor_parallel's all-reduce is a forward hook on the experts module: it moves along.
            fp8._forward_hooks.update(experts._forward_hooks)
            module.experts = fp8
        if isinstance(getattr(module, "experts", None), Fp8Experts):
            counts["Fp8Experts"] = counts.get("Fp8Experts", 0) + 1
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


def quantize_lm_head(model: torch.nn.Module) -> dict[str, int]:
    """Swap the model's output embeddings (the lm_head) for an Fp8Linear, the bf16 weight left to
    the embedding table it is tied to (the token lookup reads it). {"Fp8Linear lm_head": 1}, or
    {"skipped: lm_head, <why>": 1}."""
    if not fp8_lm_head(model):
        head = getattr(model, "get_output_embeddings", lambda: None)()
        why = "the model has no output embeddings" if head is None else _unsupported(head)
        if why:
            return {f"skipped: lm_head, {why}": 1}
        table = getattr(model, "get_input_embeddings", lambda: None)()
        fp8 = Fp8Linear.from_linear(head)
        # tied: HF's head reads the embedding table itself, so edits of the table reach it
        # (runtime/weight_watch.py's TiedHeadWatch quantizes them into this copy again)
        fp8.tied_table = table is not None and getattr(table, "weight", None) is head.weight
        model.set_output_embeddings(fp8)
    return {"Fp8Linear lm_head": 1}


def fp8_lm_head(model: torch.nn.Module) -> bool:
    """Whether the model's lm_head is an Fp8Linear (quantize_lm_head=True)."""
    return isinstance(getattr(model, "get_output_embeddings", lambda: None)(), Fp8Linear)


def _unsupported(lin) -> str | None:
    from gemma4opt.ops.fp8_checkpoint import is_hf_fp8_linear

    if is_hf_fp8_linear(lin):
        return "transformers' FP8Linear (the checkpoint's own fp8)"
    if type(lin) is not torch.nn.Linear:
        return f"{type(lin).__name__} is not an nn.Linear"
    if lin.bias is not None:
        return "a linear with a bias"
    return None


def foreign_linear(lin) -> bool:
    """A projection that is neither a plain nn.Linear nor gemma4opt's Fp8Linear: a quantized
    checkpoint's module (transformers' FP8Linear, bitsandbytes' Linear4bit, ...) whose weight is
    packed or comes with scales its own forward applies. Its weight is never merged, split or
    replaced: it runs its own forward."""
    return lin is not None and type(lin) is not torch.nn.Linear and not isinstance(lin, Fp8Linear)


def foreign_projections(root: torch.nn.Module, adopted: bool = True) -> list[str]:
    """``path (type)`` of every attention / dense-MLP projection under root that is a foreign_linear;
    ``adopted=False``: but those whose forward is gemma4opt's (ops/fp8_checkpoint.py)."""
    from gemma4opt.ops.fp8_checkpoint import adopted as runs_ours

    return [f"{path}.{name} ({type(lin).__name__})" for path, module in root.named_modules()
            for name in QUANTIZED_BLOCKS.get(type(module).__name__, ())
            if foreign_linear(lin := getattr(module, name, None)) and (adopted or not runs_ours(lin))]


def fp8_linears(root: torch.nn.Module) -> list[Fp8Linear]:
    return [m for m in root.modules() if isinstance(m, Fp8Linear)]


def fp8_experts(root: torch.nn.Module) -> list[Fp8Experts]:
    return [m for m in root.modules() if isinstance(m, Fp8Experts)]
