"""hoist_tensor_literals: literal tensor factories become one constant; written-to ones stay."""
import torch
import torch.fx as fx

from gemma4opt.compiler.constants import hoist_tensor_literals


def _capture(fn, *args):
    graphs = []

    def backend(gm: fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def _factories(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.tensor]


def test_index_literal_is_hoisted_and_results_equal():
    def f(x):
        idx = torch.tensor([-1], dtype=torch.int64)   # as HF's sliding static cache builds it
        y = x.roll(-1, dims=-1)
        y[:, idx] = 5.0
        return y

    x = torch.randn(3, 7)
    gm = _capture(f, x)
    assert len(_factories(gm)) == 1
    assert hoist_tensor_literals(gm) == 1
    assert _factories(gm) == []
    consts = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert len(consts) == 1
    first = getattr(gm, consts[0].target)
    torch.testing.assert_close(gm(x)[0], f(x))
    torch.testing.assert_close(gm(x + 1)[0], f(x + 1))
    assert getattr(gm, consts[0].target) is first       # one constant, same address every call


def test_literal_written_in_place_is_kept():
    def f(x):
        acc = torch.tensor([0.0])
        acc.add_(x.sum())
        return acc * 2

    x = torch.randn(4)
    gm = _capture(f, x)
    assert hoist_tensor_literals(gm) == 0
    assert len(_factories(gm)) == 1
    torch.testing.assert_close(gm(x)[0], f(x))
    torch.testing.assert_close(gm(x)[0], f(x))       # not accumulated across calls


def test_factory_of_a_graph_value_is_kept():
    def f(x):
        return torch.tensor(x.shape[0] * 2.0) + x    # a literal after Dynamo specialization

    def g(x):
        return torch.as_tensor(x) * 3

    x = torch.randn(5)
    gm = _capture(g, x)
    assert hoist_tensor_literals(gm) == 0            # as_tensor of a graph input is not a literal
    torch.testing.assert_close(gm(x)[0], g(x))
    gm2 = _capture(f, x)
    hoist_tensor_literals(gm2)
    torch.testing.assert_close(gm2(x)[0], f(x))
