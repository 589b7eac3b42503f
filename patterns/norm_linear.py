"""A residual tail and the GEMM that reads it → one op: ``gemma4opt.norm_linear``.

Unfused (what residual_norm, norm_add and decode_linear leave)::

    s, n = gemma4opt.add_rms_norm(x, residual, w, eps, scale, w_next, eps_next)   # a layer's end
    y = gemma4opt.linear(n, W_qkv)                          # the next layer's (merged) q/k/v

    s = gemma4opt.norm_add(mlp, w_post_ff, eps, residual, None, eps, False)        # PLE layers
    y = gemma4opt.linear(s, W_per_layer_input_gate)

Fused::

    s, y = gemma4opt.norm_linear(x, residual, w, eps, scale, w_next, eps_next, W_qkv)
    s, y = gemma4opt.norm_linear(mlp, residual, w_post_ff, eps, None, None, eps, W_gate)

At one decode row on CUDA the GEMM makes the tail as it reads its input (one launch for two)
where that timed faster (ops/norm_linear.py); else, and off CUDA, the two ops. Only a tail whose
GEMM input has no other reader (the normed output's one user is the GEMM; s may have many). With
quantization="fp8" the q/k/v are fp8_linear, fed by the tail's own quantizing kernel: no match there
(the per-layer-input gate stays bf16 and matches).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import module_stack, op_name, place


class NormLinearPattern(Pattern):
    name = "norm_linear"
    summary = "residual tail + the GEMM reading it (next q/k/v, per-layer-input gate) -> one op (tail inside the GEMM at one row)"

    def expected(self, cfg, scope):
        # Each layer's end feeds the next layer's q/k/v (the last one's feeds the final norm; with
        # fp8 weights an fp8 GEMM, through the tail's quantizing kernel), and with per-layer inputs
        # each MLP's end feeds that layer's gate (bf16 with fp8 weights too).
        L = cfg.num_hidden_layers
        return (0 if self.quantization == "fp8" else L - 1) + (L if cfg.hidden_size_per_layer_input else 0)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for node in list(graph.nodes):
            kind = op_name(node)
            if kind == "add_rms_norm.default":
                res.matched += _fuse_tail(graph, node)
            elif kind == "norm_add.default" and node.args[6] is False and node.args[4] is None:
                res.matched += _fuse_sum(graph, node)
        return res


# The GEMMs a tail is fused into, by module name: a layer's (merged) q/k/v, named for q_proj, and
# its per-layer-input gate. Not the MLP's gate/up: gate_up_gelu takes it (its fused ops read the tail).
_GEMMS = ("q_proj", "per_layer_input_gate")


def _linear_of(value: fx.Node) -> fx.Node | None:
    """The one gemma4opt.linear of ``_GEMMS`` reading ``value`` as its input, if that is its only reader there."""
    lins = [u for u in value.users if op_name(u) == "linear.default" and u.args[0] is value and not u.kwargs]
    if len(lins) != 1 or not module_stack(lins[0]) or module_stack(lins[0])[-1][0].rsplit(".", 1)[-1] not in _GEMMS:
        return None
    return lins[0]


def _row_slice(node: fx.Node):
    """The index of ``node`` if it is a getitem keeping some rows of a [batch, seq, hidden] tensor
    and all of its last dimension, else None."""
    if op_name(node) != "getitem" or not isinstance(node.args[1], tuple) or len(node.args[1]) != 3:
        return None
    idx = node.args[1]
    return idx if idx[-1] == slice(None, None, None) else None


def _fuse_tail(graph: fx.Graph, tail: fx.Node) -> int:
    gets = {u.args[1]: u for u in tail.users if op_name(u) == "getitem"}
    n, s = gets.get(1), gets.get(0)
    if n is None or len(n.users) != 1 or tail.kwargs:
        return 0
    gemm_input, idx = n, _row_slice(next(iter(n.users)))
    if idx is not None and (s is None or all(_row_slice(u) == idx for u in s.users)):
        # A prefill before the first KV-shared layer (e2b, e4b) keeps only the last positions:
        # both outputs sliced by one row index. The tail is row-wise: its inputs are sliced instead.
        gemm_input = next(iter(n.users))
    lin = _linear_of(gemm_input)
    if lin is None:
        return 0
    args = tail.args
    if gemm_input is n:
        new = _replace(graph, tail, (*args, lin.args[1]), [s] if s is not None else [], lin)
        dead = [n, tail]
    else:
        with graph.inserting_before(tail):
            sliced = [graph.call_function(operator.getitem, (v, idx)) for v in args[:2]]
        new = sliced + _replace(graph, tail, (*sliced, *args[2:], lin.args[1]), list(s.users) if s is not None else [],
                                lin)
        dead = [gemm_input, n, *([s] if s is not None else []), tail]
    for node in dead:
        graph.erase_node(node)
    place(new)      # together: a slice bound may come late (-logits_to_keep as a graph input)
    return 1


def _fuse_sum(graph: fx.Graph, tail: fx.Node) -> int:
    lin = _linear_of(tail)
    if lin is None or tail.kwargs:
        return 0
    x, w, eps, residual, _, y_eps, _ = tail.args
    new = _replace(graph, tail, (x, residual, w, eps, None, None, y_eps, lin.args[1]), [tail], lin)
    graph.erase_node(tail)
    place(new)
    return 1


def _replace(graph: fx.Graph, tail: fx.Node, args: tuple, sums: list[fx.Node], lin: fx.Node) -> list[fx.Node]:
    """norm_linear(*args) in place of ``lin`` and of ``sums`` (the nodes holding the tail's sum, if
    read): the new nodes, for place() once the old ones are gone."""
    with graph.inserting_before(tail):      # moved by place() where the order needs it
        fused = graph.call_function(torch.ops.gemma4opt.norm_linear.default, args)
        new_y = graph.call_function(operator.getitem, (fused, 1))
    new_y.meta = dict(lin.meta)
    lin.replace_all_uses_with(new_y)
    graph.erase_node(lin)
    new = [fused, new_y]
    if sums:
        with graph.inserting_after(fused):
            new_s = graph.call_function(operator.getitem, (fused, 0))
        new_s.meta = dict(sums[0].meta)
        for node in sums:
            node.replace_all_uses_with(new_s)
            if node is not tail:
                graph.erase_node(node)
        new.append(new_s)
    return new
