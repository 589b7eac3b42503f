"""A residual tail and the GEMM that reads it → one op: ``gemma4opt.norm_linear`` / ``norm_fp8_linear``.

Unfused (what residual_norm, norm_add, fp8_quant and decode_linear leave)::

    s, n = gemma4opt.add_rms_norm(x, residual, w, eps, scale, w_next, eps_next)   # a layer's end
    y = gemma4opt.linear(n, W_qkv)                          # the next layer's (merged) q/k/v

    s, q, qs = gemma4opt.add_rms_norm_quant(x, residual, w, eps, scale, w_next, eps_next)   # fp8
    y = gemma4opt.fp8_linear(q, qs, W_qkv_fp8, w_scale, dtype)

    s = gemma4opt.norm_add(mlp, w_post_ff, eps, residual, None, eps, False)        # PLE layers
    y = gemma4opt.linear(s, W_per_layer_input_gate)        # (bf16 with fp8 weights too)

Fused::

    s, y = gemma4opt.norm_linear(x, residual, w, eps, scale, w_next, eps_next, W_qkv)
    s, y = gemma4opt.norm_fp8_linear(x, residual, w, eps, scale, w_next, eps_next, W_qkv_fp8, w_scale, dtype)
    s, y = gemma4opt.norm_linear(mlp, residual, w_post_ff, eps, None, None, eps, W_gate)

At one decode row on CUDA the GEMM makes the tail (and its quantization) as it reads its input (one
launch for two) where that timed faster (ops/norm_linear.py, ops/norm_fp8_linear.py); else, and off
CUDA, the two ops. Only a tail whose GEMM input has no other reader (s may have many).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import BLOCK_FP8_OP, BLOCK_FP8_WHY, PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import module_name, op_name, place


class NormLinearPattern(Pattern):
    name = "norm_linear"
    summary = ("residual tail + the GEMM reading it (next q/k/v, per-layer-input gate) -> one op (tail inside the "
               "GEMM at one row)")

    def expected(self, cfg, scope):
        # Each layer's end feeds the next layer's q/k/v (the last one's feeds the final norm; with
        # fp8 weights through the tail's quantizing kernel into an fp8 GEMM), and with per-layer
        # inputs each MLP's end feeds that layer's gate (bf16 with fp8 weights too).
        L = cfg.num_hidden_layers
        return L - 1 + (L if cfg.hidden_size_per_layer_input else 0)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        graph = gm.graph
        for node in list(graph.nodes):
            kind = op_name(node)
            if kind in ("add_rms_norm.default", "add_rms_norm_quant.default"):
                got = _fuse_tail(graph, node, kind == "add_rms_norm_quant.default")
            elif kind == "norm_add.default" and node.args[6] is False and node.args[4] is None:
                got = _fuse_sum(graph, node)
            else:
                continue
            if got == BLOCK_FP8_WHY:
                res.not_applicable.append(got)
            elif isinstance(got, str):
                res.unfused.append(f"{node.name}: {got}")
            else:
                res.matched += got
        return res


# The GEMMs a tail is fused into, by module name: a layer's q/k/v (merged: named for whichever of the
# three Dynamo recorded first) and its per-layer-input gate. Not the MLP's gate/up: gate_up_gelu takes
# it (its fused ops read the tail).
_GEMMS = ("q_proj", "k_proj", "v_proj", "per_layer_input_gate")


def _site(gemm: fx.Node) -> bool:
    return not gemm.kwargs and module_name(gemm) in _GEMMS


def _gemm_of(inputs: list[fx.Node], target: str) -> fx.Node | None:
    """The GEMM op ``target`` of ``_GEMMS`` whose leading arguments are ``inputs``, each read by it
    alone; an fp8 GEMM without a softcap."""
    users = {u for v in inputs for u in v.users}
    gemm = users.pop() if len(users) == 1 else None
    if (gemm is None or op_name(gemm) != target or list(gemm.args[:len(inputs)]) != inputs
            or (target == "fp8_linear.default" and gemm.args[5:6] not in ((), (0.0,), (0,)))):
        return None
    return gemm if _site(gemm) else None


def _row_slice(node: fx.Node, dims: int = 3):
    """The index of ``node`` if it is a getitem keeping some rows of a [batch, seq(, hidden)] tensor
    (and all of its hidden dimension), else None."""
    if op_name(node) != "getitem" or not isinstance(node.args[1], tuple) or len(node.args[1]) != dims:
        return None
    idx = node.args[1]
    return idx if dims == 2 or idx[-1] == slice(None, None, None) else None


def _feeds_site(values: list[fx.Node], ops=("linear.default", "fp8_linear.default")) -> bool:
    """Whether a GEMM (one of ``ops``) of ``_GEMMS`` reads one of ``values``, directly or through one node."""
    near = {u for v in values if v is not None for u in v.users}
    near |= {w for u in near for w in u.users}
    return any(op_name(n) in ops and _site(n) for n in near)


_WHY = "a q/k/v or per-layer-input gate GEMM reads it, but not as its only input reader (or through another slice)"


def _why_not(values: list[fx.Node]) -> int | str:
    """A tail that fuses with no GEMM: BLOCK_FP8_WHY where a FineGrainedFP8 projection reads it (by
    design), _WHY where a GEMM of ``_GEMMS`` does in a way the fusion does not take, else 0 (none)."""
    if _feeds_site(values, (BLOCK_FP8_OP,)):
        return BLOCK_FP8_WHY
    return _WHY if _feeds_site(values) else 0


def _fuse_tail(graph: fx.Graph, tail: fx.Node, fp8: bool) -> int | str:
    """add_rms_norm (fp8: add_rms_norm_quant) and the GEMM reading its normed (quantized) output:
    1 when fused, 0 where no such GEMM reads it, else why not."""
    gets = {u.args[1]: u for u in tail.users if op_name(u) == "getitem"}
    s, outs = gets.get(0), [gets.get(1), gets.get(2)] if fp8 else [gets.get(1)]
    if any(v is None or len(v.users) != 1 for v in outs) or tail.kwargs:
        return _why_not(outs)
    target = "fp8_linear.default" if fp8 else "linear.default"
    firsts = [next(iter(v.users)) for v in outs]
    idx = _row_slice(firsts[0])
    gemm_inputs = outs
    if idx is not None and all(_row_slice(f, 3 - i) == idx[:3 - i] for i, f in enumerate(firsts)) and (
            s is None or all(_row_slice(u) == idx for u in s.users)):
        # A prefill before the first KV-shared layer (e2b, e4b) keeps only the last positions: every
        # tail output sliced by one row index. The tail is row-wise: its inputs are sliced instead.
        gemm_inputs = firsts
    gemm = _gemm_of(gemm_inputs, target)
    if gemm is None:
        return _why_not(outs)
    args = tail.args
    new, sums = [], [s] if s is not None else []
    if gemm_inputs is not outs:
        with graph.inserting_before(tail):
            new = [graph.call_function(operator.getitem, (v, idx)) for v in args[:2]]
        args, sums = (*new, *args[2:]), list(s.users) if s is not None else []
    fused = (torch.ops.gemma4opt.norm_fp8_linear.default, (*args, *gemm.args[2:5])) if fp8 else (
        torch.ops.gemma4opt.norm_linear.default, (*args, gemm.args[1]))
    new += _replace(graph, tail, *fused, sums, gemm)
    for node in [*(gemm_inputs if gemm_inputs is not outs else []), *outs, *([s] if s is not None else []), tail]:
        if node not in sums:
            graph.erase_node(node)
    place(new)      # together: a slice bound may come late (-logits_to_keep as a graph input)
    return 1


def _fuse_sum(graph: fx.Graph, tail: fx.Node) -> int | str:
    """norm_add (no next norm) and the GEMM reading its sum (which later nodes read too): 1 when
    fused, 0 where no such GEMM reads it, else why not."""
    lins = [u for u in tail.users if op_name(u) == "linear.default" and u.args[0] is tail and _site(u)]
    if not lins:
        return _why_not([tail])
    if len(lins) != 1 or tail.kwargs:
        return f"{len(lins)} GEMMs read its sum (one expected)"
    x, w, eps, residual, _, y_eps, _ = tail.args
    new = _replace(graph, tail, torch.ops.gemma4opt.norm_linear.default,
                   (x, residual, w, eps, None, None, y_eps, lins[0].args[1]), [tail], lins[0])
    graph.erase_node(tail)
    place(new)
    return 1


def _replace(graph: fx.Graph, tail: fx.Node, target, args: tuple, sums: list[fx.Node], gemm: fx.Node) -> list[fx.Node]:
    """``target(*args)`` -> (s, y) in place of ``gemm`` and of ``sums`` (the nodes holding the tail's
    sum, if read; erased here unless one is the tail): the new nodes, for place()."""
    with graph.inserting_before(tail):      # moved by place() where the order needs it
        fused = graph.call_function(target, args)
        new_y = graph.call_function(operator.getitem, (fused, 1))
    new_y.meta = dict(gemm.meta)
    gemm.replace_all_uses_with(new_y)
    graph.erase_node(gemm)
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
