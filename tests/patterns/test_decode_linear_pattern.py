"""decode_linear: every attention / MLP linear becomes gemma4opt.linear; the per-shape pick of GEMM."""
import pytest
import torch

from gemma4opt.compiler.regions import module_stack, op_name
from gemma4opt.ops import linear as linear_op
from gemma4opt.ops.state import OpState, active
from tests.models import VARIANTS, prompt, tiny
from tests.patterns.helpers import Compiled


def _in_block(node):
    return any(t in ("Gemma4TextAttention", "Gemma4TextMLP") for _, t in module_stack(node))


def _ple(node):
    return module_stack(node)[-1][0].rsplit(".", 1)[-1] in ("per_layer_input_gate", "per_layer_projection")


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_block_linear_replaced_after_merging(variant):
    model = tiny(variant)
    ids = prompt(2, 9)
    with torch.no_grad():
        want = model(ids).logits
    c = Compiled(model, ["merged_projections", "decode_linear"], text_config=model.config)
    got = c(ids).logits
    cfg = model.config
    ple = bool(cfg.hidden_size_per_layer_input)
    assert c.matched("decode_linear") == (2 + ple) * cfg.num_hidden_layers, c.unfused("decode_linear")
    nodes = list(c.graphs[-1].graph.nodes)
    assert not [n for n in nodes if op_name(n) == "linear" and (_in_block(n) or _ple(n))]
    # merged q/k/v (or q alone on KV-shared layers) + o_proj + merged gate/up + down per layer,
    # and the PLE gate and projection where the model has per-layer inputs
    assert c.gemma4opt_ops()["linear"] == (4 + 2 * ple) * cfg.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=0, atol=0)     # the CPU path is F.linear itself


def test_ple_linear_with_a_bias_stays_unfused_and_is_listed():
    model = tiny("tiny-ple-shared")
    gate = model.model.layers[1].per_layer_input_gate
    gate.bias = torch.nn.Parameter(torch.zeros(gate.out_features))
    c = Compiled(model, ["decode_linear"], text_config=model.config)
    c(prompt(1, 5))
    assert c.matched("decode_linear") == 3 * model.config.num_hidden_layers - 1
    assert any("layers.1" in u and "PLE" in u and "bias" in u for u in c.unfused("decode_linear"))


def test_biased_projection_stays_unfused_and_is_listed():
    model = tiny("tiny")
    mlp = model.model.layers[0].mlp
    mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(mlp.down_proj.out_features))
    c = Compiled(model, ["decode_linear"], text_config=model.config)
    c(prompt(1, 5))
    assert c.matched("decode_linear") == 2 * model.config.num_hidden_layers - 1
    assert any("layers.0.mlp" in u and "bias" in u for u in c.unfused("decode_linear"))


@pytest.fixture
def op_state():
    """A fresh OpState, active for the test as a model's is for its forward."""
    with active(OpState()) as state:
        yield state


def test_pick_is_timed_once_per_shape_and_never_while_capturing(monkeypatch, op_state):
    calls = []

    def timer(t_triton, t_cublas):
        def run():
            calls.append((t_triton, t_cublas))
            return t_triton, t_cublas
        return run

    pick = op_state.shapes["linear"].pick
    assert pick(("a",), timer(1.0, 2.0)) is True
    assert pick(("a",), timer(9.0, 1.0)) is True      # remembered, not re-timed
    assert pick(("b",), timer(0.99, 1.0)) is False    # within the margin: cuBLAS
    assert len(calls) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert pick(("c",), timer(0.1, 1.0)) is False     # cannot time inside a capture
    assert len(calls) == 2 and ("c",) not in linear_op.picks()


def test_a_triton_gemm_that_fails_leaves_the_shape_on_cublas(op_state):
    def broken():
        raise RuntimeError("no kernel image for this GPU")

    assert op_state.shapes["linear"].pick(("d",), broken) is False
    assert linear_op.picks() == {("d",): False}
    assert "no kernel image" in linear_op.failures()[("d",)]


def test_report_line_counts_the_picks():
    from gemma4opt.report import _decode_gemms

    state = OpState()
    assert "no shape" in _decode_gemms("cuda", state)
    state.shapes["linear"].chosen.update({(1, 8, 4, None, 0): True, (8, 8, 4, None, 0): False})
    assert _decode_gemms("cuda", state).startswith("the skinny Triton GEMM on 1 of 2 shapes timed (rows [1, 8])")
    assert "lm_head" not in _decode_gemms("cuda", state)


def test_report_line_counts_the_lm_head_picks():
    from gemma4opt.report import _decode_gemms

    state = OpState()
    state.shapes["linear"].chosen.update({(1, 8, 4, None, 0): True})
    state.shapes["linear_softcap"].chosen.update({(1, 262144, 2560, None, 0): True,
                                                  (40, 262144, 2560, None, 0): False})
    assert _decode_gemms("cuda", state).endswith(
        "; lm_head + softcap: the skinny GEMM with the softcap epilogue on 1 of 2 "
        "shapes timed (rows [1, 40]), cuBLAS + the softcap kernel on the rest")


def test_a_triton_result_that_differs_from_cublas_is_refused():
    from gemma4opt.ops.pick import check_close

    want = torch.randn(4, 64)
    check_close(want + 1e-4 * torch.randn(4, 64), want)       # 16-bit rounding: fine
    with pytest.raises(ValueError, match="differs from cuBLAS"):
        check_close(want.flip(0), want, other="cuBLAS")
    with pytest.raises(ValueError, match="differs from"):
        check_close(torch.full((4, 64), float("nan")), want)


def test_a_shape_is_checked_before_it_is_timed(monkeypatch):
    """check_then_time: a Triton result that differs never gets timed; one that matches is timed,
    both paths on the same weight."""
    from gemma4opt.ops import pick

    timed = []
    monkeypatch.setattr(pick, "time_in_graph", lambda a, b, w: timed.append(w) or (1.0, 2.0))
    w = torch.randn(8, 16)
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="skinny Triton GEMM differs from cuBLAS"):
        pick.check_then_time(lambda w: -(x @ w.T), lambda w: x @ w.T, w, "skinny Triton GEMM", "cuBLAS")
    assert timed == []
    assert pick.check_then_time(lambda w: x @ w.T, lambda w: x @ w.T, w, "skinny Triton GEMM", "cuBLAS") == (1.0, 2.0)
    assert len(timed) == 1 and timed[0] is w


def test_timed_weight_copies_overflow_l2():
    """The pick's graph timing streams each call's weight from HBM: copies hold twice the L2."""
    from gemma4opt.ops.pick import weight_copies

    l2 = 50 * 2**20
    assert weight_copies(2**30, l2) == 1                   # an lm_head: larger than L2 on its own
    assert weight_copies(46 * 2**20, l2) == 3              # 3 x 46 MiB >= 100 MiB
    assert weight_copies(10 * 2**20, l2) * 10 * 2**20 >= 2 * l2
    assert weight_copies(1, l2) == 64                      # bounded memory for tiny weights
