"""A rotary embedding's cos/sin → ``gemma4opt.rope_cos_sin`` (paged mode).

Unfused (Gemma4TextRotaryEmbedding, once per layer type and forward; transformers >= 5.25)::

    freqs = position_ids[..., None].float() * inv_freq.to(float32)
    emb = cat((freqs, freqs), -1)
    cos = (emb.cos() * scaling).to(dtype);  sin = (emb.sin() * scaling).to(dtype)

transformers 5.17 forms the product as a batched matmul::

    freqs = (inv_freq[None, :, None].expand(B, -1, 1).to(float32)
             @ position_ids[:, None, :].float()).transpose(1, 2)

Fused::

    cos, sin = gemma4opt.rope_cos_sin(position_ids, inv_freq, scaling, dtype, matmul, max_seq_len)

One launch where eager runs 8-9 per layer type (ops/rope_cos_sin.py: same bits, checked per
device). Paged mode only: there positions stay below Gemma4OptConfig.max_seq_len (a longer
generate is refused), the range over which the kernel's bits are checked. The matmul form is
left alone where TF32 may run fp32 matmuls (its products would not be fp32 ones then).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, op_name, place


def _to_dtype(node: fx.Node):
    """The dtype of a ``.to(dtype)`` / ``.to(dtype=...)`` node that changes nothing but the dtype."""
    if op_name(node) != "to":
        return None
    dtype = node.kwargs.get("dtype", node.args[1] if len(node.args) == 2 else None)
    if not isinstance(dtype, torch.dtype) or set(node.kwargs) - {"dtype", "device"}:
        return None
    return dtype


def _scaled_cast(fn: fx.Node):
    """cos/sin node -> (scaling, cast node, [nodes]) for ``(fn(emb) * scaling).to(dtype)``, else None."""
    mul = next(iter(fn.users), None)
    if len(fn.users) != 1 or op_name(mul) != "mul" or len(mul.users) != 1:
        return None
    scale = mul.args[1] if mul.args[0] is fn else mul.args[0]
    cast = next(iter(mul.users))
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or _to_dtype(cast) is None:
        return None
    return float(scale), cast, [fn, mul, cast]


def _mul_form(freqs: fx.Node):
    """freqs = position_ids[..., None].float() * inv_freq.to(float32) -> (position_ids, inv_freq, nodes)."""
    if op_name(freqs) != "mul" or len(freqs.args) != 2:
        return None
    pos_f, inv_f = freqs.args
    if op_name(pos_f) != "float":
        pos_f, inv_f = inv_f, pos_f
    if op_name(pos_f) != "float" or not isinstance(inv_f, fx.Node) or _to_dtype(inv_f) != torch.float32:
        return None
    get = pos_f.args[0]
    if op_name(get) != "getitem" or get.args[1] != (Ellipsis, None):
        return None
    return get.args[0], inv_f.args[0], [get, pos_f, inv_f, freqs]


def _matmul_form(freqs: fx.Node):
    """freqs = (inv_freq[None, :, None].expand(B, -1, 1).to(float32) @ position_ids[:, None, :].float())
    .transpose(1, 2) -> (position_ids, inv_freq, nodes)."""
    if op_name(freqs) != "transpose" or tuple(freqs.args[1:]) != (1, 2):
        return None
    mm = freqs.args[0]
    if op_name(mm) not in ("matmul", "bmm") or len(mm.args) != 2:
        return None
    inv_f, pos_f = mm.args
    if _to_dtype(inv_f) != torch.float32 or op_name(pos_f) != "float":
        return None
    expand, get_p = inv_f.args[0], pos_f.args[0]
    if op_name(expand) != "expand" or tuple(expand.args[2:]) != (-1, 1):
        return None
    get_i = expand.args[0]
    full = slice(None, None, None)
    if (op_name(get_i) != "getitem" or get_i.args[1] != (None, full, None)
            or op_name(get_p) != "getitem" or get_p.args[1] != (full, None, full)):
        return None
    return get_p.args[0], get_i.args[0], [get_i, expand, inv_f, get_p, pos_f, mm, freqs]


def _tf32_matmuls() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32)


class RopeCosSinPattern(Pattern):
    name = "rope_cos_sin"
    summary = "rotary cos/sin (product, concat, cos, sin, scalings, casts) -> gemma4opt.rope_cos_sin"
    paged_only = True

    def expected(self, cfg, scope):
        params = getattr(cfg, "rope_parameters", None) or {}
        return sum(params.get(t) is not None for t in sorted(set(cfg.layer_types)))

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for cat in list(gm.graph.nodes):
            if op_name(cat) != "cat" or not cat.args or len(cat.args[0]) != 2 or cat.args[0][0] is not cat.args[0][1]:
                continue
            where = (innermost(cat) or ("?",))[0]
            if "rotary" not in where:
                continue
            fns = {op_name(u): u for u in cat.users}
            dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
            if set(fns) != {"cos", "sin"} or len(cat.users) != 2 or dim != -1:
                res.unfused.append(f"{where}: the concat of the frequencies is not read by exactly one cos and one sin")
                continue
            tails = {k: _scaled_cast(fns[k]) for k in ("cos", "sin")}
            if None in tails.values() or tails["cos"][0] != tails["sin"][0] \
                    or _to_dtype(tails["cos"][1]) != _to_dtype(tails["sin"][1]):
                res.unfused.append(f"{where}: cos/sin are not each scaled by one number and cast to one dtype")
                continue
            freqs = cat.args[0][0]
            form, matmul = _mul_form(freqs), False
            if form is None:
                form, matmul = _matmul_form(freqs), True
            if form is None:
                res.unfused.append(f"{where}: the frequencies are not position_ids x inv_freq in a known form")
                continue
            if matmul and _tf32_matmuls():
                res.unfused.append(f"{where}: torch.backends.cuda.matmul.allow_tf32 is on, so HF's fp32 matmul "
                                   "of positions and frequencies may run in TF32")
                continue
            if ctx.max_seq_len is None:
                res.unfused.append(f"{where}: positions are unbounded here (only the paged mode bounds them)")
                continue
            pos, inv, inner = form
            scaling, cos_out, sin_out = tails["cos"][0], tails["cos"][1], tails["sin"][1]
            with gm.graph.inserting_before(cos_out):
                fused = gm.graph.call_function(torch.ops.gemma4opt.rope_cos_sin.default,
                                               (pos, inv, scaling, _to_dtype(cos_out), matmul, int(ctx.max_seq_len)))
                items = [gm.graph.call_function(operator.getitem, (fused, i)) for i in (0, 1)]
            fused.meta = dict(cos_out.meta)
            for key in ("example_value", "val"):
                if key in cos_out.meta and key in sin_out.meta:
                    fused.meta[key] = (cos_out.meta[key], sin_out.meta[key])
            for item, out in zip(items, (cos_out, sin_out)):
                item.meta = dict(out.meta)
                out.replace_all_uses_with(item)
            place([fused, *items])
            # The unfused nodes, users first (the position_ids and inv_freq inputs stay).
            for n in [*tails["sin"][2][::-1], *tails["cos"][2][::-1], cat, *inner[::-1]]:
                if not n.users:
                    gm.graph.erase_node(n)
            res.matched += 1
        return res
