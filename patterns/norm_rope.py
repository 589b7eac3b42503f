"""q/k norm + RoPE → ``gemma4opt.rms_norm_rope``.

Unfused (after the rms_norm pass; q and, in layers that own KV, k)::

    y   = gemma4opt.rms_norm(x, w, eps)          # x = proj(h).view(B, S, H, D)
    c   = cos.unsqueeze(2); s = sin.unsqueeze(2)
    out = y * c + cat((-y[..., D/2:], y[..., :D/2]), -1) * s

Fused::

    out = gemma4opt.rms_norm_rope(x, w, c, s, eps)

Dataflow match inside a Gemma4TextAttention: the norm's users must be exactly the rotate_half
reads and the cos multiply. Proportional RoPE (full layers) is the same graph (zero-padded
inv_freq), so it matches too. v_norm (no weight, no RoPE) stays a plain rms_norm.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, module_name, op_name, place

_RMS = "rms_norm.default"


def _slice_of(node: fx.Node):
    """For y[..., a:b] return (a, b); else None."""
    if op_name(node) != "getitem" or not isinstance(node.args[1], tuple) or len(node.args[1]) != 2:
        return None
    ell, sl = node.args[1]
    if ell is not Ellipsis or not isinstance(sl, slice) or sl.step not in (None, 1):
        return None
    return sl.start, sl.stop


def match_rope(norm: fx.Node):
    """{cos, sin, out} when ``norm``'s users are exactly a rotate_half RoPE; else (None, why)."""
    users = list(norm.users)
    muls = [u for u in users if op_name(u) == "mul"]
    gets = [u for u in users if _slice_of(u) is not None]
    if len(users) != 3 or len(muls) != 1 or len(gets) != 2:
        return None, "norm output is not consumed by a rotate_half RoPE"
    (lo, hi) = sorted(gets, key=lambda g: (_slice_of(g)[0] or 0))
    half = _slice_of(lo)[1]
    if _slice_of(lo)[0] not in (None, 0) or _slice_of(hi) != (half, None):
        return None, "rotate_half halves not recognized"
    mul_cos = muls[0]
    cos = mul_cos.args[1] if mul_cos.args[0] is norm else mul_cos.args[0]
    neg = next(iter(hi.users), None)
    if len(hi.users) != 1 or op_name(neg) != "neg" or len(lo.users) != 1:
        return None, "rotate_half negation not found"
    cat = next(iter(neg.users))
    if op_name(cat) != "cat" or list(cat.args[0]) != [neg, lo] or len(cat.users) != 1:
        return None, "rotate_half concat not found"
    mul_sin = next(iter(cat.users))
    if op_name(mul_sin) != "mul" or len(mul_sin.users) != 1 or len(mul_cos.users) != 1:
        return None, "sin multiply not found"
    sin = mul_sin.args[1] if mul_sin.args[0] is cat else mul_sin.args[0]
    add = next(iter(mul_sin.users))
    if op_name(add) != "add" or set(add.args) != {mul_cos, mul_sin}:
        return None, "RoPE sum not found"
    if not isinstance(cos, fx.Node) or not isinstance(sin, fx.Node):
        return None, "cos/sin are not tensors"
    return dict(cos=cos, sin=sin, out=add, nodes=[mul_cos, lo, hi, neg, cat, mul_sin, add]), ""


class NormRopePattern(Pattern):
    name = "norm_rope"
    summary = "q_norm/k_norm + rotate_half RoPE -> gemma4opt.rms_norm_rope"

    def expected(self, cfg, scope):
        return 2 * cfg.num_hidden_layers - (cfg.num_kv_shared_layers or 0)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for norm in list(gm.graph.nodes):
            if op_name(norm) != _RMS or norm.args[1] is None:
                continue
            if module_name(norm) not in ("q_norm", "k_norm"):
                continue
            m, why = match_rope(norm)
            if m is None:
                res.unfused.append(f"{innermost(norm)[0]}: {why}")
                continue
            x, w, eps = norm.args
            out = m["out"]
            with gm.graph.inserting_before(out):
                fused = gm.graph.call_function(torch.ops.gemma4opt.rms_norm_rope.default, (x, w, m["cos"], m["sin"], eps))
            fused.meta = dict(out.meta)
            out.replace_all_uses_with(fused)
            place([fused])
            for n in reversed(m["nodes"]):
                gm.graph.erase_node(n)
            gm.graph.erase_node(norm)
            res.matched += 1
        return res
