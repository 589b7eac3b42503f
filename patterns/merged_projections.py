"""Merged projections: q/k/v → one GEMM, gate/up → one GEMM.

Unfused (per non-KV-shared attention, and per MLP)::

    q = linear(h, Wq); k = linear(h, Wk); v = linear(h, Wv)     # no v with attention_k_eq_v
    g = linear(x, Wg); u = linear(x, Wu)

Fused::

    qkv = linear(h, Wqkv); q, k, v = qkv[..., :nq], qkv[..., nq:nq+nk], qkv[..., nq+nk:]
    gu  = linear(x, Wgu);  g, u = gu[..., :I], gu[..., I:]

The merged weights are built once, in ``prepare`` at optimize(); the original parameters
become views into them, so memory is not doubled and HF's own forward (fallbacks) still works.
KV-shared layers own only q_proj and are left as they are.

With quantization="fp8" the projections are ops/fp8_weights.py's Fp8Linear: each is
``fp8_linear(quantize_rows(h), Wq, scale)``, and the merge concatenates the e4m3 weights and their
per-channel scales (per-channel scales merge exactly), quantizing h once::

    qkv = fp8_linear(quantize_rows(h), Wq_qkv, scale_qkv); q, k, v = qkv[..., :nq], ...

A FineGrainedFP8 checkpoint's FP8Linear run by gemma4opt (ops/fp8_checkpoint.py) is
``fp8_block_linear(h, W, weight_scale_inv, bn, bk)``: projections with the same blocks whose rows
fill whole row blocks (all but the last) stack their e4m3 weights and their tile scales' rows::

    qkv = fp8_block_linear(h, Wq_qkv, scale_inv_qkv, bn, bk); q, k, v = qkv[..., :nq], ...
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, op_name, place, regions_of_type, resolve_module
from gemma4opt.ops.fp8_checkpoint import adopted
from gemma4opt.ops.fp8_weights import Fp8Linear, foreign_linear

MERGED_ATTR = "_gemma4opt_merged_weight"
MERGED_SCALE_ATTR = "_gemma4opt_merged_weight_scale"     # fp8: the merged per-channel scales
_GROUPS = {"Gemma4TextAttention": ("q_proj", "k_proj", "v_proj"), "Gemma4TextMLP": ("gate_proj", "up_proj")}


def _kind(lin) -> str:
    """"bf16" (a plain nn.Linear), "fp8" (gemma4opt's Fp8Linear), "block" (a FineGrainedFP8 FP8Linear
    whose forward optimize() made gemma4opt's) or "foreign" (its own forward: never merged)."""
    if isinstance(lin, Fp8Linear):
        return "fp8"
    if adopted(lin):
        return "block"
    return "foreign" if foreign_linear(lin) else "bf16"


def scale_attr(lin) -> str | None:
    """The attribute holding a mergeable projection's scales (merged with its weight), or None."""
    return {"fp8": "weight_scale", "block": "weight_scale_inv"}.get(_kind(lin))


def _whole_blocks(linears) -> bool:
    """FineGrainedFP8 projections merge when their tiles stack: the same blocks, whole row blocks."""
    blocks = {tuple(int(b) for b in lin.block_size) for lin in linears}
    return len(blocks) == 1 and all(lin.weight.shape[0] % next(iter(blocks))[0] == 0 for lin in linears[:-1])


def _merge(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    linears = [getattr(module, n, None) for n in names]
    linears = [lin for lin in linears if lin is not None]
    kinds = {_kind(lin) for lin in linears}
    if (len(linears) < 2 or len(kinds) > 1 or "foreign" in kinds or any(lin.bias is not None for lin in linears)
            or (kinds == {"block"} and not _whole_blocks(linears))):
        # (some projections not quantized, or optimized again after a projection was swapped for
        # another kind: left apart, no longer merged)
        module.__dict__.pop(MERGED_ATTR, None)
        module.__dict__.pop(MERGED_SCALE_ATTR, None)
        return
    if _views_of(module, linears):
        return
    attr = scale_attr(linears[0])
    with torch.no_grad():
        merged = torch.cat([lin.weight for lin in linears], dim=0)
        scales = torch.cat([getattr(lin, attr) for lin in linears], dim=0) if attr else None
    start = s0 = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        _assign(lin, "weight", merged[start:start + rows])
        if scales is not None:          # a row each (fp8), a row per block of rows (block)
            srows = getattr(lin, attr).shape[0]
            _assign(lin, attr, scales[s0:s0 + srows])
            s0 += srows
        start += rows
    setattr(module, MERGED_ATTR, merged)   # a plain attribute: not a parameter, not in state_dict
    if scales is not None:
        setattr(module, MERGED_SCALE_ATTR, scales)


def _assign(lin, attr: str, view: torch.Tensor) -> None:
    """The module's tensor becomes a view of the merged one: a Parameter stays a Parameter, a buffer
    (Fp8Linear's) is replaced in place."""
    held = getattr(lin, attr)
    if isinstance(held, torch.nn.Parameter):
        setattr(lin, attr, torch.nn.Parameter(view, requires_grad=held.requires_grad))
    else:
        setattr(lin, attr, view)


def merged_groups(root: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.nn.Module]]]:
    """(module, its merged linears in row order) for every module whose projections were merged."""
    out = []
    for module in root.modules():
        names = _GROUPS.get(type(module).__name__)
        if names and getattr(module, MERGED_ATTR, None) is not None:
            out.append((module, [getattr(module, n) for n in names if getattr(module, n, None) is not None]))
    return out


