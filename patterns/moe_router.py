"""Gemma-4 MoE router → ``gemma4opt.moe_router``.

Unfused (one Gemma4TextRouter, after the rms_norm pass)::

    h = gemma4opt.rms_norm(x, None, eps) * scale * hidden_size**-0.5
    probs = softmax(linear(h, Wproj), dim=-1, dtype=float32)
    w, idx = topk(probs, k); w /= w.sum(-1, keepdim=True); w = w * per_expert_scale[idx]

Fused::

    probs, w, idx = gemma4opt.moe_router(x, scale, Wproj, per_expert_scale, eps, root, k)

and where the experts' input norm reads the same x (``pre_feedforward_layernorm_2(x)``, a weighted
gemma4opt.rms_norm in the decoder layer), it comes out of the same op and kernel::

    probs, w, idx, n = gemma4opt.moe_router_norm(x, ..., k, w_pre2, eps2)

The experts stay HF's (exact); the dense MLP and the MoE branch keep their own fusions.
"""
from __future__ import annotations

import collections
import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import erase_region, op_name, place, regions_of_type, resolve_module, scalar_operand

_OPS = collections.Counter({"rms_norm.default": 1, "mul": 3, "linear": 1, "softmax": 1, "topk": 1,
                            "getitem": 3, "sum": 1, "itruediv": 1})


def _experts_norm(x: fx.Node, region) -> fx.Node | None:
    """A weighted gemma4opt.rms_norm of x outside the router (the experts' input norm), if one."""
    inside = region.node_set
    for u in x.users:
        if u not in inside and op_name(u) == "rms_norm.default" and u.args[0] is x and u.args[1] is not None:
            return u
    return None


class MoeRouterPattern(Pattern):
    name = "moe_router"
    summary = "MoE router (norm, scale, proj, softmax, top-k, renorm, per-expert scale) -> gemma4opt.moe_router"

    def expected(self, cfg, scope):
        return cfg.num_hidden_layers if cfg.enable_moe_block else 0

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for region in regions_of_type(gm.graph, "Gemma4TextRouter", subtree=True):
            m, why = self._match(region, resolve_module(ctx.root, region.path))
            if m is None:
                res.unfused.append(f"{region.path}: {why}")
                continue
            graph = gm.graph
            sibling = _experts_norm(m["args"][0], region)
            op, n_out, args = torch.ops.gemma4opt.moe_router.default, 3, m["args"]
            if sibling is not None:
                op, n_out, args = torch.ops.gemma4opt.moe_router_norm.default, 4, (*args, *sibling.args[1:3])
            with graph.inserting_before(m["weights"]):   # the index may be read before: place() moves it
                fused = graph.call_function(op, args)
                outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(n_out)]
            pairs = [(m["weights"], outs[1]), (m["index"], outs[2])] + ([(sibling, outs[3])] if sibling else [])
            for node, new in pairs:
                new.meta = dict(node.meta)
                node.replace_all_uses_with(new)
            if sibling is not None:
                graph.erase_node(sibling)
            place([fused, *outs])
            erase_region(graph, region.nodes, keep_used=True)
            res.matched += 1
        return res

    @staticmethod
    def _match(region, router):
        if region.op_counts() != _OPS:
            return None, f"unrecognized op sequence {dict(region.op_counts())}"
        k = router.config.top_k_experts
        if k & (k - 1):
            return None, f"top_k {k} is not a power of two (kernel limit)"
        norm = region.by_op("rms_norm.default")[0]
        linear = region.by_op("linear")[0]
        topk = region.by_op("topk")[0]
        muls = region.by_op("mul")
        roots = [mm for mm in muls if scalar_operand(mm)[1] is not None]
        if len(roots) != 1 or abs(scalar_operand(roots[0])[1] - router.scalar_root_size) > 1e-12:
            return None, "hidden_size**-0.5 scale not found"
        scale_mul = roots[0].args[0]
        if op_name(scale_mul) != "mul" or norm not in scale_mul.args:
            return None, "router scale multiply not found"
        scale = scale_mul.args[1] if scale_mul.args[0] is norm else scale_mul.args[0]
        outs = region.outputs()
        weights = [o for o in outs if op_name(o) == "mul"]
        index = [o for o in outs if op_name(o) == "getitem" and o.args[0] is topk]
        if len(weights) != 1 or len(index) != 1 or len(outs) != 2:
            return None, "router outputs are not (weights, index)"
        pes = next(g.args[0] for g in region.by_op("getitem") if g.args[1] is index[0])
        args = (norm.args[0], scale, linear.args[1], pes, norm.args[2], float(router.scalar_root_size), int(k))
        return dict(args=args, weights=weights[0], index=index[0]), ""
