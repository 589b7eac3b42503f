"""Paged layers' q/k/v prep and KV append → ``gemma4opt.qkv_norm_rope_append`` (attention="paged").

Unfused (after norm_rope; per layer that owns KV; the transposes are HF's [B, H, S, D] layout
and the paged attention function's way back)::

    q = gemma4opt.rms_norm_rope(xq, wq, cos, sin, eps)
    k = gemma4opt.rms_norm_rope(xk, wk, cos, sin, eps)
    v = gemma4opt.rms_norm(xv, None, eps)                       # xv is xk with attention_k_eq_v
    gemma4opt.kv_append(kv, k.T(1,2).T(1,2), v.T(1,2).T(1,2), slot_mapping, token_index, kv_scale)
    out = gemma4opt.paged_attention(q.T(1,2).T(1,2), kv, ...)     # or the step's other backend's op

Fused (one kernel: four launches per layer become one)::

    q = gemma4opt.qkv_norm_rope_append(kv, xq, wq, xk, wk, xv, cos, sin, eps, slot_mapping, token_index, kv_scale)
    out = gemma4opt.paged_attention(q, kv, ...)

``kv_scale``: the layer's fp8 KV scales (None for a pool in the model's dtype), passed on.
Found from each kv_append; its attention is the backend op (``ATTENTION_OPS``) in the same
attention module. Every intermediate must feed only the next step, q and k must use the same
cos/sin, and the three norms one eps; otherwise the layer stays unfused, with the reason in the
report.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from gemma4opt.compiler.pattern import PassContext, PassResult, Pattern
from gemma4opt.compiler.regions import innermost, op_name, place

_ROPE, _RMS = "rms_norm_rope.default", "rms_norm.default"
# The paged backends' attention ops (gemma4opt/paged/backends/: reference, FlashInfer, Triton).
ATTENTION_OPS = ("paged_attention", "paged_attention_flashinfer", "paged_decode")


def _through_transposes(node):
    """(source, chain) for ``node`` = source.transpose(1, 2) an even number of times, each step
    used once; (None, why) otherwise."""
    chain = []
    while op_name(node) == "transpose":
        dims = sorted(d % 4 for d in node.args[1:3]) if len(node.args) == 3 else None
        if dims != [1, 2] or len(node.users) != 1:
            return None, "a transpose other than the attention layout's, or one used elsewhere"
        chain.append(node)
        node = node.args[0]
    if len(chain) % 2 or len(node.users) != 1:
        return None, "the layout is not restored, or the value is used elsewhere"
    return node, chain


def _same_value(a, b) -> bool:
    """a and b compute the same thing from the same inputs (e.g. two ``cos.unsqueeze(2)`` nodes)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a.op != b.op or a.target != b.target:
        return False
    if a.op not in ("call_method", "call_function") or a.kwargs != b.kwargs or len(a.args) != len(b.args):
        return False
    return all(_same_value(x, y) if isinstance(x, fx.Node) else x == y for x, y in zip(a.args, b.args))


def _head_dim(node):
    """Last dim of a [B, S, heads, D] node, from Dynamo's example value (or FX shape propagation)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val", node.meta.get("tensor_meta")))
    shape = getattr(val, "shape", None)
    return int(shape[-1]) if shape is not None and len(shape) == 4 else None


def _match(append: fx.Node):
    """The pieces of one layer, or (None, why)."""
    kv, kt, vt, slots, tok, *rest = append.args
    kv_scale = rest[0] if rest else append.kwargs.get("kv_scale")
    k, k_chain = _through_transposes(kt)
    if k is None or op_name(k) != _ROPE:
        return None, k_chain if k is None else "K is not a gemma4opt.rms_norm_rope"
    v, v_chain = _through_transposes(vt)
    if v is None or op_name(v) != _RMS or v.args[1] is not None:
        return None, v_chain if v is None else "V is not a weightless gemma4opt.rms_norm"
    where = innermost(append)
    attn = [u for u in kv.users if op_name(u) in ATTENTION_OPS and innermost(u) == where]
    if len(attn) != 1:
        return None, "no single paged attention op of the same module reads this pool"
    q, q_chain = _through_transposes(attn[0].args[0])
    if q is None or op_name(q) != _ROPE:
        return None, q_chain if q is None else "Q is not a gemma4opt.rms_norm_rope"
    (xq, wq, cq, sq, eq), (xk, wk, ck, sk, ek), (xv, _, ev) = q.args, k.args, v.args
    dims = {_head_dim(n) for n in (xq, xk, xv)}
    if len(dims) != 1 or None in dims or dims.pop() % 2:
        return None, "q/k/v head dims differ or are odd (the kernel rotates halves of one head_dim)"
    if not (_same_value(cq, ck) and _same_value(sq, sk)):
        return None, "q and k are rotated with different cos/sin"
    if len({eq, ek, ev}) != 1:
        return None, f"q/k/v norms have different eps ({eq}, {ek}, {ev})"
    return dict(args=(kv, xq, wq, xk, wk, xv, cq, sq, eq, slots, tok, kv_scale), attn=attn[0], q=q, q_chain=q_chain,
                dead=[append, *k_chain, k, *v_chain, v]), ""


class PagedQKVPattern(Pattern):
    name = "paged_qkv"
    summary = "q/k norm+RoPE, v norm and the paged KV append -> gemma4opt.qkv_norm_rope_append (paged attention)"
    paged_only = True

    def expected(self, cfg, scope):
        return cfg.num_hidden_layers - (cfg.num_kv_shared_layers or 0)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        res = PassResult()
        for append in list(gm.graph.nodes):
            if op_name(append) != "kv_append":
                continue
            m, why = _match(append)
            if m is None:
                res.unfused.append(f"{(innermost(append) or ('?',))[0]}: {why}")
                continue
            q = m["q"]
            # At the append (the pool's write keeps its place); after q's rope where that comes later.
            with gm.graph.inserting_before(append):
                fused = gm.graph.call_function(torch.ops.gemma4opt.qkv_norm_rope_append.default, m["args"])
            fused.meta = dict(q.meta)
            attn = m["attn"]
            attn.replace_input_with(attn.args[0], fused)
            place([fused])
            for n in [*m["q_chain"], q, *m["dead"]]:     # users before what they use
                gm.graph.erase_node(n)
            res.matched += 1
        return res
