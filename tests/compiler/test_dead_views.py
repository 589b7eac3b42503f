"""drop_dead_views: what the pass manager clears before any pattern counts users."""
import torch
import torch.fx as fx

from gemma4opt.compiler.regions import drop_dead_views


def test_erases_unused_layout_and_device_calls_only():
    def f(x):
        y = x.transpose(1, 2)
        y.to("cpu").contiguous()          # a dead chain: both go
        x.view(-1)                        # dead
        torch.neg(x)                      # dead, but not a layout method: kept (not ours to judge)
        return y.reshape(-1)              # live

    gm = fx.symbolic_trace(f)
    assert drop_dead_views(gm.graph) == 3
    gm.graph.lint()
    gm.recompile()
    kept = [n.target for n in gm.graph.nodes if n.op in ("call_method", "call_function")]
    assert kept == ["transpose", torch.neg, "reshape"]
    x = torch.randn(2, 3, 4)
    assert torch.equal(gm(x), f(x))
