"""paged_qkv on a hand-traced graph of the ops the paged attention path emits: numerics, refusals."""
import torch
import torch.fx as fx
from torch.fx.passes.shape_prop import ShapeProp

import gemma4opt.ops  # noqa: F401  (registers torch.ops.gemma4opt)
import gemma4opt.paged.backends.reference  # noqa: F401  (its op: gemma4opt.paged_attention)
from gemma4opt.compiler.pattern import PassContext
from gemma4opt.compiler.regions import drop_dead_views, op_name
from patterns.paged_qkv import PagedQKVPattern

ops = torch.ops.gemma4opt


def _layer_fn(eps_v=1e-6, leak_v=False, dead_to=False):
    """What a Gemma-4 attention layer over the paged cache looks like after norm_rope."""
    def layer(kv, xq, wq, xk, wk, xv, cos, sin, slots, tok, indptr, indices, last, start, lens, new):
        return _layer(kv, xq, wq, xk, wk, xv, cos, sin, slots, tok, (indptr, indices, last, start, lens, new), eps_v,
                      leak_v, dead_to)
    return layer


def _layer(kv, xq, wq, xk, wk, xv, cos, sin, slots, tok, meta, eps_v, leak_v, dead_to):
    q = ops.rms_norm_rope.default(xq, wq, cos.unsqueeze(2), sin.unsqueeze(2), 1e-6).transpose(1, 2)
    k = ops.rms_norm_rope.default(xk, wk, cos.unsqueeze(2), sin.unsqueeze(2), 1e-6).transpose(1, 2)
    v_normed = ops.rms_norm.default(xv, None, eps_v)
    v = v_normed.transpose(1, 2)
    if dead_to:        # transformers 5.17's KV-shared layers: ``.to(device)`` of the producer's K/V, unused
        k.to("cpu"), v.to("cpu")
    ops.kv_append(kv, k.transpose(1, 2), v.transpose(1, 2), slots, tok)
    out = ops.paged_attention(q.transpose(1, 2), kv, *meta, -1, 1.0)
    return (out, v_normed.sum()) if leak_v else out


def _inputs(B=2, H=4, HK=2, D=16, ps=4, k_eq_v=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 1, (H + 2 * HK) * D, generator=g)
    xq, xk = x[..., :H * D].view(B, 1, H, D), x[..., H * D:(H + HK) * D].view(B, 1, HK, D)
    xv = xk if k_eq_v else x[..., (H + HK) * D:].view(B, 1, HK, D)
    pos = torch.tensor([[2.0], [5.0]])[:B, :, None] * torch.linspace(0.1, 1, D)
    kv = torch.randn(B, 2, ps, HK, D, generator=g)     # one page per sequence, 2 tokens already there
    i32 = dict(dtype=torch.int32)
    meta = (torch.arange(B + 1, **i32), torch.arange(B, **i32), torch.full((B,), 3, **i32),
            torch.zeros(B, **i32), torch.full((B,), 3, **i32), torch.ones(B, **i32))
    slots = torch.arange(B) * ps + 2
    return [kv, xq, torch.randn(D, generator=g), xk, torch.randn(D, generator=g), xv, pos.cos(), pos.sin(), slots,
            torch.arange(B, **i32), *meta]


def _rewrite(fn, inputs):
    gm = fx.symbolic_trace(fn)
    ShapeProp(gm).propagate(inputs[0].clone(), *inputs[1:])     # shapes, as Dynamo's example values give them
    drop_dead_views(gm.graph)                                   # as the pass manager does before every pattern
    res = PagedQKVPattern().apply(gm, PassContext(root=gm, text_config=None, scope="causal_lm", gm=gm))
    gm.graph.lint()
    gm.recompile()
    return gm, res


def _check_numerics(fn, inputs):
    gm, res = _rewrite(fn, inputs)
    want_kv, got_kv = inputs[0].clone(), inputs[0].clone()
    want = fn(want_kv, *inputs[1:])
    got = gm(got_kv, *inputs[1:])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_kv, want_kv, rtol=0, atol=0)
    return gm, res


def test_fuses_one_layer_with_same_numerics_and_nothing_left():
    gm, res = _check_numerics(_layer_fn(), _inputs())
    assert res.matched == 1 and res.unfused == []
    names = [op_name(n) for n in gm.graph.nodes]
    assert names.count("qkv_norm_rope_append.default") == 1
    for gone in ("kv_append", "rms_norm_rope.default", "rms_norm.default", "transpose"):
        assert gone not in names, names


def test_k_eq_v_layer_fuses():
    _, res = _check_numerics(_layer_fn(), _inputs(k_eq_v=True))
    assert res.matched == 1


def test_refuses_when_normed_v_is_used_elsewhere():
    _, res = _check_numerics(_layer_fn(leak_v=True), _inputs())
    assert res.matched == 0 and "used elsewhere" in res.unfused[0]


def test_refuses_different_eps():
    _, res = _check_numerics(_layer_fn(eps_v=1e-5), _inputs())
    assert res.matched == 0 and "different eps" in res.unfused[0]


def test_dead_device_moves_of_k_and_v_do_not_block_the_fusion():
    gm, res = _check_numerics(_layer_fn(dead_to=True), _inputs())
    assert res.matched == 1 and res.unfused == []
    assert "to" not in [op_name(n) for n in gm.graph.nodes]


def test_refuses_odd_head_dim_at_match_time():
    _, res = _check_numerics(_layer_fn(), _inputs(D=15))
    assert res.matched == 0 and "odd" in res.unfused[0]


def test_fp8_pool_scales_reach_the_fused_op():
    """An fp8 pool: kv_append's kv_scale becomes the fused op's, the attention op keeps reading
    it; same pool bytes and output as the unfused ops."""
    def layer(kv, xq, wq, xk, wk, xv, cos, sin, slots, tok, indptr, indices, last, start, lens, new, kv_scale):
        q = ops.rms_norm_rope.default(xq, wq, cos.unsqueeze(2), sin.unsqueeze(2), 1e-6).transpose(1, 2)
        k = ops.rms_norm_rope.default(xk, wk, cos.unsqueeze(2), sin.unsqueeze(2), 1e-6).transpose(1, 2)
        v = ops.rms_norm.default(xv, None, 1e-6).transpose(1, 2)
        ops.kv_append(kv, k.transpose(1, 2), v.transpose(1, 2), slots, tok, kv_scale)
        return ops.paged_attention(q.transpose(1, 2), kv, indptr, indices, last, start, lens, new, -1, 1.0, kv_scale)

    inputs = _inputs()
    inputs[0] = inputs[0].to(torch.float8_e4m3fn)
    inputs.append(torch.tensor([0.5, 0.25]))
    gm, res = _rewrite(layer, inputs)
    assert res.matched == 1 and res.unfused == []
    fused = next(n for n in gm.graph.nodes if op_name(n) == "qkv_norm_rope_append.default")
    assert fused.args[-1].name == "kv_scale"
    want_kv, got_kv = inputs[0].clone(), inputs[0].clone()
    want = layer(want_kv, *inputs[1:])
    torch.testing.assert_close(gm(got_kv, *inputs[1:]), want, rtol=0, atol=0)
    assert torch.equal(got_kv.view(torch.uint8), want_kv.view(torch.uint8))
