"""Two optimized models in one process keep their own op state (ops/state.py): the per-shape picks
their GEMM calls make, the picks their reports show, and the experts modules their MoE op finds.

On the CPU the ops run their reference and pick nothing, so the CPU kernel of gemma4opt.linear is
probed: each call, at run time inside the model's forward, also runs the CUDA kernel's pick
(``runs_triton``) with a stub timer. Model A's calls find Triton faster, model B's slower; shared
picks would hand B the shapes A timed first (the two share MLP shapes) and mix the two key sets."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import gemma4opt
from gemma4opt.api import get_state
from gemma4opt.ops import linear as linear_op
from gemma4opt.ops.state import DEFAULT, current
from gemma4opt.report import _decode_gemms
from tests.models import prompt, tiny

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def probe(monkeypatch):
    """Per call of gemma4opt.linear's CPU kernel: the active OpState and the shape's key, and the
    CUDA pick made through that state with ``timing["ms"]`` as the (Triton, cuBLAS) times."""
    calls, timing = [], {}

    def linear(x, weight):
        key = (x.numel() // x.shape[-1], *weight.shape, x.dtype, x.device.index)
        calls.append((current(), key, linear_op.runs_triton(x, weight)))
        return F.linear(x, weight)

    monkeypatch.setattr(linear_op, "F", SimpleNamespace(linear=linear))
    monkeypatch.setattr(linear_op, "_time_both", lambda x, weight: timing["ms"])
    return calls, timing


def _run(model, probe, ms):
    calls, timing = probe
    timing["ms"] = ms
    calls.clear()
    with torch.no_grad():
        model(prompt(1, 5))
    return list(calls)


def test_two_models_keep_their_own_picks_and_experts(probe):
    a, b = gemma4opt.optimize(tiny("tiny")), gemma4opt.optimize(tiny("tiny-moe"))
    sa, sb = get_state(a).op_state, get_state(b).op_state
    default_before = linear_op.picks(DEFAULT)

    a_calls = _run(a, probe, (1.0, 2.0))        # Triton faster on A
    b_calls = _run(b, probe, (3.0, 1.0))        # Triton slower on B
    a_keys, b_keys = {k for _, k, _ in a_calls}, {k for _, k, _ in b_calls}
    assert a_calls and b_calls and a_keys & b_keys, "the test needs shapes both models time"
    assert {id(s) for s, _, _ in a_calls} == {id(sa)} and {id(s) for s, _, _ in b_calls} == {id(sb)}
    assert all(picked for _, _, picked in a_calls) and not any(picked for _, _, picked in b_calls)
    assert linear_op.picks(sa) == dict.fromkeys(a_keys, True)
    assert linear_op.picks(sb) == dict.fromkeys(b_keys, False)

    assert all(picked for _, _, picked in _run(a, probe, (3.0, 1.0)))   # A keeps its picks, not re-timed
    assert linear_op.picks(DEFAULT) == default_before and current() is DEFAULT
    # Each report counts its own model's picks.
    assert _decode_gemms("cuda", sa).startswith(f"the skinny Triton GEMM on {len(a_keys)} of {len(a_keys)} shapes")
    assert _decode_gemms("cuda", sb).startswith(f"the skinny Triton GEMM on 0 of {len(b_keys)} shapes")

    # B's MoE layers registered their experts on B's state while its forward compiled them.
    b_experts = {id(layer.experts) for layer in b.model.layers}
    assert {id(m) for m in sb.experts.values()} == b_experts
    assert not sa.experts and not b_experts & {id(m) for m in DEFAULT.experts.values()}
