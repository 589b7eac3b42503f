"""Residual tails → ``gemma4opt.add_rms_norm`` (attention tail; layer tail across the layer boundary).

Unfused (after the rms_norm pass)::

    s = residual + gemma4opt.rms_norm(x, w, eps)     # post_attention / post_feedforward / post-PLE norm
    s *= layer_scalar                                 # only at a layer's end
    n = gemma4opt.rms_norm(s[, sliced], w_next, eps)  # pre_feedforward / next input_layernorm / final norm

Fused::

    s, n = gemma4opt.add_rms_norm(x, residual, w, eps, layer_scalar | None, w_next, eps)

The first KV-shared layer may slice the sequence before its input norm (prefill with
``logits_to_keep``): the norm is row-wise, so the fused op normalizes every row and the same
slice is applied to ``n``. Only residual-stream adds are fused (the sum is read again later, or
scaled by layer_scalar). With PLE, the post-feedforward add feeds the PLE gate (no norm
follows), so only the PLE tail (post_per_layer_input_norm + add + scale + next norm) is fused.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import op_name, place

_RMS = "rms_norm.default"


def _is_weighted_norm(n) -> bool:
    return isinstance(n, fx.Node) and op_name(n) == _RMS and n.args[1] is not None


def _next_norm(s: fx.Node):
    """The weighted norm reading s (directly or through one slice): (norm, slice_node | None)."""
    for u in s.users:
        if _is_weighted_norm(u) and u.args[0] is s:
            return u, None
        if op_name(u) == "getitem" and u.args[0] is s:
            for v in u.users:
                if _is_weighted_norm(v) and v.args[0] is u:
                    return v, u
    return None, None


class ResidualNormPattern(Pattern):
    name = "residual_norm"
    summary = "norm + residual add (+ layer_scalar) + next norm -> gemma4opt.add_rms_norm"

    def expected(self, cfg, scope):
        return 2 * cfg.num_hidden_layers   # each layer: attention tail + layer tail

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for add in list(graph.nodes):
            if op_name(add) != "add" or len(add.args) != 2:
                continue
            a, b = add.args
            norm = a if _is_weighted_norm(a) and len(a.users) == 1 else b if _is_weighted_norm(b) and len(b.users) == 1 else None
            if norm is None:
                continue
            residual = b if norm is a else a
            if not isinstance(residual, fx.Node):
                continue
            s, scale = add, None
            if len(add.users) == 1:
                u = next(iter(add.users))
                if op_name(u) in ("imul", "mul") and u.args[0] is add and isinstance(u.args[1], fx.Node):
                    s, scale = u, u.args[1]
            nxt, sl = _next_norm(s)
            if nxt is None:
                continue   # e.g. the PLE-model post-feedforward add: its consumer is the PLE gate
            if scale is None and len(s.users) < 2:
                # Not the residual stream (nothing else reads the sum): e.g. MoE's
                # post_ff_1(mlp) + post_ff_2(experts), whose norm the layer tail needs unfused.
                continue
            x, w, eps = norm.args
            with graph.inserting_before(s.next):   # moved by place() where the order needs it
                fused = graph.call_function(torch.ops.gemma4opt.add_rms_norm.default,
                                            (x, residual, w, eps, scale, nxt.args[1], nxt.args[2]))
                new_s = graph.call_function(operator.getitem, (fused, 0))
                new_n = graph.call_function(operator.getitem, (fused, 1))
            new_s.meta = dict(s.meta)
            new_n.meta = dict(nxt.meta)
            new_nodes = [fused, new_s, new_n]
            if sl is not None:
                # The slice's bounds may be computed after s (e.g. -logits_to_keep as a graph input).
                with graph.inserting_after(new_n):
                    sliced = graph.call_function(operator.getitem, (new_n, sl.args[1]))
                sliced.meta = dict(nxt.meta)
                nxt.replace_all_uses_with(sliced)
                new_nodes.append(sliced)
            else:
                nxt.replace_all_uses_with(new_n)
            graph.erase_node(nxt)
            s.replace_all_uses_with(new_s)
            if sl is not None and not sl.users:
                graph.erase_node(sl)
            if s is not add:
                graph.erase_node(s)
            graph.erase_node(add)
            graph.erase_node(norm)
            place(new_nodes)
            res.matched += 1
        return res
