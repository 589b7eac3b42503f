"""moe_streams: a MoE layer's experts branch moved ahead of its dense MLP and wrapped in the stream
fork / back / join calls (compiler/streams.py); counts, order, numerics, reasons, where it is left out."""
import operator

import torch
import torch.fx as fx

import gemma4opt
from gemma4opt import Gemma4OptConfig
from gemma4opt.compiler import streams
from patterns.moe_streams import MoeStreamsPattern, _branches
from tests.models import prompt, tiny
from tests.patterns.helpers import Compiled

FUSED = ["rms_norm", "merged_projections", "gelu_tanh_mul", "residual_norm", "norm_add", "moe_router", "moe_experts",
         "decode_linear", "gate_up_gelu", "gelu_linear", "norm_linear", "moe_streams"]


def _compiled(names=FUSED):
    model = tiny("tiny-moe")
    ids = prompt(2, 7)
    with torch.no_grad():
        want = model(ids).logits
    c = Compiled(model, names, text_config=model.config)
    return c, c(ids).logits, want, model.config


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_one_match_per_moe_layer_same_logits_branch_order():
    c, got, want, cfg = _compiled()
    L = cfg.num_hidden_layers
    assert c.matched("moe_streams") == L and c.unfused("moe_streams") == []
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gm = c.graphs[-1]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    forks, backs, joins = (_calls(gm, f) for f in (streams.branch_fork, streams.branch_back, streams.branch_join))
    experts = [n for n in gm.graph.nodes if str(n.target).startswith("gemma4opt.moe_experts")]
    routers = [n for n in gm.graph.nodes if str(n.target).startswith("gemma4opt.moe_router")]
    dense = [n for n in gm.graph.nodes if str(n.target).startswith("gemma4opt.gate_up_gelu_linear")]
    sums = [n for n in gm.graph.nodes if str(n.target).startswith("gemma4opt.norm_add")]
    assert len(forks) == len(backs) == len(joins) == len(experts) == len(routers) == len(dense) == len(sums) == L
    for f, r, e, b, d, j, s in zip(forks, routers, experts, backs, dense, joins, sums):
        # fork, the router and the experts, back, the dense MLP, join, their sum: in that order
        assert order[f] < order[r] < order[e] < order[b] < order[d] < order[j] < order[s]
        assert j.args == (f, b) and b.args[0] is f and j in s.args
        assert list(b.users) == [j] and list(j.users) == [s]
        # the fork names every computed value the branch reads (the residual), nothing it makes
        assert f.args and all(order[a] < order[f] for a in f.args)


def test_count_on_every_variant():
    for variant in ("tiny", "tiny-ple-shared", "tiny-k-eq-v", "tiny-moe"):
        model = tiny(variant)
        c = Compiled(model, FUSED, text_config=model.config)
        c(prompt(1, 5))
        want = MoeStreamsPattern().expected(model.config, "causal_lm")
        assert c.matched("moe_streams") == want == (model.config.num_hidden_layers if variant == "tiny-moe" else 0)


def test_the_unfused_sum_is_the_join_too():
    """Without norm_add the branches meet at HF's own add of the two post norms: still one match a layer."""
    c, got, want, cfg = _compiled(["moe_experts", "moe_streams"])
    assert c.matched("moe_streams") == cfg.num_hidden_layers, c.unfused("moe_streams")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_the_experts_op_nothing_moves():
    c, got, want, cfg = _compiled(["moe_streams"])
    assert c.matched("moe_streams") == 0 and not _calls(c.graphs[-1], streams.branch_fork)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_calls_are_no_ops_off_a_capture():
    x = torch.randn(3)
    assert streams.branch_fork(x, (x, x)) is None
    assert streams.branch_back(None, x) is x and streams.branch_join(None, x) is x


def _toy(read_elsewhere: bool):
    """r = x + 1 -> (dense: a = r * 2) and (experts: e on r) -> a + e [-> e read again]."""
    g = fx.Graph()
    x = g.placeholder("x")
    r = g.call_function(operator.add, (x, 1))
    e = g.call_function(torch.ops.gemma4opt.moe_experts.default, (r, x, x, x, x, 0))
    a = g.call_function(operator.mul, (r, 2))
    s = g.call_function(operator.add, (a, e))
    outs = (s, e) if read_elsewhere else (s,)
    g.output(outs)
    return e


def test_reasons_where_the_branch_cannot_move():
    assert _branches(_toy(read_elsewhere=True)) == "the experts' output is read outside their branch"
    assert not isinstance(_branches(_toy(read_elsewhere=False)), str)


def test_left_out_with_inductor_and_by_config():
    model = gemma4opt.optimize(tiny("tiny-moe"), Gemma4OptConfig(inductor=True, cache="static"))
    assert "moe_streams" not in [r.pattern for r in gemma4opt.report(model, print_table=False).rows]
    names = tuple(p for p in gemma4opt.patterns.PATTERN_NAMES if p != "moe_streams")
    model = gemma4opt.optimize(tiny("tiny-moe"), Gemma4OptConfig(patterns=names))
    assert "moe_streams" not in [r.pattern for r in gemma4opt.report(model, print_table=False).rows]
    model = gemma4opt.optimize(tiny("tiny-moe"))        # in the default set
    assert "moe_streams" in [r.pattern for r in gemma4opt.report(model, print_table=False).rows]
    model = gemma4opt.optimize(tiny("tiny-moe"), Gemma4OptConfig(patterns=gemma4opt.patterns.PATTERN_NAMES))
    assert "moe_streams" in [r.pattern for r in gemma4opt.report(model, print_table=False).rows]


def test_paged_generate_with_it_equals_eager():
    """Named, on the paged mode's graphs (prefill and decode, CPU: the calls do nothing), tokens == eager's."""
    model = tiny("tiny-moe")
    ids = prompt(2, 9)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    gemma4opt.optimize(model, Gemma4OptConfig(attention="paged", patterns=gemma4opt.patterns.PATTERN_NAMES))
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    rows = {r.pattern: r for r in gemma4opt.report(model, print_table=False).rows}
    assert rows["moe_streams"].complete and set(rows["moe_streams"].matched_per_graph) == {4}
