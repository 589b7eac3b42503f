"""Models loaded through transformers' FineGrainedFP8 quantization: their FP8Linear projections run
by gemma4opt's block-scaled fp8 GEMM (gemma4opt::fp8_block_linear).

transformers' FP8Linear keeps an e4m3 ``weight`` and fp32 ``weight_scale_inv`` tile scales; its
forward quantizes the input per token and block_k group and calls a kernel from the `kernels` hub
or DeepGEMM (an offline machine cannot load the hub's). Each FP8Linear that the GEMM takes is
*adopted*: the module stays (its type, parameters, state_dict, save_pretrained
and any reference to it are HF's), and only its forward, an instance attribute recorded in the
model's InstanceEdits, becomes the op with the same semantics (ops/fp8_block.py). One that it does
not take keeps its own forward, and the report says why. transformers' FP8Experts (MoE checkpoints)
keep theirs: gemma4opt has no block-scaled experts kernel.
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


def unsupported(lin) -> str | None:
    """Why gemma4opt's block-scaled GEMM cannot run this transformers FP8Linear, or None."""
    from gemma4opt.kernels.fp8_block_linear import BLOCK_KS

    w, s, block = lin.weight, getattr(lin, "weight_scale_inv", None), getattr(lin, "block_size", None)
    if w.dtype != FP8_DTYPE:
        return f"the checkpoint left its weight in {str(w.dtype).replace('torch.', '')} (its own forward is F.linear)"
    if block is None:
        return "one scale for the whole weight (no weight_block_size): gemma4opt takes block scales"
    block_n, block_k = (int(b) for b in block)
    if block_k not in BLOCK_KS:
        return f"weight_block_size {tuple(block)}: gemma4opt's kernel takes a block_k of {', '.join(map(str, BLOCK_KS))}"
    if s is None or s.dtype != torch.float32:
        return (f"{str(getattr(s, 'dtype', None)).replace('torch.', '')} weight scales (scale_fmt='ue8m0'): "
                "gemma4opt takes float32 ones")
    N, K = w.shape
    want = (-(-N // block_n), -(-K // block_k))
    if tuple(s.shape) != want:
        return f"weight_scale_inv {tuple(s.shape)} for a {tuple(w.shape)} weight in {tuple(block)} blocks (want {want})"
    if getattr(lin, "activation_scheme", "dynamic") != "dynamic":
        return f"activation_scheme={lin.activation_scheme!r}: gemma4opt quantizes activations dynamically"
    if lin.bias is not None:
        return "a bias"
    if w.stride(-1) != 1:
        return "a weight strided along K"
    return None


def _block_forward(self, input: torch.Tensor) -> torch.Tensor:
    block_n, block_k = (int(b) for b in self.block_size)
    return torch.ops.gemma4opt.fp8_block_linear.default(input, self.weight, self.weight_scale_inv, block_n, block_k)


def adopted(lin) -> bool:
    """Whether optimize() gave this transformers FP8Linear gemma4opt's forward."""
    fwd = getattr(lin, "__dict__", {}).get("forward")
    return isinstance(fwd, types.MethodType) and fwd.__func__ is _block_forward


def adopt_fp8_linears(root: torch.nn.Module, edits) -> dict[str, int]:
    """Give every supported transformers FP8Linear under root gemma4opt's forward, through ``edits``
    (undone with the rest of optimize()): the attention and MLP projections, and any other linear
    the checkpoint quantized (the per-layer-input and router projections: transformers converts every
    nn.Linear but the lm_head). Returns {"FP8Linear": n adopted, "FP8Linear kept, <why>": n}."""
    counts: dict[str, int] = {}
    for lin in root.modules():
        if not is_hf_fp8_linear(lin):
            continue
        why = unsupported(lin)
        key = f"{HF_FP8_LINEAR} kept, {why}" if why else HF_FP8_LINEAR
        counts[key] = counts.get(key, 0) + 1
        if not why and not adopted(lin):
            edits.set(lin, "forward", types.MethodType(_block_forward, lin))
    return counts


def hf_fp8_experts(root: torch.nn.Module) -> list[str]:
    """Paths of the transformers FP8Experts modules under root (they keep their own forward)."""
    return [path for path, m in root.named_modules() if _from_transformers(m, HF_FP8_EXPERTS)]
