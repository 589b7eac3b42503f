"""Gemma-4 MoE experts (HF's grouped or batched_mm path) → ``gemma4opt.moe_experts``.

Unfused (one Gemma4TextExperts, transformers' ``grouped_mm`` experts implementation, prefill)::

    ids, perm = sort(top_k_index.reshape(-1)); xs = x[perm // k]; ws = top_k_weights.reshape(-1)[perm]
    offs = cumsum(histc(ids, E))                              # tokens per expert
    gu = grouped_mm(xs, gate_up_proj^T, offs); h = gelu_tanh(gu[:, :I]) * gu[:, I:]   # or gelu_tanh_mul
    y = grouped_mm(h, down_proj^T, offs) * ws[:, None]        # (+ masked_fill of sentinel rows)
    out = y[inverse(perm)].view(T, k, H).sum(1).to(x.dtype)

or (``batched_mm``, which HF's generate switches to for decode steps on a GPU)::

    xs = x.repeat_interleave(k, 0); ids = top_k_index.reshape(-1).clamp(0, E - 1)
    gu = bmm(gate_up_proj[ids], xs[..., None])[..., 0]; h = gelu_tanh(gu[:, :I]) * gu[:, I:]
    y = bmm(down_proj[ids], h[..., None])[..., 0] * top_k_weights.reshape(-1)[:, None]
    out = y.view(T, k, H).sum(1).to(x.dtype)

Fused::

    out = gemma4opt.moe_experts(x, top_k_index, top_k_weights, gate_up_proj, down_proj, key)

``key`` finds the experts module again, in the model's OpState (ops/state.py): the op runs that
module (HF's own path) everywhere but CUDA decode, where each shape runs whichever of gemma4opt's
two decode kernels and HF's path timed faster (ops/moe_experts.py). One match per MoE layer. Left
unfused, with the reason, when the experts are not the concatenated [gate; up], untransposed,
bias-free, gelu-tanh layout the kernels read, or the region is neither of HF's paths above (e.g.
the eager per-expert loop). With quantization="fp8" the experts are ops/fp8_weights.py's
Fp8Experts, which call gemma4opt.moe_experts_fp8 themselves: nothing to match (0 expected). A
FineGrainedFP8 checkpoint's FP8Experts, adopted (ops/fp8_checkpoint.py), call
gemma4opt.moe_experts_fp8_block: counted as matched where the op is there.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import erase_region, regions_of_type, replace_output, resolve_module
from gemma4opt.ops.fp8_checkpoint import experts_unsupported

_GROUPED = ("grouped_mm", "_grouped_mm", "grouped_mm_fallback")


def _value(node):
    v = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


class MoeExpertsPattern(Pattern):
    name = "moe_experts"
    summary = "MoE experts (HF grouped / batched_mm path) -> gemma4opt.moe_experts (decode kernels or HF's per shape)"

    def expected(self, cfg, scope):
        # quantization="fp8": the experts are Fp8Experts, whose forward is gemma4opt.moe_experts_fp8 already.
        return cfg.num_hidden_layers if cfg.enable_moe_block and self.quantization != "fp8" else 0

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        from gemma4opt.ops.moe_experts import register_experts

        res = PassResult()
        # A FineGrainedFP8 checkpoint's experts (transformers' FP8Experts): adopted, their forward is
        # gemma4opt.moe_experts_fp8_block already (ops/fp8_checkpoint.py); else their own forward runs.
        for region in regions_of_type(gm.graph, "FP8Experts", subtree=True):
            if region.op_counts()["moe_experts_fp8_block.default"] == 1:
                res.matched += 1
            else:
                res.unfused.append(f"{region.path}: transformers' FP8Experts, their own forward "
                                   f"({experts_unsupported(resolve_module(ctx.root, region.path))})")
        for region in regions_of_type(gm.graph, "Gemma4TextExperts", subtree=True):
            experts = resolve_module(ctx.root, region.path)
            m, why = self._match(region, experts)
            if m is None:
                res.unfused.append(f"{region.path}: {why}")
                continue
            # Registered on the active OpState: the backend runs this pass inside the optimized
            # model's forward call, whose state the op reads when the graph runs (ops/state.py).
            replace_output(gm.graph, m["out"], torch.ops.gemma4opt.moe_experts.default,
                           (*m["args"], register_experts(experts)))
            erase_region(gm.graph, region.nodes, keep_used=True)
            res.matched += 1
        return res

    @staticmethod
    def _match(region, experts):
        layout = dict(has_gate=True, has_bias=False, is_transposed=False, is_concatenated=True)
        off = [f"{k}={getattr(experts, k, None)}" for k, v in layout.items() if getattr(experts, k, None) != v]
        if off:
            return None, f"experts layout {', '.join(off)} (the kernels read [gate; up] rows, no bias)"
        counts = region.op_counts()
        # The activation: HF's gelu, or gemma4opt.gelu_tanh_mul where that pattern fused it already.
        acts = counts["gelu"] + counts["gelu_tanh_mul.default"]
        grouped = sum(counts[g] for g in _GROUPED) == 2 and counts["sort"] == 1
        batched = counts["bmm"] == 2 and counts["repeat_interleave"] == 1 and counts["sort"] == 0
        if not (grouped or batched) or acts != 1:
            return None, f"not HF's grouped_mm or batched_mm experts path: {dict(counts)}"
        gelu = region.by_op("gelu")
        if gelu and gelu[0].kwargs.get("approximate", gelu[0].args[1] if len(gelu[0].args) > 1 else "none") != "tanh":
            return None, "activation is not gelu(approximate='tanh')"
        # Tensors in and out; with dynamic shapes the region also reads and yields size arithmetic
        # (SymInts other layers share), which stays in the graph for whoever uses it.
        outs = [o for o in region.outputs() if _value(o) is not None]
        if len(outs) != 1:
            return None, f"{len(outs)} tensor outputs, expected 1"
        inside = region.node_set
        ext = list(dict.fromkeys(a for n in region.nodes for a in n.all_input_nodes if a not in inside))
        vals = {a: _value(a) for a in ext if _value(a) is not None}
        if any(not isinstance(a.meta.get("example_value"), (torch.SymInt, int)) for a in ext if a not in vals):
            return None, "an input that is neither a tensor nor a size"
        ext = list(vals)
        # The stacked weights by shape: gate_up [E, 2I, H] and down [E, H, I].
        three = [a for a, v in vals.items() if v.dim() == 3]
        gate_up = [a for a in three for b in three if a is not b and vals[a].shape[1] == 2 * vals[b].shape[2]
                   and vals[a].shape[2] == vals[b].shape[1]]
        down = [b for b in three if gate_up and b is not gate_up[0]]
        index = [a for a, v in vals.items() if v.dim() == 2 and not v.is_floating_point()]
        floats2 = [a for a, v in vals.items() if v.dim() == 2 and v.is_floating_point()]
        if not (len(gate_up) == len(down) == len(index) == 1 and len(floats2) == 2 and len(ext) == 5):
            return None, f"inputs not (x, top_k_index, top_k_weights, gate_up_proj, down_proj): {[a.name for a in ext]}"
        E, two_i, H = vals[gate_up[0]].shape
        k = vals[index[0]].shape[1]
        x = [a for a in floats2 if vals[a].shape[1] == H and vals[a].shape[1] != k]
        w = [a for a in floats2 if a not in x]
        if len(x) != 1 or len(w) != 1 or tuple(vals[down[0]].shape) != (E, H, two_i // 2):
            return None, "input shapes do not fit [T, H] x [E, 2I, H] / [E, H, I] experts"
        return dict(out=outs[0], args=(x[0], index[0], w[0], gate_up[0], down[0])), ""