def restore_views(module: torch.nn.Module, linears: list[torch.nn.Module], rows: list[int], where: str) -> list[str]:
    """A weight given new storage after optimize() (``lin.weight.data = w``, a new Parameter,
    ``load_state_dict(assign=True)``) is no longer a view of the merged weight the graphs read:
    its values are copied into its rows of the merged weight, in place (the graphs, CUDA graphs
    included, keep their addresses), and it becomes that view again (the same Parameter object
    where it still is one). ``rows``: each linear's rows in the merged weight, as merged (not read
    from the weights: a replaced one may have others). Returns the names restored. A weight of
    another shape, dtype or device than its rows cannot be: a clear error."""
    merged = getattr(module, MERGED_ATTR)
    scales = getattr(module, MERGED_SCALE_ATTR, None)
    todo, start, s0 = [], 0, 0
    for lin, n in zip(linears, rows):
        sattr = scale_attr(lin)
        # scale rows: one per weight row (fp8), one per block of rows (FineGrainedFP8)
        ns = 0 if sattr is None else n if sattr == "weight_scale" else -(-n // int(lin.block_size[0]))
        for attr, whole, lo, count in (("weight", merged, start, n), (sattr, scales, s0, ns)):
            if whole is None or attr is None:
                continue
            base = whole.untyped_storage().data_ptr()
            view, w = whole[lo:lo + count], getattr(lin, attr)
            if w.data_ptr() == view.data_ptr() and w.shape == view.shape and w.dtype == view.dtype:
                continue
            if w.shape != view.shape or w.dtype != view.dtype or w.device != view.device:
                raise RuntimeError(
                    f"gemma4opt: {where}.{_name_in(module, lin)}.{attr} was replaced after optimize() by a tensor of "
                    f"shape {tuple(w.shape)}, {w.dtype} on {w.device}; the optimized model holds it merged with its "
                    f"siblings as {tuple(view.shape)}, {view.dtype} on {view.device}. Replace weights with ones of "
                    "the same shape, dtype and device, or call gemma4opt.optimize(model) again after the change")
            # a source inside the merged weight (two projections swapped) is read before it is overwritten
            src = w.detach().clone() if w.untyped_storage().data_ptr() == base else w.detach()
            todo.append((lin, attr, view, src))
        start += n
        s0 += ns
    with torch.no_grad():
        for _, _, view, src in todo:
            view.copy_(src)
    for lin, attr, view, _ in todo:
        held = getattr(lin, attr)
        if isinstance(held, torch.nn.Parameter):
            held.data = view                # the Parameter the caller may hold stays the module's
        else:
            setattr(lin, attr, view)        # Fp8Linear's buffers
    return sorted({f"{_name_in(module, lin)}.{attr}" for lin, attr, _, _ in todo})


def _name_in(module, lin) -> str:
    return next((n for n, m in module.named_children() if m is lin), "?")


def _views_of(module, linears) -> bool:
    """True when the weights are still views into the module's merged weight. A ``.to()`` (or any
    move) after optimize() gives each weight its own storage and leaves the merged one behind:
    then it is merged again, on the new device and dtype."""
    merged = getattr(module, MERGED_ATTR, None)
    if merged is None:
        return False
    base = merged.untyped_storage().data_ptr()
    return all(lin.weight.untyped_storage().data_ptr() == base and lin.weight.dtype == merged.dtype
               for lin in linears)


class MergedProjectionsPattern(Pattern):
    name = "merged_projections"
    summary = "q/k/v and gate/up linears -> one GEMM each on weights merged at optimize()"

    def expected(self, cfg, scope):
        return 2 * cfg.num_hidden_layers - (cfg.num_kv_shared_layers or 0)

    def prepare(self, root, text_config):
        for module in root.modules():
            names = _GROUPS.get(type(module).__name__)
            if names:
                _merge(module, names)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for type_name, names in _GROUPS.items():
            for region in regions_of_type(gm.graph, type_name, subtree=True):
                module = resolve_module(ctx.root, region.path)
                merged = getattr(module, MERGED_ATTR, None)
                owned = [n for n in names if getattr(module, n, None) is not None]
                if merged is None:
                    foreign = [n for n in owned if foreign_linear(getattr(module, n))]
                    if foreign and len(owned) >= 2:
                        lin = getattr(module, foreign[0])
                        how = ("run by gemma4opt::fp8_block_linear, not merged (rows not in whole blocks, or "
                               "blocks differ)" if adopted(lin) else "left to its own forward")
                        res.unfused.append(f"{region.path}: {', '.join(foreign)} {'is a' if len(foreign) == 1 else 'are'} "
                                           f"{type(lin).__name__} (not an nn.Linear): {how}")
                    elif len(owned) >= 2:
                        res.unfused.append(f"{region.path}: projections have a bias or were not merged")
                    continue
                why = self._rewrite(gm, ctx, region, module, owned, merged)
                if why:
                    res.unfused.append(f"{region.path}: {why}")
                else:
                    res.matched += 1
        return res

    @staticmethod
    def _rewrite(gm, ctx, region, module, owned, merged) -> str | None:
        kind = _kind(getattr(module, owned[0]))
        fp8 = kind == "fp8"
        op = {"fp8": "fp8_linear.default", "block": "fp8_block_linear.default"}.get(kind, "linear")
        linears = []
        for name in owned:
            path = f"{region.path}.{name}"
            found = [n for n in region.nodes if op_name(n) == op and innermost(n)[0] == path]
            if len(found) != 1:
                return f"{name}: expected one {op} call, found {len(found)}"
            linears.append(found[0])
        x = _quantized_input(linears[0]) if fp8 else linears[0].args[0]
        if any((_quantized_input(lin) if fp8 else lin.args[0]) is not x for lin in linears):
            return "projections do not share their input"
        if kind == "bf16" and any(len(lin.args) > 2 and lin.args[2] is not None for lin in linears):
            return "projection has a bias"
        graph = gm.graph
        first = min(linears)          # nodes compare by their position in the graph
        w = ctx.add_constant(f"{region.path}.merged", merged)
        new_nodes = []
        with graph.inserting_before(first):
            if fp8:
                quant = first.args[0].args[0]
                q = graph.call_function(torch.ops.gemma4opt.quantize_rows.default, (x,))
                q.meta = dict(quant.meta)
                xq, xs = (graph.call_function(operator.getitem, (q, i)) for i in (0, 1))
                xq.meta, xs.meta = dict(first.args[0].meta), dict(first.args[1].meta)
                scale = ctx.add_constant(f"{region.path}.merged_scale", getattr(module, MERGED_SCALE_ATTR))
                fused = graph.call_function(torch.ops.gemma4opt.fp8_linear.default, (xq, xs, w, scale, first.args[4]))
                new_nodes += [q, xq, xs]
            elif kind == "block":        # (x, weight, weight_scale_inv, block_n, block_k): the same blocks
                scale = ctx.add_constant(f"{region.path}.merged_scale", getattr(module, MERGED_SCALE_ATTR))
                fused = graph.call_function(torch.ops.gemma4opt.fp8_block_linear.default,
                                            (x, w, scale, *first.args[3:]))
            else:
                fused = graph.call_function(torch.nn.functional.linear, (x, w))
            fused.meta = dict(first.meta)
            new_nodes.append(fused)
            start = 0
            for name, lin in zip(owned, linears):
                rows = getattr(module, name).weight.shape[0]
                part = graph.call_function(operator.getitem, (fused, (Ellipsis, slice(start, start + rows))))
                part.meta = dict(lin.meta)
                lin.replace_all_uses_with(part)
                new_nodes.append(part)
                start += rows
        for lin in linears:
            inputs = [a for a in lin.args[:2]] if fp8 else []
            graph.erase_node(lin)
            _erase_unused(graph, inputs)
        place(new_nodes)
        return None


def _quantized_input(lin: fx.Node):
    """x of ``fp8_linear(getitem(quantize_rows(x), 0), getitem(same, 1), ...)``, or None."""
    xq, xs = lin.args[0], lin.args[1]
    if (op_name(xq) != "getitem" or op_name(xs) != "getitem" or xq.args[0] is not xs.args[0]
            or op_name(xq.args[0]) != "quantize_rows.default"):
        return None
    return xq.args[0].args[0]


def _erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase these nodes, then their inputs, as long as nothing reads them."""
    todo, erased = list(nodes), set()
    while todo:
        n = todo.pop()
        if isinstance(n, fx.Node) and n not in erased and not n.users and n.op == "call_function":
            todo.extend(a for a in n.args if isinstance(a, fx.Node))
            graph.erase_node(n)
            erased.add(n)
