"""Shared helpers for tests: tiny models, prompts, and a counting compile."""
import torch

from gemma4opt.presets import TINY_PRESETS, build_model

VARIANTS = sorted(TINY_PRESETS)
WINDOW = TINY_PRESETS["tiny"]["sliding_window"]


def tiny(name="tiny", dtype=torch.float32, seed=0):
    return build_model(name, dtype=dtype, seed=seed)


def prompt(batch, length, vocab=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g)


def greedy(model, ids, new=8):
    """Greedy generate of ``new`` tokens over an all-ones attention mask."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)


def fp8_checkpoint_reference(model, linear_forward=None):
    """A copy of a FineGrainedFP8 model (presets.finegrained_fp8_) whose e4m3 FP8Linear and FP8Experts
    run the block-scaled references (ops/fp8_block.py: the semantics of transformers' kernel, which
    loads from the `kernels` hub and cannot run here); ``linear_forward``: the FP8Linear forward instead."""
    import copy
    import types

    from gemma4opt.ops.fp8 import FP8_DTYPE
    from gemma4opt.ops.fp8_block import fp8_block_linear_reference, moe_experts_fp8_block_reference
    from gemma4opt.ops.fp8_checkpoint import is_hf_fp8_linear

    def linear(self, x):
        return fp8_block_linear_reference(x, self.weight, self.weight_scale_inv, *self.block_size)

    def experts(self, x, top_k_index, top_k_weights):
        return moe_experts_fp8_block_reference(x, top_k_index, top_k_weights, self.gate_up_proj,
                                               self.gate_up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv,
                                               *self.block_size)

    ref = copy.deepcopy(model)
    for m in ref.modules():
        if is_hf_fp8_linear(m) and m.weight.dtype == FP8_DTYPE:
            m.forward = types.MethodType(linear_forward or linear, m)
        elif type(m).__name__ == "FP8Experts":
            m.forward = types.MethodType(experts, m)
    return ref
