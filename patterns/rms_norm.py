"""Gemma-4 RMSNorm → ``gemma4opt.rms_norm``.

Unfused (Dynamo level, one Gemma4RMSNorm instance)::

    xf  = x.float()
    ms  = xf.pow(2).mean(-1, keepdim=True) + eps
    y   = xf * torch.pow(ms, -0.5)
    y   = y * weight.float()            # absent for v_norm and the MoE router norm
    out = y.type_as(x)

Fused::

    out = torch.ops.gemma4opt.rms_norm(x, weight_or_None, eps)

Found by module type (Gemma4RMSNorm) and confirmed by structure: the op multiset, the
exponents 2 and -0.5, mean over the last dim with keepdim, eps a literal, output dtype of x.
"""
from __future__ import annotations

import collections

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import const_arg, erase_region, regions_of_type, replace_output, scalar_operand

_WITH_WEIGHT = collections.Counter(float=2, pow=2, mean=1, add=1, mul=2, type_as=1)
_NO_WEIGHT = collections.Counter(float=1, pow=2, mean=1, add=1, mul=1, type_as=1)


def rms_norms_per_graph(cfg, scope: str) -> int:
    """Gemma4RMSNorm calls in one forward of the text decoder."""
    layers = cfg.num_hidden_layers
    shared = cfg.num_kv_shared_layers or 0
    ple = bool(cfg.hidden_size_per_layer_input)
    per_layer = 4 + 1                       # input/post_attn/pre_ff/post_ff + q_norm
    per_layer += 4 if cfg.enable_moe_block else 0   # router.norm, post_ff_1, post_ff_2, pre_ff_2
    per_layer += 1 if ple else 0            # post_per_layer_input_norm
    return layers * per_layer + 2 * (layers - shared) + 1 + (1 if ple else 0)   # k/v norms, final, PLE proj norm


def match_rms_norm(region) -> tuple[dict | None, str]:
    """Confirm a Gemma4RMSNorm region by structure: ({x, weight, eps, out}, "") or (None, why)."""
    counts = region.op_counts()
    if counts not in (_WITH_WEIGHT, _NO_WEIGHT):
        return None, f"unrecognized op sequence {dict(counts)}"
    outs = region.outputs()
    if len(outs) != 1 or outs[0].target != "type_as":
        return None, "block output is not the final type_as"
    out = outs[0]
    x = out.args[1]
    floats = region.by_op("float")
    x_float = [f for f in floats if f.args[0] is x]
    if len(x_float) != 1:
        return None, "input is not upcast with .float()"
    if sorted(const_arg(n, 1) for n in region.by_op("pow")) != [-0.5, 2]:
        return None, "exponents are not 2 and -0.5"
    mean = region.by_op("mean")[0]
    if const_arg(mean, 1, "dim") not in (-1, (-1,), [-1]) or mean.kwargs.get("keepdim") is not True:
        return None, "mean is not over the last dim with keepdim"
    _, eps = scalar_operand(region.by_op("add")[0])
    if not isinstance(eps, float):
        return None, "eps is not a literal"
    weight = None
    if counts == _WITH_WEIGHT:
        w_float = [f for f in floats if f is not x_float[0]]
        weight = w_float[0].args[0]
    return dict(x=x, weight=weight, eps=float(eps), out=out), ""


class RMSNormPattern(Pattern):
    name = "rms_norm"
    summary = "Gemma4RMSNorm (with/without weight) -> gemma4opt.rms_norm"

    def expected(self, cfg, scope):
        return rms_norms_per_graph(cfg, scope)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for region in regions_of_type(gm.graph, "Gemma4RMSNorm"):
            m, why = match_rms_norm(region)
            if m is None:
                res.unfused.append(f"{region.path}: {why}")
                continue
            replace_output(gm.graph, m["out"], torch.ops.gemma4opt.rms_norm.default, (m["x"], m["weight"], m["eps"]))
            erase_region(gm.graph, region.nodes)
            res.matched += 1
        return res
