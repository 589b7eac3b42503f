"""Models loaded through transformers' FineGrainedFP8 quantization: their FP8Linear projections run
by gemma4opt's block-scaled fp8 GEMM (gemma4opt::fp8_block_linear).

transformers' FP8Linear keeps an e4m3 ``weight`` and ``weight_scale_inv`` tile scales (fp32, or UE8M0); its
forward quantizes the input per token and block_k group and calls a kernel from the `kernels` hub
or DeepGEMM (an offline machine cannot load the hub's). Each FP8Linear that the GEMM takes is
*adopted*: the module stays (its type, parameters, state_dict, save_pretrained
and any reference to it are HF's), and only its forward, an instance attribute recorded in the
model's InstanceEdits, becomes the op with the same semantics (ops/fp8_block.py). transformers'
FP8Experts (MoE checkpoints) likewise become gemma4opt::moe_experts_fp8_block. One that the kernels
do not take keeps its own forward, and the report says why.
"""
from __future__ import annotations

import types

import torch

from gemma4opt.ops.fp8 import FP8_DTYPE

HF_FP8_LINEAR = "FP8Linear"
HF_FP8_EXPERTS = "FP8Experts"


def _from_transformers(module, name: str) -> bool:
    cls = type(module)
    return cls.__name__ == name and cls.__module__.startswith("transformers.")


def is_hf_fp8_linear(module) -> bool:
    return _from_transformers(module, HF_FP8_LINEAR)


def _block_reason(module) -> str | None:
    """Why the module's weight_block_size or activation scheme is not the kernel's, or None."""
    from gemma4opt.kernels.fp8_block_linear import BLOCK_KS

    block = getattr(module, "block_size", None)
    if block is None:
        return "one scale for the whole weight (no weight_block_size): gemma4opt takes block scales"
    if int(block[1]) not in BLOCK_KS:
        return (f"weight_block_size {tuple(block)}: gemma4opt's kernel takes a block_k of "
                f"{', '.join(map(str, BLOCK_KS))}")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return f"activation_scheme={module.activation_scheme!r}: gemma4opt quantizes activations dynamically"
    return None


def _scale_reason(name: str, w: torch.Tensor, s, block) -> str | None:
    """Why e4m3 weight w [..., N, K] and its tile scales s are not what the kernel reads, or None."""
    from gemma4opt.kernels.fp8_block_linear import SCALE_DTYPES

    block_n, block_k = (int(b) for b in block)
    want = (*w.shape[:-2], -(-w.shape[-2] // block_n), -(-w.shape[-1] // block_k))
    if s is None or s.dtype not in SCALE_DTYPES or tuple(s.shape) != want:
        return (f"{name} {tuple(getattr(s, 'shape', ()))} {str(getattr(s, 'dtype', None)).replace('torch.', '')} "
                f"for a {tuple(w.shape)} weight in {tuple(block)} blocks (gemma4opt takes {want} float32 or UE8M0)")
    if w.stride(-1) != 1:
        return "a weight strided along K"
    return None


def unsupported(lin) -> str | None:
    """Why gemma4opt's block-scaled GEMM cannot run this transformers FP8Linear, or None."""
    if lin.weight.dtype != FP8_DTYPE:
        dtype = str(lin.weight.dtype).replace("torch.", "")
        return f"the checkpoint left its weight in {dtype} (its own forward is F.linear)"
    if lin.bias is not None:
        return "a bias"
    return _block_reason(lin) or _scale_reason("weight_scale_inv", lin.weight, getattr(lin, "weight_scale_inv", None),
                                               lin.block_size)


def experts_unsupported(m) -> str | None:
    """Why gemma4opt's block-scaled experts op cannot run this transformers FP8Experts, or None. A stack
    left in the model's dtype by the checkpoint (not whole blocks) is multiplied as FP8Experts does."""
    if not getattr(m, "has_gate", True) or getattr(m, "has_bias", False):
        return "experts without a gate or with a bias"
    act = getattr(getattr(m, "config", None), "hidden_activation", None)
    if act != "gelu_pytorch_tanh" or getattr(m, "swiglu_alpha", None) is not None or getattr(m, "limit", None):
        return f"activation {act!r} (gemma4opt's experts take Gemma-4's gelu_pytorch_tanh gate, unclamped)"
    why = _block_reason(m)
    if why:
        return why
    stacks = [(name, getattr(m, name, None)) for name in ("gate_up_proj", "down_proj")]
    if any(w is None or w.dim() != 3 for _, w in stacks):
        return "gate_up_proj / down_proj are not stacks of experts' weights"
    if len({w.dtype for _, w in stacks if w.dtype != FP8_DTYPE}) > 1:
        return f"stacks in {sorted(str(w.dtype) for _, w in stacks)}"
    for name, w in stacks:
        why = _scale_reason(name + "_scale_inv", w, getattr(m, name + "_scale_inv", None), m.block_size) \
            if w.dtype == FP8_DTYPE else None if w.stride(-1) == 1 else f"{name} strided along K"
        if why:
            return why
    return None


def _scales(w: torch.Tensor, s) -> torch.Tensor:
    # a stack left unquantized reads no scales (its parameter may be None or never loaded): an empty stand-in
    return s if w.dtype == FP8_DTYPE else w.new_empty(0, dtype=torch.float32)


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    block_n, block_k = (int(b) for b in self.block_size)
    return torch.ops.gemma4opt.moe_experts_fp8_block.default(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
        _scales(self.gate_up_proj, self.gate_up_proj_scale_inv), self.down_proj,
        _scales(self.down_proj, self.down_proj_scale_inv), block_n, block_k)


def _block_forward(self, input: torch.Tensor) -> torch.Tensor:
    block_n, block_k = (int(b) for b in self.block_size)
    return torch.ops.gemma4opt.fp8_block_linear.default(input, self.weight, self.weight_scale_inv, block_n, block_k)


def adopted(module) -> bool:
    """Whether optimize() gave this transformers FP8Linear or FP8Experts gemma4opt's forward."""
    fwd = getattr(module, "__dict__", {}).get("forward")
    return isinstance(fwd, types.MethodType) and fwd.__func__ in (_block_forward, _experts_forward)


def adopt_fp8_modules(root: torch.nn.Module, edits) -> dict[str, int]:
    """Give every supported transformers FP8Linear and FP8Experts under root gemma4opt's forward,
    through ``edits`` (undone with the rest of optimize()): the attention and MLP projections, any other
    linear the checkpoint quantized (the per-layer-input and router projections: transformers converts
    every nn.Linear but the lm_head), the MoE experts. Returns {"FP8Linear": n adopted, "FP8Linear kept,
    <why>": n, and the same for "FP8Experts"}."""
    counts: dict[str, int] = {}
    for m in root.modules():
        if is_hf_fp8_linear(m):
            kind, why, forward = HF_FP8_LINEAR, unsupported(m), _block_forward
        elif _from_transformers(m, HF_FP8_EXPERTS):
            kind, why, forward = HF_FP8_EXPERTS, experts_unsupported(m), _experts_forward
        else:
            continue
        key = f"{kind} kept, {why}" if why else kind
        counts[key] = counts.get(key, 0) + 1
        if not why and not adopted(m):
            edits.set(m, "forward", types.MethodType(forward, m))
    return counts


