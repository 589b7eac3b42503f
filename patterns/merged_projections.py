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
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, op_name, place, regions_of_type, resolve_module

MERGED_ATTR = "_gemma4opt_merged_weight"
_GROUPS = {"Gemma4TextAttention": ("q_proj", "k_proj", "v_proj"), "Gemma4TextMLP": ("gate_proj", "up_proj")}


def _merge(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    linears = [getattr(module, n, None) for n in names]
    linears = [lin for lin in linears if lin is not None]
    if len(linears) < 2 or any(lin.bias is not None for lin in linears) or _views_of(module, linears):
        return
    with torch.no_grad():
        merged = torch.cat([lin.weight for lin in linears], dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(merged[start:start + rows], requires_grad=lin.weight.requires_grad)
        start += rows
    setattr(module, MERGED_ATTR, merged)   # a plain attribute: not a parameter, not in state_dict


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
                    if len(owned) >= 2:
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
        linears = []
        for name in owned:
            path = f"{region.path}.{name}"
            found = [n for n in region.nodes if op_name(n) == "linear" and innermost(n)[0] == path]
            if len(found) != 1:
                return f"{name}: expected one linear call, found {len(found)}"
            linears.append(found[0])
        x = linears[0].args[0]
        if any(lin.args[0] is not x for lin in linears):
            return "projections do not share their input"
        if any(len(lin.args) > 2 and lin.args[2] is not None for lin in linears):
            return "projection has a bias"
        graph = gm.graph
        first = min(linears)          # nodes compare by their position in the graph
        w = ctx.add_constant(f"{region.path}.merged", merged)
        new_nodes = []
        with graph.inserting_before(first):
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
            graph.erase_node(lin)
        place(new_nodes)
        return None
