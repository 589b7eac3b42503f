"""Normed branch + add, with no norm of the sum to fuse → ``gemma4opt.norm_add``.

Unfused (what residual_norm leaves: sums that are not a residual tail with a next norm)::

    s = gemma4opt.rms_norm(x, w, eps) + y                                    # PLE models, twice
    s = gemma4opt.rms_norm(a, w1, eps) + gemma4opt.rms_norm(b, w2, eps)      # MoE layers

Fused::

    s = gemma4opt.norm_add(x, w, eps, y, None, eps, False)
    s = gemma4opt.norm_add(a, w1, eps, b, w2, eps, True)

Where: with per-layer inputs (e2b, e4b) each layer's post-feedforward tail, whose sum feeds the
PLE gate GEMM rather than a norm, and once per step the PLE inputs' combine
(``per_layer_projection_norm(proj) + per_layer_inputs``); in MoE layers (26b-a4b) the sum of the
dense MLP's and the experts' post-feedforward norms. Each norm must have the add as its only
reader and both operands one shape and dtype (no broadcast).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import op_name, place

_RMS = "rms_norm.default"


def _norm(n, weighted: bool):
    """n if it is a gemma4opt.rms_norm (with a weight when ``weighted``) read only by one node."""
    if isinstance(n, fx.Node) and op_name(n) == _RMS and len(n.users) == 1 and (n.args[1] is not None or not weighted):
        return n
    return None


def _val(n):
    meta = getattr(n, "meta", {})
    return meta.get("example_value", meta.get("val"))


def _same_layout(a: fx.Node, b) -> bool:
    va, vb = _val(a), _val(b)
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype)


class NormAddPattern(Pattern):
    name = "norm_add"
    summary = "norm + add with no next norm (PLE post-feedforward, MoE's two post norms) -> gemma4opt.norm_add"

    def expected(self, cfg, scope):
        ple, moe = bool(cfg.hidden_size_per_layer_input), bool(getattr(cfg, "enable_moe_block", False))
        return cfg.num_hidden_layers * (ple + moe) + ple

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for add in list(graph.nodes):
            if op_name(add) != "add" or len(add.args) != 2 or add.kwargs:
                continue
            a, b = add.args
            x = _norm(a, True) or _norm(b, True)
            if x is None:
                continue
            y = b if x is a else a
            y_norm = _norm(y, False)
            if not isinstance(y, fx.Node) or not _same_layout(x, y) or not _same_layout(add, y):
                continue
            if y_norm is not None:
                args = (x.args[0], x.args[1], x.args[2], y_norm.args[0], y_norm.args[1], y_norm.args[2], True)
            else:
                args = (x.args[0], x.args[1], x.args[2], y, None, x.args[2], False)
            with graph.inserting_before(add):
                fused = graph.call_function(torch.ops.gemma4opt.norm_add.default, args)
            fused.meta = dict(add.meta)
            add.replace_all_uses_with(fused)
            graph.erase_node(add)
            graph.erase_node(x)
            if y_norm is not None:
                graph.erase_node(y_norm)
            place([fused])
            res.matched += 1
        return res
